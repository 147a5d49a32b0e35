"""lowband.plan: closed forms, monotonicity, bisection round trips, the CLI's output and errors."""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lowband.plan import (ALGORITHMS, MODELS, PlanError, bytes_per_value, exchange_wire_bytes,
                          figure, main, parse_bandwidth, plan, plan_config, required_bandwidth,
                          ring_wire_bytes, simulate)

EXAMPLE = ["--params", "1e9", "--layers", "24", "--step-time", "0.1", "--replicas", "2",
           "--sync-every", "100", "--fragments", "8", "--overlap", "1", "--codec", "fp4-e3m0",
           "--target-cu", "0.9", "--json"]
BASE = dict(params=1e8, layers=8, step_time=0.2, replicas=4, sync_every=48, codec="bf16",
            grad_dtype="bf16")


def transfer_s(payload_bytes, replicas, bandwidth, latency, codec="bf16"):
    """One outer exchange alone on the link: bf16 (BASE's codec) all-gathers, fp32 all-reduces."""
    return latency + exchange_wire_bytes(payload_bytes, replicas, codec) * 8 / bandwidth


# ----------------------------------------------------------------------------- closed forms

def test_wire_formulas():
    # as lowband.comm.codecs: one bf16 scale per block of 64 values
    assert bytes_per_value("fp32") == 4 and bytes_per_value("bf16") == 2
    assert bytes_per_value("int8") == 1 + 2 / 64
    assert bytes_per_value("fp4-e3m0") == bytes_per_value("fp4-e2m1") == 0.5 + 2 / 64
    assert bytes_per_value("fp4-e3m0", block_size=32, scale_bytes=4) == 0.5 + 4 / 32
    assert ring_wire_bytes(100, 1) == 0 and ring_wire_bytes(100, 2) == 100
    assert ring_wire_bytes(100, 4) == 150
    # as lowband.comm: fp32 is all-reduced; other codecs all-gather the encoded payloads
    assert exchange_wire_bytes(100, 4, "fp32") == 150
    assert exchange_wire_bytes(100, 4, "fp4-e3m0") == 300
    assert exchange_wire_bytes(100, 2, "int8") == exchange_wire_bytes(100, 2, "fp32") == 100


def test_wire_bytes_per_step():
    kw = BASE | {"bandwidth": 1e9, "replicas": 2}
    assert simulate("ddp", **kw).wire_bytes_per_step == pytest.approx(2e8)
    assert simulate("acco", **kw).wire_bytes_per_step == pytest.approx(2 * 2e8)  # two rounds
    assert simulate("acco", **kw, acco_rounds=1).wire_bytes_per_step == pytest.approx(2e8)
    assert simulate("diloco", **kw).wire_bytes_per_step == pytest.approx(2e8 / 48)
    assert simulate("streaming", **kw, fragments=4).peak_transfer_bytes == pytest.approx(2e8 / 4)


@pytest.mark.parametrize("steps", [None, 4 * 48])
@pytest.mark.parametrize("codec", ["bf16", "fp32"])
def test_diloco_blocking(steps, codec):
    bw, lat, H, T = 1e9, 0.01, 48, 0.2
    payload = 1e8 * bytes_per_value(codec)
    t_x = transfer_s(payload, 4, bw, lat, codec)
    r = simulate("diloco", **BASE | {"codec": codec}, bandwidth=bw, latency=lat, steps=steps)
    assert r.cu == pytest.approx(H * T / (H * T + t_x), rel=1e-12)
    assert r.wire_bytes_per_step == pytest.approx(exchange_wire_bytes(payload, 4, codec) / H)


def test_streaming_without_overlap_blocks_per_fragment():
    bw, P, H, T = 5e8, 4, 48, 0.2
    t_f = transfer_s(1e8 * 2 / P, 4, bw, 0.002)
    r = simulate("streaming", **BASE, fragments=P, overlap=0, bandwidth=bw, latency=0.002)
    assert r.cu == pytest.approx(H * T / (H * T + P * t_f), rel=1e-12)
    assert r.peak_transfer_bytes == pytest.approx(exchange_wire_bytes(2e8 / P, 4, "bf16"))


@pytest.mark.parametrize("bw", [1e8, 1e9, 1e10])
def test_streaming_overlap_hides_tau_steps(bw):
    H, T, tau = 48, 0.2, 2
    t_x = transfer_s(2e8, 4, bw, 0.0)
    r = simulate("streaming", **BASE, fragments=1, overlap=tau, bandwidth=bw)
    assert r.cu == pytest.approx(H * T / (H * T + max(0.0, t_x - tau * T)), rel=1e-12)


