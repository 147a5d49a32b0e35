"""ddp vs diloco vs streaming over a 100 Mbit/s link: emulated, and real (netns + veth + tbf).

Two replicas (R=2, S=1) train the same model on the same data with each algorithm, over
  emulated  `lowband train --link-bandwidth 100Mbit`: the comm layer delays outer transfers
            on a FIFO link (toolkit/lowband/comm/link.py); the bytes themselves go over loopback;
  real      two network namespaces joined by a veth pair, each end shaped by
            `tc qdisc ... tbf rate 100mbit`; one worker per namespace, gloo rendezvous and
            traffic over that pair. Needs root, `ip` and `tc`; skipped with one message if not.
Every setting is identical on both links except how the link is made. Prints, per algorithm
and link: tokens/s, compute utilization, outer-link bytes per token, peak outer payload and the
final validation loss, each also as a ratio to ddp on the same link; the emulated-vs-real
tokens/s agreement; then PASS/MISS for each goal, under the name of the model trained.

    python benchmarks/slow_link.py [--model mini | --model hf:DIR | --llama] [--steps 72]
        [--sync-every 18] [--fragments 3] [--batch-size 4] [--seq-len 128] [--skip-real]
        [--skip-emulated] [--json out.json]

--model hf:DIR trains a Hugging Face causal LM from a local config directory (its decoder layers
are the blocks that streaming fragments); --llama writes a Llama of about mini's size
(machine.LLAMA_MINI: 6 layers, hidden 256, 4.81M parameters, tied embeddings) into the runs'
directory and trains that, with the same settings.

The defaults make ddp link-bound (mini: 4.8M parameters, 19.3 MB of fp32 gradients a step,
about 1.5 s at 100 Mbit/s, against ~0.2-0.3 s of compute for 4 x 128 tokens on one core),
give streaming 4 syncs of each fragment, and take ~7 minutes on an idle 2-core machine. P should
divide the model's block count (mini and --llama have 6): goal 1's 6·P bound assumes equal
fragments.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import describe, model_line, write_llama_mini  # benchmarks/machine.py

from lowband import recipes
from lowband.launch.hosts import TestHosts

ALGOS = ("ddp", "diloco", "streaming", "sparse")  # sparse: streaming with topk-2bit, sparseloco
SPARSE = ["--codec", "topk-2bit", "--outer-rule", "sparseloco", "--outer-lr", "1",
          "--outer-momentum", "0.95"]
LINKS = ("emulated", "real")


# ---------------------------------------------------------------------------------------------
# runs
# ---------------------------------------------------------------------------------------------

def common_args(a) -> list[str]:
    return ["--replicas", "2", "--shards", "1", "--model", a.model, "--steps", str(a.steps),
            "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len), "--seed", str(a.seed),
            "--no-progress"]


def algo_args(algo: str, a) -> list[str]:
    """The row's recipe (lowband.recipes.slow_link_ALGO), with this benchmark's H and P."""
    args = ["--recipe", f"slow_link_{'streaming' if algo == 'sparse' else algo}"]
    if algo != "ddp":
        args += ["--sync-every", str(a.sync_every)]
    if algo in ("streaming", "sparse"):
        args += ["--fragments", str(a.fragments)]
    return args + (SPARSE if algo == "sparse" else [])


_WORKER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
               "MASTER_PORT", "GLOO_SOCKET_IFNAME", "TORCHELASTIC_RUN_ID", "LOWBAND_WORKER")


def _clean_env() -> dict:
    """This environment without a surrounding job's world (so `lowband train` launches)."""
    return {k: v for k, v in os.environ.items() if k not in _WORKER_ENV}


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGKILL it when the benchmark dies (PR_SET_PDEATHSIG)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        pass


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """Wait for every process; if one fails (or time runs out), stop the others."""
    deadline = time.time() + timeout
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return codes
        if any(c not in (None, 0) for c in codes) or time.time() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            return [p.returncode if p.returncode is not None else -9 for p in procs]
        time.sleep(0.2)


def run_emulated(algo: str, a, run_dir: Path) -> list[str]:
    """`lowband train` starts both workers itself (LOCAL_WORLD_SIZE=2: one thread each)."""
    cmd = [sys.executable, "-m", "lowband.cli", "train", *common_args(a), *algo_args(algo, a),
           "--link-bandwidth", f"{a.rate_mbit:g}Mbit", "--run-dir", str(run_dir)]
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_clean_env(),
                                stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        codes = _wait_all([proc], a.timeout)
    if codes[0] != 0:
        raise RuntimeError(f"{algo} over the emulated link failed (status {codes[0]}); "
                           f"see {run_dir.parent / f'{run_dir.name}.log'}")
    return cmd


