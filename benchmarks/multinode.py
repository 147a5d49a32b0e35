"""Two real test hosts on one machine, running the TorchX component's own node command.

The hosts are network namespaces lbx-h0 and lbx-h1 joined by a veth pair (lbx-v0 10.213.9.1 <->
lbx-v1 10.213.9.2), each end's egress shaped by `tc qdisc ... tbf rate 100mbit`. Each host also
gets its own hostname (a UTS namespace) and an /etc/hosts naming both (`ip netns exec` mounts
/etc/netns/<host>/hosts), as cluster nodes resolve each other. Each host runs the command the
`train` component (launchers/lowband_components.py) gives a node, with TorchX's rank-0 host
variable naming lbx-h0, as Slurm's and Kubernetes' do: `python3 -m lowband.launch torchrun
--rdzv_backend c10d --rdzv_endpoint lbx-h0:PORT --nnodes 2 --nproc_per_node 1 ... -m lowband.cli
train --algo streaming ...`, with GLOO_SOCKET_IFNAME set to the host's veth. Both write to one
run directory (the filesystem is shared, as a cluster's would be).

It then compares the bytes the telemetry counted on the outer link (summary.json's
outer_wire_bytes: the sum over ranks of what each sent) with the bytes the veth pair carried
(tx_bytes of both ends, read inside the namespaces):
  raw        everything on the wire: Ethernet/IP/TCP headers, ACKs, the rendezvous and TCPStore
             traffic, gloo's connection set-up, the run-directory broadcast, end-of-run gathers;
  payload    raw minus 66 bytes of Ethernet+IPv4+TCP(timestamps) headers per packet: what TCP
             carried;
  training   payload minus a baseline: the same job with --steps 1, which makes no outer
             exchange (its telemetry says 0 outer bytes), measured the same way.
The test (tests/test_multinode.py) checks `payload` within 10% on a run sized so training bytes
dominate (fp32 exchange); this script prints all three and the baseline.

    sudo python benchmarks/multinode.py [--model micro] [--steps 20] [--codec fp32] [--keep]

Needs root, `ip`, `tc` and `unshare`; exits with one message without them. The hosts are always
removed, and leftovers of a crashed run are removed first.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lowband.launch.hosts import TestHosts

HEADER_BYTES = 66  # Ethernet 14 + IPv4 20 + TCP 20 + timestamp option 12, per (GSO) packet


def make_hosts(rate: str = "100mbit") -> TestHosts:
    """Hosts lbx-h0 and lbx-h1 (veth lbx-v0 10.213.9.1 <-> lbx-v1 10.213.9.2), each with its own
    hostname and an /etc/hosts naming both."""
    return TestHosts("lbx", "10.213.9", rate, "128kb", "100ms", hostnames=True)


def node_commands(flags: list[str], run_dir: str, port: int, rdzv_timeout: int = 60,
                  nnodes: int = 2, app_id: str = "lbx-multinode") -> list[tuple[list[str], dict]]:
    """The component's command and environment for each node, as a scheduler would run them,
    with the rank-0 host variable set to the first host."""
    from torchx.specs import macros

    from lowband.launch import components

    app = components().train(*flags, replicas=nnodes, shards=1, run_dir=run_dir,
                             rdzv_port=port, rdzv_timeout=rdzv_timeout)
    role = app.roles[0]
    assert role.num_replicas == nnodes
    out = []
    for k in range(nnodes):
        r = macros.Values(img_root="", app_id=app_id, replica_id=str(k),
                          rank0_env="LOWBAND_RANK0_HOST").apply(role)
        out.append(([r.entrypoint, *r.args], dict(r.env)))
    return out


def run_job(hosts: TestHosts, flags: list[str], run_dir: Path, port: int, timeout: float = 300,
            rdzv_timeout: int = 60, only: list[int] | None = None) -> dict:
    """Run the component's node command on every host (or only some). Returns exit codes, logs,
    seconds and the veth counters' increase."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cmds = node_commands(flags, str(run_dir), port, rdzv_timeout, nnodes=len(hosts.names))
    before = hosts.counters()
    t0 = time.monotonic()
    procs, logs = [], []
    for k, (cmd, role_env) in enumerate(cmds):
        if only is not None and k not in only:
            continue
        env = {**os.environ, **role_env,
               "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]),
               "LOWBAND_RANK0_HOST": hosts.names[0],
               "GLOO_SOCKET_IFNAME": hosts.devs[k],
               # two hosts share this machine's cores: no OpenMP spinning on them
               "OMP_WAIT_POLICY": "PASSIVE"}
        log = run_dir / f"node{k}.out"
        logs.append(log)
        procs.append(hosts.popen(k, cmd, env, log))
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(timeout - (time.monotonic() - t0), 1)))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            codes.append(p.wait())
    seconds = time.monotonic() - t0
    after = hosts.counters()
    delta = {dev: {k: after[dev][k] - before[dev][k] for k in after[dev]} for dev in after}
    return {"codes": codes, "seconds": seconds, "logs": [str(x) for x in logs],
            "output": [Path(x).read_text(errors="replace") for x in logs], "veth": delta}


