"""--optimizer muon (algorithms/inner.py): Muon on the blocks' matrices, AdamW on the rest, as
one optimizer that the loop, the algorithms and the checkpoints step, zero and restore."""

from copy import deepcopy as copy_of

import pytest
import torch

from conftest import train_in_one_job
from lowband.algorithms.inner import MuonAdamW, make_optimizer_factory
from lowband.checkpoint import latest
from lowband.config import Config, ConfigError
from lowband.models.gpt import GPT, gpt_config
from lowband.telemetry import RunDir, read_events

LR, WD = 2e-3, 0.1
TINY = ["--model", "nano", "--link-bandwidth", "none", "--steps", "10", "--seq-len", "32",
        "--batch-size", "4", "--warmup-steps", "2", "--eval-every", "0", "--no-progress"]
STREAMING = ["--algo", "streaming", "--replicas", "2", "--sync-every", "4", "--fragments", "2",
             "--optimizer", "muon", "--checkpoint-every", "3", *TINY]


def _model_and_grads(seed: int):
    torch.manual_seed(seed)
    model = GPT(gpt_config("nano", n_layer=2, seq_len=32))
    grads = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    return model, grads


def _step(model, opt, grads, lr):
    for n, p in model.named_parameters():
        p.grad = grads[n].clone()
    for g in opt.param_groups:  # as the loop sets the schedule's lr
        g["lr"] = lr
    opt.step()
    opt.zero_grad(set_to_none=True)


