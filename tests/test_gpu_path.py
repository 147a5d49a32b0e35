"""The GPU path's pieces that CPU can check: bf16 autocast, compiled blocks, the backend choice,
and comm times taken from a device clock (CUDA events on a GPU; a stand-in clock here)."""

import json
import os
import threading
import time

import pytest
import torch
import torch.multiprocessing as mp

from lowband.comm import topology
from lowband.comm import Comm
from lowband.config import ConfigError
from lowband.launch.local import free_port
from lowband.models import compile_blocks, lm_loss
from lowband.models.gpt import GPT, gpt_config
from lowband.telemetry import read_events


def _pair(seed=0):
    torch.manual_seed(seed)
    a = GPT(gpt_config("nano", seq_len=32))
    b = GPT(gpt_config("nano", seq_len=32))
    b.load_state_dict(a.state_dict())
    x, y = torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32))
    return a, b, x, y


def test_bf16_autocast_runs_matmuls_in_bf16_and_keeps_fp32_state():
    model, _, x, y = _pair()
    seen = []
    model.blocks[0].fc.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    fp32 = lm_loss(model, x, y)
    bf16 = lm_loss(model, x, y, "bf16")
    bf16.backward()
    assert seen == [torch.float32, torch.bfloat16]
    assert bf16.dtype == torch.float32 and bf16.item() != fp32.item()
    assert abs(bf16.item() - fp32.item()) < 1e-2 * fp32.item()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())


@pytest.mark.slow
def test_compiled_blocks_keep_names_and_match_eager():
    compiled, eager, x, y = _pair()
    names = list(compiled.state_dict())
    compile_blocks(compiled.blocks)
    assert list(compiled.state_dict()) == names
    a, b = lm_loss(compiled, x, y), lm_loss(eager, x, y)
    a.backward()
    b.backward()
    assert abs(a.item() - b.item()) < 1e-5
    for p, q in zip(compiled.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_training_with_compile_and_bf16(train_runs):
    """streaming over 2 ranks: compiled blocks follow the eager run; bf16 trains as well."""
    flags = ["--algo", "streaming", "--model", "nano", "--steps", "8", "--sync-every", "4",
             "--fragments", "2", "--seq-len", "32", "--batch-size", "4", "--eval-every", "0",
             "--lr", "1e-3", "--link-bandwidth", "none"]
    runs = train_runs(eager=flags, compiled=[*flags, "--compile"],
                      bf16=[*flags, "--precision", "bf16"])
    eager, compiled, bf16 = runs["eager"], runs["compiled"], runs["bf16"]

    def losses(run):
        steps = sorted((e["rank"], e["step"], e["loss"]) for e in read_events(run, ("step",)))
        return [loss for _, _, loss in steps]

    assert losses(compiled) == pytest.approx(losses(eager), rel=1e-4)
    assert losses(bf16) == pytest.approx(losses(eager), rel=2e-2)
    assert losses(bf16) != losses(eager)
    config = json.loads(bf16.config.read_text())
    assert config["precision"] == "bf16" and config["meta"]["backend"] == "gloo"


def test_backend_choice(monkeypatch):
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert topology.pick_backend("auto", cpu) == "gloo"
    with pytest.raises(ConfigError, match="nccl needs CUDA"):
        topology.pick_backend("nccl", cpu)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # four ranks, one GPU: NCCL would refuse
    assert topology.pick_backend("auto", gpu) == "gloo"
    assert topology.pick_backend("nccl", gpu) == "nccl"  # asked for: NCCL itself will say no
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert topology.pick_backend("auto", gpu) == "nccl"


class _StandInClock:
    """GpuClock's interface: marks at 'GPU time' 10.0, completions at 12.5."""

    def mark(self):
        return "start"

    def seconds(self, event):
        return {"start": 10.0, "end": 12.5}[event]

    def watch(self, work, callback):
        threading.Thread(target=lambda: (work.wait(), callback("end")), daemon=True).start()


def _clock_worker(rank, port, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    topo = topology.init(2, 1, "cpu")
    comm = Comm(topo, None, clock=_StandInClock())
    t = comm.all_reduce(torch.full((1000,), float(rank + 1)), "outer")
    total = t.wait()
    deadline = time.time() + 10
    while "end" not in t.record and time.time() < deadline:
        time.sleep(0.01)
    results.put((rank, total[0].item(), dict(t.record), comm.totals.wire_bytes["outer"]))


def test_comm_times_come_from_the_device_clock():
    q = mp.get_context("spawn").Queue()
    mp.spawn(_clock_worker, args=(free_port(), q), nprocs=2)
    for _ in range(2):
        rank, total, record, wire = q.get()
        assert total == 3.0
        assert (record["start"], record["end"], record["clock"]) == (10.0, 12.5, "cuda")
        assert wire == 4000


def test_fused_step_skips_itself_on_the_device_when_a_gradient_is_not_finite():
    """On CUDA the trainer queues the fused AdamW step with found_inf instead of waiting for the
    gradient norm on the host; a non-finite gradient must still leave parameters, moments and
    step counts as they were, and count as a skip. CPU's fused AdamW takes the same path."""
    from lowband.algorithms.base import Algorithm
    from lowband.config import Config
    from lowband.train import _skips_on_device, standard_step

    torch.manual_seed(0)
    model = GPT(gpt_config("nano", seq_len=16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    assert _skips_on_device(opt)
    cfg = Config(model="nano", seq_len=16, batch_size=2, steps=3, warmup_steps=0)

    class Batches:
        def train(self, step, micro):
            g = torch.Generator().manual_seed(step)
            x = torch.randint(0, 64, (2, 16), generator=g)
            return x, x.roll(-1, 1)

    algo = Algorithm()
    algo.config = cfg  # (setup's: the learning rate's schedule reads it)
    standard_step(algo, model, opt, Batches(), cfg, 0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    hook = model.blocks[0].attn.qkv.weight.register_hook(lambda g: g * float("nan"))
    standard_step(algo, model, opt, Batches(), cfg, 1)
    hook.remove()
    assert algo.skips == 1
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(m, opt.state[p]["exp_avg"]) for m, p in zip(moments, model.parameters()))
    assert all(int(opt.state[p]["step"]) == 1 for p in model.parameters())
    standard_step(algo, model, opt, Batches(), cfg, 2)
    assert algo.skips == 0 and not torch.equal(before["blocks.0.attn.qkv.weight"],
                                               model.blocks[0].attn.qkv.weight)
