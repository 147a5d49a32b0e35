"""Hugging Face causal LMs through `lowband train --model hf:PATH` (lowband/models/hf.py): every
algorithm on a tiny Llama built from its config, zero1 equal to ddp, lowband's ddp equal to
torch's DistributedDataParallel, block-sized options checked against the model trained, the
initial broadcast kept out of the sync figures, and bad input in one sentence.
Nothing reaches a hub: the models are config directories written here."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import hf_config, lowband, train_in_one_job
from lowband.config import Config, ConfigError
from lowband.launch.local import free_port
from lowband.models import build
from lowband.telemetry import read_events

pytestmark = pytest.mark.slow  # measured (--durations): README, Run the tests

SMALL = ["--steps", 8, "--warmup-steps", 2, "--seq-len", 32, "--batch-size", 4,
         "--eval-every", 0, "--eval-batches", 2, "--no-progress", "--link-bandwidth", "none"]
EVERY = [("ddp", 1), ("diloco", 1), ("streaming", 1), ("zero1", 1), ("acco", 1), ("edit", 1),
         ("aedit", 1), ("edit", 2), ("streaming", 2)]  # (algo, shards), two replicas each


@pytest.fixture(scope="module")
def runs(llama, tmp_path_factory):
    """(algo, shards) -> the run directory of that algorithm on the tiny Llama. Every one of
    EVERY trains once, with `lowband train`'s flags, in one job a world size (train_in_one_job:
    the worker side of the CLI; the tests below run the CLI itself)."""
    root = tmp_path_factory.mktemp("hfruns")
    # acco's budget is ddp's micro-batches: enough of them for a few of its updates; the
    # progress bar on (rank 0's stderr), so that every algorithm's count for it is exercised
    bar = [f for f in SMALL if f != "--no-progress"]
    train_in_one_job(*[["--model", f"hf:{llama}", "--algo", algo, "--replicas", 2, "--shards", shards,
                        "--run-dir", root / f"{algo}-s{shards}", *bar,
                        *(["--grad-accum", 4] if algo == "acco" else [])] for algo, shards in EVERY])
    return lambda algo, shards=1: root / f"{algo}-s{shards}"


@pytest.mark.parametrize("algo,shards", EVERY)
def test_every_algorithm_trains_a_llama(runs, algo, shards):
    out = runs(algo, shards)
    summary = json.loads((out / "summary.json").read_text())
    first = [e["loss"] for e in read_events(out, ("step",)) if e["step"] == 1]
    assert summary["final_val_loss"] < min(first) - 0.3, (summary, first)  # ln 256 = 5.55 at start
    state = torch.load(out / "model.pt", weights_only=True)
    assert "model.layers.3.mlp.down_proj.weight" in state  # the model's own names, no prefix
    meta = json.loads((out / "config.json").read_text())["meta"]
    assert meta["n_params"] == sum(v.numel() for k, v in state.items() if k != "lm_head.weight")


def test_zero1_equals_ddp_to_fp32_rounding(runs, llama):
    """zero1 takes the same steps as ddp; its arithmetic differs only in rounding (a sum over
    ranks divided once, a float64 global norm, AdamW on a flat shard), so after 8 steps the
    weights agree to a few fp32 ulps while the steps moved them a thousand times further."""
    ddp = torch.load(runs("ddp") / "model.pt", weights_only=True)
    zero1 = torch.load(runs("zero1") / "model.pt", weights_only=True)
    assert ddp.keys() == zero1.keys()
    diff = max((ddp[k] - zero1[k]).abs().max().item() for k in ddp)
    cfg = Config(model=f"hf:{llama}")
    start = build(cfg, 256).state_dict()
    moved = max((ddp[k] - start[k]).abs().max().item() for k in ddp)
    assert diff < 1e-6 and moved > 1e-3, (diff, moved)


@pytest.mark.parametrize("kind", ["qwen2", "gpt2"])
def test_other_architectures_stream(kind, tmp_path):
    """Qwen2 (untied head, biased attention) and GPT-2 (Conv1D, learned positions) with 4
    fragments: one fragment per decoder layer."""
    path = hf_config(tmp_path, kind)
    proc = lowband("train", "--model", f"hf:{path}", "--algo", "streaming", "--fragments", 4,
                   "--sync-every", 4, "--overlap", 0, "--run-dir", tmp_path / "r", *SMALL, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    syncs = [e for e in read_events(tmp_path / "r", ("sync",)) if e["rank"] == 0]
    assert sorted({e["fragment"] for e in syncs}) == [0, 1, 2, 3]


def test_fragments_are_checked_against_the_model_trained(tmp_path):
    eight = hf_config(tmp_path, "llama", layers=8)
    cfg = Config(algo="streaming", model=f"hf:{eight}", fragments=8, sync_every=16)
    assert cfg.validate().n_blocks() == 8
    with pytest.raises(ConfigError, match="more than the model's 8 blocks"):
        Config(algo="streaming", model=f"hf:{eight}", fragments=9, sync_every=18).validate()
    user = Config(algo="streaming", fragments=8, sync_every=16)  # a module given to train()
    user.model_blocks = 8
    assert user.validate().n_blocks() == 8
    with pytest.raises(ConfigError, match="more than the model's 4 blocks"):
        Config(algo="streaming", fragments=8, sync_every=16).validate()  # the micro preset's 4


DDP_SCRIPT = textwrap.dedent('''
    import sys, torch
    from torch.nn.parallel import DistributedDataParallel
    from lowband import Config
    from lowband.data import Batches, load_corpus, vocab_needed
    from lowband.schedule import lr_at
    from lowband.models import build
    from lowband.train import make_optimizer_factory, train

    cfg = Config(algo="ddp", model="hf:" + sys.argv[1], replicas=2, steps=10, warmup_steps=3,
                 seq_len=32, batch_size=4, eval_every=0, eval_batches=1, run_dir=sys.argv[2],
                 progress=False, link_bandwidth="")
    summary = train(cfg)  # lowband's ddp, leaving the process group up
    ours = torch.load(sys.argv[2] + "/model.pt", weights_only=True)
    rank = torch.distributed.get_rank()
    tokens = load_corpus(cfg.data)
    data = Batches(tokens, rank=rank, world=2, seq_len=cfg.seq_len, batch_size=cfg.batch_size,
                   seed=cfg.seed, val_fraction=cfg.val_fraction)
    model = build(cfg, vocab_needed(tokens))
    theirs = DistributedDataParallel(model)
    opt = make_optimizer_factory(cfg, torch.device("cpu"))(theirs.parameters())
    for step in range(cfg.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, step)
        x, y = data.train(step, 0)
        logits = theirs(x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(theirs.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    if rank == 0:
        diff = max((ours[k] - v).abs().max().item() for k, v in model.state_dict().items())
        moved = max((ours[k] - v).abs().max().item() for k, v in build(cfg, 256).state_dict().items())
        print("DIFF", diff, "MOVED", moved)
''')


def test_lowband_ddp_equals_torch_ddp_on_a_llama(llama, tmp_path):
    (tmp_path / "both.py").write_text(DDP_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "both.py", llama,
           tmp_path / "r"]
    proc = subprocess.run(list(map(str, cmd)), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    words = proc.stdout.split()
    diff, moved = float(words[words.index("DIFF") + 1]), float(words[words.index("MOVED") + 1])
    assert moved > 1e-3  # 10 steps moved the weights well past fp32 rounding
    assert diff < 2e-5, (diff, moved)


def test_a_user_module_broadcast_is_kept_out_of_the_sync_figures(llama, tmp_path):
    """A module given to train() starts from rank 0's weights: one broadcast recorded as a
    `setup` event, not in outer_wire_bytes, the peak payload or the comm events."""
    script = textwrap.dedent(f'''
        import sys
        from transformers import AutoConfig, AutoModelForCausalLM
        from lowband import Config
        from lowband.train import train
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained("{llama}"))
        cfg = Config(algo="streaming", replicas=2, steps=4, fragments=4, sync_every=4, overlap=0,
                     seq_len=32, batch_size=4, eval_every=0, eval_batches=1,
                     run_dir=sys.argv[1], progress=False, link_bandwidth="")
        train(cfg, model=model)
    ''')
    (tmp_path / "mine.py").write_text(script)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "mine.py", tmp_path / "r"]
    proc = subprocess.run(list(map(str, cmd)), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    setup = list(read_events(tmp_path / "r", ("setup",)))
    n_params = json.loads((tmp_path / "r" / "config.json").read_text())["meta"]["n_params"]
    assert [e["tag"] for e in setup] == ["init"] and setup[0]["payload_bytes"] == 4 * n_params
    assert summary["setup_wire_bytes"] == 4 * n_params
    comm = [e for e in read_events(tmp_path / "r", ("comm",)) if e["group"] == "outer"]
    assert summary["outer_wire_bytes"] == sum(e["wire_bytes"] for e in comm)
    biggest = max(e["payload_bytes"] for e in comm)
    assert summary["peak_outer_payload_bytes"] == biggest < n_params  # a fragment, not the model


def test_bad_models_give_one_sentence(tmp_path, llama, tok, lowband_here):
    (tmp_path / "vit").mkdir()
    (tmp_path / "vit" / "config.json").write_text(json.dumps({"model_type": "vit"}))
    (tmp_path / "junk.json").write_text("{not json")
    cases = [
        (["--model", f"hf:{tmp_path / 'vit'}"], "not a causal language model"),
        (["--model", f"hf:{tmp_path / 'junk.json'}"], "is not a Hugging Face model config"),
        (["--model", f"hf:{tmp_path / 'none'}"], "does not exist"),
        (["--model", f"hf:{llama}", "--n-layer", 2], "set the size in"),
        (["--model", f"hf:{llama}", "--seq-len", 512], "longer than the 256 positions"),
    ]
    for args, words in cases:  # refused before any worker starts: cli.main in this process
        code, stderr = lowband_here("train", *args, "--run-dir", tmp_path / "r", cwd=tmp_path)
        assert code == 2 and words in stderr, (args, stderr)
        assert len(stderr.strip().splitlines()) == 1, stderr
        assert not (tmp_path / "r").exists()
    # a tokenizer of 512 ids for a model of 256: refused once the data is read, nothing written
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "summary.json").write_text('{"an": "earlier run"}')
    proc = lowband("train", "--model", f"hf:{llama}", "--tokenizer", tok[0], "--replicas", 1,
                   "--run-dir", tmp_path / "keep", "--overwrite", *SMALL, cwd=tmp_path)
    assert proc.returncode == 2 and "exceeds the model's 256" in proc.stderr, proc.stderr
    assert (tmp_path / "keep" / "summary.json").read_text() == '{"an": "earlier run"}'
    assert sorted(p.name for p in (tmp_path / "keep").iterdir()) == ["summary.json"]
