import pytest
import torch
import torch.nn as nn

from lowband.models import find_blocks, num_params
from lowband.models.gpt import GPT, MODELS, gpt_config


@pytest.mark.parametrize("preset,low,high", [("nano", 0.08e6, 0.2e6), ("micro", 0.7e6, 1.0e6),
                                             ("gpt2", 120e6, 130e6)])
def test_preset_sizes(preset, low, high):
    with torch.device("meta"):
        model = GPT(gpt_config(preset, seq_len=1024 if preset == "gpt2" else 128))
    assert low <= num_params(model) <= high
    assert isinstance(model.blocks, nn.ModuleList) and len(model.blocks) == MODELS[preset].n_layer


def test_attention_is_causal_and_shapes_are_right():
    torch.manual_seed(0)
    model = GPT(gpt_config("nano", seq_len=16)).eval()
    x = torch.randint(0, 256, (2, 16))
    logits = model(x)
    assert logits.shape == (2, 16, 256)
    x2 = x.clone()
    x2[:, 10:] = (x2[:, 10:] + 1) % 256  # change the future
    assert torch.allclose(model(x2)[:, :10], logits[:, :10], atol=1e-6)
    assert not torch.allclose(model(x2)[:, 10:], logits[:, 10:])


def test_custom_sizes_and_find_blocks():
    model = GPT(gpt_config("nano", n_layer=3, d_model=48, n_head=3, seq_len=8))
    assert len(find_blocks(model)) == 3

    class User(nn.Module):
        def __init__(self):
            super().__init__()
            self.small = nn.ModuleList([nn.Linear(2, 2)])
            self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    user = User()
    assert find_blocks(user) is user.layers
    with pytest.raises(ValueError, match="ModuleList"):
        find_blocks(nn.Linear(2, 2))
