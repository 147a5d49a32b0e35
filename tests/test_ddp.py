"""ddp against a float64 single-process reference, and the bytes it records."""

import math

import pytest
import torch
import torch.nn.functional as F

from lowband.data import Batches, load_tokens
from lowband.models import num_params
from lowband.models.gpt import GPT, gpt_config
from lowband.telemetry import read_events

pytestmark = pytest.mark.slow  # measured (--durations): README, Run the tests

STEPS, ACCUM, BATCH, SEQ, LR, WARMUP, CLIP = 4, 2, 2, 32, 1e-3, 2, 0.5


def reference_lr(step: int) -> float:
    # written out for the test: linear warm-up, cosine to 10% of the peak
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    progress = (step - WARMUP) / (STEPS - WARMUP)
    return 0.1 * LR + 0.9 * LR * 0.5 * (1 + math.cos(math.pi * progress))


def reference_params(world: int, seed: int = 3) -> dict:
    """One process, float64: train on the concatenation of every rank's micro-batches."""
    torch.manual_seed(seed)
    model = GPT(gpt_config("nano", seq_len=SEQ)).double()
    tokens = load_tokens("builtin")
    data = [Batches(tokens, rank=r, world=world, seq_len=SEQ, batch_size=BATCH, seed=seed,
                    val_fraction=0.02) for r in range(world)]
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95))
    for step in range(STEPS):
        xs, ys = zip(*[d.train(step, m) for d in data for m in range(ACCUM)])
        x, y = torch.cat(xs), torch.cat(ys)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        for g in opt.param_groups:
            g["lr"] = reference_lr(step)
        opt.step()
    return model.state_dict()


@pytest.mark.parametrize("replicas,shards", [(2, 1), (2, 2)])
def test_ddp_matches_float64_reference(train_run, replicas, shards):
    run = train_run("--algo", "ddp", "--model", "nano", "--replicas", replicas, "--shards", shards,
                    "--steps", STEPS, "--grad-accum", ACCUM, "--batch-size", BATCH,
                    "--seq-len", SEQ, "--lr", LR, "--warmup-steps", WARMUP, "--grad-clip", CLIP,
                    "--seed", 3, "--bucket-mb", 0.05)
    got = torch.load(run.root / "model.pt", weights_only=True)
    want = reference_params(replicas * shards)
    for name, w in want.items():
        g = got[name].double()
        rel = (g - w).norm() / w.norm()
        assert rel <= 1e-6, f"{name}: relative error {rel:.2e}"

    # every step moved every gradient exactly once, in buckets, with ring all-reduce volume
    n = replicas * shards
    n_params = num_params(GPT(gpt_config("nano", seq_len=SEQ)))
    comm = [e for e in read_events(run, ("comm",)) if e["tag"].startswith("bucket")]
    for rank in range(n):
        mine = [e for e in comm if e["rank"] == rank]
        assert sum(e["payload_bytes"] for e in mine) == STEPS * 4 * n_params
        assert len({e["tag"] for e in mine}) > 1  # bucketed: 0.05 MiB < the model
        for e in mine:
            assert e["op"] == "all_reduce" and e["codec"] == "fp32"
            assert e["wire_bytes"] == 2 * (n - 1) * e["payload_bytes"] // n
            assert e["start"] <= e["end"]
            # the ring in rank order crosses the slow link after the last shard of a replica
            assert e["group"] == ("outer" if rank % shards == shards - 1 else "inner")
