"""The elastic control plane under a saturated link (issue 32): three replica groups on three
test hosts whose link is shaped to 10 Mbit/s, with outer exchanges that last several of the
Lighthouse's heartbeat timeouts. Does any group drop out of a quorum because its heartbeats
starved behind the exchange?

The hosts are network namespaces lbz-h0..h2 (10.213.20.1-3) on a bridge, each host's egress
shaped by tbf (lowband.launch.hosts), each with its own hostname. The TorchX component's elastic
roles run as a scheduler would run them (tests/test_elastic_hosts.py does the same): the
Lighthouse and group 0 on host 0, group g on host g. Groups 1 and 2 reach the Lighthouse over
their own shaped link, the one their exchange saturates: their torchft Manager (group rank 0)
heartbeats every 100 ms over it. A poller on host 0 reads the Lighthouse's status page
(`/status`: the age of each group's last heartbeat) every 50 ms over host 0's loopback, so the
gaps it sees are the Lighthouse's own view.

Figures (JSON on stdout): each outer exchange's seconds (the `comm` events of the outer link:
diloco waits for its exchange, so start to end is the transfer), the heartbeat ages the
Lighthouse showed while exchanges ran, the most bytes queued in each shaper, each quorum's
members and who left or healed (membership events), and the Lighthouse's own quorum decisions
(its log: the groups asking and heartbeating at each).

    sudo python benchmarks/saturated_link.py [--rate 10mbit] [--heartbeat-timeout 1]
        [--model micro] [--steps 30] [--sync-every 10] [--tbf-latency 100ms]

The hosts' own shaping keeps the queue short (TCP holds little in the sender's own qdisc). A
real site link's queue forms in a router: `--router-queue 4s` shapes the bridge's port into each
host to --rate with that much buffer (htb and a byte FIFO), `--nic-rate 1gbit` leaves the hosts'
own egress fast, `--cc cubic` sets loss-based TCP on the hosts' routes (this machine's default
is BBR, which keeps queues short), and `--lighthouse-band` gives TCP to and from the
Lighthouse's port its own class in that router (docs/elastic.md's recipe).

Needs root, `ip`, `tc`, `unshare`, torchft and torchx; the hosts are always removed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lowband.launch.hosts import TestHosts
from lowband.telemetry import RunDir, read_events

RANK0 = "LOWBAND_RANK0_HOST"  # the scheduler's rank-0 host variable, as Slurm's names role 0
PORT = 29510  # the component's Lighthouse port on host 0
SUBNET = "10.213.20"


def make_hosts(rate: str = "10mbit", latency: str = "100ms") -> TestHosts:
    """lbz-h0, -h1, -h2 (10.213.20.1-3) on a bridge in lbz-hsw, each with its own hostname."""
    return TestHosts("lbz", SUBNET, rate, "128kb", latency, hostnames=True, n=3)


def flags(model: str = "micro", steps: int = 30, sync_every: int = 10,
          quorum_timeout: float = 60) -> list[str]:
    """diloco with an fp32 exchange (micro: 3.2 MB a group, about 3.4 s at 10 Mbit/s)."""
    return ["--algo", "diloco", "--model", model, "--seq-len", "32", "--batch-size", "4",
            "--eval-every", "0", "--eval-batches", "1", "--steps", str(steps), "--sync-every",
            str(sync_every), "--codec", "fp32", "--quorum-timeout", str(quorum_timeout),
            "--link-bandwidth", "none"]


def role_commands(argv: list[str], run_dir: Path, host0: str, heartbeat_timeout: float,
                  replicas: int = 3) -> dict[str, tuple[list[str], dict]]:
    """The component's elastic roles (lighthouse, group0..) as a scheduler would run them:
    command and environment, the rank-0 host variable naming host0 (expanded in the
    environment, as the scheduler's shell would); the Lighthouse with heartbeat_timeout."""
    from torchx.specs import macros

    from lowband.launch import components

    app = components().train(*argv, replicas=replicas, shards=1, run_dir=str(run_dir),
                             elastic=True, max_restarts=0, lighthouse_port=PORT)
    out = {}
    for role in app.roles:
        r = macros.Values(img_root="", app_id="lbz-elastic", replica_id="0",
                          rank0_env=RANK0).apply(role)
        env = {k: re.sub(r"\$\{" + RANK0 + r"(:=[^}]*)?\}", host0, v) for k, v in r.env.items()}
        args = list(r.args)
        if r.name == "lighthouse":
            args += ["--heartbeat-timeout", str(heartbeat_timeout)]
        out[r.name] = ([r.entrypoint, *args], {**env, RANK0: host0})
    return out


# on host 0: every 50 ms, the age of each group's last heartbeat on the Lighthouse's status page
# (at host 0's link address, which it binds),
# and the bytes queued in each host's tbf (argv[4:]: namespace=device ...)
_POLLER = r"""
import json, re, subprocess, sys, time, urllib.request
url = f"http://{sys.argv[1]}/status"  # host:port the Lighthouse listens on
out, until = open(sys.argv[2], "w"), float(sys.argv[3])
devs = [a.split("=") for a in sys.argv[4:]]
scale = {"s": 1.0, "ms": 1e-3, "µs": 1e-6, "us": 1e-6, "ns": 1e-9}
while time.time() < until:
    queued = {}
    for ns, dev in devs:
        text = subprocess.run(["tc", "-n", ns, "-s", "qdisc", "show", "dev", dev],
                              capture_output=True, text=True).stdout
        queued[dev] = int((re.findall(r"backlog (\d+)b", text) or ["0"])[0])
    try:
        page = urllib.request.urlopen(url, timeout=1).read().decode()
    except OSError:
        time.sleep(0.05)
        continue
    ages = {m[0]: float(m[1]) * scale[m[2]]
            for m in re.findall(r"(replica\d+)\S*: seen ([\d.]+)(s|ms|µs|us|ns) ago", page)}
    out.write(json.dumps({"t": time.time(), "ages": ages, "queued": queued}) + "\n"); out.flush()
    time.sleep(0.05)
"""


def run(hosts: TestHosts, out: Path, argv: list[str], heartbeat_timeout: float,
        deadline_s: float = 120, queues: tuple = ()) -> dict:
    """Run the roles on the hosts with the poller (which also reads the backlog of each
    (namespace, device) in `queues`: a `tc` process each every 50 ms); the exit codes (None:
    still running when the deadline came), the logs' tails and the run directory."""
    run_dir = out / "run"
    roles = role_commands(argv, run_dir, hosts.names[0], heartbeat_timeout)
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]])
    procs = {}
    for name, (cmd, role_env) in roles.items():
        host = int(name[-1]) if name.startswith("group") else 0
        env = {**os.environ, **role_env, "PATH": path, "GLOO_SOCKET_IFNAME": hosts.devs[host],
               "OMP_WAIT_POLICY": "PASSIVE",  # four processes share this machine's cores
               "LOWBAND_BIND_HOST": hosts.addrs[host]}  # the heal server: the host's link
        if name == "lighthouse":  # its quorum decisions, with the groups heartbeating then
            env["RUST_LOG"] = "torchft::lighthouse=info"
        procs[name] = hosts.popen(host, cmd, env, out / f"{name}.out", cwd=out)
    t0 = time.time()
    poller = hosts.popen(0, [sys.executable, "-c", _POLLER, f"{hosts.addrs[0]}:{PORT}",
                             str(out / "heartbeats.jsonl"), str(t0 + deadline_s),
                             *(f"{ns}={dev}" for ns, dev in queues)],
                         dict(os.environ), out / "poller.out")
    while time.time() - t0 < deadline_s and any(p.poll() is None for p in procs.values()):
        if any(p.poll() for p in procs.values()):  # a role failed: no use waiting
            break
        time.sleep(0.2)
    codes = {name: p.poll() for name, p in procs.items()}
    poller.kill()
    poller.wait()
    logs = "\n".join(f"--- {n}\n" + (out / f"{n}.out").read_text(errors="replace")[-3000:]
                     for n in procs)
    return {"codes": codes, "logs": logs, "run": run_dir, "seconds": time.time() - t0}