def run_real(algo: str, a, run_dir: Path, hosts: TestHosts, port: int,
             addrs: list[str] | None = None, ifaces: list[str] | None = None) -> list[list[str]]:
    """One worker in each namespace, rendezvous at rank 0's veth address (or at addrs[0], gloo
    on ifaces[r]: a tunnel's, benchmarks/tunnel.py)."""
    addrs, ifaces = addrs or hosts.addrs, ifaces or hosts.devs
    cmds, procs, codes = [], [], [-1, -1]
    try:
        for r in range(2):
            env = {"RANK": r, "WORLD_SIZE": 2, "LOCAL_RANK": 0, "LOCAL_WORLD_SIZE": 2,
                   "MASTER_ADDR": addrs[0], "MASTER_PORT": port,
                   "GLOO_SOCKET_IFNAME": ifaces[r]}
            cmd = ["env", *[f"{k}={v}" for k, v in env.items()], sys.executable, "-m",
                   "lowband.cli", "train", *common_args(a), *algo_args(algo, a), "--run-dir",
                   str(run_dir)]
            cmds.append([*hosts.exec_prefix(r), *cmd])
            procs.append(hosts.popen(r, cmd, _clean_env(),
                                     run_dir.parent / f"{run_dir.name}.rank{r}.log",
                                     preexec_fn=_die_with_parent))
        codes = _wait_all(procs, a.timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(codes):
        raise RuntimeError(f"{algo} over the real link failed (statuses {codes}); see "
                           f"{run_dir.parent / f'{run_dir.name}.rank*.log'}")
    return cmds


def _children_cpu_s() -> float:
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _median_compute_s(run_dir: Path) -> float:
    """Median per-step compute seconds over every rank's step events (a load indicator: the
    same model and batch take the same compute on a quiet machine whatever the link)."""
    import statistics

    from lowband.telemetry import read_events

    xs = [e["compute_s"] for e in read_events(run_dir, ("step",))]
    return statistics.median(xs) if xs else float("nan")


def result_of(run_dir: Path) -> dict:
    s = json.loads((run_dir / "summary.json").read_text())
    meta = json.loads((run_dir / "config.json").read_text())["meta"]
    return {"tokens_per_s": s["tokens_per_s"], "compute_utilization": s["compute_utilization"],
            "bytes_per_token": s["outer_wire_bytes"] / s["tokens"],
            "peak_outer_payload_bytes": s["peak_outer_payload_bytes"],
            "final_val_loss": s["final_val_loss"], "final_loss": s["final_loss"],
            "wall_s": s["wall_s"], "tokens": s["tokens"], "outer_wire_bytes": s["outer_wire_bytes"],
            "n_params": meta["n_params"], "median_compute_s": _median_compute_s(run_dir),
            "run_dir": str(run_dir)}


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------

def ratio_text(r: float) -> str:
    if math.isnan(r) or r == 0:
        return "-"
    return f"{r:.2f}x" if r >= 0.1 else f"1/{1 / r:.0f}"


def si(x: float, unit: str) -> str:
    for p in ("", "k", "M", "G"):
        if abs(x) < 1000 or p == "G":
            return f"{x:.3g} {p}{unit}"
        x /= 1000
    return f"{x} {unit}"


COLUMNS = [("tokens/s", "tokens_per_s", lambda v: f"{v:,.0f}"),
           ("compute util", "compute_utilization", lambda v: f"{100 * v:.1f}%"),
           ("outer B/token", "bytes_per_token", lambda v: f"{v:,.1f}"),
           ("peak outer payload", "peak_outer_payload_bytes", lambda v: si(v, "B")),
           ("final val loss", "final_val_loss", lambda v: f"{v:.4f}")]


def table(results: dict) -> list[str]:
    head = "| link | algorithm | " + " | ".join(f"{c} (vs ddp)" for c, _, _ in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (2 + len(COLUMNS))]
    for link, by_algo in results.items():
        ddp = by_algo.get("ddp")
        for algo, r in by_algo.items():
            cells = []
            for _, key, fmt in COLUMNS:
                rel = r[key] / ddp[key] if ddp and ddp[key] else float("nan")
                cells.append(f"{fmt(r[key])} ({ratio_text(rel)})")
            lines.append(f"| {link} | {algo} | " + " | ".join(cells) + " |")
    return lines


def check_goals(results: dict, a) -> list[dict]:
    goals = []

    def goal(n, link, ok, text):
        goals.append({"goal": n, "link": link, "pass": bool(ok), "text": text})

    P, H = a.fragments, a.sync_every
    for link, by in results.items():
        ddp, st = by.get("ddp"), by.get("streaming")
        if not (ddp and st):
            continue
        ddp_step = 4 * ddp["n_params"]
        r1 = ddp_step / st["peak_outer_payload_bytes"]
        goal(1, link, r1 >= 6 * P, f"largest outer transfer {si(st['peak_outer_payload_bytes'], 'B')}"
             f" is {r1:.1f}x smaller than ddp's per-step gradient payload {si(ddp_step, 'B')} "
             f"(goal >= 6*P = {6 * P})")
        r2 = ddp["bytes_per_token"] / st["bytes_per_token"]
        goal(2, link, r2 >= 7 * H, f"streaming sends {r2:.1f}x fewer outer bytes per token than ddp "
             f"({st['bytes_per_token']:.2f} vs {ddp['bytes_per_token']:.1f}; goal >= 7*H = {7 * H})")
        r3 = st["tokens_per_s"] / ddp["tokens_per_s"]
        goal(3, link, r3 >= 5, f"streaming {st['tokens_per_s']:,.0f} tokens/s = {r3:.2f}x ddp's "
             f"{ddp['tokens_per_s']:,.0f} (goal >= 5x)")
        u = st["compute_utilization"]
        goal(4, link, u >= 0.9, f"streaming compute utilization {100 * u:.1f}% (goal >= 90%)")
        dv = st["final_val_loss"] / ddp["final_val_loss"] - 1
        goal(6, link, dv <= 0.03, f"streaming final validation loss {st['final_val_loss']:.4f} "
             f"vs ddp's {ddp['final_val_loss']:.4f} = {100 * dv:+.2f}% (goal within 3%, "
             "i.e. at most 3% higher)")
    for link, by in results.items():  # the sparse codec (issue 16)
        ddp, sp, st = by.get("ddp"), by.get("sparse"), by.get("streaming")
        if ddp and sp:
            r7 = ddp["bytes_per_token"] / sp["bytes_per_token"]
            goal(7, link, r7 >= 100 * H, f"streaming topk-2bit sends {r7:,.0f}x fewer outer bytes "
                 f"per token than ddp (goal >= 100*H = {100 * H})")
            goal(8, link, sp["compute_utilization"] >= 0.9, f"streaming topk-2bit compute "
                 f"utilization {100 * sp['compute_utilization']:.1f}% (goal >= 90%)")
        if st and sp:
            dv = sp["final_val_loss"] / st["final_val_loss"] - 1
            goal(9, link, dv <= 0.03, f"streaming topk-2bit final validation loss "
                 f"{sp['final_val_loss']:.4f} vs fp4's {st['final_val_loss']:.4f} = {100 * dv:+.2f}% "
                 "(goal within 3%)")
    if all(k in results for k in LINKS):
        for algo in ALGOS:
            e, r = results["emulated"].get(algo), results["real"].get(algo)
            if e and r:
                ratio = r["tokens_per_s"] / e["tokens_per_s"]
                goal(5, algo, abs(ratio - 1) <= 0.2, f"{algo}: real {r['tokens_per_s']:,.0f} vs "
                     f"emulated {e['tokens_per_s']:,.0f} tokens/s, real/emulated = {ratio:.3f} "
                     "(goal within 20%)")
    return goals


def run_one(algo, link, rep, a, out, hosts, port, results, commands) -> bool:
    """One run; keeps the faster of repeated runs (least disturbed by other load)."""
    run_dir = out / (f"{algo}-{link}" + (f"-{rep + 1}" if a.repeat > 1 else ""))
    if run_dir.exists():
        shutil.rmtree(run_dir)
    t0, cpu0, load0 = time.time(), _children_cpu_s(), os.getloadavg()[0]
    try:
        if link == "emulated":
            cmd = shlex.join(run_emulated(algo, a, run_dir))
        else:
            cmd = [shlex.join(c) for c in run_real(algo, a, run_dir, hosts, port)]
        r = result_of(run_dir)
    except RuntimeError as e:
        print(f"slow_link: {e}")
        return False
    r["workers_cpu_s"] = _children_cpu_s() - cpu0
    r["load_avg_1min_before"] = load0
    print(f"{algo:>9} over {link:<8} {r['tokens_per_s']:8,.0f} tokens/s, compute "
          f"{100 * r['compute_utilization']:5.1f}%, val loss {r['final_val_loss']:.4f}  "
          f"({time.time() - t0:.0f} s; workers used {r['workers_cpu_s']:.0f} CPU-s, median compute "
          f"{1000 * r['median_compute_s']:.0f} ms/step; load average before {load0:.1f})", flush=True)
    best = results[link].get(algo)
    if best is None or r["tokens_per_s"] > best["tokens_per_s"]:
        results[link][algo] = r
        commands[f"{algo}/{link}"] = cmd
    return True


def revision() -> str:
    """The lowband commit these runs used, and whether its package files had local changes."""
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              check=False).stdout.strip()

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return "unknown (not a git checkout)"
    dirty = git("status", "--porcelain", "--", "toolkit")
    return head + (" + uncommitted changes in toolkit/" if dirty else "")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    base = recipes.slow_link_streaming()  # the defaults below are the recipes'
    p.add_argument("--model", default=base.model,
                   help=f"a preset or hf:DIR, a Hugging Face config directory (default {base.model})")
    p.add_argument("--llama", action="store_true",
                   help="a Llama of mini's size, written into the runs' directory (replaces --model)")
    p.add_argument("--steps", type=int, default=base.steps, help="training steps (a multiple of H)")
    p.add_argument("--sync-every", type=int, default=base.sync_every, help="H for diloco and streaming")
    p.add_argument("--fragments", type=int, default=base.fragments, help="P for streaming (divides H)")
    p.add_argument("--batch-size", type=int, default=base.batch_size)
    p.add_argument("--seq-len", type=int, default=base.seq_len)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rate-mbit", type=float, default=100.0, help="link bandwidth, Mbit/s")
    p.add_argument("--tbf-burst", default="64kb", help="tbf burst of the real link")
    p.add_argument("--tbf-latency", default="50ms", help="tbf latency (queue) of the real link")
    p.add_argument("--algos", default=",".join(ALGOS), help="comma-separated subset to run "
                   "(sparse: streaming with --codec topk-2bit --outer-rule sparseloco)")
    p.add_argument("--skip-real", action="store_true", help="skip the real (netns) link")
    p.add_argument("--skip-emulated", action="store_true", help="skip the emulated link")
    p.add_argument("--out-dir", default="", help="where run directories go (default: a new temp dir)")
    p.add_argument("--repeat", type=int, default=1,
                   help="run everything N times and keep each run's fastest (for a busy machine)")
    p.add_argument("--timeout", type=float, default=1200, help="seconds allowed per run")
    p.add_argument("--json", default="", help="also write the results to this JSON file")
    a = p.parse_args(argv)
    algos = [x for x in a.algos.split(",") if x]
    if unknown := set(algos) - set(ALGOS):
        p.error(f"unknown algorithm(s) {', '.join(sorted(unknown))}: use {', '.join(ALGOS)}")
    if a.sync_every % a.fragments:
        p.error(f"--sync-every {a.sync_every} is not a multiple of --fragments {a.fragments}")

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # still remove the namespaces
    t_all = time.time()
    out = Path(a.out_dir or tempfile.mkdtemp(prefix="lowband-slow-link-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    links = [x for x in LINKS if not (x == "real" and a.skip_real or x == "emulated" and a.skip_emulated)]
    hosts = TestHosts("lb", "10.213.7", f"{a.rate_mbit:g}mbit", a.tbf_burst, a.tbf_latency,
                      host="ns")
    why_not = hosts.unavailable() if "real" in links else None
    if why_not:
        print(f"slow_link: skipping the real link: it {why_not}.")
        links.remove("real")
    if not links:
        print("slow_link: nothing left to run.")
        return 0

    from lowband.data import load_tokens
    from lowband.models import spec
    from lowband.options import ConfigError

    if a.llama:
        a.model = write_llama_mini(out, a.seq_len)
    try:  # an unusable --model stops here, in one line, not in every run
        model = model_line(a.model, a.seq_len)
        n_layer = spec(a.model).n_layer
    except ConfigError as e:
        if not a.out_dir:
            shutil.rmtree(out, ignore_errors=True)
        p.error(str(e))
    load_tokens("builtin")  # build the corpus cache once, before workers race for it
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    print(f"machine: {describe()}")
    rev = revision()  # now: the tree may change while the runs go on
    print(f"lowband: {rev}")
    print(f"settings: R=2 S=1, model {model}, batch {a.batch_size} x "
          f"{a.seq_len} tokens per rank, {a.steps} steps, H={a.sync_every}, P={a.fragments}, "
          f"streaming fp4-e3m0 tau=1 alpha=0.5, link {a.rate_mbit:g} Mbit/s, runs in {out}")
    if a.steps % a.sync_every:
        print(f"note: --steps {a.steps} is not a multiple of H={a.sync_every}: bytes per token "
              "of diloco/streaming then cover a partial round of syncs.")
    if n_layer % a.fragments:
        print(f"note: P={a.fragments} does not divide the {n_layer} blocks: fragments are unequal, "
              "so the largest is more than 1/P of the model (goal 1).")

    results: dict = {link: {} for link in links}
    commands: dict = {}
    link_check = None
    failed = False
    try:
        if "real" in links:
            try:
                hosts.setup()
            except RuntimeError as e:
                print(f"slow_link: skipping the real link: could not create it: {e}")
                links.remove("real")
                results.pop("real")
        if "real" in links:
            nbytes = 8_000_000
            secs = hosts.measure_tcp(nbytes)
            link_check = {"bytes": nbytes, "seconds": secs, "mbit_per_s": 8 * nbytes / secs / 1e6}
            ends = [f"{n}/{d} {ip}" for n, d, ip in zip(hosts.names, hosts.devs, hosts.addrs)]
            print(f"real link: {ends[0]} <-> {ends[1]}, tbf rate {hosts.rate} burst {hosts.burst} "
                  f"latency {hosts.latency} on both ends; one TCP stream: {nbytes / 1e6:g} MB in "
                  f"{secs:.3f} s = {link_check['mbit_per_s']:.1f} Mbit/s")
        print(flush=True)
        port = 29411
        for rep in range(a.repeat):
            for algo in algos:  # both links back to back per algorithm: the same machine load
                for link in links:
                    port += 1
                    if not run_one(algo, link, rep, a, out, hosts, port, results, commands):
                        failed = True
    finally:
        if "real" in links or hosts.leftovers():
            hosts.teardown()
            left = hosts.leftovers()
            if left:
                print(f"slow_link: could not remove {', '.join(left)}")

    print()
    for line in table(results):
        print(line)
    if "ddp" in algos:
        any_r = next((r for by in results.values() for r in by.values()), None)
        if any_r:
            step_b = 4 * any_r["n_params"]
            print(f"\nddp moves {si(step_b, 'B')} of fp32 gradients a step = "
                  f"{8 * step_b / (a.rate_mbit * 1e6):.2f} s at {a.rate_mbit:g} Mbit/s "
                  f"({any_r['n_params']:,} parameters)")
    if all(k in results for k in LINKS):
        print("\nemulated vs real tokens/s:")
        for algo in algos:
            e, r = results["emulated"].get(algo), results["real"].get(algo)
            if e and r:
                print(f"  {algo:>9}: emulated {e['tokens_per_s']:8,.0f}, real {r['tokens_per_s']:8,.0f}"
                      f", real/emulated {r['tokens_per_s'] / e['tokens_per_s']:.3f}")
    goals = check_goals(results, a)
    print(f"\ngoals, model {model}:")
    for g in goals:
        print(f"  {'PASS' if g['pass'] else 'MISS'}  {g['goal']}. [{g['link']}] {g['text']}")
    if not goals:
        print("  (none checkable: needs ddp and streaming runs)")
    wall = time.time() - t_all
    print(f"\nwall time {wall:.0f} s; run directories in {out}")
    if a.json:
        Path(a.json).write_text(json.dumps({
            "command": shlex.join([sys.executable, *sys.argv]), "machine": describe(),
            "lowband": rev, "model": model,
            "settings": {k: v for k, v in vars(a).items() if k != "json"},
            "link_check": link_check, "results": results, "commands": commands, "goals": goals,
            "wall_s": wall}, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
