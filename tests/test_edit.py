"""edit and aedit: the penalty math, and runs against a float64 reference (R replicas simulated in
a loop, written here from the documented formulas), corruption, stragglers, memory, state."""

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lowband.algorithms import penalty as pen
from lowband.config import Config, ConfigError
from lowband.models.gpt import GPT, gpt_config
from conftest import join_local_job, outer_lr_of, reference_replicas, train_in_one_job
from test_penalty_reference import AtorchPenalty
from lowband.telemetry import RunDir, read_events

pytestmark = pytest.mark.slow  # measured (--durations): README, Run the tests

BATCH, SEQ, LR, WARMUP, CLIP, SEED, MU, N_LAYER = 2, 32, 1e-3, 2, 0.5, 5, 0.9, 2


# ---------------------------------------------------------------------------------------------
# the penalty, written again in float64 from its documentation
# ---------------------------------------------------------------------------------------------

class RefPenalty:
    def __init__(self, anomaly=True, rate=0.1, z=3.0, warmup=3, floor=0.1, weighted=True,
                 temperature=0.0, clip=0.0, step_weights=False):
        self.anomaly, self.rate, self.z, self.warmup, self.floor = anomaly, rate, z, warmup, floor
        self.weighted, self.temperature, self.clip, self.step_weights = weighted, temperature, clip, step_weights
        self.stats = {}  # block -> [mean, var, values seen, syncs seen]

    def decide(self, block, norms, shares=None):
        mean, var, seen, syncs = self.stats.get(block, [0.0, 0.0, 0, 0])
        std = max(math.sqrt(var), self.floor * abs(mean))
        z = [0.0 if seen == 0 or std == 0 else (x - mean) / std for x in norms]
        flags = [not math.isfinite(x) or (self.anomaly and syncs >= self.warmup and zi > self.z)
                 for x, zi in zip(norms, z)]
        cap = mean + self.z * std
        for x, f in zip(norms, flags):
            x = cap if f else x
            if seen == 0:
                mean, var = x, 0.0
            else:
                var = (1 - self.rate) * (var + self.rate * (x - mean) ** 2)
                mean = mean + self.rate * (x - mean)
            seen += 1
        self.stats[block] = [mean, var, seen, syncs + 1]
        keep = [i for i, f in enumerate(flags) if not f]
        w = [0.0] * len(norms)
        if keep:
            base = [1.0] * len(norms)
            if self.step_weights and shares is not None and sum(shares[i] for i in keep) > 0:
                base = list(shares)
            T = self.temperature or sum(norms[i] for i in keep) / len(keep) or 1.0
            for i in keep:
                w[i] = base[i] * (math.exp(-norms[i] / T) if self.weighted else 1.0)
            w = [x / sum(w) for x in w]
        return z, flags, w

    def clip_scale(self, norm):
        return self.clip / norm if self.clip > 0 and norm > self.clip else 1.0


def test_penalty_matches_reference_on_synthetic_norms():
    g = torch.Generator().manual_seed(0)
    cfg = pen.PenaltyConfig(anomaly=True, rate=0.2, z=2.5, warmup=3, weighted=True, temperature=0.0)
    ref = RefPenalty(rate=0.2, z=2.5, warmup=3)
    ewma = pen.EWMA()
    seen_flag = False
    for sync in range(12):
        norms = (1.0 + 0.05 * sync + 0.1 * torch.rand(3, generator=g, dtype=torch.float64)).tolist()
        if sync in (1, 7):  # an outlier inside the warm-up (ignored) and one after it (flagged)
            norms[2] *= 20
        d = pen.decide(norms, ewma, cfg)
        z, flags, w = ref.decide("b", norms)
        assert d.flags == flags, sync
        assert d.z == pytest.approx(z, rel=1e-12, abs=1e-12)
        assert d.weights == pytest.approx(w, rel=1e-12, abs=1e-15)
        assert d.ewma.state()[:2] == pytest.approx(ref.stats["b"][:2], rel=1e-12)
        ewma = d.ewma
        if sync == 1:
            assert not any(d.flags), "no flag during the anomaly warm-up"
        if sync == 7:
            assert d.flags == [False, False, True] and d.weights[2] == 0.0
            seen_flag = True
        else:
            assert not any(d.flags)
        assert sum(d.weights) == pytest.approx(1.0)
    assert seen_flag
    # the flagged outlier was folded in clipped: the mean stays near the ordinary norms
    assert ewma.mean < 2.0


