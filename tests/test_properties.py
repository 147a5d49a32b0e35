"""Property-based tests: config validation, codecs, the event reader on damaged files."""

import json
import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lowband.comm import CODECS, NonFiniteError, decode, encode, payload_bytes
from lowband.config import Config, ConfigError, fields
from lowband.telemetry import EventTail, EventWriter, RunDir, read_events

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
values = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                   st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))


@FAST
@given(st.dictionaries(st.sampled_from([f.name for f in fields()] + ["bogus", "lr-x"]), values,
                       max_size=6))
def test_config_from_any_dict_validates_or_refuses_in_one_sentence(d):
    try:
        Config.from_dict(d).validate()
    except ConfigError as e:
        msg = str(e)
        assert msg and "\n" not in msg and msg.rstrip().endswith((".", ")."))


@FAST
@given(st.sampled_from(CODECS), st.integers(0, 300), st.sampled_from([1, 7, 32, 64]),
       st.floats(-1e30, 1e30, allow_nan=False), st.integers(0, 2**31 - 1))
def test_codec_round_trip_any_size(codec, n, block, scale, seed):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale
    x = x.nan_to_num(0.0, 3e38, -3e38)
    payload = encode(x, codec, block)
    assert payload.numel() == payload_bytes(codec, n, block)
    y = decode(payload, n, codec, block)
    assert y.shape == (n,) and torch.isfinite(y).all()
    if n:  # never larger than the block's largest magnitude (+ bf16 rounding of the scale)
        assert y.abs().max() <= x.abs().max() * (1 + 2 ** -7) + 1e-30


@FAST
@given(st.sampled_from(CODECS), st.integers(1, 100), st.sampled_from([math.nan, math.inf, -math.inf]),
       st.data())
def test_codec_refuses_non_finite(codec, n, bad, data):
    x = torch.zeros(n)
    x[data.draw(st.integers(0, n - 1))] = bad
    try:
        encode(x, codec)
    except NonFiniteError:
        return
    raise AssertionError("a non-finite value was encoded")


@FAST
@given(st.lists(st.one_of(st.binary(max_size=40), st.just(b"\n"), st.just(b'{"v":1}\n')),
                max_size=20), st.binary(max_size=30))
def test_event_reader_survives_damaged_files(tmp_path_factory, garbage, tail):
    run = RunDir(tmp_path_factory.mktemp("run")).create()
    w = EventWriter(run, 0, 0)
    w.emit("step", step=1, loss=2.0)
    w.close()
    with open(run.event_file(0), "ab") as f:
        for chunk in garbage:
            f.write(chunk)
        f.write(b"\n")
        f.write(json.dumps({"v": 1, "t": 4e9, "rank": 0, "replica": 0, "kind": "step",
                            "step": 2, "new_field": [1]}).encode() + b"\n")
        f.write(tail.replace(b"\n", b""))  # a torn last line
    events = read_events(run)
    assert [e["step"] for e in events if e["kind"] == "step"][-1] == 2
    assert all(isinstance(e, dict) and "kind" in e for e in events)
    tailer = EventTail(run)
    first = tailer.poll()
    assert tailer.poll() == [] and len(first) == len(events)
