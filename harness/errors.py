"""One exception tree for the whole harness.

    HarnessError                  base; `kind` (a Kind) is the manifest's error.kind and says whether it is retried
    ├── InputError                bad YAML, playbook, inventory or template: exit 2, names file/key/line
    └── RemoteError               something on a host: carries host, run id, command and output tail
        ├── UnreachableError      cannot connect (refused, no route, DNS)           kind=unreachable, retryable
        ├── AuthError             the host refused our credentials                  kind=auth, never retried
        ├── HostKeyError          unknown or changed host key                       kind=host_key, never retried
        ├── RemoteTimeout         a remote step ran past its deadline                kind=timeout, retryable
        ├── CommandFailed         a remote command exited non-zero                   kind=given by the caller
        └── RunFailed             a lifecycle stage failed (launch, oom, health...)  kind=given by the caller

The CLI maps InputError to exit 2; a failed run to exit 1; KeyboardInterrupt to 130.
Messages never contain secrets: callers redact before raising (see `harness.secrets`).
"""

from __future__ import annotations

from enum import StrEnum


class Kind(StrEnum):
    """What went wrong, as a manifest's `error.kind` records it (docs/formats.md). Each kind says
    whether another attempt can help (`retried`) and whether it rules the host out for the sweep
    (`host_fatal`: no run there would fare better). A str, so it is written and compared as its name."""

    UNREACHABLE = "unreachable"
    AUTH = "auth"
    HOST_KEY = "host_key"
    PREFLIGHT = "preflight"
    LAUNCH = "launch"
    OOM = "oom"
    STARTUP_TIMEOUT = "startup_timeout"
    SERVER_DIED = "server_died"
    BENCH = "bench"
    COLLECT = "collect"
    TIMEOUT = "timeout"
    INTERRUPTED = "interrupted"
    INTERNAL = "internal"
    INPUT = "input"
    LOCKED = "locked"
    ERROR = "error"

    @property
    def retried(self) -> bool:
        """A transient failure: the same run may well succeed on the next attempt."""
        return self in _RETRIED

    @property
    def host_fatal(self) -> bool:
        """Met while connecting to a host, it sets the host aside for the whole sweep."""
        return self in _HOST_FATAL

    @classmethod
    def of(cls, name: object) -> Kind:
        """The kind a file records (an older harness may have written one this version lacks)."""
        try:
            return cls(str(name))
        except ValueError:
            return cls.ERROR


_RETRIED = frozenset({Kind.UNREACHABLE, Kind.TIMEOUT, Kind.COLLECT, Kind.SERVER_DIED})
_HOST_FATAL = frozenset({Kind.HOST_KEY, Kind.AUTH, Kind.PREFLIGHT})


class HarnessError(Exception):
    kind: Kind = Kind.ERROR
    # whether what the run left on its host may still be brought back though the host is gone: a Slurm
    # node gone with its job, whose folder the login host may reach on a shared filesystem
    collectable: bool = False

    def __init__(self, message: str, *, kind: Kind | None = None):
        super().__init__(message)
        self.message = message
        if kind is not None:
            self.kind = Kind(kind)   # a name from untyped code is checked too: a misspelt one fails here

    @property
    def retryable(self) -> bool:
        return self.kind.retried


class InputError(HarnessError):
    """A user mistake in a file we read: never a traceback, always exit 2."""

    kind = Kind.INPUT

    def __init__(self, message: str, *, file: str | None = None, key: str | None = None,
                 line: int | None = None):
        self.file, self.key, self.line = file, key, line
        where = ""
        if file:
            where = f"{file}:{line}" if line else str(file)
        if key:
            where = f"{where}: {key}" if where else key
        super().__init__(f"{where}: {message}" if where else message)


class RemoteError(HarnessError):
    """Something went wrong on (or on the way to) a host."""

    kind = Kind.ERROR

    def __init__(self, message: str, *, host: str | None = None, run_id: str | None = None,
                 command: str | None = None, output: str = "", kind: Kind | None = None):
        self.host, self.run_id, self.command, self.output = host, run_id, command, output
        prefix = f"[{host}] " if host else ""
        super().__init__(prefix + message, kind=kind)

    def detail(self) -> str:
        """The message with the command and the last lines of output, like Invoke's UnexpectedExit."""
        parts = [self.message]
        if self.command:
            parts.append(f"command: {self.command}")
        if self.output:
            parts.append("output (last lines):\n" + tail(self.output, 20))
        return "\n".join(parts)


class UnreachableError(RemoteError):
    kind = Kind.UNREACHABLE


class AuthError(RemoteError):
    kind = Kind.AUTH


class HostKeyError(RemoteError):
    kind = Kind.HOST_KEY


class RemoteTimeout(RemoteError):
    kind = Kind.TIMEOUT


class CommandFailed(RemoteError):
    def __init__(self, message: str, *, exit_code: int, host: str | None = None, run_id: str | None = None,
                 command: str | None = None, output: str = "", kind: Kind | None = None):
        self.exit_code = exit_code
        super().__init__(message, host=host, run_id=run_id, command=command, output=output, kind=kind)


class RunFailed(RemoteError):
    """A lifecycle stage decided the run failed; `kind` says how (launch, oom, server_died, ...)."""


def tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.rstrip("\n").splitlines()[-lines:])