def test_penalty_weights_temperature_shares_and_clip():
    norms = [1.0, 2.0, 4.0]
    d = pen.decide(norms, pen.EWMA(), pen.PenaltyConfig(temperature=0.5))
    e = [math.exp(-x / 0.5) for x in norms]
    assert d.weights == pytest.approx([x / sum(e) for x in e], rel=1e-12)
    auto = pen.decide(norms, pen.EWMA(), pen.PenaltyConfig())  # T = mean norm = 7/3
    e = [math.exp(-x / (7 / 3)) for x in norms]
    assert auto.weights == pytest.approx([x / sum(e) for x in e], rel=1e-12)
    flat = pen.decide(norms, pen.EWMA(), pen.PenaltyConfig(weighted=False))
    assert flat.weights == pytest.approx([1 / 3] * 3)
    shares = [0.5, 0.25, 0.25]
    sw = pen.decide(norms, pen.EWMA(), pen.PenaltyConfig(weighted=False, step_weights=True), shares)
    assert sw.weights == pytest.approx(shares)
    ref = RefPenalty(step_weights=True)
    assert pen.decide(norms, pen.EWMA(), pen.PenaltyConfig(step_weights=True), shares).weights == \
        pytest.approx(ref.decide("b", norms, shares)[2], rel=1e-12)
    assert pen.clip_scale(4.0, 1.0) == 0.25 and pen.clip_scale(0.5, 1.0) == 1.0
    assert pen.clip_scale(4.0, 0.0) == 1.0
    nan = pen.decide([1.0, float("nan")], pen.EWMA(), pen.PenaltyConfig(anomaly=False))
    assert nan.flags == [False, True] and nan.weights == [1.0, 0.0]  # NaN: always left out


def test_penalty_all_flagged():
    cfg = pen.PenaltyConfig(rate=0.5, z=2.0, warmup=2)
    ref = RefPenalty(rate=0.5, z=2.0, warmup=2)
    ewma = pen.EWMA()
    for norms in ([1.0, 1.1], [1.05, 0.95], [50.0, 60.0], [1.0, 1.0]):
        d = pen.decide(norms, ewma, cfg)
        _, flags, w = ref.decide("b", norms)
        assert (d.flags, d.all_flagged) == (flags, all(flags))
        assert d.weights == pytest.approx(w, abs=1e-15)
        assert d.ewma.state()[:2] == pytest.approx(ref.stats["b"][:2], rel=1e-12)
        ewma = d.ewma
        if norms[0] == 50.0:
            assert d.all_flagged and d.weights == [0.0, 0.0]
            assert d.ewma.mean < 3.0  # folded in clipped to the threshold


# ---------------------------------------------------------------------------------------------
# runs against a float64 reference
# ---------------------------------------------------------------------------------------------

def reference_lr(step, steps):
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    progress = (step - WARMUP) / (steps - WARMUP)
    return 0.1 * LR + 0.9 * LR * 0.5 * (1 + math.cos(math.pi * progress))


def unit_of(name):
    return int(name.split(".")[1]) + 1 if name.startswith("blocks.") else 0  # 0: the root's own


