"""The transport seam: run a command, put a file, pull a directory, on a host over SSH or locally.

Everything above this package speaks only `Transport` and `connect()`; the lifecycle never sees
paramiko. Callers open one transport per host per worker thread and reuse it for every command.

Output is bounded: `run` keeps the last `OUTPUT_LIMIT` bytes of stdout and of stderr (a 1 GB flood
costs 2 MB of memory). Commands whose output matters beyond that write it to a file and `pull` it.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

# run() keeps this many trailing bytes of stdout and of stderr.
OUTPUT_LIMIT = 1 << 20
# How long killing a timed-out command's process group may take before we give up on it.
KILL_BUDGET_S = 3.0


@dataclass(frozen=True)
class HostSpec:
    """What a transport needs to know about a host (built by the inventory loader)."""

    name: str
    address: str | None = None  # None: use the name (and ~/.ssh/config may map it)
    port: int | None = None
    user: str | None = None
    identity_file: str | None = None
    jump: str | None = None  # ProxyJump, "user@host:port"
    known_hosts: str | None = None  # default: ~/.ssh/config's UserKnownHostsFile, else ~/.ssh/known_hosts
    transport: str = "ssh"  # "ssh" | "local"
    connect_timeout: float = 10.0
    python: str | None = None  # the host's venv Python: runs the command starter before python3 is tried


@dataclass(frozen=True)
class Result:
    """What a command did; stdout and stderr are their last OUTPUT_LIMIT bytes, decoded as UTF-8."""

    command: str
    exit_code: int
    stdout: str
    stderr: str
    step: str | None = None   # the scheduler's step that ran it (a Slurm node: JOB.STEP), else None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


@dataclass(frozen=True)
class Pulled:
    """What a pull brought back, all of it now under the local directory."""

    sizes: dict[str, int]   # relative path -> bytes of each file pulled (no hash: docs/formats.md, collected)
    # Members left out on purpose (links, devices, names escaping the directory), as "name (why)".
    skipped: tuple[str, ...] = ()

    @property
    def files(self) -> int:
        return len(self.sizes)

    @property
    def bytes(self) -> int:
        return sum(self.sizes.values())


class Transport(Protocol):
    """One host. Not for sharing between threads: open one per worker and reuse it."""

    host: HostSpec

    def run(self, command: str, *, timeout: float, check: bool = True,
            stdin: bytes | None = None) -> Result:
        """Run `command` with `bash -c` in a process group of its own; `stdin` is sent, then EOF.

        Past `timeout` the whole group is killed and RemoteTimeout raised; a frozen peer does the
        same. With `check`, a non-zero exit raises CommandFailed carrying the output's tail.
        Never put a secret in `command` (it appears in errors): send it with `put(mode=0o600)`.
        """
        ...

    def put(self, data: bytes, remote_path: str, *, mode: int = 0o644) -> None:
        """Write `data` to `remote_path` atomically (temporary name, then rename), with `mode` from
        the start, creating parent directories. A leading `~/` is the remote user's home."""
        ...

    def pull(self, remote_dir: str, local_dir: Path, *, timeout: float,
             max_bytes: int | None = None, exclude: tuple[str, ...] = ()) -> Pulled:
        """Copy `remote_dir` into `local_dir` (merging), all or nothing: regular files and
        directories only, never a link or a name outside `local_dir`, never a top-level name in
        `exclude` (it is not even read on the host). Over `max_bytes`: TooLarge."""
        ...

    def close(self) -> None:
        """Close the connection; a later call would open a new one."""
        ...


@runtime_checkable
class Placed(Protocol):
    """A transport onto a node a scheduler allocated: it says where a run on it ran (the manifest's
    `placement`); `step` is the step of the command that launched the run's server. `gone`: why the
    node is gone for the rest of the sweep (its job ended), or None: a run it fails is not tried again
    there, nor on another node of the same job, which would throw away what it brought back."""

    def placement(self, step: str | None) -> dict[str, Any]: ...

    @property
    def gone(self) -> str | None: ...


class Tail:
    """The last `limit` bytes written to it: bounded memory however much a command prints."""

    def __init__(self, limit: int = OUTPUT_LIMIT):
        self.limit = limit
        self._buf = bytearray()

    def feed(self, data: bytes) -> None:
        self._buf += data
        if len(self._buf) > self.limit:
            del self._buf[: len(self._buf) - self.limit]

    def value(self) -> bytes:
        return bytes(self._buf)


def shell_path(path: str) -> str:
    """Quote a remote path for the shell, keeping a leading `~/` meaning the remote user's home."""
    if path == "~" or path.startswith("~/"):
        rest = path[2:]
        return '"$HOME"' + ("/" + shlex.quote(rest) if rest else "")
    return shlex.quote(path)


def text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def output_tail(stdout: bytes, stderr: bytes, limit: int = 8192) -> str:
    """The tail of stdout then stderr, for error messages: the error is usually last, on stderr."""
    parts = [text(b[-limit:]).rstrip("\n") for b in (stdout, stderr) if b.strip()]
    return "\n".join(parts)