def _references(model):
    """torch's own Muon and AdamW over the split the module doc names, picked here by name:
    a block's matrices to Muon; embeddings (the tied head with them) and norms to AdamW."""
    named = dict(model.named_parameters())
    hidden = [p for n, p in named.items() if n.startswith("blocks.") and p.dim() == 2]
    decay = [named["wte.weight"], named["wpe.weight"]]
    rest = [p for p in named.values() if p.dim() == 1]
    assert len(hidden) + len(decay) + len(rest) == len(named)
    muon = torch.optim.Muon(hidden, lr=LR, weight_decay=WD, momentum=0.95, nesterov=True,
                            adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([{"params": decay, "weight_decay": WD},
                               {"params": rest, "weight_decay": 0.0}], lr=LR, betas=(0.9, 0.95))
    return muon, adamw


def test_one_optimizer_steps_as_torch_muon_and_adamw_exactly():
    cfg = Config(optimizer="muon", lr=LR, weight_decay=WD)
    mine, grads = _model_and_grads(0)
    theirs, _ = _model_and_grads(0)
    opt = make_optimizer_factory(cfg, torch.device("cpu"), mine.blocks)(mine.parameters())
    assert isinstance(opt, MuonAdamW) and not opt.defaults["fused"]  # the host decides skips
    muon, adamw = _references(theirs)
    for step, lr in enumerate((LR, LR / 3)):  # the lr reaches both through param_groups
        _step(mine, opt, grads, lr)
        for ref in (muon, adamw):
            _step(theirs, ref, grads, lr)
        for (n, a), b in zip(mine.named_parameters(), theirs.parameters()):
            assert torch.equal(a, b), (step, n)
    # a block's matrix moved by Muon's orthogonalized update (not AdamW's), the head by AdamW
    qkv = mine.blocks[0].attn.qkv.weight
    assert set(opt.state[qkv]) == {"momentum_buffer"}
    assert set(opt.state[mine.wte.weight]) == {"step", "exp_avg", "exp_avg_sq"}
    # state_dict into a fresh optimizer over a copy: the next step is the same
    copy, _ = _model_and_grads(1)
    copy.load_state_dict(mine.state_dict())
    again = make_optimizer_factory(cfg, torch.device("cpu"), copy.blocks)(copy.parameters())
    again.load_state_dict(copy_of(opt.state_dict()))  # (torch's shares the state's tensors)
    _step(mine, opt, grads, LR)
    _step(copy, again, grads, LR)
    assert all(torch.equal(a, b) for a, b in zip(mine.parameters(), copy.parameters()))
    # guard.py's recovery zeroes every moment through .state, Muon's momentum too
    for p in mine.parameters():
        for k, v in opt.state.get(p, {}).items():
            if k != "step":
                v.zero_()
    assert not opt.state[qkv]["momentum_buffer"].any()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_torch_dcp_checkpoint_round_trip(tmp_path):
    """checkpoint/ writes and reads the model and optimizer with torch DCP (get_state_dict,
    dcp.save, dcp.load, set_state_dict): here in one process, into a fresh model's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    cfg = Config(optimizer="muon", lr=LR, weight_decay=WD)
    a, grads = _model_and_grads(0)
    opt_a = make_optimizer_factory(cfg, torch.device("cpu"), a.blocks)(a.parameters())
    _step(a, opt_a, grads, LR)
    msd, osd = get_state_dict(a, opt_a)
    assert "blocks.0.attn.qkv.weight" in osd["state"]  # keyed by name, as DCP writes it
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp_path / "ckpt")
    b, _ = _model_and_grads(1)
    opt_b = make_optimizer_factory(cfg, torch.device("cpu"), b.blocks)(b.parameters())
    state = dict(zip(("model", "optim"), get_state_dict(b, opt_b)))
    dcp.load(state, checkpoint_id=tmp_path / "ckpt")
    set_state_dict(b, opt_b, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _step(a, opt_a, grads, LR / 2)
    _step(b, opt_b, grads, LR / 2)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """ddp at R=1 with and without --optimizer adamw; streaming R=2 with muon, whole and
    stopped after 5 steps, then the stopped one resumed in a fresh job."""
    root = tmp_path_factory.mktemp("muon")
    ddp = ["--algo", "ddp", "--replicas", "1", *TINY]
    train_in_one_job(["--run-dir", root / "plain", *ddp],
                     ["--run-dir", root / "adamw", "--optimizer", "adamw", *ddp],
                     ["--run-dir", root / "whole", *STREAMING],
                     ["--run-dir", root / "part", "--stop-after", "5", *STREAMING])
    train_in_one_job(["--resume", root / "part"])
    return root


@pytest.mark.slow  # (the runs: multi-process training)
def test_adamw_is_the_default_bitwise(runs):
    a = torch.load(runs / "plain" / "model.pt", weights_only=True)
    b = torch.load(runs / "adamw" / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow  # (the runs: multi-process training)
def test_streaming_with_muon_learns_and_resumes_bitwise(runs):
    losses = [e["loss"] for e in read_events(runs / "whole", ("step",)) if e["rank"] == 0]
    assert len(losses) == 10 and sum(losses[-3:]) / 3 < losses[0] - 0.3, losses
    assert latest(RunDir(runs / "part")).name == "step-00000010"
    for name in ("model.pt", "outer.pt"):
        a = torch.load(runs / "whole" / name, weights_only=True)
        b = torch.load(runs / "part" / name, weights_only=True)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


@pytest.mark.parametrize("flags, says", [
    (["--optimizer", "sgd"], "--optimizer 'sgd' is not one of adamw, muon"),
    (["--algo", "zero1", "--optimizer", "muon"], "zero1 takes the inner step itself"),
    (["--algo", "acco", "--optimizer", "muon"], "acco takes the inner step itself"),
    (["--algo", "edit", "--shards", "2", "--optimizer", "muon"], "Newton-Schulz needs whole"),
])
def test_refusals(tmp_path, lowband_here, flags, says):
    code, stderr = lowband_here("train", "--run-dir", tmp_path / "r", *flags, cwd=tmp_path)
    assert code == 2 and says in stderr and stderr.count("\n") == 1, stderr
    assert not (tmp_path / "r").exists()


def test_a_user_loop_keeps_its_own_optimizer():
    from lowband.sync.options import config_of

    with pytest.raises(ConfigError, match="optimizer= is an option of `lowband train`'s own"):
        config_of("diloco", None, {"optimizer": "muon"}, 2)


@pytest.mark.parametrize("adjust,nesterov", [("original", False), ("match_rms_adamw", True),
                                             (None, True)])
def test_batched_muon_is_torch_muon_bitwise_over_tall_wide_and_repeated_shapes(adjust, nesterov):
    """BatchedMuon (made to batch on the CPU too) runs one Newton-Schulz per shape over the
    matrices stacked; the update is torch.optim.Muon's, bit for bit for matrices of this size
    (tall ones transposed, as torch's are)."""
    from lowband.algorithms.inner import BatchedMuon

    torch.manual_seed(0)
    shapes = [(48, 16), (16, 48), (48, 16), (32, 32), (16, 48), (32, 32), (8, 64)]
    ours = [torch.randn(s, requires_grad=True) for s in shapes]
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    start = [p.detach().clone() for p in ours]
    args = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust)
    opts = BatchedMuon(ours, **args, batch=True), torch.optim.Muon(theirs, **args)
    for _ in range(3):
        grads = [torch.randn(s) for s in shapes]
        for params, opt in zip((ours, theirs), opts):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert not any(torch.equal(p, s) for p, s in zip(ours, start))  # every matrix moved


def test_the_muon_step_benchmark_runs_and_stays_bitwise(tmp_path):
    """benchmarks/muon_step.py on nano, two steps: its rows, torch's step against the batches."""
    import importlib.util
    import json
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(bench))  # (its `machine` helper)
    try:
        spec = importlib.util.spec_from_file_location("muon_step", bench / "muon_step.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        assert mod.main(["--models", "nano", "--steps", "2", "--device", "cpu",
                         "--json", str(tmp_path / "m.json")]) == 0
    finally:
        sys.path.remove(str(bench))
    row, = json.loads((tmp_path / "m.json").read_text())["rows"]
    assert (row["matrices"], row["shapes"], row["bitwise_equal"]) == (8, 4, True)
    assert row["torch_s"] > 0 and row["batched_s"] > 0
