"""The journal: an append-only, fsynced record of every run's state changes.

It is the single source of truth for progress: `harness status` and `--resume` read it, never the run
directories. Each line is one JSON event {t, run_id, state, ...}; a torn last line (a kill mid-write)
is ignored on read.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

STATES = ("pending", "running", "retry", "ok", "failed", "skipped", "interrupted")
FINAL = ("ok", "failed")   # what --resume leaves alone; skipped runs (deadline, fail-fast) run on resume


class Journal:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, run_id: str, state: str, **fields: Any) -> None:
        assert state in STATES, state
        line = json.dumps({"t": time.time(), "run_id": run_id, "state": state, **fields}, default=str) + "\n"
        with self._lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())
                os.fsync(fd)
            finally:
                os.close(fd)


def read_journal(path: Path) -> list[dict]:
    events = []
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return events
    for line in lines:
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn write from a kill: the run it describes was in flight
    return events


def latest_states(path: Path) -> dict[str, dict]:
    """run_id -> its last event."""
    states: dict[str, dict] = {}
    for event in read_journal(path):
        states[event["run_id"]] = event
    return states