def byte_report(run_dir: Path, veth: dict, baseline: dict | None = None) -> dict:
    """Telemetry's outer bytes against the veth counters (both directions)."""
    from lowband.telemetry import read_events

    summary = json.loads((run_dir / "summary.json").read_text())
    events = read_events(run_dir)
    by_events = sum(e["wire_bytes"] for e in events
                    if e.get("kind") == "comm" and e.get("group") == "outer")
    raw = sum(d["tx_bytes"] for d in veth.values())
    packets = sum(d["tx_packets"] for d in veth.values())
    payload = raw - HEADER_BYTES * packets
    out = {"telemetry_outer_wire_bytes": summary["outer_wire_bytes"],
           "telemetry_comm_events_outer": by_events, "veth_tx_bytes": raw,
           "veth_tx_packets": packets, "veth_tcp_payload": payload,
           "ratio_raw": raw / summary["outer_wire_bytes"],
           "ratio_payload": payload / summary["outer_wire_bytes"]}
    if baseline is not None:
        base = sum(d["tx_bytes"] - HEADER_BYTES * d["tx_packets"] for d in baseline.values())
        out["baseline_tcp_payload"] = base
        out["ratio_training"] = (payload - base) / summary["outer_wire_bytes"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="micro")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--sync-every", type=int, default=4)
    p.add_argument("--fragments", type=int, default=2)
    p.add_argument("--codec", default="fp32")
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--port", type=int, default=29611)
    p.add_argument("--keep", action="store_true", help="keep the run directories")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    why = make_hosts().unavailable()
    if why:
        print(f"multinode benchmark skipped: it {why}.")
        return 0
    flags = ["--algo", "streaming", "--model", args.model, "--sync-every", str(args.sync_every),
             "--fragments", str(args.fragments), "--codec", args.codec, "--eval-every", "0",
             "--link-bandwidth", "none"]  # the veth pair's shaped link is the link
    tmp = Path(tempfile.mkdtemp(prefix="lbx-multinode-"))
    results = {}
    try:
        with make_hosts(args.rate) as hosts:
            base = run_job(hosts, flags + ["--steps", "1"], tmp / "baseline", args.port)
            train = run_job(hosts, flags + ["--steps", str(args.steps)], tmp / "train",
                            args.port + 1)
        for name, r in (("baseline", base), ("train", train)):
            if any(r["codes"]):
                print(f"{name} run failed: exit codes {r['codes']}\n" + "\n".join(r["output"]))
                return 1
        base_summary = json.loads((tmp / "baseline" / "summary.json").read_text())
        results = byte_report(tmp / "train", train["veth"], base["veth"])
        results.update(baseline_telemetry_outer=base_summary["outer_wire_bytes"],
                       train_seconds=round(train["seconds"], 1),
                       baseline_seconds=round(base["seconds"], 1), flags=flags,
                       steps=args.steps, rate=args.rate,
                       tokens_per_s=json.loads((tmp / "train" / "summary.json").read_text())
                       ["tokens_per_s"])
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    t = results
    print(f"streaming over a real {args.rate} veth between two hosts, {args.model}, "
          f"{args.steps} steps, codec {args.codec}: {t['train_seconds']} s "
          f"(baseline job {t['baseline_seconds']} s)")
    print(f"  telemetry, outer link (summary)      {t['telemetry_outer_wire_bytes']:>12,} B")
    print(f"  telemetry, outer comm events         {t['telemetry_comm_events_outer']:>12,} B")
    print(f"  veth tx, both ends (raw)             {t['veth_tx_bytes']:>12,} B  "
          f"ratio {t['ratio_raw']:.4f}  ({t['veth_tx_packets']} packets)")
    print(f"  veth minus {HEADER_BYTES} B headers/packet      {t['veth_tcp_payload']:>12,} B  "
          f"ratio {t['ratio_payload']:.4f}")
    print(f"  baseline job (--steps 1, telemetry {t['baseline_telemetry_outer']} B) "
          f"{t['baseline_tcp_payload']:>8,} B")
    print(f"  veth payload minus baseline          "
          f"{t['veth_tcp_payload'] - t['baseline_tcp_payload']:>12,} B  "
          f"ratio {t['ratio_training']:.4f}")
    ok = abs(t["ratio_payload"] - 1) <= 0.10
    print(f"{'PASS' if ok else 'MISS'}: veth payload within 10% of telemetry")
    if args.keep:
        print(f"run directories kept under {tmp}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
