"""Does the live dashboard keep up with a busy run, and what does it cost the kernel?

Eight writer processes (the ranks of a 4 x 2 run) append events with lowband's EventWriter as a
streaming-DiLoCo trainer at 50 steps/s would: per step a `step` event and `--buckets` inner
transfers, every 10 steps an outer transfer and a `sync`, every 100 steps an `eval`. A python3
kernel (started with jupyter_client, as JupyterLab starts one) shows `Dashboard(run_dir)` with
its default 0.25 s polling, and this script measures, while the writers write:

  kernel CPU share   CPU seconds of the kernel process (all its threads: the polling thread and
                     the redraws on the event loop) / wall seconds; goal: under 20 % of one core
  lag                seconds between now and the newest event the dashboard has folded in, and
                     steps behind the writers, read through the kernel at the end
  redraws            figure updates per second, and the bytes per second of widget messages the
                     kernel sent towards the browser (comm messages on iopub)

    python benchmarks/dashboard_load.py [--ranks 8] [--rate 50] [--seconds 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GOAL_SHARE = 0.20


# -- one rank's writer (run as a subprocess: --writer RANK) ------------------------------------

def write_rank(run_dir: str, rank: int, shards: int, rate: float, seconds: float,
               buckets: int, sync_every: int = 10, eval_every: int = 100) -> None:
    from lowband.telemetry import EventWriter, RunDir

    rd = RunDir(run_dir)
    w = EventWriter(rd, rank, rank // shards)
    w.emit("run", phase="start", world=0, config_hash="dashboard-load")
    t0 = time.time()
    period = 1.0 / rate
    step = 0
    while True:
        step += 1
        due = t0 + step * period
        now = time.time()
        if due > now:
            time.sleep(due - now)
        now = time.time()
        if now - t0 > seconds:
            break
        for b in range(buckets):
            w.emit("comm", op="all_reduce", group="inner", tag=f"bucket{b}", payload_bytes=4e6,
                   wire_bytes=2e6, codec="fp32", start=now - period * 0.3 * (b + 1),
                   end=now - period * 0.3 * b)
        w.emit("step", step=step, loss=2 + 3 * math.exp(-step / 300) + 0.002 * rank,
               lr=3e-4, tokens=step * 4096, step_s=period, compute_s=0.9 * period)
        if step % sync_every == 0:
            frag = step // sync_every % 2
            w.emit("comm", op="all_reduce", group="outer", tag=f"frag{frag}",
                   payload_bytes=2e6, wire_bytes=2.6e5, codec="fp4-e3m0",
                   start=now - 0.02, end=now, begin=now - 0.02)
            w.emit("sync", step=step, fragment=frag, pseudo_grad_norm=0.5, weight=0.25,
                   anomaly=False, outer_lr=0.7)
        if step % eval_every == 0:
            w.emit("eval", step=step, val_loss=2 + 3 * math.exp(-step / 300))
    w.emit("run", phase="end", world=0, config_hash="dashboard-load")
    w.close()


def latest_step(path: Path) -> int:
    """The highest step in the last few kilobytes of a rank's event file."""
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - 8192))
        lines = f.read().splitlines()[1:]
    steps = []
    for ln in lines:
        if b'"kind":"step"' in ln:
            try:
                steps.append(json.loads(ln)["step"])
            except (ValueError, KeyError):   # a line still being written
                pass
    return max(steps, default=0)


# -- the kernel ---------------------------------------------------------------------------------

