"""The journal: an append-only, fsynced record of every run's state changes.

It is the single source of truth for progress: `harness status` and `--resume` read it, never the run
directories. Each line is one JSON event {t, run_id, state, ...}. A line is written whole or not at
all: a short write (a full disk) is cut off again and raised, so the next line never lands in the
middle of a torn one. A torn last line left by a kill mid-write is ignored on read and cut off when
the journal is next opened for writing.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path
from typing import Any, get_args

from pydantic import ValidationError

from harness.errors import InputError
from harness.results.models import JournalEvent, RunState

STATES: tuple[str, ...] = get_args(RunState)
FINAL = ("ok", "failed")   # what --resume leaves alone; skipped runs (deadline, fail-fast) run on resume


class Journal:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._cut = False   # the torn tail is cut by the first append: by the orchestrator holding the
        # sweep's lock, never by one refused it while another writes

    def append(self, run_id: str, state: str, **fields: Any) -> None:
        event = JournalEvent.model_validate({"t": time.time(), "run_id": run_id, "state": state, **fields})
        line = (event.line() + "\n").encode()
        with self._lock:
            if not self._cut:
                _cut_torn_tail(self.path)
                self._cut = True
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                size = os.fstat(fd).st_size
                try:
                    written = os.write(fd, line)
                except OSError:
                    os.ftruncate(fd, size)
                    raise
                if written != len(line):
                    os.ftruncate(fd, size)
                    raise OSError(errno.ENOSPC, f"{self.path}: only {written} of {len(line)} bytes written")
                os.fsync(fd)
            finally:
                os.close(fd)


def _cut_torn_tail(path: Path) -> None:
    """Cut a last line that has no newline (a kill mid-write), so the next one starts whole."""
    try:
        with open(path, "rb+") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            if size == 0:
                return
            f.seek(max(0, size - 65536))
            tail = f.read()
            if tail.endswith(b"\n"):
                return
            keep = size - len(tail) + tail.rfind(b"\n") + 1
            f.truncate(keep if tail.rfind(b"\n") >= 0 or size <= 65536 else size)
    except FileNotFoundError:
        return


def read_journal(path: Path) -> list[JournalEvent]:
    """The journal's events, in order; a line that is no event (a torn write from a kill: the run it
    describes was in flight; or JSON not ours) is skipped. A whole line that is not UTF-8 is damage,
    not a kill's (a torn last line may end inside a character of a host's or a reason's UTF-8): an
    error naming the file and where, rather than a traceback of `--resume` or `status`."""
    events: list[JournalEvent] = []
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return events
    lines = data.split(b"\n")
    offset = 0
    for number, line in enumerate(lines, 1):
        try:
            text = line.decode()
        except UnicodeDecodeError as e:
            if number < len(lines):   # a whole line (the last piece, with no newline, is a torn write)
                raise InputError(f"not UTF-8 text at byte {offset + e.start} (line {number}): damaged, or not "
                                 "a journal; remove that line to go on", file=str(path)) from None
            continue
        finally:
            offset += len(line) + 1
        try:
            events.append(JournalEvent.model_validate_json(text))
        except ValidationError:
            continue
    return events


def latest_states(path: Path) -> dict[str, JournalEvent]:
    """run_id -> its last event."""
    states: dict[str, JournalEvent] = {}
    for event in read_journal(path):
        states[event.run_id] = event
    return states