def reference(R, S, steps, H, W, lr, penalty=None, corrupt=None, drop=None, bf16=False):
    """Local SGD in float64: AdamW per replica on the concatenation of its S ranks' batches,
    the first W steps with gradients averaged over replicas; after step s (s > W, (s - W) % H
    == 0) every unit (root's own parameters, each block) is averaged with the penalty's weights
    (uniform when None; `drop` {s: replicas} leaves replicas out of every unit), the average
    clipped, an outer Nesterov step of rate `lr` taken, and every replica's unit set to the
    outer one.
    Returns the outer parameters, replica 0's, and the flags of each sync."""
    init, models, data, opts = reference_replicas(R, S, N_LAYER, SEQ, BATCH, LR, SEED)
    names = [n for n, _ in init.named_parameters()]
    units = sorted({unit_of(n) for n in names})
    params = [dict(m.named_parameters()) for m in models]
    outer = {n: p.detach().clone() for n, p in init.named_parameters()}
    mom = {n: torch.zeros_like(p) for n, p in outer.items()}
    flags_log = {}
    residual = {}  # bf16: error feedback per replica and parameter (weighted units)
    for step in range(steps):
        for r, (m, opt) in enumerate(zip(models, opts)):
            xs, ys = zip(*[data[r * S + k].train(step, 0) for k in range(S)])
            logits = m(torch.cat(xs))
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.cat(ys).reshape(-1))
            opt.zero_grad()
            loss.backward()
        if step < W:  # synchronous warm-up
            for n in names:
                mean = sum(params[r][n].grad for r in range(R)) / R
                for r in range(R):
                    params[r][n].grad = mean.clone()
        for m, opt in zip(models, opts):
            torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP)
            for g in opt.param_groups:
                g["lr"] = reference_lr(step, steps)
            opt.step()
        s = step + 1
        if corrupt and corrupt[1] == s:
            g = torch.Generator().manual_seed(SEED + s)
            with torch.no_grad():
                for p in models[corrupt[0]].parameters():
                    noise = torch.randn(p.shape, generator=g).double()
                    p.add_(noise * corrupt[2] * p.pow(2).mean().sqrt())
        if s == W:
            outer = {n: params[0][n].detach().clone() for n in names}
        if not (s > W and (s - W) % H == 0):
            continue
        for u in units:
            ns = [n for n in names if unit_of(n) == u]
            deltas = [{n: outer[n] - params[r][n].detach() for n in ns} for r in range(R)]
            norms = [math.sqrt(sum(float(d[n].pow(2).sum()) for n in ns)) for d in deltas]
            if penalty is not None:
                _, flags, w = penalty.decide(u, norms)
            else:
                flags = [r in (drop or {}).get(s, ()) for r in range(R)]
                keep = R - sum(flags)
                w = [0.0 if f else 1 / keep for f in flags] if keep else [0.0] * R
            flags_log[(s, u)] = flags
            if any(w):
                avg = {n: sum(w[r] * deltas[r][n] for r in range(R)) for n in ns}
                if bf16:  # each replica sends bf16(w delta + residual), keeps the rest
                    avg = {n: 0 for n in ns}
                    for r in range(R):
                        for n in ns:
                            x = w[r] * deltas[r][n] + residual.get((r, n), 0)
                            sent = x.float().to(torch.bfloat16).double()
                            residual[r, n] = x - sent
                            avg[n] = avg[n] + sent
                if penalty is not None and penalty.clip > 0:
                    norm = math.sqrt(sum(float(avg[n].pow(2).sum()) for n in ns))
                    avg = {n: v * penalty.clip_scale(norm) for n, v in avg.items()}
                for n in ns:
                    mom[n] = MU * mom[n] + avg[n]
                    outer[n] = outer[n] - lr * (avg[n] + MU * mom[n])
            with torch.no_grad():
                for r in range(R):
                    for n in ns:
                        params[r][n].copy_(outer[n])
    return outer, {n: p.detach() for n, p in models[0].named_parameters()}, flags_log


def common(R, S, steps, H, W=0):
    return ["--algo", "edit", "--model", "nano", "--n-layer", N_LAYER, "--replicas", R,
            "--shards", S, "--steps", steps, "--sync-every", H, "--warmup-sync-steps", W,
            "--batch-size", BATCH, "--seq-len", SEQ, "--lr", LR, "--warmup-steps", WARMUP,
            "--grad-clip", CLIP, "--seed", SEED, "--eval-every", 0, "--link-bandwidth", "none"]


def assert_close(run, want_outer, want_local):
    got_outer = torch.load(run.root / "outer.pt", weights_only=True)
    got_local = torch.load(run.root / "model.pt", weights_only=True)
    assert set(want_outer) <= set(got_outer)
    for name, w in want_outer.items():
        rel = (got_outer[name].double() - w).norm() / w.norm()
        assert rel <= 1e-5, f"outer {name}: relative error {rel:.2e}"
        rel = (got_local[name].double() - want_local[name]).norm() / want_local[name].norm()
        assert rel <= 1e-5, f"local {name}: relative error {rel:.2e}"


