"""Model sources: what `--model NAME` names, behind one interface.

Each kind of source is one module here with a `KIND` (models/base.py's Kind: the names it
takes, how each becomes its record):
  gpt.py  lowband's GPT and its presets (MODELS): `--model micro`; the size flags override them
  hf.py   a Hugging Face causal LM from local files: `--model hf:PATH`

`spec(name)` gives the record (a ModelSource: base.py lists its methods); validation, the
trainer, the planner, export and `lowband launch` call it and never ask which kind it is:
  n_blocks(n_layer), param_count(...), vocab_size, sizes_from, seq_len   without building it
  check(cfg), check_vocab(cfg, vocab)                                    validation
  build(cfg, vocab), network(*sizes) (on the meta device: the planner)   the model itself
  to_hf(model, meta)                                                     `lowband export`
`files(name)`: the local path a name reads, unread (`lowband launch` leaves a path that is not
here to the nodes; export refuses a run whose model is gone). `blocks_of` and `for_training`
take any module, a user's own too. The model options (ModelOptions) are declared here.

A new kind: its module with a record class and a KIND, and that KIND in KINDS below.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch.nn as nn

from lowband.models import gpt, hf
from lowband.models.base import (SIZES, ModelSource, compile_blocks, find_blocks, lm_loss,
                                 load_weights, num_params)
from lowband.options import ConfigError, Options, flag, option

__all__ = ["KINDS", "SIZES", "ModelOptions", "ModelSource", "blocks_of", "build", "check",
           "check_vocab", "compile_blocks", "files", "find_blocks", "for_training", "lm_loss",
           "load_weights", "names", "num_params", "spec"]

# the order a module is matched in (blocks_of); a name goes to the kind of the longest prefix
KINDS = (hf.KIND, gpt.KIND)


def _kind(name: str):
    return max((k for k in KINDS if name.startswith(k.prefix)), key=lambda k: len(k.prefix))


def names() -> str:
    parts = [k.names for k in reversed(KINDS)]
    return ", ".join(parts[:-1]) + ", or " + parts[-1]


def spec(name: str) -> ModelSource:
    """The record of a model name; ConfigError (one sentence) for an unknown or unusable one."""
    record = _kind(name).spec(name)
    if record is None and name and Path(name).expanduser().exists():  # hf: forgotten
        raise ConfigError(f"unknown model '{name}': for a Hugging Face model saved there, give "
                          f"--model {hf.HF}{name}.")
    if record is None:
        raise ConfigError(f"unknown model '{name}': use one of {names()}.")
    return record


def files(name: str) -> Path | None:
    """The local path a model name reads (None: none), without reading it."""
    return _kind(name).files(name)


def check(cfg) -> None:
    """The model-related checks of a config (cfg.model, sizes, sequence length)."""
    spec(cfg.model).check(cfg)


def check_vocab(cfg, vocab: int) -> None:
    """ConfigError unless the model's vocabulary covers data whose ids go up to vocab - 1 (the
    tokenizer's whole vocabulary for prepared data): checked before anything is written."""
    spec(cfg.model).check_vocab(cfg, vocab)


def build(cfg, vocab: int) -> nn.Module:
    """The model of a config, built from cfg.seed (the same on every rank), for data whose ids
    go up to vocab - 1."""
    return spec(cfg.model).build(cfg, vocab)


def blocks_of(model: nn.Module) -> nn.ModuleList:
    """The blocks lowband fragments, hooks and shards, of any module: a Hugging Face model's
    decoder layers, else find_blocks (a `blocks` nn.ModuleList, or the largest one)."""
    for kind in KINDS:
        blocks = kind.source.blocks(model)
        if blocks is not None:
            return blocks
    return find_blocks(model)


def for_training(model: nn.Module) -> nn.Module:
    """Any module made ready for lowband's loop (a Hugging Face model: use_cache=False)."""
    for kind in KINDS:
        model = kind.source.prepare(model)
    return model


@dataclass
class ModelOptions(Options):
    title = "model"
    model: str = option("micro", f"model: {names()}")
    n_layer: int = option(0, "override the preset's number of blocks (0 keeps the preset)")
    n_head: int = option(0, "override the preset's attention heads (0 keeps the preset)")
    d_model: int = option(0, "override the preset's width (0 keeps the preset)")
    vocab_size: int = option(0, "override the vocabulary size (0: 256 for bytes, the preset's "
                             "otherwise)")

    @classmethod
    def resolve(cls, cfg, algorithm) -> None:
        """A model read from local files is recorded by its absolute path (hf:/abs/dir), so the
        run's config.json names it from any directory (`lowband export RUN` elsewhere)."""
        path = files(cfg.model)
        if path is not None and path.exists():
            cfg.model = _kind(cfg.model).prefix + str(path.resolve())

    @classmethod
    def check(cls, cfg) -> None:
        for name in SIZES:
            if getattr(cfg, name) < 0:
                raise ConfigError(f"{flag(name)} must be zero or positive, got {getattr(cfg, name)}.")
