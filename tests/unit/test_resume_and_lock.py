"""One orchestrator per sweep (`sweep.lock`) and the journal a resume reads, with real processes and files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness import lock
from harness.errors import InputError
from harness.journal import Journal, latest_states, read_journal
from harness.lock import SweepLock, SweepLocked
from harness.results.models import JournalEvent
from harness.resume import differences, fingerprint

HOLD = """
import sys
from harness.lock import SweepLock
held = SweepLock(sys.argv[1])
held.acquire()
print("held", flush=True)
sys.stdin.readline()
held.release()
"""

TRY = """
import sys
from harness.lock import SweepLock, SweepLocked
try:
    SweepLock(sys.argv[1]).acquire()
except SweepLocked:
    print("refused")
else:
    print("acquired")
"""


def hold(sweep: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(sweep)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def test_a_lock_taken_as_its_holder_releases_it_is_the_one_a_third_orchestrator_meets(tmp_path, monkeypatch):
    """The holder removes sweep.lock as it releases. An orchestrator that opened the file just before and
    locks it just after holds a removed file: a third one would make a new file, lock it too, and two
    orchestrators would run one sweep."""
    sweep = tmp_path / "sweep"
    first = hold(sweep)
    real_flock = lock.fcntl.flock

    def flock_after_the_release(fd, op):
        if first.poll() is None:      # between our open and our lock, the holder releases and exits
            assert first.stdin is not None
            first.stdin.write("\n")
            first.stdin.close()
            first.wait()
        return real_flock(fd, op)

    monkeypatch.setattr(lock.fcntl, "flock", flock_after_the_release)
    second = SweepLock(sweep)
    second.acquire()
    monkeypatch.setattr(lock.fcntl, "flock", real_flock)
    try:
        third = subprocess.run([sys.executable, "-c", TRY, str(sweep)], capture_output=True, text=True, check=True)
        assert third.stdout == "refused\n"
        assert lock.holder(sweep) is not None
    finally:
        second.release()


def test_a_lock_left_by_a_killed_orchestrator_is_taken_over(tmp_path):
    sweep = tmp_path / "sweep"
    first = hold(sweep)
    first.kill()
    first.wait()
    assert (sweep / "sweep.lock").exists() and lock.holder(sweep) is None
    with SweepLock(sweep), pytest.raises(SweepLocked):
        SweepLock(sweep).acquire()


def test_a_torn_last_line_cut_inside_a_character_is_skipped_and_cut_when_the_journal_reopens(tmp_path):
    """A kill that tore the last line inside a character of a reason: that line is no event, the others
    stand (it raised UnicodeDecodeError: a traceback of `--resume --dry-run` and of status)."""
    journal = Journal(tmp_path / "journal.jsonl")
    journal.append("a-1", "ok", host="gpu-01", attempts=1)
    whole = JournalEvent.model_validate({"t": 1, "run_id": "b-1", "state": "skipped", "reason": "déjà"}).line()
    with open(journal.path, "ab") as f:
        f.write(whole.encode()[:whole.encode().index("é".encode()) + 1])   # no newline: cut inside the é
    assert [(e.run_id, e.state) for e in read_journal(journal.path)] == [("a-1", "ok")]
    Journal(journal.path).append("b-1", "running", host="gpu-01", attempt=1)
    assert {k: e.state for k, e in latest_states(journal.path).items()} == {"a-1": "ok", "b-1": "running"}


def test_a_whole_line_that_is_not_utf8_is_an_error_naming_the_journal_and_the_line(tmp_path):
    journal = Journal(tmp_path / "journal.jsonl")
    journal.append("a-1", "ok", host="gpu-01", attempts=1)
    with open(journal.path, "ab") as f:
        f.write(b"\xff\xfe not ours\n")
    journal.append("b-1", "ok", host="gpu-01", attempts=1)
    with pytest.raises(InputError) as raised:
        latest_states(journal.path)
    assert str(raised.value).startswith(f"{journal.path}: not UTF-8 text at byte ") and "(line 2)" in str(raised.value)


def test_a_change_python_takes_for_equal_is_named_as_it_changes_the_launch():
    """`tp-size: 8` edited to `8.0`, `enable-metrics: true` to `1`: each launches another command line and
    changes the fingerprint, so the refusal must say what changed (it listed nothing)."""
    old = {"config": {"args": {"tp-size": 8, "enable-metrics": True, "mem": 0.5}}}
    new = {"config": {"args": {"tp-size": 8.0, "enable-metrics": 1, "mem": 0.5}}}
    assert fingerprint(old) != fingerprint(new)
    assert differences(old, new) == ["config.args.enable-metrics: true -> 1", "config.args.tp-size: 8 -> 8.0"]
    assert differences(old, old) == []


def test_a_journal_opened_but_not_written_is_left_as_it_is(tmp_path):
    """An orchestrator refused the sweep's lock opens the journal too: its torn tail may be the line
    the holder is writing, so only a first append (under the lock) cuts it."""
    path = tmp_path / "journal.jsonl"
    Journal(path).append("a-1", "ok")
    with open(path, "ab") as f:
        f.write(b'{"t": 1, "run_id": "b-1", "sta')   # the holder's line, half written
    before = path.read_bytes()
    Journal(path)
    assert path.read_bytes() == before
