"""`lowband launch --elastic` over three real test hosts (network namespaces on a bridge, each
host's egress shaped to 100 Mbit/s, each with its own hostname; lowband.launch.hosts).

The TorchX component's elastic job (launchers/lowband_components.py) has a Lighthouse role and a
role a replica group; each role's command runs in a host as a scheduler would run it: the
Lighthouse and group 0 on host 0, group g on host g, with the scheduler's rank-0 host variable
naming host 0. Streaming (fp4, tau 1), group 1 SIGKILLed after step 10: its torchrun restarts it,
it heals from a live peer over the shaped link at the others' next sync, the survivors never
stop, and all three end with bitwise equal outer parameters. Needs root, `ip`, `tc` and
`unshare`; skipped without them.
"""

import json
import os
import re
import sys
import time

import pytest

from conftest import hosts_for_a_test
from lowband.telemetry import read_events
from lowband.launch.hosts import TestHosts

pytestmark = pytest.mark.slow  # measured (--durations): README, Run the tests

pytest.importorskip("torchft")
pytest.importorskip("torchx")

QUORUM_TIMEOUT = 60
FLAGS = ["--algo", "streaming", "--model", "nano", "--seq-len", "32", "--batch-size", "4",
         "--eval-every", "0", "--eval-batches", "1", "--steps", "24", "--sync-every", "8",
         "--fragments", "2", "--kill", "1:10", "--quorum-timeout", str(QUORUM_TIMEOUT),
         "--link-bandwidth", "none", "--heartbeat-timeout", "12"]  # (test_elastic.HOLD)
RANK0 = "LOWBAND_RANK0_HOST"  # the scheduler's rank-0 host variable, as Slurm's names role 0


def make_hosts() -> TestHosts:
    """lbe-h0, -h1, -h2 (10.213.10.1-3) on a bridge in lbe-hsw, each with its own hostname."""
    return TestHosts("lbe", "10.213.10", "100mbit", "128kb", "100ms", hostnames=True, n=3)


WHY = make_hosts().unavailable()


@pytest.fixture
def hosts():
    yield from hosts_for_a_test(make_hosts())  # kills what runs in them even when a test fails


def role_commands(run_dir, host0: str) -> dict[str, tuple[list[str], dict]]:
    """Each role's command and environment, with the rank-0 host variable set to host0 and
    expanded in the environment as the scheduler's shell would."""
    from torchx.specs import macros

    from lowband.launch import components

    app = components().train(*FLAGS, replicas=3, shards=1, run_dir=str(run_dir), elastic=True,
                             max_restarts=1)
    out = {}
    for role in app.roles:
        assert role.num_replicas == 1, role
        r = macros.Values(img_root="", app_id="lbe-elastic", replica_id="0",
                          rank0_env=RANK0).apply(role)
        env = {k: re.sub(r"\$\{" + RANK0 + r"(:=[^}]*)?\}", host0, v) for k, v in r.env.items()}
        out[r.name] = ([r.entrypoint, *r.args], {**env, RANK0: host0})
    return out


@pytest.mark.root
@pytest.mark.skipif(WHY is not None, reason=f"three test hosts: {WHY}")
def test_a_killed_group_heals_from_a_live_peer_across_hosts(hosts, tmp_path):
    run = tmp_path / "run"
    roles = role_commands(run, hosts.names[0])
    assert sorted(roles) == ["group0", "group1", "group2", "lighthouse"]
    assert "TORCHFT_LIGHTHOUSE=http://${LOWBAND_LIGHTHOUSE_HOST:-${LOWBAND_RANK0_HOST:=localhost}}" \
        ":29510 " in roles["group0"][0][2]
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]])
    procs = {}
    for name, (cmd, role_env) in roles.items():
        host = int(name[-1]) if name.startswith("group") else 0
        env = {**os.environ, **role_env, "PATH": path, "GLOO_SOCKET_IFNAME": hosts.devs[host],
               "OMP_WAIT_POLICY": "PASSIVE",  # four processes share two cores
               "LOWBAND_BIND_HOST": hosts.addrs[host]}  # the heal server: the host's link
        procs[name] = hosts.popen(host, cmd, env, tmp_path / f"{name}.out", cwd=tmp_path)
    deadline = time.monotonic() + 120  # ~20 s when it works; a role that fails ends the wait
    while time.monotonic() < deadline and any(p.poll() is None for p in procs.values()):
        if any(p.poll() for p in procs.values()):
            break
        time.sleep(0.2)
    codes = {name: p.poll() for name, p in procs.items()}  # None: still running (teardown kills)
    logs = "\n".join(f"--- {n}\n" + (tmp_path / f"{n}.out").read_text(errors="replace")[-3000:]
                     for n in procs)
    assert set(codes.values()) == {0}, f"{codes}\n{logs}"

    # group 1 killed itself after step 10 (once: the marker), its torchrun restarted it
    assert (run / "logs" / "killed-replica1-step10-rank1").exists(), logs
    assert "failed (exitcode: -9)" in (tmp_path / "group1.out").read_text(), logs
    steps = {g: [e for e in read_events(run, ("step",)) if e["replica"] == g] for g in range(3)}
    # it healed from a live peer at the others' next sync, then trained on to the end
    healed = [e for e in read_events(run, ("membership",)) if e["healed"]]
    # every heal is a group's first quorum of a life: group 1's restart, and (on a loaded
    # machine) a group whose first life started after the others' first quorum
    assert all(e["replica"] in e["joined"] for e in healed), healed
    late = {e["replica"]: e["step"] for e in healed if e["step"] != 12 or e["replica"] != 1}
    again = [e for e in healed if e["replica"] == 1 and e["step"] == 12]
    assert len(again) == 1 and again[0]["heal_bytes"] > 0, healed
    # the state came over the shaped link into host 1
    assert hosts.counters()[hosts.devs[1]]["rx_bytes"] > again[0]["heal_bytes"]
    restarted = [e["step"] for e in steps[1]]  # killed in step 10; healed to 12
    assert restarted[-12:] == list(range(13, 25)), restarted
    assert restarted[:-12] == list(range(late.get(1, 0) + 1, 10)), restarted
    for g in (0, 2):  # the survivors ran every step once, without a gap, none waiting too long
        assert [e["step"] for e in steps[g]] == list(range(late.get(g, 0) + 1, 25)), (g, steps[g])
        assert max(e["step_s"] for e in steps[g]) < QUORUM_TIMEOUT, steps[g]
    records = {g: json.loads((run / "groups" / f"replica{g}.json").read_text()) for g in range(3)}
    assert len({r["outer_sha256"] for r in records.values()}) == 1  # bitwise equal
    summary = json.loads((run / "summary.json").read_text())  # the Lighthouse role wrote it
    assert summary["elastic"]["groups_finished"] == [0, 1, 2], summary["elastic"]
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())
