"""A trace is a file from a host nobody vouches for: whatever it holds, the analysis names the file in an
InputError or gives figures that are right (finite, JSON), and a large top-level value it does not read
costs no memory."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.analysis import analyze_path
from harness.errors import InputError

REPO = Path(__file__).resolve().parents[2]


def event(name: object = "gemm_kernel", ts: object = 1.0, dur: object = 2.0, cat: str = "kernel") -> str:
    """One complete event as Kineto lays it out, with `ts` and `dur` written as given (raw JSON text)."""
    return (f'{{"ph": "X", "cat": "{cat}", "name": {json.dumps(name)}, "pid": 0, "tid": 7, '
            f'"ts": {ts}, "dur": {dur}, "args": {{"grid": [1, 1, 1]}}}}')


def trace(path: Path, events: list[str], head: str = "", tail: str = "") -> Path:
    text = "{" + head + '"traceEvents": [\n' + ",\n".join(events) + "\n]" + tail + "}"
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.write(text)
    return path


GOOD = [event(ts=10 * i) for i in range(6000)]
"""Enough events (over 256 kB) that the reader has learned their layout and scans the rest."""

BAD_EVENTS = {
    "a null name": event(name=None),
    "a number for a name": event(name=5),
    "a 400-digit ts": event(ts="9" * 400),
    "a ts past any clock": event(ts="1e999"),
    "an infinite dur": event(dur="Infinity"),
    "a NaN dur": event(dur="NaN"),
    "a NaN ts": event(ts="NaN"),
    "a negative dur": event(dur=-1000),
    "a negative ts": event(ts=-5),
    "a string ts": event(ts='"soon"'),
    "no dur": event().replace(', "dur": 2.0', ""),
}


@pytest.mark.parametrize("where", ["first", "scanned"])
@pytest.mark.parametrize("bad", list(BAD_EVENTS))
def test_a_malformed_event_is_an_input_error_naming_the_file(tmp_path, bad, where):
    """First in the file (decoded in full) or among events the reader scans without decoding."""
    events = [BAD_EVENTS[bad], *GOOD[:3]] if where == "first" else [*GOOD, BAD_EVENTS[bad], *GOOD[:3]]
    path = trace(tmp_path / "rank0.trace.json", events)
    with pytest.raises(InputError, match="malformed trace event") as caught:
        analyze_path(path)
    assert str(path) in str(caught.value)


@pytest.mark.parametrize("where", ["args", "meta"])
def test_nesting_too_deep_to_decode_is_an_input_error_naming_the_file(tmp_path, where):
    deep = "[" * 200_000 + "]" * 200_000
    if where == "args":
        events = [*GOOD[:3], event().replace('{"grid": [1, 1, 1]}', deep)]
        path = trace(tmp_path / "rank0.trace.json", events)
    else:   # a key that is read
        path = trace(tmp_path / "rank0.trace.json", GOOD[:3], head=f'"distributedInfo": {deep}, ')
    with pytest.raises(InputError, match="nested too deep") as caught:
        analyze_path(path)
    assert str(path) in str(caught.value)


def test_a_deep_or_tricky_value_of_a_key_nobody_reads_is_stepped_over(tmp_path):
    """Brackets inside strings, escaped quotes and backslashes, a string longer than a chunk, numbers
    and literals: none of it is decoded, and the keys after it still are."""
    tricky = ('{"name": "H200 \\" ] } [ {", "path": "C:\\\\", "deep": ' + "[" * 200_000 + "]" * 200_000
              + ', "long": "' + "x]" * 1_500_000 + '", "n": -1.5e3, "ok": true, "none": null}')
    head = (f'"deviceProperties": [{tricky}], "schemaVersion": 1, "flag": false, "label": "}}", '
            f'"distributedInfo": {{"rank": 3, "world_size": 4}}, ')
    path = trace(tmp_path / "t.trace.json", [event(dur=5), event(ts=20, dur=7)], head=head,
                 tail=f', "trailer": {tricky}, "last": 7')
    result = analyze_path(path)
    assert result["ranks"][0]["rank"] == 3
    assert result["total_gpu_ms"] == pytest.approx(0.012)


def test_a_key_that_is_read_is_refused_past_a_megabyte(tmp_path):
    info = '{"rank": 1, "pad": "' + "x" * (2 << 20) + '"}'
    path = trace(tmp_path / "t.trace.json", GOOD[:3], head=f'"distributedInfo": {info}, ')
    with pytest.raises(InputError, match="1 MB") as caught:
        analyze_path(path)
    assert str(path) in str(caught.value)


def test_every_figure_of_a_readable_trace_is_finite_json(tmp_path):
    """Times at the edge of what is taken still sum to finite figures: analysis.json is JSON."""
    events = [event(ts=1e17, dur=1e17), event(ts=0, dur=1e17), event(name="other", ts=2e17, dur=0)]
    result = analyze_path(trace(tmp_path / "t.trace.json", events))
    json.dumps(result, allow_nan=False)
    assert result["total_gpu_ms"] == pytest.approx(2e14)


PEAK = """
import json, sys
from harness.analysis import analyze_path
from tests.peak import peak_kb, reset_peak
analyze_path(sys.argv[1])                      # the imports and a small trace: the baseline
reset_peak()
before = peak_kb()
result = analyze_path(sys.argv[2])
print(json.dumps({"grew_kb": peak_kb() - before, "rank": result["ranks"][0]["rank"],
                  "total_gpu_ms": result["total_gpu_ms"]}))
"""


def test_large_top_level_values_nobody_reads_cost_no_memory(tmp_path):
    """Four keys of 1.5 MB of empty objects each (a 20 kB gzip), around the events: decoded, they would
    take well over 100 MB; stepped over, they take no more than a small trace does."""
    small = trace(tmp_path / "small.trace.json", GOOD[:3], head='"distributedInfo": {"rank": 2}, ')
    blob = "[" + "{}," * 500_000 + "{}]"
    head = "".join(f'"meta{i}": {blob}, ' for i in range(2)) + '"distributedInfo": {"rank": 5}, '
    tail = "".join(f', "meta{i}": {blob}' for i in range(2, 4))
    big = trace(tmp_path / "big.trace.json.gz", [event(dur=5), event(ts=20, dur=7)], head=head, tail=tail)
    assert big.stat().st_size < 100_000
    done = subprocess.run([sys.executable, "-c", PEAK, str(small), str(big)], capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["rank"] == 5 and found["total_gpu_ms"] == pytest.approx(0.012)
    assert found["grew_kb"] < 30_000, found


def test_one_event_of_megabytes_is_refused_in_bounded_memory(tmp_path):
    """Real events are a few kB; one of 16 MB (an args string) took 511 MB and 34 s to decode."""
    huge = '{"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 3, "dur": 1, "args": {"x": "%s"}}'
    path = trace(tmp_path / "big.pt.trace.json", [event(), huge % ("a" * (16 << 20))])
    code = ("from harness.analysis import analyze_path\nfrom harness.errors import InputError\n"
            "from tests.peak import peak_kb\n"
            f"try:\n    analyze_path({str(path)!r})\nexcept InputError as e:\n    print('refused', e)\n"
            "print(peak_kb())")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    said, peak_kb = done.stdout.splitlines()[0], int(done.stdout.splitlines()[-1])
    assert said.startswith("refused") and "big.pt.trace.json" in said, done.stdout + done.stderr
    assert peak_kb < 200_000, peak_kb
