"""The topk codecs (SparseLoCo's compression, arXiv 2508.15706) and --outer-rule sparseloco:
exact bytes, exactly the chosen values, error feedback, non-finite input, validation, a run's
loss against fp4's, and the outer rule against a float64 reference."""

import json
import math

import pytest
import torch

from conftest import reference_replicas
from lowband.comm import (CODEC_RECORDS, SPARSE, Chunks, NonFiniteError, decode, encode,
                          payload_bytes)
from lowband.comm.exchanges import encoded
from test_streaming import BATCH, FLAGS, LR, MU, SEED, SEQ, inner_step

DENSITIES = [0.01, 0.02, 0.03, 0.25, 1.0]
SIZES = [1, 2, 63, 64, 65, 1001, 4097, 12289]
LAYOUT = {"topk-2bit": (2, 2), "topk-fp4": (4, 1)}  # code bits, bf16 scales a chunk
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def kept(length, density):
    return max(1, math.floor(density * length + 0.5)) if length else 0


def chunks(n, chunk):
    return [(lo, min(lo + chunk, n)) for lo in range(0, n, chunk)]


def values(n, seed):
    """Wide-ranging values with exact zeros and ties of magnitude (equal and opposite)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 2)
    x[3:40:3] = 0.0
    x[41:60] = torch.tensor([1.5, -1.5] * 10)[: len(x[41:60])]
    return x


def bf16(v: float) -> float:
    return torch.tensor(v, dtype=torch.float64).to(torch.bfloat16).item()


@pytest.mark.parametrize("codec", SPARSE)
@pytest.mark.parametrize("density", DENSITIES)
def test_wire_bytes_are_exact(codec, density):
    bits, scales = LAYOUT[codec]
    for chunk in (64, 100, 4096):
        for n in SIZES:
            words = sum(kept(hi - lo, density) for lo, hi in chunks(n, chunk))
            word_bits = bits + math.ceil(math.log2(chunk))
            want = 2 * scales * math.ceil(n / chunk) + math.ceil(words * word_bits / 8)
            payload = encode(values(n, n), codec, chunk, density)
            assert payload.dtype == torch.uint8 and payload.numel() == want, (chunk, n)
            assert payload_bytes(codec, n, chunk, density) == want
            assert payload_bytes(codec, n, Chunks(chunk, density)) == want
            assert CODEC_RECORDS[codec].payload_bytes(n, chunk, density) == want
    # 4096 values at 2%: 82 kept as words of 2 + 12 bits (1148 bits, 144 bytes), 2 scales
    assert payload_bytes("topk-2bit", 4096, 4096, 0.02) == 4 + 144
    assert CODEC_RECORDS["topk-2bit"].bytes_per_value(Chunks(4096, 0.02)) == (4 + 143.5) / 4096
    assert CODEC_RECORDS["topk-fp4"].bytes_per_value(64, 0.02) == (2 + 10 / 8) / 64


def reference(x: torch.Tensor, codec: str, chunk: int, density: float) -> torch.Tensor:
    """decode(encode(x)) as documented, in float64: each chunk's kept values (largest magnitude
    first, a tie to the lower index) at their quantized values, zero elsewhere."""
    y = torch.zeros(x.numel(), dtype=torch.float64)
    for lo, hi in chunks(x.numel(), chunk):
        v = x[lo:hi].double().tolist()
        order = sorted(range(hi - lo), key=lambda i: (-abs(v[i]), i))[: kept(hi - lo, density)]
        mags = [abs(v[i]) for i in order]
        if codec == "topk-2bit":  # the upper half to the mean of its magnitudes, the rest to theirs
            h = (len(order) + 1) // 2
            rest = len(mags) - h
            level = [bf16(sum(mags[:h]) / h)] * h + [bf16(sum(mags[h:]) / max(rest, 1))] * rest
        else:  # e2m1 at scale absmax / 6 (in fp32, as the codec divides), nearest level, ties down
            s = torch.tensor(mags[0], dtype=torch.float32).div(6).bfloat16().item()
            mids = [(a + b) / 2 for a, b in zip(E2M1, E2M1[1:])]
            level = [E2M1[sum(m / (s or 1.0) > mid for mid in mids)] * s for m in mags]
        for i, q in zip(order, level):
            y[lo + i] = -q if v[i] < 0 else q
    return y


@pytest.mark.parametrize("codec", SPARSE)
@pytest.mark.parametrize("density", [0.02, 0.1, 0.5])
@pytest.mark.parametrize("chunk", [7, 64, 1000])
def test_decode_keeps_exactly_the_top_k_at_their_quantized_values(codec, density, chunk):
    for n in (1, 65, 2500):
        x = values(n, seed=chunk + n)
        y = decode(encode(x, codec, chunk, density), n, codec, chunk, density)
        assert y.dtype == torch.float32 and y.shape == (n,)
        assert torch.equal(y.double(), reference(x, codec, chunk, density)), (n, chunk)


def test_ties_go_to_the_lower_index():
    x = torch.tensor([6.0, -6.0, 6.0, -6.0, 3.0, 6.0])  # scale 1: the levels are exact
    y = decode(encode(x, "topk-fp4", 6, 0.5), 6, "topk-fp4", 6, 0.5)
    assert y.tolist() == [6.0, -6.0, 6.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("codec", SPARSE)
def test_error_feedback_sends_everything_in_the_end(codec):
    """Over many rounds, what was sent plus what is kept back is what came in."""
    g = torch.Generator().manual_seed(1)
    n, block = 5000, Chunks(512, 0.02)
    residual = torch.zeros(n)
    sent_sum, in_sum = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for _ in range(200):
        delta = torch.randn(n, generator=g) * 1e-3
        e = delta + residual
        sent = decode(encode(e, codec, block), n, codec, block)
        residual = e - sent
        sent_sum += sent.double()
        in_sum += delta.double()
    assert torch.allclose(sent_sum + residual.double(), in_sum, rtol=0, atol=1e-7)
    # what is kept back stays small: a value that piles up is sent (all but a few that
    # wandered near zero were, at 2% a round)
    assert residual.abs().max() < 0.2 * in_sum.abs().max()
    assert (sent_sum != 0).double().mean() > 0.95


@pytest.mark.parametrize("codec", SPARSE)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_is_refused_and_travels_as_nan(codec, bad):
    block = Chunks(256, 0.05)
    x = torch.randn(1000)
    x[700] = bad
    with pytest.raises(NonFiniteError):
        encode(x, codec, block)
    payload, sent = encoded(x, codec, block)  # what Comm.average sends instead: scales first
    assert payload.numel() == payload_bytes(codec, 1000, block)
    other = decode(encode(torch.randn(1000), codec, block), 1000, codec, block)
    assert not torch.isfinite(sent).all() and not torch.isfinite(sent + other).all()


@pytest.mark.parametrize("args,message", [
    (["--codec", "topk-2bit", "--density", "0"], "--density must lie in (0, 1], got 0.0."),
    (["--codec", "topk-fp4", "--density", "1.5"], "--density must lie in (0, 1], got 1.5."),
    (["--codec", "topk-2bit", "--sparse-chunk", "0"], "--sparse-chunk must lie in 1..16777216"),
    (["--density", "0.1"], "--density applies only to the topk codecs"),
    (["--outer-rule", "sparseloco", "--no-error-feedback"], "drop --no-error-feedback"),
])
def test_bad_sparse_options_one_sentence(tmp_path, lowband_here, args, message):
    code, stderr = lowband_here("train", "--algo", "streaming", *args, cwd=tmp_path)
    assert code == 2 and stderr.count("\n") == 1 and message in stderr, stderr


@pytest.mark.slow
def test_topk_2bit_sparseloco_within_3_percent_of_fp4(train_runs):
    """Equal tokens: streaming fp4-e3m0 (Nesterov) against topk-2bit at 2% with SparseLoCo's
    outer rule (lr 1, beta 0.95), nano, 2 replicas, 200 steps (about 8 s each on 2 cores)."""
    common = ("--algo", "streaming", "--model", "nano", "--fragments", 2, "--sync-every", 10,
              "--steps", 200, "--eval-every", 100, "--link-bandwidth", "none")
    runs = train_runs(fp4=[*common, "--codec", "fp4-e3m0"],
                      topk=[*common, "--codec", "topk-2bit", "--outer-rule", "sparseloco",
                            "--outer-lr", 1.0, "--outer-momentum", 0.95])
    a, b = (json.loads(runs[name].summary.read_text()) for name in ("fp4", "topk"))
    assert a["tokens"] == b["tokens"]
    fp4_loss, topk_loss = a["final_val_loss"], b["final_val_loss"]
    assert topk_loss <= 1.03 * fp4_loss, (fp4_loss, topk_loss)
    assert b["outer_wire_bytes"] * 10 < a["outer_wire_bytes"]


def top1(e: torch.Tensor, chunk: int) -> torch.Tensor:
    """topk-2bit at one value a chunk: the largest magnitude (the first on a tie) at its bf16."""
    out = torch.zeros_like(e)
    for lo, hi in chunks(e.numel(), chunk):
        i = lo + int(e[lo:hi].abs().argmax())
        out[i] = math.copysign(bf16(abs(e[i].item())), e[i].item())
    return out


def sparseloco_reference(R, steps, H, lr, beta, nesterov=False):
    """diloco with a topk-2bit exchange at one value per 64 in float64, R replicas in a loop:
    e_r = beta e_r + delta_r; c_r = topk(e_r); e_r -= c_r; outer -= lr mean(c) (or, nesterov,
    lowband's default rule with its momentum). Returns (names, initial and final outer
    parameters, flat in the names' order)."""
    init, models, data, opts = reference_replicas(R, 1, 2, SEQ, BATCH, LR, SEED)
    flat = lambda m: torch.cat([p.detach().reshape(-1) for p in m.parameters()])  # noqa: E731
    outer = flat(init)
    errors, momentum = [torch.zeros_like(outer) for _ in range(R)], torch.zeros_like(outer)
    for step in range(steps):
        inner_step(models, opts, data, 1, step, steps)
        if (step + 1) % H:
            continue
        sent = []
        for r, m in enumerate(models):
            errors[r] = beta * errors[r] + (outer - flat(m))
            sent.append(top1(errors[r], 64))
            errors[r] -= sent[-1]
        mean = sum(sent) / R
        if nesterov:
            momentum = MU * momentum + mean
            outer = outer - lr * (mean + MU * momentum)
        else:
            outer = outer - lr * mean
        for m in models:  # alpha 0: every replica restarts from the outer parameters
            torch.nn.utils.vector_to_parameters(outer.clone(), m.parameters())
    return [n for n, _ in init.named_parameters()], flat(init), outer


@pytest.mark.slow
def test_outer_rule_sparseloco_matches_float64_reference(train_run):
    R, steps, H, lr, beta = 2, 12, 4, 1.0, 0.95
    run = train_run("--algo", "diloco", *FLAGS, "--n-layer", 2, "--replicas", R, "--steps", steps,
                    "--sync-every", H, "--codec", "topk-2bit", "--sparse-chunk", 64, "--density",
                    0.01, "--outer-rule", "sparseloco", "--outer-lr", lr, "--outer-momentum", beta)
    names, init, want = sparseloco_reference(R, steps, H, lr, beta)
    outer = torch.load(run.root / "outer.pt", weights_only=True)
    got = torch.cat([outer[n].reshape(-1).double() for n in names])

    def error(w):  # relative to the outer update, which the rule decides
        return float((got - w).norm() / (want - init).norm())

    assert error(want) < 1e-3, error(want)
    # the rule is what tells them apart: no decay, or lowband's Nesterov rule, lands far away
    assert error(sparseloco_reference(R, steps, H, lr, 1.0)[2]) > 0.05
    assert error(sparseloco_reference(R, steps, H, 0.7, 1.0, nesterov=True)[2]) > 0.05
