"""Model sources: lowband's GPT presets (model.MODELS) and Hugging Face causal language models.

`--model NAME` names a preset; `--model hf:PATH` a Hugging Face model, where PATH is a local
directory holding a config.json (its weights are loaded when safetensors or .bin files are there,
else the model is initialised from --seed, the same on every rank) or a config.json file. Any
transformers causal LM (Llama, Qwen2/3, Mistral, GPT-2, Gemma, ...) works: its decoder layer list
is the block list that fragments, hooks and FSDP2 use. Nothing reaches a hub: files are read
locally (`local_files_only`).

`spec(name)` is what validation, the trainer and the planner read: the block count, parameter
count and vocabulary of a model without building it, `check(cfg)` and `build(cfg, vocab)`.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn as nn

from lowband.model import GPT, MODELS, ModelSpec, find_blocks, gpt_config, num_params
from lowband.options import ConfigError

HF = "hf:"
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")


def names() -> str:
    return ", ".join(MODELS) + ", or hf:PATH (a Hugging Face model directory or config.json)"


def spec(name: str) -> "ModelSpec | HFModel":
    """The record of a model name; ConfigError (one sentence) for an unknown or unusable one."""
    if name.startswith(HF):
        return _hf(name)
    if name not in MODELS:
        raise ConfigError(f"unknown model '{name}': use one of {names()}.")
    return MODELS[name]


def check(cfg) -> None:
    """The model-related checks of a config (cfg.model, sizes, sequence length)."""
    model = spec(cfg.model)
    if isinstance(model, HFModel):
        model.check(cfg)


def check_vocab(cfg, vocab: int) -> None:
    """ConfigError unless the model's vocabulary covers data whose ids go up to vocab - 1 (the
    tokenizer's whole vocabulary for prepared data): checked before anything is written."""
    model = spec(cfg.model)
    if isinstance(model, HFModel):
        if model.vocab_size < vocab:
            raise ConfigError(f"the data's vocabulary ({vocab} ids, from its tokenizer) exceeds "
                              f"the model's {model.vocab_size} (vocab_size in {model.config_file}): "
                              "use the model's own tokenizer or a config with a larger vocab_size.")
        return
    size = gpt_config(cfg.model, cfg.n_layer, cfg.n_head, cfg.d_model, cfg.vocab_size).vocab_size
    if size < vocab:
        raise ConfigError(f"the data has token ids up to {vocab - 1} but the model's vocabulary "
                          f"is {size}: pass --vocab-size {vocab} or more.")


def build(cfg, vocab: int) -> nn.Module:
    """The model of a config, built from cfg.seed (the same on every rank), for data whose ids
    go up to vocab - 1."""
    check_vocab(cfg, vocab)
    model = spec(cfg.model)
    if isinstance(model, HFModel):
        return model.build(cfg)
    mc = gpt_config(cfg.model, cfg.n_layer, cfg.n_head, cfg.d_model, cfg.vocab_size, cfg.seq_len)
    if mc.d_model % mc.n_head:
        raise ConfigError(f"--d-model {mc.d_model} is not divisible by --n-head {mc.n_head}: "
                          "pick sizes where it is.")
    torch.manual_seed(cfg.seed)
    return GPT(mc)


@functools.lru_cache(maxsize=16)
def _hf(name: str) -> "HFModel":
    return HFModel(name)


class HFModel:
    """A Hugging Face causal LM from local files, read without building it where possible."""

    def __init__(self, name: str):
        self.name = name
        path = Path(name[len(HF):]).expanduser()
        if not path.exists():
            raise ConfigError(f"model path '{path}' does not exist: give --model hf:DIR (a "
                              "directory with a config.json) or hf:FILE (a config.json).")
        self.directory = path if path.is_dir() else path.parent
        self.config_file = path / "config.json" if path.is_dir() else path
        if not self.config_file.is_file():
            raise ConfigError(f"'{path}' has no config.json: give a Hugging Face model "
                              "directory (save_pretrained) or a config.json file.")
        self.config = self._load_config()
        self.weights = (sorted(f for g in WEIGHT_FILES for f in self.directory.glob(g))
                        if path.is_dir() else [])

    def _load_config(self):
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        try:
            config = AutoConfig.from_pretrained(str(self.config_file), local_files_only=True)
        except (ValueError, OSError, KeyError, TypeError) as e:
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"'{self.config_file}' is not a Hugging Face model config "
                              f"({why[:160]}): give the config.json of a causal language model.") from None
        if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            raise ConfigError(f"'{self.config_file}' describes a '{config.model_type}' model, "
                              "which is not a causal language model: give a causal LM (Llama, "
                              "Qwen, Mistral, GPT-2, Gemma, ...).")
        return config

    # what the planner and validation read -----------------------------------------------------
    @property
    def n_layer(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def max_seq_len(self) -> int | None:
        for key in ("max_position_embeddings", "n_positions"):
            value = getattr(self.config, key, None)
            if isinstance(value, int) and value > 0:
                return value
        return None

    @property
    def seq_len(self) -> int:
        return min(self.max_seq_len or 1024, 1024)

    def blocks(self, n_layer: int = 0) -> int:
        return self.n_layer

    @functools.cached_property
    def _count(self) -> int:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            return num_params(AutoModelForCausalLM.from_config(self.config))

    def param_count(self, *_, **__) -> int:
        return self._count

    def check(self, cfg) -> None:
        sized = [f for f in ("n_layer", "n_head", "d_model", "vocab_size") if getattr(cfg, f)]
        if sized:
            raise ConfigError(f"--{sized[0].replace('_', '-')} does not apply to --model hf:...: "
                              f"set the size in {self.config_file} instead.")
        if self.max_seq_len and cfg.seq_len > self.max_seq_len:
            raise ConfigError(f"--seq-len {cfg.seq_len} is longer than the {self.max_seq_len} "
                              f"positions of {self.config_file}: use --seq-len {self.max_seq_len} "
                              "or less.")

    # what the trainer reads -------------------------------------------------------------------
    def build(self, cfg) -> nn.Module:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(cfg.seed)
        if self.weights:
            model = AutoModelForCausalLM.from_pretrained(str(self.directory), local_files_only=True,
                                                         dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_config(self.config, dtype=torch.float32)
        return for_training(model)


def for_training(model: nn.Module) -> nn.Module:
    """A Hugging Face model made ready for lowband's loop: no key/value cache is built in the
    forward (use_cache=False). Other modules are returned as they are."""
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", None):
        config.use_cache = False
    return model


def decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """A Hugging Face model's decoder layer list (the nn.ModuleList of num_hidden_layers
    entries holding the most parameters); None for other models."""
    n = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    if not isinstance(n, int):
        return None
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == n]
    return max(lists, key=num_params) if lists else None


def blocks_of(model: nn.Module) -> nn.ModuleList:
    """The blocks lowband fragments, hooks and shards: a Hugging Face model's decoder layers,
    else model.find_blocks (a `blocks` nn.ModuleList, or the largest one)."""
    layers = decoder_layers(model)
    return layers if layers is not None else find_blocks(model)
