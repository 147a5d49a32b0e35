"""What every model source shares: the ModelSource interface its records implement, the Kind
that resolves its names, and what the trainer applies to any model (num_params, find_blocks,
lm_loss, compile_blocks, load_weights)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from lowband.options import ConfigError, flag

SIZES = ("n_layer", "n_head", "d_model", "vocab_size")  # lowband's size overrides of a model


class ModelSource:
    """One model a `--model` name gives: what validation, the trainer, the planner and export
    read, without building it where they can. Attributes: `name`; `n_layer`, `vocab_size` (the
    model's own); `seq_len` (the context the planner counts with); `sizes_from`: "" when
    lowband's size flags (SIZES) size the model, else what fixes its sizes (a config file)."""
    name: str
    n_layer: int
    vocab_size: int
    seq_len: int
    sizes_from: str = ""

    def n_blocks(self, n_layer: int = 0) -> int:
        """The blocks of the model as --n-layer sizes it (0 keeps the model's)."""
        return (0 if self.sizes_from else n_layer) or self.n_layer

    def param_count(self, n_layer=0, d_model=0, vocab_size=0, seq_len=0) -> int:
        """Exactly num_params(network(...)), without building it where it can."""
        raise NotImplementedError

    def network(self, n_layer=0, n_head=0, d_model=0, vocab_size=0, seq_len=0) -> nn.Module:
        """The model's architecture, freshly initialised (sizes 0: the model's own; the planner
        builds it under torch.device('meta'), export loads a run's weights into it)."""
        raise NotImplementedError

    def check(self, cfg) -> None:
        """ConfigError (one sentence) for a config this model cannot run."""
        sized = [name for name in SIZES if getattr(cfg, name)]
        if self.sizes_from and sized:
            raise ConfigError(f"{flag(sized[0])} does not apply to --model {self.name}: set the "
                              f"size in {self.sizes_from} instead.")

    def check_vocab(self, cfg, vocab: int) -> None:
        """ConfigError unless the model's vocabulary covers data whose ids go up to vocab - 1."""
        raise NotImplementedError

    def build(self, cfg, vocab: int) -> nn.Module:
        """The model of a config, from cfg.seed (the same on every rank), for data whose ids go
        up to vocab - 1."""
        self.check_vocab(cfg, vocab)
        torch.manual_seed(cfg.seed)
        return self.network(*(getattr(cfg, name) for name in SIZES), cfg.seq_len)

    def to_hf(self, model: nn.Module, meta: dict) -> nn.Module:
        """A network(...) holding a run's weights as a transformers model that save_pretrained
        writes (export; meta: the run's config.json "meta")."""
        raise NotImplementedError

    # any module of this kind, a user's own included ----------------------------------------
    @staticmethod
    def blocks(model: nn.Module) -> nn.ModuleList | None:
        """The blocks lowband fragments, hooks and shards; None when the module is not of this
        kind."""
        return None

    @staticmethod
    def prepare(model: nn.Module) -> nn.Module:
        """The module made ready for lowband's loop (as it is, unless of this kind)."""
        return model


def _no_files(name: str) -> Path | None:
    return None


@dataclass(frozen=True)
class Kind:
    """A kind of model source: the names it takes and how each becomes its record."""
    prefix: str  # the names starting with it ("": every name no other kind takes)
    names: str  # how --help and errors name them
    spec: Callable[[str], ModelSource | None]  # a name's record; None: not a name of this kind
    source: type[ModelSource]  # its records' class (blocks and prepare of any module)
    files: Callable[[str], Path | None] = _no_files  # the local path a name reads, unread


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def find_blocks(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks of a model: its `blocks` attribute when that is an nn.ModuleList,
    else the nn.ModuleList holding the most parameters. Pass `blocks=` explicitly to override."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList):
        return blocks
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of blocks: put its "
                         "transformer blocks in one, or pass blocks= explicitly.")
    return max(lists, key=num_params)


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
            precision: str = "fp32") -> torch.Tensor:
    """Next-token cross-entropy of any model that maps (B, T) token ids to (B, T, V) logits, as
    a tensor or as an output with `.logits` (Hugging Face models; lowband builds them with
    use_cache=False, models.for_training). precision 'bf16' runs the forward (and so the
    backward) under bf16 autocast on x's device; the parameters and their gradients stay fp32,
    the loss is computed in fp32."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
        logits = model(x)
    if not isinstance(logits, torch.Tensor):
        logits = logits.logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def compile_blocks(blocks: nn.ModuleList) -> None:
    """torch.compile each block's forward in place: parameter names, hooks (FSDP's, lowband's
    sync hooks) and communication stay outside the compiled graphs, and one compiled graph
    serves every block of the same shape."""
    for block in blocks:
        block.forward = torch.compile(block.forward)


def load_weights(model: nn.Module, state: dict, path: str, partial: bool = False) -> None:
    """Load a run's state into model: no unexpected keys, no wrong shapes, and (unless partial)
    no missing key but one tied to a loaded tensor. ConfigError (one sentence) otherwise."""
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as e:
        why = next((line.strip() for line in str(e).splitlines() if "size mismatch" in line), "")
        raise ConfigError(f"{path} does not fit the model the run's config describes "
                          f"({why[:160] or 'wrong shapes'}).") from None
    own = model.state_dict(keep_vars=True)
    loaded = {id(own[k]) for k in state if k in own}
    missing = [k for k in result.missing_keys if not partial and id(own[k]) not in loaded]
    if result.unexpected_keys or missing:
        key = (result.unexpected_keys or missing)[0]
        raise ConfigError(f"{path} does not hold the weights of the model the run's config "
                          f"describes ({'unexpected' if result.unexpected_keys else 'missing'} key "
                          f"'{key}'): was it trained on a model of its own?")
