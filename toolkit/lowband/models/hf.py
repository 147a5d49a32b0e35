"""Hugging Face causal language models from local files: the model source of `--model hf:PATH`.

PATH is a local directory holding a config.json (its weights are loaded when safetensors or .bin
files are there, else the model is initialised from --seed, the same on every rank) or a
config.json file. Any transformers causal LM (Llama, Qwen2/3, Mistral, GPT-2, Gemma, ...) works:
its decoder layer list is the block list that fragments, hooks and FSDP2 use. Nothing reaches a
hub: files are read locally (`local_files_only`). Its sizes are its config's: lowband's size
flags do not apply. transformers is imported on first use.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn as nn

from lowband.models.base import Kind, ModelSource, num_params
from lowband.options import ConfigError, needs_extra

HF = "hf:"
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")


def files(name: str) -> Path:
    """The local path `hf:PATH` reads (not read here)."""
    return Path(name[len(HF):]).expanduser()


@functools.lru_cache(maxsize=16)
def _hf(name: str) -> "HFModel":
    return HFModel(name)


class HFModel(ModelSource):
    """A Hugging Face causal LM from local files, read without building it where possible."""

    def __init__(self, name: str):
        self.name = name
        path = files(name)
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
        needs_extra("hf", f"--model {self.name}", "transformers")
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

    @property
    def sizes_from(self) -> str:
        return str(self.config_file)

    @functools.cached_property
    def _count(self) -> int:
        with torch.device("meta"):
            return num_params(self.network())

    def param_count(self, *_, **__) -> int:
        return self._count

    def network(self, *_, **__) -> nn.Module:
        """From its config (sizes given are not its to take)."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(self.config, dtype=torch.float32)

    def check(self, cfg) -> None:
        super().check(cfg)
        if self.max_seq_len and cfg.seq_len > self.max_seq_len:
            raise ConfigError(f"--seq-len {cfg.seq_len} is longer than the {self.max_seq_len} "
                              f"positions of {self.config_file}: use --seq-len {self.max_seq_len} "
                              "or less.")

    def check_vocab(self, cfg, vocab: int) -> None:
        if self.vocab_size < vocab:
            raise ConfigError(f"the data's vocabulary ({vocab} ids, from its tokenizer) exceeds "
                              f"the model's {self.vocab_size} (vocab_size in {self.config_file}): "
                              "use the model's own tokenizer or a config with a larger vocab_size.")

    # what the trainer and export read ---------------------------------------------------------
    def build(self, cfg, vocab: int) -> nn.Module:
        if not self.weights:
            return super().build(cfg, vocab)
        from transformers import AutoModelForCausalLM

        self.check_vocab(cfg, vocab)
        torch.manual_seed(cfg.seed)
        return AutoModelForCausalLM.from_pretrained(str(self.directory), local_files_only=True,
                                                    dtype=torch.float32)

    def to_hf(self, model: nn.Module, meta: dict) -> nn.Module:
        return model.eval()

    @staticmethod
    def blocks(model: nn.Module) -> nn.ModuleList | None:
        return decoder_layers(model)

    @staticmethod
    def prepare(model: nn.Module) -> nn.Module:
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


KIND = Kind(prefix=HF, names="hf:PATH (a Hugging Face model directory or config.json)",
            spec=_hf, source=HFModel, files=files)
