"""One orchestrator per sweep: `sweep.lock` in the sweep folder, held while a sweep runs.

The lock is an advisory `flock` on the file, so it goes with the process that holds it, however that
process ends (a SIGKILL included): a lock file left behind by a dead orchestrator is not held and is
taken over. While held, the file says who holds it (pid, host, since), which is what a second
`--resume` refuses with and what `harness status` reports as running.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from harness.errors import HarnessError, Kind
from harness.results.layout import SweepLayout


class SweepLocked(HarnessError):
    kind = Kind.LOCKED


class SweepLock:
    def __init__(self, sweep_dir: Path):
        self.path = SweepLayout(Path(sweep_dir)).lock
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read(fd)
                os.close(fd)
                raise SweepLocked(f"{self.path.parent} is being run by {describe(holder)}: wait for it, or stop "
                                  "it first (Ctrl-C there, or kill that pid)") from None
            if _is_at(fd, self.path):
                break
            os.close(fd)   # a holder that released removed the file we locked: lock the one there now
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode())
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(self._fd)   # closing releases the flock
            self._fd = None

    def __enter__(self) -> SweepLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def holder(sweep_dir: Path) -> dict | None:
    """Who runs the sweep now ({pid, host, since}), or None when no orchestrator holds its lock."""
    path = SweepLayout(Path(sweep_dir)).lock
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read(fd) or {}
    finally:
        os.close(fd)
    return None


def describe(who: dict | None) -> str:
    if not who:
        return "another orchestrator"
    since = time.strftime("%Y-%m-%d %H:%M", time.localtime(who.get("since", 0)))
    return f"pid {who.get('pid')} on {who.get('host')} since {since}"


def _is_at(fd: int, path: Path) -> bool:
    """Whether the file `fd` holds is the one at `path` still. A holder removes the file as it releases:
    a lock taken on the file it removed, opened just before, would hold nothing, and the next
    orchestrator would make a new file and lock that one too."""
    try:
        there = os.lstat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino)


def _read(fd: int) -> dict | None:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        return json.loads(os.read(fd, 4096) or b"null")
    except (OSError, ValueError):
        return None
