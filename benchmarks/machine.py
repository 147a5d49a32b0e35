"""The machine a benchmark ran on, in one line, for its printed results and RESULTS.md."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def describe(load: bool = False) -> str:
    """CPU model, cores, kernel, Python and torch versions; with load=True the 1-minute load
    average too (benchmarks on a shared machine should say how busy it was)."""
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    text = (f"{cpu}, {os.cpu_count()} cores, Linux {platform.release()}, Python "
            f"{platform.python_version()}, torch {torch.__version__}")
    return text + (f"; load average {os.getloadavg()[0]:.1f}" if load else "")


# ---------------------------------------------------------------------------------------------
# the Llama the benchmarks' --llama flag trains (ddp_overhead.py, slow_link.py)
# ---------------------------------------------------------------------------------------------

# lowband's `mini` preset as a Llama: 6 decoder layers, hidden 256, 8 heads (no GQA), SwiGLU
# intermediate 688 (~8/3 x 256), byte vocabulary, tied embeddings: 4,812,032 parameters against
# mini's 4,820,224 (RoPE: no position table). Only max_position_embeddings follows --seq-len.
LLAMA_MINI = dict(vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=6,
                  num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=True)


def write_llama_mini(root, seq_len: int = 1024) -> str:
    """Write a Hugging Face LlamaConfig of about lowband's `mini` size (LLAMA_MINI) into
    root/llama-mini (config.json only, as save_pretrained writes it: lowband initialises the
    model from --seed) and return the --model value for it, "hf:ROOT/llama-mini"."""
    from transformers import LlamaConfig

    out = Path(root) / "llama-mini"
    LlamaConfig(**LLAMA_MINI, max_position_embeddings=max(1024, seq_len)).save_pretrained(out)
    return f"hf:{out}"


def model_line(name: str, seq_len: int = 0) -> str:
    """A model name with what it is, for printed results: 'mini (GPT preset, 6 blocks, 4,820,224
    parameters)' or 'hf:DIR (llama, 6 decoder layers, 4,812,032 parameters)'. seq_len: the
    context trained (a preset's learned position table grows with it)."""
    from lowband.models import spec
    from lowband.models.hf import HFModel

    m = spec(name)
    if isinstance(m, HFModel):
        return (f"{name} ({m.config.model_type}, {m.n_layer} decoder layers, "
                f"{m.param_count():,} parameters)")
    return (f"{name} (GPT preset, {m.n_layer} blocks, {m.param_count(seq_len=seq_len):,} "
            "parameters)")