def decisions(lighthouse_log: Path) -> list[tuple[str, int, int]]:
    """The Lighthouse's quorum statuses, logged when they change: (its words, the groups that
    asked for the quorum then, the groups heartbeating then). A quorum is issued by a status
    that says "quorum found"."""
    text = lighthouse_log.read_text(errors="replace") if lighthouse_log.exists() else ""
    found = re.findall(r"Quorum status: ([^\[]*)\[\d+/(\d+) participants healthy\]\[(\d+) "
                       r"heartbeating", text)
    return [(words.strip(), int(asked), int(beating)) for words, asked, beating in found]


def figures(run_dir: Path, heartbeats: Path, heartbeat_timeout: float) -> dict:
    """What the run's records and the poller say: the outer exchanges' seconds (each group's),
    the quorums, who left, and for each group the ages of its last heartbeat that the
    Lighthouse showed: while an exchange was under way (median, 90th percentile, largest), in
    the half second before each exchange began (when that sync's quorum was decided), and the
    largest over the whole run (start-up and the end, when a finished group stops, included)."""
    events = read_events(RunDir(run_dir), ("comm", "membership"))
    exchanges = [e for e in events if e["kind"] == "comm" and e["group"] == "outer"
                 and not e["tag"].endswith("-norm")]  # (the guard's 32 bytes beside each)
    spans = sorted((e["start"], e["end"]) for e in exchanges)
    members = [e for e in events if e["kind"] == "membership"]
    polls = [json.loads(line) for line in heartbeats.read_text().splitlines() if line.strip()] \
        if heartbeats.exists() else []
    during, at_quorum, every, queued = {}, {}, {}, {}
    for p in polls:
        for dev, n in p.get("queued", {}).items():
            queued[dev] = max(queued.get(dev, 0), n)
        busy = any(a <= p["t"] <= b for a, b in spans)
        deciding = any(a - 0.5 <= p["t"] < a for a, _ in spans)
        for replica, age in p["ages"].items():
            every.setdefault(replica, []).append(age)
            if busy:
                during.setdefault(replica, []).append(age)
            if deciding:
                at_quorum.setdefault(replica, []).append(age)

    lighthouse = decisions(heartbeats.with_name("lighthouse.out"))
    issued = [i for i, d in enumerate(lighthouse) if "quorum found" in d[0].lower()] or [0]

    def pick(ages: dict, q: float) -> dict:
        return {k: round(sorted(v)[min(int(q * len(v)), len(v) - 1)], 2)
                for k, v in sorted(ages.items())}

    return {
        "heartbeat_timeout_s": heartbeat_timeout,
        "exchange_s": sorted(round(e["end"] - e["start"], 2) for e in exchanges),
        "exchange_wire_bytes": sorted({e["wire_bytes"] for e in exchanges}),
        "quorums": sorted({(e["quorum_id"], tuple(e["members"])) for e in members}),
        "left": sorted({g for e in members for g in e["left"]}),
        "healed": sorted({e["replica"] for e in members if e["healed"]}),
        "heartbeat_age_during_exchange_s": {"median": pick(during, 0.5), "p90": pick(during, 0.9),
                                            "max": pick(during, 1.0)},
        "heartbeat_age_before_quorum_s": pick(at_quorum, 1.0),
        "heartbeat_age_s": pick(every, 1.0),
        "most_queued_bytes": queued,
        "polls": len(polls),
        "quorums_issued": [d for d in lighthouse if "quorum found" in d[0].lower()],
        "fewest_heartbeating": min((d[2] for d in lighthouse[issued[0]:issued[-1]]), default=None),
    }


