"""The telemetry sampler against a host and an engine that misbehave: an answer sent a byte at a time,
and an nvidia-smi that prints ERR! or a number that is none. Real sockets, processes and files."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.remote import telemetry as tm
from tests.unit.test_telemetry import _Server

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def dripping():
    """A loopback /metrics that sends its head at once, then its body a byte every 0.2 s."""
    s = _Server()
    s.body, s.drip = b"vllm:num_requests_running 1\n", 0.2
    yield s
    s.close()


def test_an_answer_sent_a_byte_at_a_time_is_cut_off_at_the_timeout(dripping):
    """Each byte comes well within the socket's timeout: only a deadline on the whole answer ends it."""
    started = time.monotonic()
    with pytest.raises(ValueError, match="took over 1 s"):
        tm.fetch_metrics(dripping.url, timeout=1.0)
    assert time.monotonic() - started < 4


FAKE_SMI = """#!/bin/sh
echo "index, clocks.current.sm [MHz], memory.used [MiB], power.draw [W], utilization.gpu [%]"
echo "0, 1980 MHz, 1000 MiB, ERR!, 50 %"
echo "1, nan MHz, 2000 MiB, 300.5 W, inf %"
"""


def test_an_nvidia_smi_cell_it_could_not_read_or_no_number_is_none_and_the_rest_stands(tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    out = tmp_path / "telemetry.jsonl"
    done = subprocess.run([sys.executable, "-m", "harness.remote", "telemetry", "--url", "http://127.0.0.1:9/metrics",
                           "--out", str(out), "--no-metrics", "--nvidia-smi", str(smi), "--interval", "0.05",
                           "--duration", "0.1"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(x) for x in out.read_text().splitlines()]   # strict JSON: no NaN or Infinity
    gpus = [x["values"] for x in lines if x["source"] == "gpu"]
    assert gpus[:2] == [
        {"gpu": 0, "sm_clock_mhz": 1980.0, "memory_used_mib": 1000.0, "power_w": None, "utilization_pct": 50.0},
        {"gpu": 1, "sm_clock_mhz": None, "memory_used_mib": 2000.0, "power_w": 300.5, "utilization_pct": None}]
    assert "NaN" not in out.read_text() and "Infinity" not in out.read_text()
    notes = [x["values"]["message"] for x in lines if x["source"] == "note"]
    assert notes == ["nvidia-smi: sm_clock_mhz of GPU 1 is nan: left out",
                     "nvidia-smi: utilization_pct of GPU 1 is inf: left out"]


def test_a_write_the_disk_cannot_take_leaves_whole_lines_and_the_sampler_goes_on(tmp_path):
    """A file size limit (RLIMIT_FSIZE, as a full disk or a quota does) cuts the first round's write
    short: it is undone to the last whole line, the start line comes first once it fits, and the lines
    lost are noted."""
    out = tmp_path / "telemetry.jsonl"

    def limited():
        import resource
        import signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # the write fails (EFBIG) instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (500, 500))

    done = subprocess.run([sys.executable, "-m", "harness.remote", "telemetry", "--url", "http://127.0.0.1:9/metrics",
                           "--out", str(out), "--nvidia-smi", "no-such-nvidia-smi", "--interval", "0.02",
                           "--duration", "0.3"], cwd=REPO, capture_output=True, text=True, timeout=120,
                          preexec_fn=limited)
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    assert text.endswith("\n")
    lines = [json.loads(x) for x in text.splitlines()]   # every line whole
    assert lines[0]["source"] == "start" and lines[-1]["source"] == "stop"
    notes = [x["values"]["message"] for x in lines if x["source"] == "note"]
    assert notes == ["2 lines not written: File too large"]
