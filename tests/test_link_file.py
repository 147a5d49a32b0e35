"""A measured link (issue 47): the file `lowband doctor --save-link` writes (comm/link.py), read
back by `--link FILE` in place of --link-bandwidth and --link-latency; `lowband plan` says it is
measured and from where, `lowband compare` names it and shapes its test hosts to it, and a run
keeps its record (config.json's meta.link), which its report shows and which outlives the file."""

import html
import json

import pytest

from lowband.comm.link import (MEASURED_KIND, describe_measured, read_measured, write_measured)
from lowband.config import Config, ConfigError
from lowband.flags import parse_train
from lowband.plan.cli import run_plan, table
from lowband.units import parse_bandwidth, parse_duration

RECORD = {"kind": "lowband-link", "version": 1, "by": "lowband doctor",
          "measured_at": "2026-11-29T22:50:01Z", "transport": "gloo over TCP",
          "nodes": [{"name": "h0", "address": "10.0.0.1", "interface": "veth0"},
                    {"name": "h1", "address": "10.0.0.2", "interface": "veth1"}],
          "pairs": [{"from": "h0", "to": "h1", "bandwidth_bps": 1.96e7, "bytes": 4194304,
                     "seconds": 1.71},
                    {"from": "h1", "to": "h0", "bandwidth_bps": 1.98e7, "bytes": 4194304,
                     "seconds": 1.69}],
          "bandwidth_bps": 1.96e7, "latency_s": 0.00061,
          "streams": {"count": 4, "bandwidth_bps": 1.95e7, "ratio": 0.995}}
LINE = ("measured by lowband doctor 2026-11-29 22:50 UTC between h0 and h1 over gloo over TCP: "
        "19.6 Mbit/s h0->h1, 19.8 Mbit/s h1->h0, latency 0.61 ms; 4 streams 0.99x one's")


@pytest.fixture
def link(tmp_path):
    return write_measured(tmp_path / "link.json", RECORD)


def test_a_saved_link_reads_back_as_it_was_written_and_says_itself_in_one_line(link):
    assert read_measured(link) == RECORD and MEASURED_KIND == RECORD["kind"]
    assert describe_measured(RECORD) == LINE
    bare = {"kind": "lowband-link", "bandwidth_bps": 1e9, "latency_s": 0}  # all a run needs
    assert describe_measured(bare) == "measured by lowband doctor: 1 Gbit/s, latency 0 ms"
    with pytest.raises(ConfigError, match="bandwidth_bps must be a positive number"):
        write_measured(link, {**RECORD, "bandwidth_bps": 0})  # nothing --link could read
    assert read_measured(link) == RECORD  # (the refused write left the file alone)


@pytest.mark.parametrize("text,says", [
    (None, "--link {f} does not exist: give a file `lowband doctor --save-link FILE` saved."),
    ("{not json", "--link {f} is not JSON (Expecting property name enclosed in double quotes: "
                  "line 1 column 2 (char 1)): give a file `lowband doctor --save-link FILE` "
                  "saved."),
    (json.dumps({**RECORD, "kind": "lowband-config"}),
     "--link {f} is not a measured link (its kind is 'lowband-config', not 'lowband-link'): "
     "give a file"),
    (json.dumps({k: v for k, v in RECORD.items() if k != "kind"}),
     "--link {f} is not a measured link (it has no kind, not 'lowband-link')"),
    (json.dumps({**RECORD, "bandwidth_bps": "fast"}),
     "--link {f}: its bandwidth_bps must be a positive number of bits per second, got 'fast'"),
    (json.dumps({**RECORD, "bandwidth_bps": -5}), "--link {f}: its bandwidth_bps must be a "
                                                  "positive number of bits per second, got -5"),
    (json.dumps({**RECORD, "latency_s": -0.001}),
     "--link {f}: its latency_s must be zero or a positive number of seconds, got -0.001"),
])
def test_a_bad_link_file_is_one_sentence(lowband_here, tmp_path, text, says):
    bad = tmp_path / "bad.json"
    if text is not None:
        bad.write_text(text)
    code, stderr = lowband_here("plan", "--link", "bad.json", "--step-time", "50ms", cwd=tmp_path)
    assert code == 2 and stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
    assert f"lowband: error: {says.format(f='bad.json')}" in stderr, stderr


def test_the_plan_takes_the_files_link_and_says_it_is_measured(link):
    result, as_json = run_plan(["--link", str(link), "--step-time", "50ms", "--compare", "ddp"])
    assert not as_json and result["link"] == {**RECORD, "file": str(link)}
    for row in result["algorithms"].values():  # every row plans on the file's link
        assert row["inputs"]["bandwidth"] == 1.96e7 and row["inputs"]["latency"] == 0.00061
    header, line = table(result).splitlines()[:2]
    assert header.endswith(f"link 19.6 Mbit/s, latency 0.61 ms (measured: {link}); a run of "
                           "200 steps"), header
    assert line == f"{link}: {LINE}"