def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, all threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Kernel:
    def __init__(self, cwd: str):
        from jupyter_client import KernelManager

        self.km = KernelManager(kernel_name="python3")
        path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
        self.km.start_kernel(cwd=cwd, env={**os.environ, "PATH": path})   # `python`: this one
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)
        self.pid = self.km.provisioner.process.pid
        self.comm_msgs = 0
        self.comm_bytes = 0

    def run(self, code: str) -> str:
        out = []

        def hook(msg):
            self._count(msg)
            if msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                out.append("\n".join(msg["content"]["traceback"]))

        reply = self.kc.execute_interactive(code, timeout=120, output_hook=hook)
        if reply["content"]["status"] != "ok":
            raise RuntimeError("".join(out) or str(reply["content"]))
        return "".join(out)

    def value(self, expr: str):
        return json.loads(self.run(f"import json as _j; print(_j.dumps({expr}))"))

    def _count(self, msg) -> None:
        if msg["msg_type"] in ("comm_msg", "comm_open"):
            self.comm_msgs += 1
            self.comm_bytes += len(json.dumps(msg["content"], default=str))
            self.comm_bytes += sum(len(memoryview(b)) for b in msg.get("buffers") or [])

    def drain(self, seconds: float) -> None:
        """Receive what the kernel sends to frontends for `seconds` (as a browser would)."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            try:
                self._count(self.kc.get_iopub_msg(timeout=left))
            except queue.Empty:
                break

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--shards", type=int, default=2, help="ranks per replica (default 2)")
    p.add_argument("--rate", type=float, default=50.0, help="steps per second per rank")
    p.add_argument("--buckets", type=int, default=2, help="inner transfers per step per rank")
    p.add_argument("--seconds", type=float, default=30.0, help="measured seconds")
    p.add_argument("--interval", type=float, default=0.25, help="the dashboard's poll interval")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--writer", type=int, help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.writer is not None:
        write_rank(args.run_dir, args.writer, args.shards, args.rate, args.seconds,
                   args.buckets)
        return 0

    from lowband.telemetry import RunDir, write_json_atomic

    warmup = 3.0
    with tempfile.TemporaryDirectory(prefix="lowband-dashload-") as tmp:
        rd = RunDir(Path(tmp) / "run").create()
        write_json_atomic(rd.config, {
            "name": "dashboard-load", "algo": "streaming", "replicas": args.ranks // args.shards,
            "shards": args.shards, "steps": int(args.rate * (args.seconds + 60)),
            "sync_every": 20, "fragments": 2, "link_bandwidth": "1Gbit"})
        kernel = Kernel(tmp)
        writers = []
        try:
            kernel.run("from lowband.dashboard import Dashboard\n"
                       "import plotly.graph_objects as go\n_ = go.FigureWidget()")
            idle_cpu, idle_t = cpu_seconds(kernel.pid), time.monotonic()
            kernel.drain(2.0)
            idle_share = (cpu_seconds(kernel.pid) - idle_cpu) / (time.monotonic() - idle_t)

            total_s = args.seconds + warmup
            writers = [subprocess.Popen(
                [sys.executable, __file__, "--writer", str(r), "--run-dir", str(rd.root),
                 "--shards", str(args.shards), "--rate", str(args.rate),
                 "--buckets", str(args.buckets), "--seconds", str(total_s + 5)])
                for r in range(args.ranks)]
            kernel.run(f"d = Dashboard({str(rd.root)!r}, interval={args.interval})\nd")
            kernel.drain(warmup)

            renders0 = kernel.value("d.renders")
            msgs0, bytes0 = kernel.comm_msgs, kernel.comm_bytes
            cpu0, t0 = cpu_seconds(kernel.pid), time.monotonic()
            thirds = []
            for _ in range(3):
                c, t = cpu_seconds(kernel.pid), time.monotonic()
                kernel.drain(args.seconds / 3)
                thirds.append((cpu_seconds(kernel.pid) - c) / (time.monotonic() - t))
            cpu1, t1 = cpu_seconds(kernel.pid), time.monotonic()
            wall = t1 - t0
            share = (cpu1 - cpu0) / wall
            state = kernel.value("[d.renders, d.live, d.models[0].events_seen, "
                                 "d.models[0].current_step(), d.models[0].t_last, "
                                 "__import__('time').time()]")
            renders, live, events_seen, shown_step, t_last, now = state
            written_step = max(latest_step(rd.event_file(r)) for r in range(args.ranks))
            result = {
                "ranks": args.ranks, "rate": args.rate, "buckets": args.buckets,
                "interval": args.interval, "seconds": round(wall, 2),
                "kernel_cpu_share": round(share, 4),
                "kernel_cpu_share_thirds": [round(x, 4) for x in thirds],
                "idle_kernel_cpu_share": round(idle_share, 4),
                "redraws_per_s": round((renders - renders0) / wall, 2),
                "cpu_s_per_redraw": round((cpu1 - cpu0) / max(renders - renders0, 1), 4),
                "widget_msgs_per_s": round((kernel.comm_msgs - msgs0) / wall, 1),
                "widget_bytes_per_s": round((kernel.comm_bytes - bytes0) / wall),
                "lag_s": round(now - t_last, 3),
                "steps_behind": max(0, written_step - (shown_step or 0)),
                "events_seen": events_seen, "live": live,
            }
        finally:
            for w in writers:
                if w.poll() is None:
                    w.terminate()
            for w in writers:
                w.wait()
            kernel.close()
    result["events_per_s"] = round(events_seen / (wall + warmup), 1)
    print(f"{args.ranks} ranks x {args.rate:g} steps/s ({result['events_per_s']:,.0f} events/s "
          f"folded in), dashboard polling every {args.interval:g} s, {wall:.1f} s measured")
    print(f"kernel CPU share: {100 * share:.1f} % of one core "
          f"(thirds: {', '.join(f'{100 * x:.1f} %' for x in thirds)}; idle kernel "
          f"{100 * idle_share:.1f} %)")
    print(f"redraws {result['redraws_per_s']:.2f}/s ({1000 * result['cpu_s_per_redraw']:.0f} ms "
          f"of kernel CPU each, polling included), widget messages "
          f"{result['widget_msgs_per_s']:.1f}/s, {result['widget_bytes_per_s'] / 1e6:.2f} MB/s "
          "towards the browser")
    print(f"lag: newest event shown {result['lag_s']:.2f} s old, "
          f"{result['steps_behind']} steps behind the writers")
    ok = share < GOAL_SHARE and result["lag_s"] < 2.0
    print(f"goal: kernel CPU share < {100 * GOAL_SHARE:.0f} % and lag < 2 s: "
          f"{'PASS' if ok else 'MISS'}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
