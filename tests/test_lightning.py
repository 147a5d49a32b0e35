"""PyTorch Lightning with lowband's diloco and streaming (lowband.integrations.lightning): under
torchrun with R=2 on the CPU, a LightningModule around lowband's GPT fitted by Lightning's
Trainer with LowbandCallback and LowbandStrategy equals, bitwise, a plain loop with lowband.Sync
around the same module, data order, seed and options (the weights, the outer state, every
step's loss and tokens, the evaluations; streaming fp4 with overlap 1 and gradient
accumulation, diloco); a fit lost after step 6 and resumed from step 4 equals the whole fit; and
what the callback refuses, each in one sentence before anything is written."""

import importlib
import json
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

from lowband.config import ConfigError  # noqa: E402
from lowband.integrations.lightning import LowbandCallback, LowbandStrategy  # noqa: E402
from lowband.launch.local import free_port  # noqa: E402
from lowband.telemetry import read_events  # noqa: E402

SCRIPT = textwrap.dedent('''
    """Under torchrun (2 ranks): each run of sys.argv[2:] into OUT/NAME, one after another.
    NAME:lightning:ALGO or NAME:plain:ALGO (the same module, data, seed and options in a plain
    loop), NAME:lost:streaming (a fit lost after step 6), NAME:resumed:streaming."""
    import os, sys
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, DistributedSampler
    from lowband import Config, Sync
    from lowband.data import load_tokens
    from lowband.integrations.lightning import LowbandCallback, LowbandStrategy
    from lowband.models import build, lm_loss

    OPTIONS = {"streaming": dict(sync_every=4, fragments=2, overlap=1, codec="fp4-e3m0"),
               "diloco": dict(sync_every=4)}
    ACCUM = {"streaming": 2, "diloco": 1}  # 64 rows, 32 a replica: 8 batches of 4 an epoch
    STEPS, BATCH = 8, 4
    text = torch.from_numpy(load_tokens("builtin")[:80 * 33].astype("int64")).view(80, 33)
    train = [{"input_ids": r[:-1], "labels": r[1:]} for r in text[:64]]
    val = [{"input_ids": r[:-1], "labels": r[1:]} for r in text[64:]]


    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.gpt = build(Config(model="nano", seq_len=32), 256)

        def training_step(self, batch, i):
            return lm_loss(self.gpt, batch["input_ids"], batch["labels"])

        def validation_step(self, batch, i):
            self.log("val_loss", lm_loss(self.gpt, batch["input_ids"], batch["labels"]))

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)
            warm = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": warm, "interval": "step"}}


    class Lost(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 6:
                raise RuntimeError("lost after step 6")


    def fit(out, algo, lost=False, resume=False):
        options = dict(link_bandwidth="", checkpoint_every=4, run_dir=out, **OPTIONS[algo])
        callback = LowbandCallback(algo, resume=resume, **options)
        saves = ModelCheckpoint(dirpath=out + "-ckpt", filename="{step}", every_n_train_steps=4,
                                save_top_k=-1)
        trainer = pl.Trainer(strategy=LowbandStrategy(), max_steps=STEPS, logger=False,
                             accumulate_grad_batches=ACCUM[algo], gradient_clip_val=1.0,
                             callbacks=[callback, saves] + [Lost()] * lost,
                             enable_progress_bar=False, enable_model_summary=False)
        try:
            trainer.fit(LM(), DataLoader(train, batch_size=BATCH, shuffle=True),
                        DataLoader(val, batch_size=16),
                        ckpt_path=out + "-ckpt/step=4.ckpt" if resume else None)
        except RuntimeError:
            torch.distributed.barrier()  # (rank 0 has saved Lightning's checkpoint)


    def plain(out, algo):
        """The loop Lightning runs, written out: its sampler, accumulation, clipping, schedule."""
        module, accum = LM(), ACCUM[algo]
        config = module.configure_optimizers()
        opt, sched = config["optimizer"], config["lr_scheduler"]["scheduler"]
        sync = Sync(module, opt, algo, steps=STEPS, batch_size=BATCH, grad_accum=accum,
                    link_bandwidth="", checkpoint_every=4, run_dir=out, **OPTIONS[algo])
        sampler = DistributedSampler(train, num_replicas=2, rank=int(os.environ["RANK"]),
                                     shuffle=True, seed=0)
        for epoch in range(STEPS * accum * BATCH * 2 // len(train)):
            sampler.set_epoch(epoch)
            batches = list(DataLoader(train, batch_size=BATCH, sampler=sampler))
            for k in range(0, len(batches), accum):
                losses = []
                for batch in batches[k:k + accum]:
                    loss = module.training_step(batch, 0) / accum
                    loss.backward()
                    losses.append(loss.detach())
                torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
                sched.step()
                sync.step(loss=float(torch.stack(losses).float().sum()),
                          tokens=accum * BATCH * 32)
            with sync.paused(), torch.no_grad():  # Lightning validates at each epoch's end
                module.eval()
                batch = next(iter(DataLoader(val, batch_size=16)))
                sync.evaluated(float(lm_loss(module.gpt, batch["input_ids"], batch["labels"])))
                module.train()
        sync.finish()


    OUT = sys.argv[1]
    for run in sys.argv[2:]:
        name, how, algo = run.split(":")
        if how == "plain":
            plain(f"{OUT}/{name}", algo)
        else:
            fit(f"{OUT}/{name}", algo, lost=how == "lost", resume=how == "resumed")
''')