def test_streaming_ample_bandwidth_and_ddp_infinite_bandwidth():
    assert simulate("streaming", **BASE, fragments=4, overlap=1, bandwidth="10tbit",
                    latency=0.05).cu == 1.0
    assert simulate("ddp", **BASE, bandwidth="inf").cu == 1.0
    assert simulate("acco", **BASE, bandwidth="inf").cu == 1.0


def test_diloco_is_streaming_with_one_fragment_no_overlap():
    for bw in (1e7, 1e9, 1e11):
        d = simulate("diloco", **BASE, bandwidth=bw, latency=0.03)
        s = simulate("streaming", **BASE, fragments=1, overlap=0, bandwidth=bw, latency=0.03)
        assert d.cu == s.cu


@pytest.mark.parametrize("bw", [1e9, 1e11, 1e13])
def test_ddp_buckets_through_backward(bw):
    L, T, lat = 8, 0.2, 0.001
    t_b = ring_wire_bytes(2e8, 4) / L * 8 / bw
    # bucket k leaves at T/3 + (k+1)/L * 2T/3; the link sends them one after another, and
    # each arrives one latency after its last bit left
    free = 0.0
    for k in range(L):
        free = max(free, T / 3 + (k + 1) / L * 2 * T / 3) + t_b
    stall = free + lat - T
    r = simulate("ddp", **BASE, bandwidth=bw, latency=lat)
    assert r.cu == pytest.approx(T / (T + stall), rel=1e-9)


@pytest.mark.parametrize("rounds", [1, 2])
@pytest.mark.parametrize("lat", [0.0, 0.001, 0.03])
def test_acco_round_must_fit_its_window(rounds, lat):
    u = 0.2 / rounds  # the compute a round hides behind
    for bw in (1e9, 1e10, 1e11, 1e12):
        s = 3 / 4 * 2e8 * 8 / bw  # a reduce-scatter or an all-gather; the second waits for the
        # first to arrive; the next round's reduce-scatter may follow the all-gather's last bit
        cycle = max(u, 2 * s + lat, s + lat + u / 2)
        r = simulate("acco", **BASE, bandwidth=bw, latency=lat, acco_rounds=rounds)
        assert r.cu == pytest.approx(u / cycle, rel=1e-9)
        assert (r.cu == 1.0) == (2 * (s + lat) <= u)


def test_single_replica_sends_nothing():
    for alg in ALGORITHMS:
        kw = BASE | {"replicas": 1}
        assert simulate(alg, **kw, bandwidth=1.0, latency=1.0).cu == 1.0
        assert required_bandwidth(alg, **kw, latency=1.0) == 0.0


# ----------------------------------------------------------------------------- properties

CASES = [
    BASE,
    BASE | {"fragments": 8, "overlap": 1, "codec": "fp4-e3m0", "latency": 0.02},
    dict(params=1e9, layers=24, step_time=0.1, replicas=2, sync_every=100, fragments=8,
         overlap=3, codec="int8", latency=0.005),  # 8 does not divide 100: uneven offsets
    dict(model="micro", step_time=0.01, replicas=3, sync_every=20, fragments=2, overlap=1,
         latency=0.001, bucket_mb=1),
]
SWEEP = [10 ** (5 + i / 4) for i in range(36)]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("alg", ALGORITHMS)
def test_cu_monotone_in_bandwidth(case, alg):
    cus = [simulate(alg, **case, bandwidth=bw).cu for bw in SWEEP]
    assert all(0 < c <= 1 for c in cus)
    assert all(b >= a - 1e-12 for a, b in zip(cus, cus[1:]))


@pytest.mark.parametrize("case", CASES)
def test_streaming_at_least_diloco_at_same_bytes(case):
    for bw in SWEEP:
        d = simulate("diloco", **case, bandwidth=bw)
        s = simulate("streaming", **case, bandwidth=bw)
        assert s.wire_bytes_per_step == pytest.approx(d.wire_bytes_per_step)
        assert s.cu >= d.cu - 1e-12


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("alg", ALGORITHMS)
@pytest.mark.parametrize("target", [0.5, 0.9])
def test_required_bandwidth_round_trip(case, alg, target):
    need = required_bandwidth(alg, target, **case)
    if need is None:  # unreachable: even a huge link stays below the target
        assert simulate(alg, **case, bandwidth=1e18).cu < target
        return
    assert simulate(alg, **case, bandwidth=need).cu >= target
    assert simulate(alg, **case, bandwidth=0.9 * need).cu < target