def sync_events(run, rank=0):
    return [e for e in read_events(run, ("sync",)) if e["rank"] == rank]


def unit_index(block):
    return 0 if block == "root" else block + 1


EDIT_CLIP = 0.08  # --edit-clip of the penalty runs
RUNS = {  # the runs the reference tests below check, trained once (edit_runs)
    "no-penalty": [*common(2, 2, 12, 4), "--no-edit-anomaly", "--no-edit-weighted"],
    # outer lr 0.7: the default for R=2, H=4 (0.455) moves bf16 and fp32 apart by less than
    # the test's tolerance, so that it could not tell them apart
    "bf16": [*common(2, 1, 12, 4), "--no-edit-anomaly", "--no-edit-weighted", "--codec", "bf16",
             "--outer-lr", 0.7],
    **{f"penalty-{mode}": [*common(2, 2, 12, 2, 2), "--edit-anomaly-warmup", 2,
                           "--edit-ewma-rate", 0.3, "--edit-clip", EDIT_CLIP, "--corrupt", "1:9:2",
                           "--edit-penalty", mode] for mode in ("lowband", "reference")},
    "dropped": [*common(2, 1, 12, 2), "--no-edit-weighted", "--edit-anomaly-warmup", 2,
                "--corrupt", "1:7:1"],
}


@pytest.fixture(scope="module")
def edit_runs(tmp_path_factory):
    """name -> RunDir of RUNS[name]: all train in one job a world size (conftest.train_in_one_job,
    the worker side of `lowband train` with these flags)."""
    root = tmp_path_factory.mktemp("edit")
    train_in_one_job(*[["--no-progress", "--run-dir", root / name, *flags]
                       for name, flags in RUNS.items()])
    return {name: RunDir(root / name) for name in RUNS}


def test_edit_without_penalty_matches_local_sgd_and_memory(edit_runs):
    R, S, steps, H = 2, 2, 12, 4
    run = edit_runs["no-penalty"]
    outer, local, _ = reference(R, S, steps, H, 0, outer_lr_of(run))
    assert_close(run, outer, local)
    syncs = sync_events(run)
    assert sorted({e["step"] for e in syncs}) == [4, 8, 12]
    assert all(e["weight"] == pytest.approx(0.5) and not e["anomaly"] for e in syncs)
    assert [e["block"] for e in syncs[:3]] == ["root", 0, 1]  # in forward order
    # the outer exchange of each unit is its own transfer over the outer link
    tags = [e["tag"] for e in read_events(run, ("comm",)) if e["rank"] == 0 and e["group"] == "outer"]
    assert tags.count("root") == tags.count("block0") == tags.count("block1") == 3
    # outer parameters and momentum: 2 x params / S fp32 values on every rank
    n_params = sum(p.numel() for p in GPT(gpt_config("nano", n_layer=N_LAYER, seq_len=SEQ)).parameters())
    mem = [e for e in read_events(run, ("memory",))]
    assert len(mem) == R * S
    for e in mem:
        assert e["n_params"] == n_params
        assert e["bytes"] == pytest.approx(2 * 4 * n_params / S, rel=0.02), e


def test_edit_with_an_encoded_exchange_and_error_feedback_matches_reference(edit_runs):
    """--codec bf16 (elementwise, so the FSDP shards' layout does not matter): each replica
    sends bf16(w delta + residual) and keeps the rest for the unit's next sync."""
    R, S, steps, H = 2, 1, 12, 4
    run = edit_runs["bf16"]
    outer, local, _ = reference(R, S, steps, H, 0, outer_lr_of(run), bf16=True)
    got = torch.load(run.root / "outer.pt", weights_only=True)
    plain, _, _ = reference(R, S, steps, H, 0, outer_lr_of(run))
    for name, w in outer.items():
        rel = (got[name].double() - w).norm() / w.norm()
        assert rel <= 1e-4, f"outer {name}: relative error {rel:.2e}"
    off = max(float((plain[n] - outer[n]).norm() / outer[n].norm()) for n in outer)
    assert off > 1e-4  # the encoding shows: the test can tell bf16 from fp32
    units = {e["codec"] for e in read_events(run, ("comm",)) if e["tag"].startswith(("root", "block"))}
    assert units == {"bf16"}


