"""lowband's GPT and its presets (MODELS): the model source of `--model NAME`.

A small GPT whose transformer blocks are an nn.ModuleList (fragments and hooks need that).
Pre-norm blocks, causal attention through F.scaled_dot_product_attention, learned positions,
tied input/output embeddings, byte-level vocabulary (256) by default. No parallelism here:
algorithms wrap the model from outside. --n-layer, --n-head, --d-model and --vocab-size
override a preset's sizes; `lowband export` writes it as an equivalent GPT-2 (ModelSpec.to_hf).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from lowband.models.base import Kind, ModelSource, load_weights
from lowband.options import ConfigError


@dataclass
class GPTConfig:
    n_layer: int
    n_head: int
    d_model: int
    vocab_size: int = 256
    max_seq_len: int = 1024


@dataclass(frozen=True)
class ModelSpec(ModelSource):
    """A preset: how to build the GPT and, without building it, its blocks and parameter count
    (the planner's presets)."""
    name: str
    n_layer: int
    n_head: int
    d_model: int
    vocab_size: int
    seq_len: int = 128  # the context the preset is meant for (and the planner counts with)
    note: str = ""

    def config(self, n_layer=0, n_head=0, d_model=0, vocab_size=0, seq_len=1024) -> GPTConfig:
        """The GPT of this preset, with any size given as non-zero overriding the preset's."""
        return GPTConfig(n_layer or self.n_layer, n_head or self.n_head, d_model or self.d_model,
                         vocab_size or self.vocab_size, max(seq_len, 1))

    def network(self, n_layer=0, n_head=0, d_model=0, vocab_size=0, seq_len=1024) -> nn.Module:
        return GPT(self.config(n_layer, n_head, d_model, vocab_size, seq_len))

    def param_count(self, n_layer=0, d_model=0, vocab_size=0, seq_len=0) -> int:
        """Exactly num_params(network(...)): tied embeddings, learned positions, per block two
        norms (D each), attention (4 D^2) and MLP (8 D^2), a final norm."""
        L, D = n_layer or self.n_layer, d_model or self.d_model
        T = seq_len or self.seq_len
        return (vocab_size or self.vocab_size) * D + T * D + L * (12 * D * D + 2 * D) + D

    def check_vocab(self, cfg, vocab: int) -> None:
        size = cfg.vocab_size or self.vocab_size
        if size < vocab:
            raise ConfigError(f"the data has token ids up to {vocab - 1} but the model's "
                              f"vocabulary is {size}: pass --vocab-size {vocab} or more.")

    def build(self, cfg, vocab: int) -> nn.Module:
        self.check_vocab(cfg, vocab)
        d_model, n_head = cfg.d_model or self.d_model, cfg.n_head or self.n_head
        if d_model % n_head:
            raise ConfigError(f"--d-model {d_model} is not divisible by --n-head {n_head}: "
                              "pick sizes where it is.")
        return super().build(cfg, vocab)

    def to_hf(self, model: nn.Module, meta: dict) -> nn.Module:
        return as_gpt2(model, (meta.get("tokenizer") or {}).get("eos_id"))

    @staticmethod
    def blocks(model: nn.Module) -> nn.ModuleList | None:
        return model.blocks if isinstance(model, GPT) else None


MODELS = {m.name: m for m in (
    ModelSpec("nano", 2, 2, 64, 256, note="~0.12M parameters, for tests"),
    ModelSpec("micro", 4, 4, 128, 256, note="~0.8M"),
    ModelSpec("mini", 6, 8, 256, 256, note="~4.8M"),
    ModelSpec("small", 8, 8, 512, 256, note="~25M"),
    ModelSpec("gpt2", 12, 12, 768, 50304, 1024, "GPT-2 124M (GPT-2 BPE vocabulary, padded to 50304)"),
)}


KIND = Kind(prefix="", names=", ".join(MODELS), spec=MODELS.get, source=ModelSpec)


def gpt_config(preset: str, n_layer=0, n_head=0, d_model=0, vocab_size=0, seq_len=1024) -> GPTConfig:
    return MODELS[preset].config(n_layer, n_head, d_model, vocab_size, seq_len)


class Attention(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.n_head = c.n_head
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model, bias=False)
        self.proj = nn.Linear(c.d_model, c.d_model, bias=False)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, D // self.n_head).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(c.d_model, bias=False)
        self.attn = Attention(c)
        self.norm2 = nn.LayerNorm(c.d_model, bias=False)
        self.fc = nn.Linear(c.d_model, 4 * c.d_model, bias=False)
        self.proj = nn.Linear(4 * c.d_model, c.d_model, bias=False)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.proj(F.gelu(self.fc(self.norm2(x))))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        if c.d_model % c.n_head:
            raise ValueError(f"d_model {c.d_model} is not divisible by n_head {c.n_head}")
        self.config = c
        self.wte = nn.Embedding(c.vocab_size, c.d_model)
        self.wpe = nn.Embedding(c.max_seq_len, c.d_model)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.norm = nn.LayerNorm(c.d_model, bias=False)
        self.head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.head.weight = self.wte.weight
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):  # residual projections, GPT-2 style
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * c.n_layer))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def as_gpt2(gpt: GPT, eos: int | None = None) -> nn.Module:
    """lowband's GPT as an equivalent GPT2LMHeadModel: Conv1D weights are the transposed Linear
    ones, the qkv Linear is c_attn ([q|k|v], heads contiguous), zero biases, exact GELU, eps
    1e-5, n_positions = its max_seq_len, tied head; the two models' logits are compared on one
    input (ConfigError when they differ)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    mc, D = gpt.config, gpt.config.d_model
    hf = GPT2LMHeadModel(GPT2Config(
        vocab_size=mc.vocab_size, n_positions=mc.max_seq_len, n_embd=D, n_layer=mc.n_layer,
        n_head=mc.n_head, n_inner=4 * D, activation_function="gelu", layer_norm_epsilon=1e-5,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
        bos_token_id=eos, eos_token_id=eos))
    s, zero = gpt.state_dict(), torch.zeros
    state = {"transformer.wte.weight": s["wte.weight"], "transformer.wpe.weight": s["wpe.weight"],
             "transformer.ln_f.weight": s["norm.weight"], "transformer.ln_f.bias": zero(D),
             "lm_head.weight": s["wte.weight"]}
    for i in range(mc.n_layer):
        b, h = f"blocks.{i}.", f"transformer.h.{i}."
        for ours, theirs, n in (("attn.qkv", "attn.c_attn", 3 * D), ("attn.proj", "attn.c_proj", D),
                                ("fc", "mlp.c_fc", 4 * D), ("proj", "mlp.c_proj", D)):
            state[h + theirs + ".weight"] = s[b + ours + ".weight"].t().contiguous()  # Conv1D: (in, out)
            state[h + theirs + ".bias"] = zero(n)
        for ours, theirs in (("norm1", "ln_1"), ("norm2", "ln_2")):
            state[h + theirs + ".weight"], state[h + theirs + ".bias"] = s[b + ours + ".weight"], zero(D)
    load_weights(hf, state, "model.pt")
    hf.eval()
    x = torch.randint(0, mc.vocab_size, (1, min(mc.max_seq_len, 16)),
                      generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gap = (gpt.eval()(x) - hf(x).logits).abs().max().item()
    if not gap <= 1e-4:
        raise ConfigError(f"the GPT-2 form of this run's model differs from it (logits apart by "
                          f"{gap:.2g}), so nothing was exported.")
    return hf
