"""No run is lost to the harness's own bug (RELIABILITY case 27).

The executor runs for real (threads, journal, local transport, the simulated engine serving); one
stage of one run is made to raise an exception no stage expects, as a bug of ours would. That run must
be recorded failed (kind `internal`, the traceback kept), its server stopped, the other runs finished,
and the sweep's outcome failed.
"""

from __future__ import annotations

import json
import sys

import pytest
import yaml

import harness.lifecycle.run as lifecycle_run
from harness.executor import Executor
from harness.plan import load_sweep
from tests.e2e.test_faults import listening
from tests.e2e.test_sweep import FAST, _free_port

pytestmark = pytest.mark.e2e


def test_an_unexpected_exception_fails_that_run_only_and_stops_its_server(tmp_path, monkeypatch):
    port = _free_port()
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(yaml.safe_dump({"all": {"hosts": {"localhost": {
        "transport": "local", "venv": sys.prefix, "workdir": str(tmp_path / "work")}}}}))
    playbook = tmp_path / "pb.yaml"
    playbook.write_text(yaml.safe_dump({
        "name": "internal", "hosts": "localhost", "engine": "sim", "model": {"path": "/m"},
        "server": {"port": port, "env": dict(FAST), "startup_timeout_s": 60},
        "configs": [{"name": "buggy"}, {"name": "fine"}],
        "benchmark": {"prompt": "hi", "max_tokens": 4, "requests": 2, "warmup": 0}}))
    real_bench = lifecycle_run.bench
    seen = {}

    def bench(ctx):
        if ctx.run.config.name == "buggy":
            seen["listening"] = listening(port)
            raise ZeroDivisionError("a bug of ours")
        return real_bench(ctx)

    monkeypatch.setattr(lifecycle_run, "bench", bench)
    outcome = Executor(load_sweep(playbook, inventory), tmp_path / "results").run()

    by_config = {m.config.name: m for m in outcome.manifests}
    assert seen["listening"]                              # the server was up when the bug struck
    buggy, fine = by_config["buggy"], by_config["fine"]
    assert buggy.status == "failed" and buggy.error is not None and buggy.error.kind == "internal"
    assert "ZeroDivisionError: a bug of ours" in buggy.error.message
    log = (outcome.sweep_dir / "runs" / "buggy-1" / "harness-error.log").read_text()
    assert "Traceback" in log and "a bug of ours" in log
    assert fine.status == "ok"                         # the next run had the port, so nothing outlived it
    states = [json.loads(line) for line in (outcome.sweep_dir / "journal.jsonl").read_text().splitlines()]
    assert [s["state"] for s in states if s["run_id"] == "buggy-1"][-1] == "failed"
    assert outcome.failed == [buggy]