@pytest.mark.parametrize("mode", ["lowband", "reference"])
def test_edit_penalty_with_warmup_and_corruption_matches_reference(edit_runs, mode):
    """Also --edit-penalty reference against test_penalty_reference.py's float64 transcription of
    atorch: a detector per replica, softmax(-norm) at T 1 (0 given), weights not renormalized,
    atorch's clip."""
    R, S, steps, H, W = 2, 2, 12, 2, 2
    run = edit_runs[f"penalty-{mode}"]
    ref = (RefPenalty(rate=0.3, z=3.0, warmup=2, clip=EDIT_CLIP) if mode == "lowband" else
           AtorchPenalty(rate=0.3, z=3.0, warmup=2, temperature=0.0, clip=EDIT_CLIP))
    outer, local, flags = reference(R, S, steps, H, W, outer_lr_of(run), penalty=ref, corrupt=(1, 9, 2.0))
    assert_close(run, outer, local)
    syncs = sync_events(run)
    assert sorted({e["step"] for e in syncs}) == list(range(4, steps + 1, 2))
    for e in syncs:
        assert e["flagged"] == [r for r, f in enumerate(flags[(e["step"], unit_index(e["block"]))]) if f]
    assert all(e["flagged"] == [1] for e in syncs if e["step"] == 10)  # the corrupted replica
    assert any(e["clip_scale"] < 1 for e in syncs) and any(e["clip_scale"] == 1 for e in syncs)
    assert len({round(e["weight"], 6) for e in syncs if not e["flagged"]}) > 1  # weighted


def test_corrupted_replica_is_dropped(edit_runs):
    R, S, steps, H = 2, 1, 12, 2
    run = edit_runs["dropped"]
    outer, local, _ = reference(R, S, steps, H, 0, outer_lr_of(run), corrupt=(1, 7, 1.0), drop={8: {1}})
    assert_close(run, outer, local)
    for rank in range(R):
        syncs = sync_events(run, rank)
        assert {(e["step"], str(e["block"])) for e in syncs if e["anomaly"] or e["flagged"]} == \
            {(8, "root"), (8, "0"), (8, "1")}
        assert all(e["anomaly"] == (rank == 1) for e in syncs if e["step"] == 8)
    # the corrupted replica's loss jumps after step 7, and is back in line once the sync of step
    # 8 has reset it to the outer parameters
    loss = {e["step"]: e["loss"] for e in read_events(run, ("step",)) if e["rank"] == 1}
    assert loss[8] > 1.05 * loss[7] and loss[9] < loss[8]


# ---------------------------------------------------------------------------------------------
# one shard a replica (S = 1): no FSDP2
# ---------------------------------------------------------------------------------------------

SINGLE = {  # name -> (R, S, flags) of the runs own_model_runs trains
    "r2s1": (2, 1, [*common(2, 1, 12, 2, 2), "--edit-anomaly-warmup", 2, "--edit-ewma-rate", 0.3,
                    "--edit-clip", EDIT_CLIP, "--corrupt", "1:9:2"]),
    "r1s1": (1, 1, [*common(1, 1, 12, 4, 2), "--no-edit-anomaly", "--edit-clip", EDIT_CLIP]),
    "r1s2": (1, 2, [*common(1, 2, 12, 4, 2), "--no-edit-anomaly", "--edit-clip", EDIT_CLIP]),
}