def test_link_takes_the_place_of_the_link_flags_and_a_saved_run_keeps_its_record(link, tmp_path):
    cfg, _ = parse_train(["--link", str(link), "--link-bandwidth", "1gbit", "--link-latency",
                          "0ms"])  # --link wins, as its --help says
    assert (cfg.link_bandwidth, cfg.link_latency) == ("19600000bit", "0.00061s")
    assert parse_bandwidth(cfg.link_bandwidth) == 1.96e7  # read back exactly
    assert parse_duration(cfg.link_latency) == 0.00061
    assert cfg.measured_link == {**RECORD, "file": str(link)}
    assert "the place of --link-bandwidth and --link-latency" in Config.__dataclass_fields__[
        "link"].metadata["help"]
    # a run's config.json, read back once its file is gone: its own record, not the file's
    saved = tmp_path / "run" / "config.json"
    saved.parent.mkdir()
    saved.write_text(json.dumps({**cfg.to_dict(), "meta": {"link": cfg.measured_link}}))
    link.unlink()
    again = Config.from_file(str(saved.parent)).validate()
    assert (again.link, again.link_bandwidth, again.link_latency) == (
        str(link), "19600000bit", "0.00061s")
    assert again.measured_link == cfg.measured_link
    resumed, resumes = parse_train(["--resume", str(saved.parent)])  # (each worker reads it so)
    assert resumes and resumed.measured_link == cfg.measured_link
    assert (resumed.link_bandwidth, resumed.link_latency) == ("19600000bit", "0.00061s")
    with pytest.raises(ConfigError, match="does not exist"):  # a new run needs the file
        parse_train(["--link", str(link)])


def test_compare_names_the_measured_link_and_shapes_test_hosts_to_it(link, monkeypatch):
    from lowband.compare import entries, runner
    from lowband.compare.table import text
    from lowband.dashboard.comparison import note
    import lowband.launch.hosts as hosts_module
    import lowband.launch.here as here

    ddp, streaming = entries.resolve(algos=["ddp", "streaming"],
                                     args={"link": str(link), "model": "nano"})
    for e in (ddp, streaming):
        assert e.config.link_bandwidth == "19600000bit" and e.config.measured_link

    class Hosts:  # lowband.launch.hosts.TestHosts without root: what it was asked for
        def __init__(self, prefix, net, rate, *rest, n):
            self.rate, self.n = rate, n

        def unavailable(self):
            return None

    monkeypatch.setattr(hosts_module, "TestHosts", Hosts)
    hosts = runner._test_hosts([ddp, streaming])
    assert hosts.rate == "19600kbit"  # the measured bandwidth, as --link-bandwidth's would be
    started = []
    monkeypatch.setattr(here, "train_here", lambda cfg, argv, resume, hosts: started.append(cfg)
                        or (0, None))
    from lowband.telemetry import RunDir
    runner._train(streaming, RunDir(link.parent / "streaming"), {"steps": 2}, hosts)
    assert (started[0].link, started[0].link_bandwidth) == ("", "")  # the hosts' link instead
    result = {"runs": [], "link": {"test_hosts": False, "bandwidth": "19600000bit",
                                   "latency": "0.00061s", "measured": ddp.config.measured_link}}
    assert f"the link in {link}, {LINE}" in note(result)
    said = " ".join(text(result).split())  # (wrapped at 100 columns)
    assert f"link: the link in {link}, {LINE}" in said


@pytest.mark.slow  # a short run of two processes, ~11 s on 2 cores
def test_a_run_on_a_measured_link_keeps_it_and_its_report_and_plan_show_it(train_run, link):
    run = train_run("--model", "nano", "--steps", 4, "--seq-len", 32, "--batch-size", 4,
                    "--eval-every", 0, "--eval-batches", 1, "--sync-every", 4, "--fragments", 2,
                    "--link", link)
    saved = run.read_json(run.config)
    assert (saved["link"], saved["link_bandwidth"], saved["link_latency"]) == (
        str(link), "19600000bit", "0.00061s")
    assert saved["meta"]["link"] == {**RECORD, "file": str(link)}
    page = (run.root / "report.html").read_text()
    shown = html.unescape(page[page.index('data-key="measured-link">'):].split("</p>")[0])
    assert shown.endswith(f"Outer link emulated 19.6 Mbit/s, latency 0.61 ms (its slowest "
                          f"direction and its latency): the link in {link}, {LINE}.")
    link.unlink()  # the run keeps what its link was: planned (and repeated) without the file
    result, _ = run_plan(["--config", str(run.root), "--compare", "none"])
    assert result["link"] == saved["meta"]["link"]
    assert f"(measured: {link})" in table(result).splitlines()[0]
    assert result["algorithms"]["streaming"]["inputs"]["bandwidth"] == 1.96e7
