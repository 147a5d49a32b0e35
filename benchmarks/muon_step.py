"""Muon's step: torch.optim.Muon (one Newton-Schulz per matrix) against lowband's BatchedMuon
batching (one per matrix shape, algorithms/inner.py), side by side in one run.

Both step their own copy of the same GPT preset's block matrices (what --optimizer muon hands
Muon) with the same gradients; steps alternate between the two (ABBA order), so machine noise
hits both alike. Prints per model the median step time of each, their ratio (torch / batched:
above 1, batched is faster), the kernel-launch count that batching saves (matrices against
shapes) and whether the two copies are still bitwise equal after every step, or how far apart
they drifted (on the CPU the small presets' are equal: tests/test_muon.py).

    python benchmarks/muon_step.py [--models nano,micro,mini,small] [--steps 20]
        [--device cpu|cuda] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from machine import describe  # benchmarks/machine.py
from lowband.algorithms.inner import MUON_MOMENTUM, BatchedMuon
from lowband.models.gpt import GPT, gpt_config


def matrices(model: str, device: torch.device) -> list[torch.Tensor]:
    """The 2-D parameters inside the preset's blocks (what --optimizer muon gives Muon)."""
    torch.manual_seed(0)
    gpt = GPT(gpt_config(model, seq_len=256))
    return [p.detach().to(device).requires_grad_() for b in gpt.blocks for p in b.parameters()
            if p.dim() == 2]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compare(model: str, steps: int, device: torch.device) -> dict:
    ours, theirs = matrices(model, device), matrices(model, device)
    args = dict(lr=2e-3, weight_decay=0.1, momentum=MUON_MOMENTUM, nesterov=True,
                adjust_lr_fn="match_rms_adamw")
    opts = {"torch": torch.optim.Muon(theirs, **args),
            "batched": BatchedMuon(ours, **args, batch=True)}
    params = {"torch": theirs, "batched": ours}
    times = {"torch": [], "batched": []}
    equal, apart = True, 0.0
    gen = torch.Generator().manual_seed(1)
    for step in range(steps + 2):  # two warm-up steps
        grads = [torch.randn(p.shape, generator=gen).to(device) for p in ours]
        order = ("torch", "batched") if step % 2 == 0 else ("batched", "torch")
        for name in order:
            for p, g in zip(params[name], grads):
                p.grad = g.clone()
            sync(device)
            t0 = time.perf_counter()
            opts[name].step()
            sync(device)
            if step >= 2:
                times[name].append(time.perf_counter() - t0)
        equal = equal and all(torch.equal(a, b) for a, b in zip(ours, theirs))
        apart = max(apart, max((a - b).abs().max().item() for a, b in zip(ours, theirs)))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"model": model, "matrices": len(ours), "shapes": len({tuple(p.shape) for p in ours}),
            "params": sum(p.numel() for p in ours), "torch_s": med["torch"],
            "batched_s": med["batched"], "ratio": med["torch"] / med["batched"],
            "bitwise_equal": equal, "max_difference": apart}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="nano,micro,mini,small")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    print(describe())
    rows = []
    for model in a.models.split(","):
        r = compare(model, a.steps, device)
        rows.append(r)
        print(f"{model:6s} {r['matrices']:3d} matrices in {r['shapes']} shapes "
              f"({r['params'] / 1e6:.2f}M): torch {r['torch_s'] * 1e3:8.2f} ms, batched "
              f"{r['batched_s'] * 1e3:8.2f} ms a step: {r['ratio']:.2f}x; bitwise equal: "
              f"{r['bitwise_equal']} (largest difference {r['max_difference']:.2g})",
              flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": str(device), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