def _own_model_worker(rank: int, world: int, port: int, argvs: list) -> None:
    """One rank of own_model_runs: each run trains lowband's GPT built here from the seed (as the
    trainer builds it) through train(cfg, model=...), then writes the names of its parameters
    that are DTensors (FSDP2's sharded ones) to RUN/dtensors-rank<r>.json."""
    join_local_job(rank, world, port)
    import torch.distributed as dist

    from lowband.flags import parse_train
    from lowband.params import is_dtensor
    from lowband.train import train

    for argv in argvs:
        cfg, _ = parse_train(argv)
        torch.manual_seed(SEED)
        model = GPT(gpt_config("nano", n_layer=N_LAYER, seq_len=SEQ))
        train(cfg, model=model)
        sharded = [n for n, p in model.named_parameters() if is_dtensor(p)]
        (Path(cfg.run_dir) / f"dtensors-rank{rank}.json").write_text(json.dumps(sharded))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def own_model_runs(tmp_path_factory):
    """name -> RunDir of SINGLE[name], trained on models the test can look at afterwards, in one
    job a world size."""
    import torch.multiprocessing as mp

    from lowband.launch.local import free_port

    root = tmp_path_factory.mktemp("single")
    by_world = {}
    for name, (R, S, flags) in SINGLE.items():
        argv = ["--no-progress", "--run-dir", root / name, *flags]
        by_world.setdefault(R * S, []).append(list(map(str, argv)))
    for world, argvs in by_world.items():
        mp.start_processes(_own_model_worker, args=(world, free_port(), argvs), nprocs=world,
                           start_method="spawn")
    return {name: RunDir(root / name) for name in SINGLE}


def dtensors(run, rank):
    return json.loads((run.root / f"dtensors-rank{rank}.json").read_text())


@pytest.mark.parametrize("name", ["r2s1", "r1s1"])
def test_edit_with_one_shard_a_replica_uses_no_fsdp_and_matches_reference(own_model_runs, name):
    """S = 1: a replica's one rank holds its whole model, so edit leaves it unsharded (FSDP2
    would copy every unit and gradient each step for nothing), and the run still matches the
    float64 reference: r2s1 with the warm-up, the penalty, the clip and a corrupted replica;
    r1s1, one rank alone, with no transfer at all."""
    R, S, flags = SINGLE[name]
    run = own_model_runs[name]
    assert all(dtensors(run, rank) == [] for rank in range(R * S))
    H = flags[flags.index("--sync-every") + 1]
    ref = (RefPenalty(rate=0.3, z=3.0, warmup=2, clip=EDIT_CLIP) if R == 2 else
           RefPenalty(anomaly=False, clip=EDIT_CLIP))
    corrupt = (1, 9, 2.0) if R == 2 else None
    outer, local, flagged = reference(R, S, 12, H, 2, outer_lr_of(run), penalty=ref, corrupt=corrupt)
    assert_close(run, outer, local)
    syncs = sync_events(run)
    assert sorted({e["step"] for e in syncs}) == list(range(2 + H, 13, H))
    for e in syncs:
        assert e["flagged"] == [r for r, f in enumerate(flagged[(e["step"], unit_index(e["block"]))]) if f]
    assert any(e["clip_scale"] < 1 for e in syncs)
    # the outer state is the whole model's: 2 x params fp32 values on every rank
    n_params = sum(p.numel() for p in GPT(gpt_config("nano", n_layer=N_LAYER, seq_len=SEQ)).parameters())
    assert [e["bytes"] for e in read_events(run, ("memory",))] == [2 * 4 * n_params] * R
    # what crosses a link: the outer exchanges between replicas (none alone), nothing inner
    comm = read_events(run, ("comm",))
    assert {e["group"] for e in comm} == ({"outer"} if R == 2 else set())
    if R == 2:
        tags = [e["tag"] for e in comm if e["rank"] == 0]
        assert {"root", "block0", "block1", "grad", "norms"} <= set(tags)


def test_edit_with_several_shards_a_replica_still_uses_fsdp(own_model_runs):
    """S > 1 is unchanged: every parameter is FSDP2's DTensor, and the run matches the float64
    reference (one replica of two shards)."""
    run = own_model_runs["r1s2"]
    assert all(len(dtensors(run, rank)) == len(dict(GPT(gpt_config("nano", n_layer=N_LAYER,
                                                                   seq_len=SEQ)).named_parameters()))
               for rank in range(2))
    outer, local, _ = reference(1, 2, 12, 4, 2, outer_lr_of(run),
                                penalty=RefPenalty(anomaly=False, clip=EDIT_CLIP))
    assert_close(run, outer, local)


