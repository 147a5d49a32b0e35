"""`lowband export RUN -o DIR [--which local|outer]`: a finished run as a Hugging Face model
directory that `transformers.AutoModelForCausalLM.from_pretrained(DIR)` loads.

  weights    --which local (default): RUN/model.pt, rank 0's final weights; --which outer:
             RUN/outer.pt, the outer (synced) parameters, with what it lacks (a tied head is
             the embedding's; buffers) from model.pt
  model      the run's model source (lowband.models) rebuilds its network from the run's
             config and takes the weights strictly (only keys tied to a loaded one may be
             missing); its to_hf gives the transformers model: hf: runs as they are, lowband's
             GPT as an equivalent GPT2LMHeadModel (models/gpt.py's as_gpt2, its logits compared
             before anything is written), then save_pretrained
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

from lowband import models
from lowband.config import Config
from lowband.models import SIZES, load_weights
from lowband.options import ArgParser, ConfigError, needs_extra
from lowband.telemetry import RunDir, os_fault

NEEDS = ("hf", "lowband export", "transformers")  # needs_extra's: asked before anything is read

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
    needs_extra(*NEEDS)
    from transformers.utils import logging

    logging.disable_progress_bar()  # one line of output, not save_pretrained's bar
    out = export(a.run, a.output, a.which, a.overwrite)
    print(f"exported {a.run} ({a.which} weights) to {out}")
    return 0


def export(run_dir, output, which: str = "local", overwrite: bool = False) -> Path:
    """Write the run's model to output; returns its path. ConfigError (one sentence) on bad
    input, before anything is written."""
    needs_extra(*NEEDS)
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
    path = models.files(cfg.model)
    if path is not None and not path.exists():
        raise ConfigError(f"the run's model '{path}' is gone, and export rebuilds the model "
                          "from it: restore it (or run the export where the path holds).")
    local = _read(run.root / "model.pt")
    outer = _read(weights) if which == "outer" else None
    source = models.spec(cfg.model)
    net = source.network(*(getattr(cfg, name) for name in SIZES), cfg.seq_len)
    load_weights(net, local, "model.pt")
    if outer is not None:  # after model.pt: a tied head takes the outer embedding
        load_weights(net, outer, "outer.pt", partial=True)
    model = source.to_hf(net, meta)

    tmp = None
    try:  # written beside, then renamed: a fault (a full disk) leaves no half a model
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
        model.save_pretrained(tmp)
        _tokenizer(run.root, meta, tmp)
        if out.exists():  # empty, or --overwrite
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException as e:
        fault = os_fault(e, out)  # named as the output (lowband prints it in one sentence)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if fault is not None:
            raise fault from e
        raise
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
