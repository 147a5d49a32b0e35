"""`lowband doctor` on one machine, without root: this machine's checks and the transport over
loopback (two doctors); the verdict across nodes from the records nodes send (every sentence
a check can say, without the hosts); the link record; bad input; `lowband launch --doctor`.
The checks between real hosts are tests/test_doctor_hosts.py."""

import json

import pytest

from conftest import lowband
from lowband.doctor import nodes as across
from lowband.doctor.cli import _rdzv
from lowband.doctor.measure import record
from lowband.options import ConfigError


def node(name, address, **kw):
    return {"name": name, "address": address, "interface": f"eth-{name}", "ports": "32768-60999",
            "probe": 40000, "lighthouse": None, "addresses": {address: f"eth-{name}"},
            "secret": {"state": "ok", "mac": "m"}, **kw}


def probes(nodes, *, names=None, offset=0.0, down=()):
    """What each node found: every other's probe port reached (but those in `down`, (from, to)),
    every name resolving as `names` says (default: to the address it binds)."""
    names = names or {}
    out = []
    for i in range(len(nodes)):
        to = [{"node": j, "port": n["probe"], "what": "probe",
               **({"ok": False, "why": "no answer within 3 s"} if (i, j) in down else
                  {"ok": True, "offset": offset * (j - i), "rtt": 0.001})}
              for j, n in enumerate(nodes) if j != i]
        out.append({"to": to, "names": {n["name"]: names.get((i, n["name"]), n["address"])
                                        for n in nodes}})
    return out


PAIR = [node("a", "10.0.0.1"), node("b", "10.0.0.2")]


def test_a_healthy_pair_passes_every_check():
    v = across.verdict(PAIR, probes(PAIR), "10.0.0.1:29500", loopback=False)
    assert v["failures"] == [] and v["notes"] == []
    assert [s.split(":")[0] for s in v["passed"]] == ["ports", "names", "secret", "clocks"]


def test_each_failure_is_one_sentence_naming_the_node_and_the_fix():
    nodes = [node("a", "10.0.0.1"), node("b", "10.0.0.2", secret={"state": "missing",
                                                                   "path": "/r/secret"})]
    found = probes(nodes, down={(1, 0)}, names={(0, "b"): "192.168.1.2"})
    v = across.verdict(nodes, found, "10.0.0.1:29500", loopback=False)
    assert v["failures"] == [
        "b (10.0.0.2) cannot open a connection to a (10.0.0.1) port 40000, a port its system "
        "picks for listeners, where gloo, the heal transport and torchft's manager listen (no "
        "answer within 3 s): open TCP 32768-60999 on a to the other nodes (a firewall?).",
        "b (10.0.0.2) advertises the name 'b', which resolves on a to 192.168.1.2 (another "
        "address), not to the address it binds (10.0.0.2 on eth-b): make 'b' name 10.0.0.2 on "
        "every node (/etc/hosts or DNS), or bind the interface that holds 192.168.1.2 (--bind) "
        "if that is the link between the nodes.",
        "b (10.0.0.2) has no secret at /r/secret: put the run directory on a filesystem every "
        "node shares, or copy RUN_DIR/secret there (mode 0600)."]
    assert all(s.count(": ") >= 1 and s.endswith(".") for s in v["failures"])


def test_names_that_do_not_resolve_secrets_that_differ_clocks_and_the_lighthouse():
    nodes = [node("a", "10.0.0.1", lighthouse=29510), node("b", "10.0.0.2")]
    nodes[1]["secret"] = {"state": "ok", "mac": "other"}
    found = probes(nodes, names={(1, "a"): None, (0, "b"): None}, offset=2.5)
    found[1]["to"].append({"node": 0, "port": 29510, "what": "lighthouse", "ok": False,
                           "why": "connection refused"})
    v = across.verdict(nodes, found, "a:29500", loopback=False)
    # the first node is reached by name: not resolving fails; another node's only a note
    assert ("a (10.0.0.1)'s name 'a' does not resolve on b, so the job reaches its first node "
            "by name: make 'a' name 10.0.0.1 on every node (/etc/hosts or DNS).") in v["failures"]
    assert any(s.startswith("b (10.0.0.2)'s name 'b' does not resolve on a") for s in v["notes"])
    assert ("the secret of b (10.0.0.2) differs from a (10.0.0.1)'s: every node must read the "
            "same RUN_DIR/secret (one run directory, shared).") in v["failures"]
    assert any("port 29510, the Lighthouse's (--elastic) (connection refused): open TCP 29510 "
               "on a" in s for s in v["failures"])
    assert any(s.startswith("the clocks of") and "differ by 2.50 s" in s for s in v["notes"])


def test_without_a_secret_it_is_a_note_and_on_loopback_names_are_not_checked():
    nodes = [node("a", "127.0.0.1", secret={"state": "absent"}),
             node("a", "127.0.0.1", secret={"state": "absent"})]
    v = across.verdict(nodes, probes(nodes, names={(0, "a"): None}), "127.0.0.1:1", True)
    assert v["failures"] == []
    assert v["notes"][0].startswith("secret: none given (--secret, LOWBAND_SECRET_FILE)")
    assert "names: not used (every node on this machine, on loopback)" in v["passed"]


