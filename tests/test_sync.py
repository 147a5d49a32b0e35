"""lowband.Sync (sync/): a plain PyTorch loop around lowband's algorithms equals `lowband train`
bitwise (ddp; diloco fp32; streaming fp4 with overlap 1; R=2), a resume in the middle equals the
uninterrupted run, and bad input gets one sentence and changes nothing."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import train_in_one_job
from lowband.launch.local import free_port
from lowband.telemetry import read_events

OPTIONS = {"ddp": {}, "diloco": dict(sync_every=4),
           "streaming": dict(sync_every=4, fragments=2, overlap=1, codec="fp4-e3m0")}
SHARED = dict(model="nano", steps=8, seq_len=32, batch_size=4)

# the loop a user would write around lowband's own GPT and data, as `lowband train` steps them
LOOP = textwrap.dedent('''
    import sys, torch
    from lowband import Config, Sync
    from lowband.data import Batches, load_corpus, vocab_needed
    from lowband.models import build, for_training, lm_loss
    from lowband.schedule import lr_at
    from lowband.train import make_optimizer_factory

    OPTIONS, SHARED = {options}, {shared}

    def run(run_dir, algo, stop, resume=False):
        opts = OPTIONS[algo]
        cfg = Config(algo=algo, **SHARED, **opts).validate()  # the loop's own model, data, lr
        tokens = load_corpus(cfg.data, cfg.tokenizer)
        torch.manual_seed(cfg.seed)
        model = for_training(build(cfg, vocab_needed(tokens)))
        optimizer = make_optimizer_factory(cfg, torch.device("cpu"))(model.parameters())
        sync = Sync(model, optimizer, algo, steps=8, seq_len=32, batch_size=4, run_dir=run_dir,
                    link_bandwidth="", checkpoint_every=4, resume=resume, **opts)
        batches = Batches(tokens, rank=sync.topo.rank, world=sync.topo.world, seq_len=32,
                          batch_size=4, seed=cfg.seed, val_fraction=cfg.val_fraction,
                          device=torch.device("cpu"))
        for step in range(sync.start_step, stop):
            for g in optimizer.param_groups:
                g["lr"] = lr_at(cfg, step)
            x, y = batches.train(step, 0)
            loss = lm_loss(model, x, y, "fp32")
            sync.backward(loss) if algo == "ddp" else loss.backward()  # ddp averages in it
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sync.step(loss=loss, tokens=x.numel())
        if stop == sync.steps:
            sync.finish()

    for arg in sys.argv[1:]:  # RUN_DIR:ALGO:STOP[:resume], one run after another
        run_dir, algo, stop, *resume = arg.split(":")
        run(run_dir, algo, int(stop), bool(resume))
''').format(options=OPTIONS, shared=SHARED)


def torchrun(tmp_path, *runs):
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
           "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script), *runs]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _flags(algo: str, run_dir) -> list[str]:
    out = ["--algo", algo, "--run-dir", run_dir, "--link-bandwidth", "none",
           "--checkpoint-every", 4, "--no-progress"]
    for key, value in {**SHARED, **OPTIONS[algo]}.items():
        out += [f"--{key.replace('_', '-')}", value]
    return out


def _same(a, b, name) -> None:
    x, y = torch.load(a / name), torch.load(b / name)
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), name


@pytest.mark.slow
def test_the_wrapper_equals_lowband_train_bitwise_and_a_resume_the_uninterrupted_run(tmp_path):
    train_in_one_job(*(_flags(a, tmp_path / f"train-{a}") for a in OPTIONS))
    torchrun(tmp_path, "sync-ddp:ddp:8", "sync-diloco:diloco:8", "sync-streaming:streaming:8",
             "resumed:streaming:5")  # the last stops after step 5, its checkpoint at step 4
    torchrun(tmp_path, "resumed:streaming:8:resume")
    for algo in OPTIONS:
        ours, theirs = tmp_path / f"sync-{algo}", tmp_path / f"train-{algo}"
        _same(ours, theirs, "model.pt")
        if algo != "ddp":
            _same(ours, theirs, "outer.pt")
        mine, base = (json.loads((d / "summary.json").read_text()) for d in (ours, theirs))
        for key in ("steps_run_per_replica", "tokens", "outer_wire_bytes", "final_loss"):
            assert mine[key] == base[key], key
        assert json.loads((ours / "config.json").read_text())["meta"]["loop"] == "lowband.Sync"
    resumed, whole = tmp_path / "resumed", tmp_path / "train-streaming"
    _same(resumed, whole, "model.pt")
    _same(resumed, whole, "outer.pt")
    mine, base = (json.loads((d / "summary.json").read_text()) for d in (resumed, whole))
    assert (mine["outer_wire_bytes"], mine["tokens"]) == (base["outer_wire_bytes"], base["tokens"])
    events = [e for e in read_events(resumed) if e["rank"] == 0]
    runs = [(e["phase"], e.get("step")) for e in events if e["kind"] == "run"]
    assert runs == [("start", 0), ("resume", 4), ("end", None)], runs
    steps = [e["step"] for e in events if e["kind"] == "step"]
    assert steps == list(range(1, 9))  # step 5 of the lost attempt is redone, counted once
    # the exchange in flight at the checkpoint lands as it was judged: no merge was bounded
    assert not [e for e in read_events(resumed) if e["kind"] == "guard"]


BAD = textwrap.dedent('''
    import os, sys, torch
    from lowband import ConfigError, Sync

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.ModuleList(
            [torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)]), torch.nn.Linear(8, 16))

    def said(make):
        try:
            make()
        except ConfigError as e:
            print("SAID", e)
        else:
            print("SAID nothing")

    m = model()
    before = [p.detach().clone() for p in m.parameters()]
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    said(lambda: Sync(m, torch.optim.SGD(list(m.parameters())[:2], lr=0.1), "diloco", run_dir="r1"))
    said(lambda: Sync(m, opt, "acco", run_dir="r2"))
    said(lambda: Sync(m, opt, "ddp", fragments=2, run_dir="r3"))
    said(lambda: Sync(m, opt, "ddp", sync_every=5, run_dir="r4"))
    said(lambda: Sync(m, opt, "streaming", lr=0.1, run_dir="r5"))
    said(lambda: Sync(m, opt, "diloco", sync_evry=10, run_dir="r6"))
    said(lambda: Sync(m, opt, "diloco", link_latency="10", run_dir="r7"))
    print("DIRS", sorted(d for d in os.listdir(".") if d.startswith("r")))
    sync = Sync(m, opt, "diloco", sync_every=2, link_bandwidth="", run_dir="ok")
    print("EVENTS", sorted({e.split('"kind":"')[1].split('"')[0]
                            for e in open("ok/events/rank0.jsonl")}))
    said(lambda: Sync(m, opt, "diloco", run_dir="again"))
    said(lambda: sync.step(loss=1.0))
    print("GONE", sorted(os.listdir(".")))  # refused at its first step: its directory removed
    print("SAME", all(torch.equal(a, b) for a, b in zip(before, m.parameters())))
    sync = Sync(m, opt, "diloco", sync_every=2, link_bandwidth="", run_dir="twice")  # free again
    for skipped in (False, True):  # a step AMP's scaler skipped has its backward, no update
        sum(p.sum() for p in m.parameters()).backward()
        if not skipped:
            opt.step()
        opt.zero_grad()
        sync.step(loss=1.0)
    said(lambda: sync.step(loss=1.0))
    print("STEPS", sync.done.step)
''')


def test_bad_input_gets_one_sentence_and_changes_nothing(tmp_path):
    (tmp_path / "bad.py").write_text(BAD)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["MASTER_PORT"] = str(free_port())  # a plain `python bad.py`: a world of one
    proc = subprocess.run([sys.executable, "bad.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line[5:] for line in proc.stdout.splitlines() if line.startswith("SAID ")]
    assert len(said) == 10 and "nothing" not in said, proc.stdout
    assert said[0].startswith("the optimizer does not own 5 of the model's 7 trainable parameters")
    assert said[1].startswith("lowband.Sync cannot run algo='acco': it owns the inner step")
    assert said[2].startswith("--fragments applies only to --algo")
    assert said[3].startswith("sync_every= is read only by algo diloco or streaming") and \
        said[3].endswith("so algo='ddp' would ignore it: remove it from lowband.Sync."), said[3]
    assert said[4].startswith("lr= is an option of `lowband train`'s own loop (--lr)")
    assert said[5].startswith("unknown option sync_evry: did you mean sync_every? ")
    assert said[6].startswith("--link-latency 10 has no unit: did you mean 10ms? ")
    assert said[7].startswith("this model is already wrapped by a lowband.Sync")
    assert said[8].startswith("sync.step() was called before the optimizer's step")
    assert said[9].startswith("sync.step() was called twice in step 2, with no backward pass")
    assert all(s.endswith(".") and s.count(". ") == 0 for s in said), said
    assert "DIRS []" in proc.stdout  # refused before the run directory was made
    assert "SAME True" in proc.stdout and "EVENTS ['run']" in proc.stdout, proc.stdout
    assert "GONE ['bad.py']" in proc.stdout and "STEPS 2\n" in proc.stdout, proc.stdout


def test_each_algorithm_says_how_it_fits_your_loop(monkeypatch):
    """Sync and the Hugging Face callback read one class attribute (user_loop), not lists of
    names: a registered subclass of DiLoCo fits both, as DiLoCo does; one of ddp fits Sync (it
    calls sync.backward) and not the Trainer; one that says nothing needs lowband's loop, and
    the refusal gives its reason and the algorithms that fit."""
    from lowband.algorithms import ALGORITHMS, Algorithm
    from lowband.algorithms.base import AT_STEP_EDGES, IN_BACKWARD, OWN_LOOP
    from lowband.algorithms.ddp import DDP
    from lowband.algorithms.streaming import DiLoCo
    from lowband.config import ConfigError
    from lowband.sync import check_fits, fitting

    class MyDiLoCo(DiLoCo):
        name = "my-diloco"

    class MyDDP(DDP):
        name = "my-ddp"

    class Mine(Algorithm):
        name = "mine"

    for cls in (MyDiLoCo, MyDDP, Mine):
        monkeypatch.setitem(ALGORITHMS, cls.name, cls)
    assert (MyDiLoCo.user_loop, MyDDP.user_loop, Mine.user_loop) == \
        (AT_STEP_EDGES, IN_BACKWARD, OWN_LOOP)
    trainer = {IN_BACKWARD: "the Trainer runs the backward pass"}  # what its loop refuses
    assert {"ddp", "my-ddp", "diloco", "my-diloco", "streaming"} <= set(fitting())
    assert {"diloco", "my-diloco", "streaming"} == set(fitting(tuple(trainer)))
    check_fits("my-diloco", "lowband.Sync")
    check_fits("my-diloco", "LowbandCallback", trainer)
    check_fits("my-ddp", "lowband.Sync")
    with pytest.raises(ConfigError, match="LowbandCallback cannot run algo='my-ddp'"):
        check_fits("my-ddp", "LowbandCallback", trainer)
    for name in ("mine", "acco", "edit", "aedit", "zero1"):
        with pytest.raises(ConfigError) as e:
            check_fits(name, "lowband.Sync")
        assert ALGORITHMS[name].own_loop_why in str(e.value) and "pick ddp" in str(e.value)
