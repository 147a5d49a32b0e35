"""`lowband export RUN -o DIR [--which local|outer]`: a finished run as a Hugging Face model
directory that `transformers.AutoModelForCausalLM.from_pretrained(DIR)` loads.

  weights    --which local (default): RUN/model.pt, rank 0's final weights; --which outer:
             RUN/outer.pt, the outer (synced) parameters, with what it lacks (a tied head is
             the embedding's; buffers) from model.pt
  hf: runs   the model is rebuilt from the config directory recorded in the run's "model",
             loaded strictly (only keys tied to a loaded one may be missing), save_pretrained
  presets    lowband's GPT becomes an equivalent GPT2LMHeadModel: Conv1D weights are the
             transposed Linear ones, the qkv Linear is c_attn ([q|k|v], heads contiguous), zero
             biases, exact GELU, eps 1e-5, n_positions = the run's seq_len, tied head; the two
             models' logits are compared before anything is written
  tokenizer  RUN/tokenizer/ when the run used one: a save_pretrained directory is copied, a lone
             tokenizer.json is wrapped in PreTrainedTokenizerFast (eos from the run's meta)

The directory is written beside DIR under a temporary name and renamed into place: an export
that fails writes nothing. transformers loads lazily.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from lowband.config import Config
from lowband.model import GPT, gpt_config
from lowband.options import ArgParser, ConfigError
from lowband.sources import HF, HFModel, spec
from lowband.telemetry import RunDir


def parser() -> ArgParser:
    p = ArgParser(prog="lowband export", description="Write a finished run's weights as a Hugging "
                  "Face model directory (config.json, safetensors, the tokenizer when the run used "
                  "one) that AutoModelForCausalLM.from_pretrained loads (docs/run-directory.md).")
    p.add_argument("run", metavar="RUN", help="a finished run directory")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="the model directory to write")
    p.add_argument("--which", choices=("local", "outer"), default="local",
                   help="local: model.pt, rank 0's final weights (default); outer: outer.pt, the "
                   "synced parameters of diloco, streaming, edit and aedit")
    p.add_argument("--overwrite", action="store_true", help="replace DIR when it is not empty")
    return p


def main(argv: list[str]) -> int:
    a = parser().parse_args(argv)
    from transformers.utils import logging

    logging.disable_progress_bar()  # one line of output, not save_pretrained's bar
    out = export(a.run, a.output, a.which, a.overwrite)
    print(f"exported {a.run} ({a.which} weights) to {out}")
    return 0


def export(run_dir, output, which: str = "local", overwrite: bool = False) -> Path:
    """Write the run's model to output; returns its path. ConfigError (one sentence) on bad
    input, before anything is written."""
    run, out = RunDir(run_dir), Path(output)
    if not run.config.is_file():
        raise ConfigError(f"'{run_dir}' is not a run directory (it has no config.json): give the "
                          "directory of a finished `lowband train` run.")
    cfg = Config.from_file(str(run.root))
    meta = json.loads(run.config.read_text()).get("meta") or {}
    weights = run.root / ("outer.pt" if which == "outer" else "model.pt")
    if not (run.root / "model.pt").is_file():
        raise ConfigError(f"run '{run_dir}' has no model.pt, so it did not finish: export a "
                          "finished run (or resume this one with --resume).")
    if not weights.is_file():
        raise ConfigError(f"run '{run_dir}' has no outer.pt ({cfg.algo} keeps no outer "
                          "parameters): export its local weights with --which local.")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"'{out}' is a file: give a directory to write the model into.")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ConfigError(f"'{out}' exists and is not an empty directory: give a new one, or "
                              "pass --overwrite to replace it.")
        if run.root.resolve().is_relative_to(out.resolve()):
            raise ConfigError(f"'{out}' holds the run itself: give another output directory.")
    if cfg.model.startswith(HF) and not Path(cfg.model[len(HF):]).expanduser().exists():
        raise ConfigError(f"the run's model config '{cfg.model[len(HF):]}' is gone, and export "
                          "rebuilds the model from it: restore that directory (or run the export "
                          "where the path holds).")
    local = _read(run.root / "model.pt")
    outer = _read(weights) if which == "outer" else None
    if cfg.model.startswith(HF):
        model = _hf(spec(cfg.model), local, outer)
    else:
        model = _gpt2(cfg, meta, local, outer)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        _tokenizer(run.root, meta, tmp)
        if out.exists():  # empty, or --overwrite
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _read(path: Path) -> dict:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ConfigError(f"'{path}' does not load ({type(e).__name__}): it is damaged or not "
                          "a lowband weights file.") from None
    if not isinstance(state, dict):
        raise ConfigError(f"'{path}' holds no state dict: it is not a lowband weights file.")
    return state


def _load(model: torch.nn.Module, state: dict, path: str, partial: bool = False) -> None:
    """Load state into model: no unexpected keys, no wrong shapes, and (unless partial) no
    missing key but one tied to a loaded tensor."""
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


def _hf(model_spec: HFModel, local: dict, outer: dict | None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(model_spec.config, dtype=torch.float32)
    _load(model, local, "model.pt")
    if outer is not None:  # after model.pt: a tied head takes the outer embedding
        _load(model, outer, "outer.pt", partial=True)
    return model.eval()


def _gpt2(cfg: Config, meta: dict, local: dict, outer: dict | None):
    """lowband's GPT as an equivalent GPT2LMHeadModel, checked on one input."""
    from transformers import GPT2Config, GPT2LMHeadModel

    mc = gpt_config(cfg.model, cfg.n_layer, cfg.n_head, cfg.d_model, cfg.vocab_size, cfg.seq_len)
    gpt = GPT(mc)
    _load(gpt, local, "model.pt")
    if outer is not None:
        _load(gpt, outer, "outer.pt", partial=True)
    eos = (meta.get("tokenizer") or {}).get("eos_id")
    D = mc.d_model
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
    _load(hf, state, "model.pt")
    hf.eval()
    x = torch.randint(0, mc.vocab_size, (1, min(mc.max_seq_len, 16)),
                      generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gap = (gpt.eval()(x) - hf(x).logits).abs().max().item()
    if not gap <= 1e-4:
        raise ConfigError(f"the GPT-2 form of this run's model differs from it (logits apart by "
                          f"{gap:.2g}), so nothing was exported.")
    return hf


def _tokenizer(root: Path, meta: dict, out: Path) -> None:
    src = root / "tokenizer"
    if not src.is_dir():
        if meta.get("tokenizer"):
            print(f"lowband: note: {src} is missing, so the model is exported without its "
                  "tokenizer.", file=sys.stderr)
        return
    if (src / "tokenizer_config.json").exists():  # a save_pretrained directory: as it is
        for p in src.iterdir():
            if p.is_file() and not (out / p.name).exists():
                shutil.copyfile(p, out / p.name)
        return
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(src / "tokenizer.json"))
    eos = (meta.get("tokenizer") or {}).get("eos_id")
    if eos is not None:
        tok.eos_token = tok.convert_ids_to_tokens(eos)
    tok.save_pretrained(out)