@pytest.mark.parametrize("alg,case", [
    # a link that barely keeps up: the backlog eats the tau-step slack over many periods
    ("streaming", dict(params=977_136, layers=24, step_time=1.936, replicas=5, sync_every=10,
                       fragments=6, overlap=9, codec="fp4-e3m0", latency=1e-4, bandwidth=320_436)),
    ("streaming", CASES[2] | {"bandwidth": 2e9}),
    ("acco", BASE | {"bandwidth": 3e11, "latency": 0.001, "acco_rounds": 3}),
])
def test_steady_state_is_the_long_run_average(alg, case):
    steady = simulate(alg, **case).cu
    runs = [simulate(alg, **case, steps=n).cu for n in (5_000, 10_000)]
    # a whole run converges to the steady state as 1/steps (its start and end differ)
    assert abs(runs[1] - steady) < 1e-3
    assert abs(runs[1] - steady) <= abs(runs[0] - steady) + 1e-12


def test_latency_makes_ddp_unreachable():
    # ddp stalls at least one latency a step: CU <= 0.2 / 0.25 < 0.9 at any bandwidth
    assert simulate("ddp", **BASE, bandwidth="inf", latency=0.05).cu == pytest.approx(0.8)
    assert required_bandwidth("ddp", 0.9, **BASE, latency=0.05) is None
    assert required_bandwidth("streaming", 0.9, **BASE, fragments=4, overlap=1,
                              latency=0.05) is not None


# ----------------------------------------------------------------------------- inputs

def test_parse_bandwidth():
    assert parse_bandwidth("100mbit") == 1e8
    assert parse_bandwidth("1gbit") == 1e9
    assert parse_bandwidth("10gbit") == 1e10
    assert parse_bandwidth("1e9") == parse_bandwidth(1e9) == 1e9
    assert parse_bandwidth("10 Gbps") == parse_bandwidth("10Gb/s") == 1e10
    assert parse_bandwidth("100Mbit") == parse_bandwidth("100mb") == 1e8  # as lowband train
    assert math.isinf(parse_bandwidth("inf"))
    for bad in ("fast", "-1gbit", "0", "1 lightyear", "125MB/s"):
        with pytest.raises(PlanError):
            parse_bandwidth(bad)


def test_model_presets_and_flops():
    r = plan(model="gpt2", step_time="500ms", bandwidth="1gbit")
    assert r["inputs"]["params"] == MODELS["gpt2"][0] and r["inputs"]["layers"] == 12
    r = plan(params="1.3B", layers=24, flops_per_step=6e15, flops="300T")
    assert r["inputs"]["params"] == 1.3e9 and r["inputs"]["step_time"] == pytest.approx(20.0)


def test_plan_config_reads_lowband_config_names():
    cfg = {"algo": "streaming", "params": 1e9, "n_layer": 24, "sync_every": 100, "fragments": 4,
           "overlap": 1, "codec": "int8", "codec_block": 128, "link_bandwidth": "1Gbit",
           "link_latency": "20ms", "steps": 400}
    r = plan_config(cfg, step_time=0.1)
    assert r["inputs"]["block_size"] == 128 and r["inputs"]["latency"] == pytest.approx(0.02)
    assert r["inputs"]["steps"] == 400
    want = simulate("streaming", params=1e9, layers=24, step_time=0.1, sync_every=100,
                    fragments=4, overlap=1, codec="int8", block_size=128, bandwidth=1e9,
                    latency=0.02, steps=400).cu
    assert r["cu"] == pytest.approx(want)
    ddp = plan_config({"algo": "ddp", "model": "micro", "n_layer": 0, "link_bandwidth": "",
                       "bucket_mb": 4.0}, step_time=0.01)
    assert ddp["inputs"]["grad_dtype"] == "fp32" and ddp["inputs"]["bandwidth"] == "inf"
    assert ddp["cu"] == 1.0
    json.dumps(ddp, allow_nan=False)


def test_plan_config_takes_a_lowband_config_dict():
    cfg = {"algo": "streaming", "model": "mini", "n_layer": 0, "step_time": 0.05, "replicas": 2,
           "sync_every": 30, "fragments": 3, "overlap": 1, "codec": "fp4_e2m1",
           "bandwidth": "100mbit", "latency": 0.01, "lr": 3e-3, "seed": 0}
    r = plan_config(cfg)
    assert r["algorithm"] == "streaming" and 0 < r["cu"] <= 1
    assert r["inputs"]["layers"] == MODELS["mini"][1] and r["inputs"]["codec"] == "fp4-e2m1"
    with pytest.raises(ValueError):
        plan_config(cfg | {"algo": "nope"})


