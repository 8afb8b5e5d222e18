"""The local transport: this machine as a host, for `transport: local` and for tests.

Commands run under `bash -c` in a new session (`start_new_session=True`), so the process group is
the command's pid and a timeout kills everything it started. stdin, stdout and stderr are served by
one selector loop, so neither a flood of output nor a large stdin can deadlock the pipes.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from harness.transport.base import KILL_BUDGET_S, HostSpec, Tail
from harness.transport.process import ProcessTransport

_CHUNK = 1 << 16


class LocalTransport(ProcessTransport):
    def __init__(self, host: HostSpec):
        self.host = host

    def _spawn(self, command: str, *, stdin: bytes | None, timeout: float, lasting: bool = False) -> _PipeProcess:
        return _PipeProcess(command, stdin)

    def put(self, data: bytes, remote_path: str, *, mode: int = 0o644) -> None:
        path = Path(remote_path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        # mkstemp creates the file 0600, so a secret is never readable by others, even briefly.
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, mode)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def close(self) -> None:
        """Nothing to close: every command has its own process."""


class _PipeProcess:
    def __init__(self, command: str, stdin: bytes | None):
        self._proc = subprocess.Popen(
            ["bash", "-c", command], start_new_session=True,
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self._err = Tail()
        self._stdin = memoryview(stdin or b"")
        self._sel = selectors.DefaultSelector()
        assert self._proc.stdout is not None and self._proc.stderr is not None  # both PIPE, above
        self._sel.register(self._proc.stdout, selectors.EVENT_READ)
        self._sel.register(self._proc.stderr, selectors.EVENT_READ)
        if self._proc.stdin is not None:
            os.set_blocking(self._proc.stdin.fileno(), False)
            self._sel.register(self._proc.stdin, selectors.EVENT_WRITE)

    def _open(self) -> set:
        return {key.fileobj for key in self._sel.get_map().values()}

    def _pump(self, deadline: float) -> bytes:
        """One round of the selector: feed stdin, keep stderr, return what stdout had (maybe b"")."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        out = b""
        for key, _ in self._sel.select(remaining):
            if key.fileobj is self._proc.stdin:
                self._write_stdin()
            elif not (data := os.read(key.fd, _CHUNK)):
                self._sel.unregister(key.fileobj)
            elif key.fileobj is self._proc.stderr:
                self._err.feed(data)
            else:
                out = data
        return out

    def _write_stdin(self) -> None:
        stdin = self._proc.stdin
        assert stdin is not None  # called only while stdin is registered: a pipe
        try:
            sent = os.write(stdin.fileno(), self._stdin[:_CHUNK])
            self._stdin = self._stdin[sent:]
        except BrokenPipeError:  # the command stopped reading stdin: it decides what that means
            self._stdin = self._stdin[:0]
        if not self._stdin:
            self._sel.unregister(stdin)
            stdin.close()

    def read(self, deadline: float) -> bytes:
        while self._proc.stdout in self._open():
            if data := self._pump(deadline):
                return data
        return b""

    def wait(self, deadline: float) -> int:
        while self._open() - {self._proc.stdin}:  # stderr can outlive stdout
            self._pump(deadline)
        try:
            return self._proc.wait(max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            raise TimeoutError from None

    def stderr(self) -> bytes:
        return self._err.value()

    def kill(self) -> None:
        """SIGTERM the process group, then SIGKILL whatever is left after a grace period."""
        pgid = self._proc.pid
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                return
            end = time.monotonic() + KILL_BUDGET_S / 2
            while time.monotonic() < end:
                self._proc.poll()  # reap the leader, or it counts as alive
                if not _group_alive(pgid):
                    return
                time.sleep(0.02)

    def close(self) -> None:
        if self._proc.poll() is None:  # abandoned early (a refused pull): never leave it running
            self.kill()
        self._sel.close()
        for pipe in (self._proc.stdin, self._proc.stdout, self._proc.stderr):
            if pipe is not None:
                pipe.close()
        self._proc.poll()


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs. Zombies do not count: in a container whose init
    never reaps, killed children stay in the group as zombies for good."""
    if not os.path.exists("/proc/self/stat"):  # not Linux: signal 0 (which counts zombies) will do
        try:
            os.killpg(pgid, 0)
            return True
        except ProcessLookupError:
            return False
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _ppid, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except OSError:
            continue
        if int(group) == pgid and state != "Z":
            return True
    return False
