"""`lowband export` (lowband/export.py): a prepared, tokenized Llama run exported and loaded with
AutoModelForCausalLM gives the run's own validation loss and its tokenizer; --which outer exports
outer.pt; a GPT preset becomes a GPT2LMHeadModel with the same logits; bad input is refused with
one sentence, exit status 2 and nothing written. Nothing reaches a hub."""

import json
import os
import shutil

import pytest
import torch

from conftest import hf_config, lowband
from lowband.cli import main as cli
from lowband.config import Config
from lowband.data import Batches, ShardedTokens
from lowband.models import lm_loss
from lowband.models.gpt import GPT, gpt_config

pytestmark = pytest.mark.slow  # measured (--durations): README, Run the tests

os.environ.setdefault("HF_HUB_OFFLINE", "1")
FAST = ["--seq-len", 32, "--batch-size", 4, "--eval-every", 0, "--eval-batches", 2, "--no-progress",
        "--link-bandwidth", "none"]


@pytest.fixture(scope="module")
def llama_runs(tok, tmp_path_factory):
    """A prepared corpus and two finished runs of a 2-layer Llama (vocabulary 512) on it: ddp and
    diloco (5 steps, a sync every 2: the last step leaves the local weights off the outer ones)."""
    root = tmp_path_factory.mktemp("export")
    (root / "src.txt").write_text(tok[2][:100_000])
    proc = lowband("prepare", "src.txt", "-o", "prep", "--tokenizer", tok[0], "--workers", 1,
                   "--no-progress", cwd=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    model = hf_config(root, "llama", layers=2, vocab=512)
    for algo, extra in (("ddp", ["--steps", 6]), ("diloco", ["--steps", 5, "--sync-every", 2])):
        proc = lowband("train", "--model", f"hf:{model}", "--data", "prep", "--algo", algo,
                       "--replicas", 2, "--run-dir", algo, *extra, *FAST, cwd=root)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return root


def test_prepare_train_export_loads_with_the_runs_val_loss_and_tokenizer(llama_runs, tok):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = llama_runs
    proc = lowband("export", "ddp", "-o", "hf", cwd=root)
    assert proc.returncode == 0 and proc.stderr == "", proc.stdout + proc.stderr
    assert "exported" in proc.stdout
    model = AutoModelForCausalLM.from_pretrained(root / "hf").eval()
    cfg = Config.from_file(str(root / "ddp"))
    batches = Batches(ShardedTokens(root / "prep"), rank=0, world=2, seq_len=cfg.seq_len,
                      batch_size=cfg.batch_size, seed=cfg.seed, val_fraction=cfg.val_fraction)
    with torch.no_grad():
        losses = [lm_loss(model, *batches.val(i)).item() for i in range(cfg.eval_batches)]
    loss = sum(losses) / cfg.eval_batches
    final = json.loads((root / "ddp" / "summary.json").read_text())["final_val_loss"]
    assert loss == pytest.approx(final, rel=1e-5)

    tokenizer = AutoTokenizer.from_pretrained(root / "hf")
    text = "def export(run, out):\n    return {'ok': True}  # ünïcode"
    assert tokenizer(text)["input_ids"] == tok[1].encode(text).ids
    assert tokenizer.eos_token == "<|endoftext|>"


def test_which_outer_exports_outer_pt(llama_runs, tmp_path):
    from transformers import AutoModelForCausalLM

    run = llama_runs / "diloco"
    assert cli(["export", str(run), "-o", str(tmp_path / "outer"), "--which", "outer"]) == 0
    outer = torch.load(run / "outer.pt", weights_only=True)
    local = torch.load(run / "model.pt", weights_only=True)
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "outer").state_dict()
    assert "lm_head.weight" not in outer  # tied: the head is the outer embedding
    assert all(torch.equal(got[k], v) for k, v in outer.items())
    assert torch.equal(got["lm_head.weight"], outer["model.embed_tokens.weight"])
    assert not all(torch.equal(local[k], v) for k, v in outer.items())  # local differs


def test_a_gpt_preset_exports_as_gpt2_with_the_same_logits(tmp_path):
    from transformers import AutoModelForCausalLM, GPT2LMHeadModel

    proc = lowband("train", "--algo", "ddp", "--model", "nano", "--replicas", 1, "--steps", 3,
                   "--run-dir", "r", *FAST, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert cli(["export", str(tmp_path / "r"), "-o", str(tmp_path / "gpt2")]) == 0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2").eval()
    assert isinstance(hf, GPT2LMHeadModel) and hf.config.n_positions == 32
    gpt = GPT(gpt_config("nano", seq_len=32))
    gpt.load_state_dict(torch.load(tmp_path / "r" / "model.pt", weights_only=True))
    x = torch.randint(0, 256, (3, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = gpt.eval()(x), hf(x).logits
    assert ours.abs().max() > 0.1  # trained logits, not zeros
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)


def _refused(capsys, argv, out):
    """cli(argv) refuses with one sentence and exit 2, and writes nothing beside or into out."""
    before = sorted(p.name for p in out.parent.iterdir())
    inside = sorted(p.name for p in out.iterdir()) if out.is_dir() else None
    capsys.readouterr()
    assert cli(["export", *map(str, argv)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lowband: error: ") and err.count("\n") == 1, err
    assert err.rstrip().endswith("."), err
    assert sorted(p.name for p in out.parent.iterdir()) == before
    assert (sorted(p.name for p in out.iterdir()) if out.is_dir() else None) == inside
    return err


def test_bad_input_is_one_sentence_and_writes_nothing(llama_runs, tmp_path, capsys):
    ddp, out = llama_runs / "ddp", tmp_path / "out"
    assert "not a run directory" in _refused(capsys, [tmp_path, "-o", out], out)
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    shutil.copy(ddp / "config.json", unfinished)
    assert "no model.pt" in _refused(capsys, [unfinished, "-o", out], out)
    assert "no outer.pt" in _refused(capsys, [ddp, "-o", out, "--which", "outer"], out)

    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert "--overwrite" in _refused(capsys, [ddp, "-o", out], out)
    assert "holds the run" in _refused(capsys, [ddp, "-o", llama_runs, "--overwrite"], llama_runs)
    gone = tmp_path / "gone"
    shutil.copytree(ddp, gone)
    config = json.loads((gone / "config.json").read_text())
    config["model"] = f"hf:{tmp_path / 'no-such-model'}"
    (gone / "config.json").write_text(json.dumps(config))
    assert "is gone" in _refused(capsys, [gone, "-o", tmp_path / "new"], tmp_path / "new")

    assert cli(["export", str(ddp), "-o", str(out), "--overwrite"]) == 0  # replaced
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gone", "out", "unfinished"]
