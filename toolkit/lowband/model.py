"""A small GPT whose transformer blocks are an nn.ModuleList (fragments and hooks need that).

Pre-norm blocks, causal attention through F.scaled_dot_product_attention, learned positions,
tied input/output embeddings, byte-level vocabulary (256) by default. No parallelism here:
algorithms wrap the model from outside.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    n_layer: int
    n_head: int
    d_model: int
    vocab_size: int = 256
    max_seq_len: int = 1024


@dataclass(frozen=True)
class ModelSpec:
    """One entry of the model registry, read by validation, the trainer and the planner: how to
    build the model and, without building it, its blocks and parameter count."""
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

    def build(self, **sizes) -> nn.Module:
        return GPT(self.config(**sizes))

    def blocks(self, n_layer: int = 0) -> int:
        return n_layer or self.n_layer

    def param_count(self, n_layer=0, d_model=0, vocab_size=0, seq_len=0) -> int:
        """Exactly num_params(build(...)): tied embeddings, learned positions, per block two
        norms (D each), attention (4 D^2) and MLP (8 D^2), a final norm."""
        L, D = n_layer or self.n_layer, d_model or self.d_model
        T = seq_len or self.seq_len
        return (vocab_size or self.vocab_size) * D + T * D + L * (12 * D * D + 2 * D) + D


MODELS = {m.name: m for m in (
    ModelSpec("nano", 2, 2, 64, 256, note="~0.12M parameters, for tests"),
    ModelSpec("micro", 4, 4, 128, 256, note="~0.8M"),
    ModelSpec("mini", 6, 8, 256, 256, note="~4.8M"),
    ModelSpec("small", 8, 8, 512, 256, note="~25M"),
    ModelSpec("gpt2", 12, 12, 768, 50304, 1024, "GPT-2 124M (GPT-2 BPE vocabulary, padded to 50304)"),
)}


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


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
            precision: str = "fp32") -> torch.Tensor:
    """Next-token cross-entropy of any model that maps (B, T) token ids to (B, T, V) logits, as
    a tensor or as an output with `.logits` (Hugging Face models; lowband builds them with
    use_cache=False, sources.for_training). precision 'bf16' runs the forward (and so the backward) under bf16 autocast on x's device;
    the parameters and their gradients stay fp32, the loss is computed in fp32."""
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