def _same(a, b, name) -> None:
    x, y = torch.load(a / name), torch.load(b / name)
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), (a, b, name)


def _events(run, kind):
    """Rank 0's events of a kind, but for their times (t, step_s, elapsed_s, ...)."""
    return [{k: v for k, v in e.items() if k != "t" and not k.endswith("_s")}
            for e in read_events(run, (kind,)) if e["rank"] == 0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One torchrun of 2 ranks: Lightning and the plain loop for streaming and diloco, then a
    streaming fit lost after step 6 and resumed from its checkpoints of step 4."""
    out = tmp_path_factory.mktemp("lightning")
    (out / "fit.py").write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "fit.py", out,
           "l-stream:lightning:streaming", "p-stream:plain:streaming", "l-diloco:lightning:diloco",
           "p-diloco:plain:diloco", "resumed:lost:streaming", "resumed:resumed:streaming"]
    proc = subprocess.run(list(map(str, cmd)), cwd=out, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["stream", "diloco"])
def test_a_lightning_fit_equals_the_plain_loop_bitwise(runs, algo):
    ours, plain = runs / f"l-{algo}", runs / f"p-{algo}"
    _same(ours, plain, "model.pt")
    _same(ours, plain, "outer.pt")
    mine, base = (json.loads((d / "summary.json").read_text()) for d in (ours, plain))
    accum = {"stream": 2, "diloco": 1}[algo]  # batches of 4 rows of 32 tokens a step
    assert mine["steps_run_per_replica"] == [8, 8] and mine["tokens"] == 2 * 8 * accum * 4 * 32
    for key in ("tokens", "outer_wire_bytes", "inner_wire_bytes", "final_loss", "final_val_loss"):
        assert mine[key] == base[key], key
    steps = _events(ours, "step")
    assert [e["step"] for e in steps] == list(range(1, 9)) and steps == _events(plain, "step")
    evals = _events(ours, "eval")  # each epoch's end (4 steps); the sanity check is none
    assert [e["step"] for e in evals] == {"stream": [4, 8], "diloco": [8]}[algo]
    assert evals == _events(plain, "eval")
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.3
    assert sorted(p.name for p in (runs / f"l-{algo}-ckpt").iterdir()) == ["step=4.ckpt",
                                                                           "step=8.ckpt"]


@pytest.mark.slow
def test_a_resumed_lightning_fit_equals_the_whole_fit(runs):
    resumed, whole = runs / "resumed", runs / "l-stream"
    _same(resumed, whole, "model.pt")
    _same(resumed, whole, "outer.pt")
    mine, base = (json.loads((d / "summary.json").read_text()) for d in (resumed, whole))
    for key in ("steps_run_per_replica", "tokens", "outer_wire_bytes", "final_loss",
                "final_val_loss"):
        assert mine[key] == base[key], key
    events = [e for e in read_events(resumed) if e["rank"] == 0]
    runs_ = [(e["phase"], e.get("step")) for e in events if e["kind"] == "run"]
    assert runs_ == [("start", 0), ("resume", 4), ("end", None)], runs_
    steps = [e["step"] for e in events if e["kind"] == "step"]
    assert steps == list(range(1, 9))  # steps 5 and 6 of the lost fit redone, counted once
    # every step's loss, lr and tokens; the evaluations, but for step 4's, which Lightning ran
    # after lowband's checkpoint of step 4 (so the resume may drop its event) and not again
    assert _events(resumed, "step") == _events(whole, "step")
    evals, whole_evals = _events(resumed, "eval"), _events(whole, "eval")
    assert evals[-1]["step"] == 8 and all(e in whole_evals for e in evals), evals


# -- what the callback refuses ---------------------------------------------------------------------

def _one_sentence(message: str) -> bool:
    return "\n" not in message and message.endswith(".")


@pytest.mark.parametrize("algo, kwargs, says", [
    ("ddp", {}, "use Lightning's own strategy='ddp' (without the callback), or diloco or"),
    ("acco", {}, "cannot run algo='acco'"),
    ("nope", {}, "LowbandCallback runs algo='diloco' or 'streaming', not 'nope'."),
    ("streaming", {"local_steps": "adaptive"}, "than Lightning's max_steps"),
    ("streaming", {"steps": 10}, "steps= is Lightning's max_steps (or max_epochs) here"),
    ("diloco", {"batch_size": 8}, "batch_size= is the DataLoader's batch_size here"),
    ("diloco", {"grad_accum": 2}, "grad_accum= is Lightning's accumulate_grad_batches here"),
])
def test_the_callback_refuses_what_it_cannot_run(algo, kwargs, says):
    with pytest.raises(ConfigError) as e:
        LowbandCallback(algo, **kwargs)
    assert says in str(e.value) and _one_sentence(str(e.value)), str(e.value)


class Tiny(pl.LightningModule):
    def __init__(self, manual=False):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
        self.automatic_optimization = not manual

    def training_step(self, batch, i):
        return self.blocks[1](self.blocks[0](batch)).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _refused(callback, trainer, module=None):
    with pytest.raises(ConfigError) as e:
        trainer.fit(module or Tiny(), torch.utils.data.DataLoader(torch.randn(8, 4)))
    assert _one_sentence(str(e.value)), str(e.value)
    return str(e.value)


def _trainer(callback, **kwargs):
    return pl.Trainer(max_steps=2, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[callback], **kwargs)


def test_the_callback_refuses_data_parallel_strategies_and_manual_optimization(tmp_path,
                                                                              monkeypatch):
    monkeypatch.chdir(tmp_path)
    options = dict(run_dir=str(tmp_path / "r"), link_bandwidth="")
    cb = LowbandCallback("diloco", **options)
    ddp = _trainer(cb, strategy="ddp", accelerator="cpu", devices=2)
    # (checked at setup, in each process Lightning's DDP would start: here, before it starts any)
    with pytest.raises(ConfigError) as e:
        cb.setup(ddp, Tiny(), "fit")
    assert str(e.value).startswith("Lightning's DDPStrategy would train data-parallel over its "
                                   "devices and nodes") and _one_sentence(str(e.value))
    assert "LowbandStrategy()" in str(e.value)
    said = _refused(cb, _trainer(cb, accelerator="cpu"), Tiny(manual=True))
    assert said.startswith("LowbandCallback runs Lightning's automatic optimization")
    monkeypatch.setenv("WORLD_SIZE", "2")  # a job of two processes, as torchrun starts it
    said = _refused(cb, _trainer(cb, accelerator="cpu"))
    assert said.startswith("in a job of 2 processes Lightning's SingleDeviceStrategy makes every "
                           "rank rank 0") and "LowbandStrategy()" in said
    monkeypatch.setenv("RANK", "1")
    ours = LowbandStrategy()
    assert (ours.global_rank, ours.is_global_zero, ours.replicas) == (1, False, 2)
    assert not (tmp_path / "r").exists()  # nothing written


def test_the_callback_refuses_shards_and_elastic_before_writing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    for options, says in [({"shards": 2}, "runs one rank a replica group, not shards=2: a "
                                          "replica's ranks average gradients inside the backward "
                                          "pass, which Lightning runs;"),
                          ({"elastic": True}, "LowbandCallback does not run elastic: a group "
                                              "healed from a live peer goes on from the peer's "
                                              "step, which Lightning's own step count")]:
        module = Tiny()
        before = [p.detach().clone() for p in module.parameters()]
        cb = LowbandCallback("streaming", run_dir=str(tmp_path / "r"), **options)
        said = _refused(cb, _trainer(cb, strategy=LowbandStrategy()), module)
        assert says in said, said
        assert all(torch.equal(a, b) for a, b in zip(before, module.parameters()))
    assert not (tmp_path / "r").exists()


def test_without_lightning_the_import_is_one_sentence(monkeypatch):
    monkeypatch.setitem(sys.modules, "lightning", None)  # as if it were not installed
    monkeypatch.delitem(sys.modules, "lowband.integrations.lightning")
    with pytest.raises(ConfigError) as e:
        importlib.import_module("lowband.integrations.lightning")
    assert "needs the lightning extra (lightning is not installed): pip install " \
        "'lowband[lightning]'." in str(e.value) and _one_sentence(str(e.value))
