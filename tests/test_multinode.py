"""Multi-node for real: two test hosts (network namespaces joined by a 100 Mbit/s veth pair) each
run the TorchX component's node command; streaming trains across them. The bytes the telemetry
counts on the outer link must match what the veth pair carried. And a node that cannot reach the
rendezvous, or finds nobody else there, fails with one sentence in bounded time.

The two-host tests need root, `ip`, `tc` and `unshare` (lowband.launch.hosts makes the hosts)
and are skipped without them; the lonely-node test runs anywhere.
"""

import importlib.util
import json
import os
import time
from pathlib import Path

import pytest

pytest.importorskip("torchx")

from conftest import hosts_for_a_test  # noqa: E402
from lowband.launch.local import free_port  # noqa: E402

pytestmark = pytest.mark.slow  # measured (--durations): README, Run the tests

ROOT = Path(__file__).resolve().parents[1]
# tiny, but with an fp32 exchange: the synced bytes dwarf the rendezvous and TCP/IP overhead
FLAGS = ["--algo", "streaming", "--model", "nano", "--steps", "20", "--sync-every", "4",
         "--fragments", "2", "--codec", "fp32", "--seq-len", "32", "--batch-size", "4",
         "--eval-every", "0", "--eval-batches", "1", "--link-bandwidth", "none"]  # the veth's link


def _bench():
    spec = importlib.util.spec_from_file_location("multinode", ROOT / "benchmarks" / "multinode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bench = _bench()
WHY = bench.make_hosts().unavailable()
needs_hosts = pytest.mark.skipif(WHY is not None, reason=f"two test hosts: {WHY}")


@pytest.fixture
def hosts():
    yield from hosts_for_a_test(bench.make_hosts())  # leftovers() include /etc/netns/<host>


def _events(run_dir: Path, rank: int) -> list[dict]:
    path = run_dir / "events" / f"rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.root
@needs_hosts
def test_streaming_across_two_hosts_matches_the_veth_counters(hosts, tmp_path):
    run_dir = tmp_path / "run"
    r = bench.run_job(hosts, FLAGS, run_dir, port=29611, timeout=240)
    assert r["codes"] == [0, 0], "\n".join(r["output"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["replicas"], summary["steps"], summary["algorithm"]) == (2, 20, "streaming")
    for rank in (0, 1):  # one rank on each host, both wrote their events to the shared run dir
        kinds = [e["kind"] for e in _events(run_dir, rank)]
        assert kinds.count("step") == 20 and kinds.count("sync") > 0, kinds
        assert kinds[0] == "run" and kinds[-1] == "run"
    report = bench.byte_report(run_dir, r["veth"])
    print(json.dumps(report, indent=2))
    assert report["telemetry_comm_events_outer"] == report["telemetry_outer_wire_bytes"] > 10**6
    # both directions carried training traffic, about equally (each rank sends its share)
    tx = [d["tx_bytes"] for d in r["veth"].values()]
    assert min(tx) > 0.4 * sum(tx), r["veth"]
    # TCP payload on the veth pair (bytes minus 66 B of headers a packet) against telemetry:
    # what is left over is the rendezvous, store and gloo set-up traffic, ~15 KB here
    assert abs(report["ratio_payload"] - 1) <= 0.10, report
    assert abs(report["ratio_raw"] - 1) <= 0.15, report


@pytest.mark.root
@needs_hosts
def test_unreachable_rendezvous_fails_clearly_in_bounded_time(hosts, tmp_path):
    # only the second host starts: the first, which hosts the rendezvous, never comes
    t0 = time.monotonic()
    r = bench.run_job(hosts, FLAGS, tmp_path / "run", port=29612, rdzv_timeout=4, only=[1],
                      timeout=60)
    assert time.monotonic() - t0 < 30
    assert r["codes"] == [3], r["output"]
    out = r["output"][0].strip()
    assert out.count("\n") == 0, out  # one sentence, no traceback
    assert out.startswith("lowband: error: this node (lbx-h1) could not reach the rendezvous at "
                          "lbx-h0:29612 within 4 s"), out
    assert not (tmp_path / "run" / "events").exists()


def test_lonely_node_never_trains_in_a_world_of_its_own(tmp_path):
    """The first node of a two-node job, started alone, hosts the rendezvous and waits for the
    second one; after the timeout it fails with one sentence. It never starts training alone."""
    import subprocess
    import sys

    (cmd, role_env), _ = bench.node_commands(FLAGS, str(tmp_path / "run"), free_port(),
                                             rdzv_timeout=4)
    env = {**os.environ, **role_env, "LOWBAND_RANK0_HOST": "localhost",
           "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]])}
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)
    assert time.monotonic() - t0 < 30
    assert proc.returncode == 3, proc.stdout + proc.stderr
    err = proc.stderr.strip()
    assert err.count("\n") == 0, err
    assert err.startswith("lowband: error: not all 2 nodes joined the rendezvous at "
                          "localhost:"), err
    assert "within 4 s" in err
    assert not (tmp_path / "run" / "events").exists()
