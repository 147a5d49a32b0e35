"""The tokens streaming needs against ddp's to reach ddp's loss, by model size (issue 46).

For each model of --models, R of --replicas and inner optimizer of --optimizers, one run after
another with the same seed and data, no link emulation (losses at a fixed schedule do not
depend on the link, so the machine may be shared):
  ddp        --steps S steps and S/2 steps (each its own full schedule): ddp's final validation
             loss L(S), and how it falls with tokens there, alpha = ln(L(S/2) / L(S)) / ln 2
  variants   each of --variants for S steps (VARIANTS: today's streaming, eager outer updates,
             outer momentum warm-up, diloco; each against ddp with the same inner optimizer):
             its loss at equal tokens L_v, p = L_v / L(S) - 1, and the tokens it needs to reach
             L(S), estimated as (1 + p) ^ (1 / alpha): the planner's own rule (plan/loss.py),
             with the exponent measured here instead of the published 0.0953
  --direct   each variant also for 1.5 S steps, then 2 S, 2.5 S and 3 S, each only where the
             one before did not reach L(S): the tokens factor where its final loss crosses L(S)
             (log-log between the two runs that bracket it), each run with its own full
             schedule, as a user would run it longer. The factor then is this one ("beyond 3"
             past 3 S); the estimate stays beside it
Then, for each R, optimizer and variant, the least-squares slopes of ln(factor) against ln N
(direct, and the alpha rule's), beside the published fit's (plan/loss.py: DiLoCo scaling laws,
Table 4, over 35M-2.4B at H=30) and the factor the planner takes from it (held at 35M below
it); the goals: MuLoCo's check (diloco at R=1 with Muon no worse than Muon ddp at equal
tokens, from `--replicas 1 --variants diloco`) and, per model and R, the variant and optimizer
needing the fewest tokens against their ddp. --plan prints the table plan/measured.py holds
(direct factors of today's streaming and diloco): the planner takes it where it applies.

    python benchmarks/per_token.py [--models nano micro mini small] [--replicas 2 4]
        [--optimizers adamw muon] [--variants today eager warmup diloco] [--steps 300]
        [--direct] [--dir DIR] [--json out.json] [--plan] [--svg factor.svg]
    python benchmarks/per_token.py --from a.json b.json [--svg f.svg] [--plan]   # together
    python benchmarks/per_token.py --smoke   # a few steps: the script works, no figures

Runs land in DIR/<model>-r<R>-<optimizer>-<variant>-<steps>/ (default: a fresh temporary
directory); calling again with the same --dir reuses every finished run, so parts can be run one
after another and printed together.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

from goals import report  # benchmarks/goals.py
from machine import describe  # benchmarks/machine.py
from outer_lr import finished  # benchmarks/outer_lr.py
from slow_link import revision

from lowband.plan import loss as published

H = 20
VARIANTS = {  # name -> (what it is, its lowband train flags)
    "today": ("streaming as it is (P=4, tau=1, fp4-e3m0, delayed merge)", ["--algo", "streaming"]),
    "eager": ("streaming, eager outer updates", ["--algo", "streaming", "--outer-update",
                                                 "eager"]),
    "warmup": ("streaming, outer momentum warm-up over 3 outer steps",
               ["--algo", "streaming", "--outer-warmup", "3"]),
    "diloco": ("diloco (the whole model each H)", ["--algo", "diloco"]),
}


def run(name: str, flags: list[str], steps: int, a, root: Path) -> dict:
    """One `lowband train` run (reused when its directory holds a finished one): its final
    validation loss, parameter count, tokens and seconds."""
    d = root / f"{name}-{steps}"
    if (d / "summary.json").exists():
        summary, config = (json.loads((d / f).read_text()) for f in ("summary.json",
                                                                     "config.json"))
        wall = None
    else:
        cmd = [sys.executable, "-m", "lowband.cli", "train", *flags, "--steps", str(steps),
               "--sync-every", str(H), "--link-bandwidth", "none", "--eval-every", "0",
               "--eval-batches", str(a.eval_batches), "--seed", str(a.seed), "--no-progress",
               "--run-dir", str(d), "--overwrite", *a.extra]
        summary, config, wall = finished(cmd, d)
        print(f"  {name} {steps} steps: val {summary['final_val_loss']:.4f} ({wall:.0f} s)",
              flush=True)
    return {"val": summary["final_val_loss"], "params": config["meta"]["n_params"],
            "tokens": summary["tokens"], "wall_s": wall}


def crossing(target: float, points: list[tuple[float, float]]) -> float | None:
    """The tokens factor k where the loss L(k) crosses `target`, log-log between the two points
    (k, L) that bracket it; None when no pair does (then the factor lies beyond the last k)."""
    for (k0, l0), (k1, l1) in zip(points, points[1:]):
        if l0 >= target >= l1 and l0 > l1:
            t = math.log(l0 / target) / math.log(l0 / l1)
            return math.exp(math.log(k0) + t * math.log(k1 / k0))
    return 1.0 if points and points[0][1] <= target else None


def measure(model: str, replicas: int, optimizer: str, a, root: Path) -> list[dict]:
    """ddp at S and S/2, then each variant at S; with --direct each variant at 1.5 S too, and at
    2 S, 2.5 S and 3 S, each when the one before did not reach ddp's loss. factor: the direct
    one where measured, else the alpha rule's estimate."""
    base = ["--model", model, "--replicas", str(replicas), "--optimizer", optimizer]
    tag = f"{model}-r{replicas}-{optimizer}"
    full = run(f"{tag}-ddp", ["--algo", "ddp", *base], a.steps, a, root)
    half = run(f"{tag}-ddp", ["--algo", "ddp", *base], a.steps // 2, a, root)
    alpha = math.log(half["val"] / full["val"]) / math.log(2)
    rows = []
    for v in a.variants:
        flags = [*VARIANTS[v][1], *base]
        mine = run(f"{tag}-{v}", flags, a.steps, a, root)
        p = mine["val"] / full["val"] - 1
        estimate = (1 + p) ** (1 / alpha) if alpha > 0 else None
        row = {"model": model, "params": full["params"], "replicas": replicas,
               "optimizer": optimizer, "variant": v, "ddp_val": full["val"],
               "ddp_half_val": half["val"], "alpha": alpha, "val": mine["val"], "loss": p,
               "estimate": estimate, "direct": None, "factor": estimate,
               "published": published.published(full["params"], replicas, H).tokens_factor}
        if a.direct:
            points = [(1.0, mine["val"])]
            for k in (1.5, 2.0, 2.5, 3.0):  # each only where the one before did not reach
                if crossing(full["val"], points) is not None:
                    break
                points.append((k, run(f"{tag}-{v}", flags, round(a.steps * k), a, root)["val"]))
            row |= {"direct": crossing(full["val"], points), "direct_points": points}
            row["factor"] = row["direct"]  # None: beyond 3 S
        rows.append(row)
    return rows


def slope(rows: list[dict], key: str = "factor") -> float | None:
    """Least-squares slope of ln(row[key]) against ln N; None under two sizes."""
    pts = [(math.log(r["params"]), math.log(r[key])) for r in rows if r.get(key)]
    if len({x for x, _ in pts}) < 2:
        return None
    mx, my = (sum(v) / len(pts) for v in zip(*pts))
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def published_slope(replicas: int) -> float:
    """The published fit's slope of ln(tokens factor) against ln N over its range (35M-2.4B)."""
    lo, hi = published.SIZES[0], published.SIZES[-1]
    f = [published.published(n, replicas, H).tokens_factor for n in (lo, hi)]
    return math.log(f[1] / f[0]) / math.log(hi / lo)


def direct(r: dict) -> str:
    if "direct_points" not in r:
        return "—"
    return f"{r['direct']:.2f}x" if r["direct"] else f"> {r['direct_points'][-1][0]:g}x"


def table(rows: list[dict]) -> list[str]:
    head = ("| model | N | R | inner | variant | ddp L(S) | ddp L(S/2) | alpha | L at equal "
            "tokens | loss vs ddp | factor (alpha rule) | factor (direct) | published |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows:
        f = lambda x, fmt: "—" if x is None else format(x, fmt)  # noqa: E731
        lines.append(f"| {r['model']} | {r['params'] / 1e6:.2f}M | {r['replicas']} | "
                     f"{r['optimizer']} | {r['variant']} | {r['ddp_val']:.4f} | "
                     f"{r['ddp_half_val']:.4f} | {r['alpha']:.3f} | {r['val']:.4f} | "
                     f"{r['loss']:+.2%} | {f(r['estimate'], '.2f')}x | "
                     f"{direct(r)} | "
                     f"{r['published']:.2f}x |")
    return lines


def fits(rows: list[dict]) -> list[str]:
    """Per R, optimizer and variant: the factors by model, and the slopes of ln(factor) on ln N
    of the direct factors and of the alpha rule's estimates (every model has one)."""
    out = []
    for key in sorted({(r["replicas"], r["optimizer"], r["variant"]) for r in rows}):
        group = sorted((r for r in rows if (r["replicas"], r["optimizer"], r["variant"]) == key),
                       key=lambda r: r["params"])
        cells = ", ".join(f"{r['model']} {direct(r)} (rule {r['estimate']:.2f}x)"
                          for r in group if r["estimate"])
        slopes = "; ".join(f"{what} {s:+.3f}" for what, s in (
            ("slope of ln(direct) on ln N", slope(group, "direct")),
            ("of ln(rule)", slope(group, "estimate"))) if s is not None)
        out.append(f"  R={key[0]} {key[1]} {key[2]}: {cells}{'; ' + slopes if slopes else ''} "
                   f"(published fit, 35M-2.4B: {published_slope(key[0]):+.3f})")
    return out


def plot(rows: list[dict], path: Path) -> None:
    """An SVG of today's streaming's tokens factor against N (log scale): a line per R and
    optimizer, filled dots the direct factor, hollow ones the alpha rule's estimate (where the
    direct one was not run); the published fit's factor dashed beside each R."""
    rows = [r for r in rows if r["variant"] == "today" and r["replicas"] > 1]
    W, Ht, L, B = 640, 400, 60, 50  # size, left and bottom margins
    ns = [r["params"] for r in rows] + [published.SIZES[0], published.SIZES[-1]]
    fs = [r["factor"] for r in rows if r["factor"]] + [1.0]
    x0, x1 = math.log10(min(ns)) - 0.1, math.log10(max(ns)) + 0.1
    y0, y1 = 0.9, max(fs) * 1.05
    X = lambda n: L + (math.log10(n) - x0) / (x1 - x0) * (W - L - 20)  # noqa: E731
    Y = lambda f: Ht - B - (f - y0) / (y1 - y0) * (Ht - B - 20)  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{Ht}" '
           'font-family="sans-serif" font-size="11">',
           f'<line x1="{L}" y1="{Ht - B}" x2="{W - 20}" y2="{Ht - B}" stroke="black"/>',
           f'<line x1="{L}" y1="20" x2="{L}" y2="{Ht - B}" stroke="black"/>',
           f'<text x="{W / 2}" y="{Ht - 12}" text-anchor="middle">parameters N</text>',
           f'<text x="14" y="{Ht / 2}" transform="rotate(-90 14 {Ht / 2})" text-anchor="middle">'
           "tokens factor to ddp's loss</text>"]
    for e in range(math.ceil(x0), math.floor(x1) + 1):
        out.append(f'<text x="{X(10 ** e):.1f}" y="{Ht - B + 15}" text-anchor="middle">'
                   f'1e{e}</text>')
    for k in range(5):
        f = y0 + (y1 - y0) * k / 4
        out.append(f'<text x="{L - 5}" y="{Y(f) + 4:.1f}" text-anchor="end">{f:.2f}</text>')
    colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf"]
    groups = sorted({(r["replicas"], r["optimizer"], r["variant"]) for r in rows})
    for i, key in enumerate(groups):
        g = sorted((r for r in rows if (r["replicas"], r["optimizer"], r["variant"]) == key
                    and r["factor"]), key=lambda r: r["params"])
        c = colours[i % len(colours)]
        pts = " ".join(f"{X(r['params']):.1f},{Y(r['factor']):.1f}" for r in g)
        out += [f'<polyline points="{pts}" fill="none" stroke="{c}" stroke-width="2"/>',
                *(f'<circle cx="{X(r["params"]):.1f}" cy="{Y(r["factor"]):.1f}" r="3" '
                  f'stroke="{c}" fill="{c if r["direct"] else "white"}"/>' for r in g),
                f'<text x="{W - 25}" y="{30 + 14 * i}" text-anchor="end" fill="{c}">'
                f'R={key[0]} {key[1]} {key[2]}</text>']
    for j, n in enumerate(sorted({r["replicas"] for r in rows})):
        sizes = list(published.SIZES)
        ys = [Y(published.published(s, n, H).tokens_factor) for s in sizes]
        pts = " ".join(f"{X(s):.1f},{y:.1f}" for s, y in zip(sizes, ys))
        out += [f'<polyline points="{pts}" fill="none" stroke="gray" stroke-dasharray="5,3"/>',
                f'<text x="{X(sizes[-1]):.1f}" y="{ys[-1] - 6 - 12 * j:.1f}" text-anchor="end" '
                f'fill="gray">published fit, R={n}</text>']
    path.write_text("\n".join([*out, "</svg>"]) + "\n")


def goals(rows: list[dict]) -> list[tuple[str, bool | None, str]]:
    """MuLoCo's own check (diloco at R=1 with Muon no worse than Muon ddp at equal tokens), and
    per model and R the variant and optimizer that need the fewest tokens against their ddp."""
    out = [(f"{r['model']}: diloco R=1 {r['optimizer']} no worse than {r['optimizer']} ddp at "
            "equal tokens", r["loss"] <= 0 if r["optimizer"] == "muon" else None,
            f"{r['val']:.4f} vs {r['ddp_val']:.4f} ({r['loss']:+.2%})")
           for r in rows if r["replicas"] == 1 and r["variant"] == "diloco"]
    sizes = {(r["replicas"], r["params"], r["model"]) for r in rows if r["replicas"] > 1}
    for key in sorted(sizes):
        group = [r for r in rows if (r["replicas"], r["params"], r["model"]) == key and r["factor"]]
        if group:
            b = min(group, key=lambda r: r["factor"])
            out.append((f"{key[2]} R={key[0]}: fewest tokens to its ddp's loss", None,
                        f"{b['variant']} with {b['optimizer']}, {b['factor']:.2f}x (of "
                        + ", ".join(f"{r['variant']}/{r['optimizer']} {r['factor']:.2f}x"
                                    for r in group) + ")"))
    return out


def plan_table(rows: list[dict], a) -> str:
    """plan/measured.py's MEASURED: per (algorithm, inner optimizer, R), the (N, loss at equal
    tokens over ddp's - 1, direct tokens factor) of each model whose factor was measured directly
    (the alpha rule's estimates stay out of the planner); today's streaming and diloco."""
    algo = {"today": "streaming", "diloco": "diloco"}
    lines = [f"# python benchmarks/per_token.py --steps {a.steps} ... ({revision()}, "
             f"{time.strftime('%Y-%m-%d')})", "MEASURED = {"]
    for key in sorted({(algo[r["variant"]], r["optimizer"], r["replicas"]) for r in rows
                       if r["variant"] in algo and r["direct"]}):
        pts = sorted((r for r in rows if (algo.get(r["variant"]), r["optimizer"], r["replicas"])
                      == key and r["direct"]), key=lambda r: r["params"])
        lines += [f"    {key!r}: (", *(f"        ({r['params']}, {r['loss']:.5f}, "
                                       f"{r['direct']:.4f})," for r in pts), "    ),"]
    return "\n".join([*lines, "}"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["nano", "micro", "mini", "small"])
    p.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    p.add_argument("--optimizers", nargs="+", choices=["adamw", "muon"], default=["adamw"])
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=["today"])
    p.add_argument("--steps", type=int, default=300, help="S: ddp's steps")
    p.add_argument("--eval-batches", type=int, default=16, help="held-out micro-batches a rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--direct", action="store_true", help="each variant at 1.5 S (and up to 3 S)")
    p.add_argument("--smoke", action="store_true", help="short runs of short sequences: checks "
                   "the script, measures nothing")
    p.add_argument("--dir", help="keep the run directories here (default: a temporary one)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plan", action="store_true", help="print plan/measured.py's table")
    p.add_argument("--svg", help="draw the factor against N here")
    p.add_argument("--from", dest="sources", nargs="+", help="print the rows of these --json "
                   "files (earlier calls) together instead of running")
    a = p.parse_args(argv)
    a.extra = []
    if a.smoke:
        a.steps, a.eval_batches = 40, 2
        a.extra = ["--seq-len", "32", "--batch-size", "4", "--warmup-steps", "2"]
    started = time.strftime("%Y-%m-%d %H:%M")
    print(f"machine: {describe(load=True)}; lowband {revision()}; {started}", flush=True)
    if a.sources:  # the last file's row wins where two measured the same setting
        rows = list({(r["model"], r["replicas"], r["optimizer"], r["variant"]): r
                     for f in a.sources for r in json.loads(Path(f).read_text())["rows"]}
                    .values())
        a.variants = sorted({r["variant"] for r in rows}, key=list(VARIANTS).index)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(a.dir or tmp)
            rows = [r for m in a.models for n in a.replicas for o in a.optimizers
                    for r in measure(m, n, o, a, root)]
    rows.sort(key=lambda r: (r["replicas"], r["optimizer"], r["params"],
                             list(VARIANTS).index(r["variant"])))
    print(f"\nat equal tokens: S = {a.steps} steps, H = {H}, seed {a.seed}"
          f"{' SMOKE' * a.smoke}; machine at the end: {describe(load=True)}")
    for v in a.variants:
        print(f"  {v}: {VARIANTS[v][0]}")
    print("\n".join(["", *table(rows), "", "the factor against model size:", *fits(rows)]))
    report("goals", goals(rows), a, None)
    if a.plan:
        print("\n" + plan_table(rows, a))
    if a.svg:
        plot(rows, Path(a.svg))
    if a.json:
        Path(a.json).write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()},
                                            "started": started, "machine": describe(),
                                            "revision": revision(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