def test_a_secret_state_never_carries_the_secret(tmp_path):
    from lowband.comm.membership import secret

    path = secret.make(tmp_path / "secret")
    state = across.secret_state(str(path), "nonce")
    assert state["state"] == "ok" and path.read_bytes().hex() not in json.dumps(state)
    assert across.secret_state(str(path), "other")["mac"] != state["mac"]
    assert across.secret_state(str(tmp_path / "none"), "n")["state"] == "missing"
    (tmp_path / "short").write_bytes(b"x")
    bad = across.secret_state(str(tmp_path / "short"), "n")
    assert bad["state"] == "bad" and bad["why"]


def test_the_link_record_is_the_slowest_way_and_the_largest_latency(tmp_path):
    nodes = [node("a", "10.0.0.1"), node("b", "10.0.0.2"), node("c", "10.0.0.3")]
    pairs = {1: {"latency_s": 0.001, "out_bps": 9e7, "back_bps": 8e7, "streams_bps": 9e7,
                 "bytes": 1 << 20},
             2: {"latency_s": 0.004, "out_bps": 5e7, "back_bps": 6e7, "streams_bps": 4e7,
                 "bytes": 1 << 20}}
    r = record(nodes, pairs)
    assert r["kind"] == "lowband-link" and r["bandwidth_bps"] == 5e7 and r["latency_s"] == 0.004
    assert [(p["from"], p["to"]) for p in r["pairs"]] == [("a", "b"), ("b", "a"), ("a", "c"),
                                                          ("c", "a")]
    assert r["streams"]["ratio"] == pytest.approx(0.8)
    from lowband.comm.link import read_measured, write_measured

    assert read_measured(write_measured(tmp_path / "link.json", r)) == r


def test_rdzv_and_nodes_are_checked_in_one_sentence(lowband_here, tmp_path):
    assert _rdzv("h0:29501", 2) == ("h0", 29501)
    assert _rdzv("10.0.0.1", 2) == ("10.0.0.1", 29500)
    assert _rdzv("[fd00::1]:29502", 2) == ("fd00::1", 29502)
    with pytest.raises(ConfigError, match="is not HOST:PORT"):
        _rdzv("h0:port", 2)
    code, err = lowband_here("doctor", "--nodes", "2", cwd=tmp_path)
    assert code == 2 and err.strip() == ("lowband: error: --nodes 2 needs --rdzv HOST:PORT: the "
                                         "first node's address on the link between the nodes, "
                                         "and the rendezvous port.")
    code, err = lowband_here("doctor", "--nodes", "1", "--rdzv", "h:1", cwd=tmp_path)
    assert code == 2 and "a job across machines has 2 or more nodes" in err
    code, err = lowband_here("doctor", "--bind", "0.0.0.0", cwd=tmp_path)
    assert code == 2 and "every interface, which lowband never binds" in err


@pytest.mark.slow
def test_alone_it_checks_this_machine_and_measures_loopback(tmp_path):
    r = lowband("doctor", cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    for said in ("lowband doctor: this machine", "torch.distributed with gloo",
                 "extras installed:", "GB of memory available", "GB free where runs go",
                 "lowband binds 127.0.0.1 (lo; a run on this machine), never every interface",
                 "lowband doctor: the transport on this machine (two doctors, 127.0.0.1:",
                 "ports: every node reached every other's", "clocks: within",
                 "link: measured by lowband doctor ",
                 "across machines: `lowband doctor --nodes N --rdzv HOST:PORT` on every node"):
        assert said in out, (said, out)
    assert "FAIL" not in out


def test_launch_runs_the_doctor_first_on_every_node():
    pytest.importorskip("torchx")
    from lowband.launch import components

    app = components().train("--model", "nano", replicas=2, rdzv_port=29533, rdzv_timeout=40,
                             doctor=True)
    command = app.roles[0].args[1]
    doctor, agent = command.split(" && ")
    assert doctor.startswith("python3 -m lowband.doctor --nodes 2 --rdzv $${${rank0_env}:="
                             "localhost}:29533 --timeout 40 -- --replicas 2 --shards 1 ")
    assert doctor.endswith("--model nano") and agent.startswith("python3 -m lowband.launch "
                                                                "torchrun")
    script = components().train(script="train.py", replicas=2, doctor=True)
    assert "--no-plan" in script.roles[0].args[1]
    with pytest.raises(ValueError, match="an elastic job's groups do not share"):
        components().train(replicas=2, elastic=True, doctor=True)


@pytest.mark.slow
def test_a_launched_job_with_doctor_checks_then_trains(tmp_path):
    pytest.importorskip("torchx")
    r = lowband("launch", "--doctor", "--run-dir", tmp_path / "run", "--", "--model", "nano",
                "--steps", "4", "--eval-every", "0", cwd=tmp_path, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "run" / "summary.json").exists()
    log = (tmp_path / "run" / "logs" / "node0.log").read_text()
    assert log.startswith("lowband doctor: this machine")  # before the node's agent
    for out in (r.stdout, log):  # what lowband launch followed, and the node's own log
        assert "lowband doctor: the transport on this machine" in out
        assert "secret: present and equal on all 2 nodes" in out
        assert "link: measured by lowband doctor" in out
