"""A transport that fails on cue: the local transport (real commands, real processes, real files)
with faults injected where a test says, so the executor's retries, failover, leases and internal-error
handling run in-process, in seconds.

    faults = Faults()
    faults.on("hostA", "run", r"bench.py", error=unreachable, times=1)   # the first benchmark there dies
    Executor(sweep, results, connect=faults.connect).run()

A fault matches a host, an operation (`connect`, `run`, `put`, `pull`) and a regular expression on the
command (or path); it fires `times` times (None: always), only `when` a condition holds, optionally
after waiting for one, then raises what its `error` returns. Everything else goes to the local transport unchanged.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from harness.errors import Kind, RemoteError
from harness.transport.base import HostSpec, Pulled, Result, Transport
from harness.transport.local import LocalTransport


def unreachable(host: str, what: str) -> Exception:
    return RemoteError(f"connection lost during {what[:60]!r}", host=host, kind=Kind.UNREACHABLE)


def timeout(host: str, what: str) -> Exception:
    return RemoteError(f"timed out: {what[:60]!r}", host=host, kind=Kind.TIMEOUT)


def bug(host: str, what: str) -> Exception:
    return ZeroDivisionError("a bug of ours")


@dataclass
class Fault:
    host: str
    op: str
    pattern: re.Pattern[str]
    error: Callable[[str, str], Exception]
    times: int | None
    after: Callable[[], bool] | None = None     # wait (up to 60 s) until this holds, then fail
    when: Callable[[], bool] | None = None      # only while this holds
    fired: int = 0


@dataclass
class Faults:
    faults: list[Fault] = field(default_factory=list)
    seen: list[tuple[str, str, str]] = field(default_factory=list)   # (host, op, command or path)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def on(self, host: str, op: str, pattern: str = "", *, error: Callable[[str, str], Exception] = unreachable,
           times: int | None = 1, after: Callable[[], bool] | None = None,
           when: Callable[[], bool] | None = None) -> Fault:
        fault = Fault(host, op, re.compile(pattern), error, times, after, when)
        self.faults.append(fault)
        return fault

    def check(self, host: str, op: str, what: str) -> None:
        with self.lock:
            self.seen.append((host, op, what))
            fault = next((f for f in self.faults if f.host == host and f.op == op and f.pattern.search(what)
                          and (f.times is None or f.fired < f.times) and (f.when is None or f.when())), None)
            if fault is not None:
                fault.fired += 1
        if fault is None:
            return
        if fault.after is not None:
            deadline = time.monotonic() + 60
            while not fault.after() and time.monotonic() < deadline:
                time.sleep(0.05)
        raise fault.error(host, what)

    def connect(self, spec: HostSpec) -> Transport:
        self.check(spec.name, "connect", spec.name)
        return Faulty(LocalTransport(spec), self)

    def count(self, host: str, op: str, pattern: str = "") -> int:
        with self.lock:
            return sum(1 for h, o, w in self.seen if h == host and o == op and re.search(pattern, w))


class Faulty:
    def __init__(self, inner: LocalTransport, faults: Faults):
        self.inner, self.faults, self.host = inner, faults, inner.host

    def run(self, command: str, *, timeout: float, check: bool = True, stdin: bytes | None = None) -> Result:
        self.faults.check(self.host.name, "run", command)
        return self.inner.run(command, timeout=timeout, check=check, stdin=stdin)

    def put(self, data: bytes, remote_path: str, *, mode: int = 0o644) -> None:
        self.faults.check(self.host.name, "put", remote_path)
        self.inner.put(data, remote_path, mode=mode)

    def pull(self, remote_dir: str, local_dir: Path, *, timeout: float, exclude: tuple[str, ...] = (),
             max_bytes: int | None = None) -> Pulled:
        self.faults.check(self.host.name, "pull", remote_dir)
        return self.inner.pull(remote_dir, local_dir, timeout=timeout, exclude=exclude, max_bytes=max_bytes)

    def close(self) -> None:
        self.inner.close()