# ----------------------------------------------------------------------------- the command line

def test_example_json_shape_and_speed(capsys):
    start = time.perf_counter()
    assert main(EXAMPLE) == 0
    assert time.perf_counter() - start < 1.0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"inputs", "target_cu", "algorithms"}
    assert out["target_cu"] == 0.9 and out["inputs"]["codec"] == "fp4-e3m0"
    assert list(out["algorithms"]) == list(ALGORITHMS)
    for row in out["algorithms"].values():
        assert row["cu"] is None  # no --bandwidth: only the requirement
        assert row["required_bandwidth"] is None or row["required_bandwidth"] > 0
        assert row["wire_bytes_per_step"] > 0
    need = out["algorithms"]
    assert need["streaming"]["required_bandwidth"] < need["diloco"]["required_bandwidth"]
    assert need["diloco"]["required_bandwidth"] < need["ddp"]["required_bandwidth"]


def test_json_with_bandwidth_and_table(capsys):
    assert main(EXAMPLE + ["--bandwidth", "1gbit", "--latency", "10ms"]) == 0
    out = json.loads(capsys.readouterr().out)
    for row in out["algorithms"].values():
        assert 0 < row["cu"] <= 1 and row["stall_per_step"] >= 0
    assert main([a for a in EXAMPLE if a != "--json"] + ["--bandwidth", "1gbit"]) == 0
    table = capsys.readouterr().out
    assert all(alg in table for alg in ALGORITHMS) and "needs for CU 0.9" in table


BAD = [
    (["--params", "-5", "--layers", "4", "--step-time", "0.1"], "--params"),
    (["--params", "1e9", "--layers", "4", "--step-time", "0.1", "--codec", "fp3"], "codec"),
    (["--params", "1e9", "--layers", "4", "--step-time", "0.1", "--bandwidth", "fast"],
     "bandwidth"),
    (["--params", "1e9", "--layers", "4", "--step-time", "0.1", "--fragments", "8"], "--fragments"),
    (["--params", "1e9", "--layers", "24", "--step-time", "0.1", "--sync-every", "4",
      "--fragments", "8"], "--fragments"),
    (["--params", "1e9", "--layers", "4"], "--step-time"),
    (["--params", "1e9", "--layers", "4.5", "--step-time", "0.1"], "--layers"),
    (["--model", "huge", "--step-time", "0.1"], "model"),
    (["--params", "1e9", "--layers", "4", "--step-time", "0.1", "--target-cu", "2"], "--target-cu"),
    (["--params", "1e9", "--layers", "4", "--step-time", "0.1", "--wat"], "unrecognized"),
]


@pytest.mark.parametrize("argv,word", BAD)
def test_bad_input_one_sentence_exit_2(argv, word, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and word in lines[0] and "Traceback" not in captured.err


def test_bad_input_in_a_real_process():
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1] / "toolkit"))
    p = subprocess.run([sys.executable, "-m", "lowband.plan", "--params", "-1", "--layers", "2",
                        "--step-time", "1"], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 2 and p.stdout == ""
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr


def test_help_exits_0(capsys):
    assert main(["--help"]) == 0
    assert "--bandwidth" in capsys.readouterr().out


def test_uneven_fragments_are_planned_with_a_note(capsys):
    assert main(EXAMPLE) == 0  # P=8 does not divide H=100, as in the example
    assert "note" in capsys.readouterr().err


def test_figure():
    pytest.importorskip("plotly")
    fig = figure(params=1e9, layers=24, step_time=0.1, sync_every=100, fragments=8, overlap=1,
                 codec="fp4-e3m0", bandwidth="1gbit", points=12)
    assert [t.name for t in fig.data] == list(ALGORITHMS)
    assert fig.layout.xaxis.type == "log"
    assert all(0 < y <= 1 for t in fig.data for y in t.y)


def test_presets_match_lowband_models():
    import torch

    from lowband.model import GPT, PRESETS, gpt_config, num_params

    assert set(MODELS) == set(PRESETS)
    for name, (params, layers) in MODELS.items():
        with torch.device("meta"):
            model = GPT(gpt_config(name, seq_len=1024 if name == "gpt2" else 128))
        assert (num_params(model), len(model.blocks)) == (params, layers), name