ROUND_TRIP = textwrap.dedent("""
    import io, os, torch
    from lowband.comm import topology
    from lowband.algorithms.edit import EDiT
    from lowband.algorithms.penalty import EWMA
    from lowband.comm import Comm
    from lowband.config import Config
    from lowband.data import Batches, load_tokens
    from lowband.models.gpt import GPT, gpt_config
    from lowband.params import is_dtensor
    from lowband.train import make_optimizer_factory, standard_step

    cfg = Config(algo="edit", replicas=1, shards=1, model="nano", steps=10, sync_every=2,
                 batch_size=2, seq_len=32, edit_clip=0.05, device="cpu",
                 edit_penalty=os.environ["PENALTY"], edit_anomaly_warmup=2).validate()
    topo = topology.init(1, 1, "cpu")
    batches = Batches(load_tokens("builtin"), rank=0, world=1, seq_len=32, batch_size=2, seed=0,
                      val_fraction=0.02)

    def build():
        torch.manual_seed(0)
        model = GPT(gpt_config("nano", seq_len=32))
        algo = EDiT()
        opt = algo.setup(model, model.blocks, make_optimizer_factory(cfg, topo.device), topo,
                         Comm(topo, None), cfg)
        return model, algo, opt

    (a, algo_a, opt_a), (b, algo_b, opt_b) = build(), build()
    for step in range(4):
        for model, algo, opt in ((a, algo_a, opt_a), (b, algo_b, opt_b)):
            standard_step(algo, model, opt, batches, cfg, step)
    algo_a.before_forward(4)  # a sync is prepared, the first unit's exchange in flight
    algo_b.before_forward(4)
    f = io.BytesIO()
    torch.save(algo_a.state_dict(), f)
    f.seek(0)
    state = torch.load(f, weights_only=True)
    for u in algo_b.units:  # wipe b's algorithm state, then restore it from a's
        u.outer.fill_(float("nan")); u.momentum.fill_(float("nan")); u.ewma = EWMA(); u.pending = None
    algo_b.plan, algo_b.syncs, algo_b.last_prepared, algo_b.anchored = None, 0, -1, False
    algo_b.load_state_dict(state)
    for step in range(4, 10):
        for model, algo, opt in ((a, algo_a, opt_a), (b, algo_b, opt_b)):
            standard_step(algo, model, opt, batches, cfg, step)
    algo_a.finish(); algo_b.finish()
    assert not any(is_dtensor(p) for p in a.parameters())  # S = 1: no FSDP2
    for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(va, vb), k
    for ua, ub in zip(algo_a.units, algo_b.units):
        assert torch.equal(ua.outer, ub.outer) and torch.equal(ua.momentum, ub.momentum)
        assert ua.ewma == ub.ewma
    print("identical", algo_a.syncs)
""")


@pytest.mark.parametrize("penalty", ["lowband", "reference"])  # reference: per-replica detectors
def test_state_dict_round_trip(tmp_path, penalty):
    from lowband.launch.local import free_port

    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "PENALTY": penalty}
    proc = subprocess.run([sys.executable, "-c", ROUND_TRIP], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "identical 5" in proc.stdout


@pytest.mark.parametrize("values,message", [
    ({"algo": "edit", "merge_weights": "tokens"}, "drop --merge-weights tokens"),
    ({"algo": "ddp", "codec": "int8"}, "--codec applies only to --algo"),
    ({"algo": "edit", "warmup_sync_steps": 200}, "--warmup-sync-steps 200 must be at least 0 and below"),
    ({"algo": "aedit", "sync_seconds": 0.0}, "--sync-seconds must be positive"),
    ({"algo": "ddp", "aedit_min_new_steps": 10}, "--aedit-min-new-steps applies only to --algo aedit"),
    ({"algo": "diloco", "edit_clip": 1.0}, "--edit-clip applies only to --algo edit or aedit"),
    ({"algo": "edit", "edit_ewma_rate": 0.0}, "--edit-ewma-rate must lie in (0, 1]"),
])
def test_bad_settings(values, message):
    with pytest.raises(ConfigError, match=None) as e:
        Config(**values).validate()
    assert message in str(e.value)