def router(ns: str, dev: str, rate: str, queue: str, lighthouse_band: bool) -> None:
    """Shape `dev` (in namespace ns) as a router's downlink: htb at `rate`, its traffic waiting
    in a byte FIFO that holds `queue` of it. With lighthouse_band, TCP to and from the
    Lighthouse's port has a class of its own (1% guaranteed, the whole rate to borrow, served
    first) with its own short queue."""
    from lowband.units import parse_bandwidth, parse_duration

    bits = parse_bandwidth(rate)
    depth = int(bits / 8 * parse_duration(queue))

    def tc(*args):
        subprocess.run(["tc", "-n", ns, *args], check=True)

    tc("qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "20")
    tc("class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", rate)
    tc("class", "add", "dev", dev, "parent", "1:1", "classid", "1:20", "htb", "rate",
       f"{int(bits * 0.99)}bit", "ceil", rate, "prio", "1")
    tc("qdisc", "add", "dev", dev, "parent", "1:20", "bfifo", "limit", str(depth))
    if lighthouse_band:
        tc("class", "add", "dev", dev, "parent", "1:1", "classid", "1:10", "htb", "rate",
           f"{int(bits * 0.01)}bit", "ceil", rate, "prio", "0")
        for end in ("dport", "sport"):
            tc("filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
               "match", "ip", end, str(PORT), "0xffff", "flowid", "1:10")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", default="10mbit")
    p.add_argument("--tbf-latency", default="100ms", help="tbf's queue, as the longest delay")
    p.add_argument("--heartbeat-timeout", type=float, default=1.0,
                   help="the Lighthouse's, seconds (torchft's default is 5)")
    p.add_argument("--model", default="micro")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--sync-every", type=int, default=10)
    p.add_argument("--cc", help="the hosts' TCP congestion control on their link (this "
                   "machine's default: bbr)")
    p.add_argument("--router-queue", help="also shape the bridge's port into each host (a "
                   "router's downlink, beyond the senders' own TCP stacks) to --rate, with a "
                   "buffer of this many seconds of it")
    p.add_argument("--lighthouse-band", action="store_true", help="with --router-queue: TCP "
                   "to and from the Lighthouse's port gets a class of its own there, served first")
    p.add_argument("--nic-rate", help="with --router-queue: the hosts' own egress (default "
                   "--rate)")
    p.add_argument("--keep", help="a directory to keep the run in")
    a = p.parse_args()
    hosts = make_hosts(a.nic_rate or a.rate, a.tbf_latency)
    why = hosts.unavailable()
    if why:
        print(f"saturated_link: the test hosts {why}.", file=sys.stderr)
        return 2
    out = Path(a.keep or tempfile.mkdtemp(prefix="lbz-"))
    out.mkdir(parents=True, exist_ok=True)
    queues = [*zip(hosts.names, hosts.devs)]
    queues += [(hosts.switch, port) for port in hosts.ports] if a.router_queue else []
    with hosts:
        for ns, dev, port in zip(hosts.names, hosts.devs, hosts.ports):
            if a.cc:  # a route's own congestion control (the sysctl is not writable here)
                subprocess.run(["ip", "-n", ns, "route", "replace", f"{SUBNET}.0/24",
                                "dev", dev, "congctl", a.cc], check=True)
            if a.router_queue:
                router(hosts.switch, port, a.rate, a.router_queue, a.lighthouse_band)
        result = run(hosts, out, flags(a.model, a.steps, a.sync_every), a.heartbeat_timeout,
                     deadline_s=600, queues=queues)
    found = figures(result["run"], out / "heartbeats.jsonl", a.heartbeat_timeout)
    found.update(rate=a.rate, tbf_latency=a.tbf_latency, cc=a.cc, router_queue=a.router_queue,
                 nic_rate=a.nic_rate, lighthouse_band=a.lighthouse_band, model=a.model,
                 codes=result["codes"], seconds=round(result["seconds"], 1), out=str(out))
    print(json.dumps(found, indent=1, default=list))
    if set(result["codes"].values()) != {0}:
        print(result["logs"], file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
