"""`run` and `pull` written once, over a `Process`, for both the SSH and the local transport.

A transport only has to start a command in its own process group (`_spawn`) and say how to kill it;
the deadline, the bounded output, CommandFailed and RemoteTimeout, and the one safe way of pulling
a directory live here, so the local transport is a faithful stand-in for a remote host in tests.
"""

from __future__ import annotations

import tarfile
import time
from pathlib import Path
from typing import Protocol

from harness.errors import CommandFailed, Kind, RemoteError, RemoteTimeout
from harness.transport import tarpull
from harness.transport.base import HostSpec, Pulled, Result, Tail, output_tail, text


class Process(Protocol):
    """A command running on the host in its own process group.

    `read` and `wait` raise TimeoutError once `deadline` (a time.monotonic value) has passed; `kill`
    ends the whole process group, bounded by base.KILL_BUDGET_S; `close` releases pipes or channel.
    """

    def read(self, deadline: float) -> bytes: ...  # the next stdout chunk; b"" at its end

    def wait(self, deadline: float) -> int: ...  # the exit code, once stdout has ended

    def stderr(self) -> bytes: ...  # the last OUTPUT_LIMIT bytes of stderr so far

    def kill(self) -> None: ...

    def close(self) -> None: ...


class ProcessTransport:
    """The shared half of a transport: subclasses provide `_spawn`, `put` and `close`."""

    host: HostSpec

    @property
    def compress_pulls(self) -> bool:
        """Compress pull streams: worth it over a network, wasted CPU on this machine."""
        return False

    def _spawn(self, command: str, *, stdin: bytes | None, timeout: float, lasting: bool = False) -> Process:
        """Start `command`. `lasting`: its process may outlive the command's own end (a Slurm step that
        holds a server) and be looked at again later, so it must not share what commands that end share
        (SSH's command starter runs one command to its end at a time)."""
        raise NotImplementedError

    @staticmethod
    def _abandon(proc: Process | None) -> bytes:
        """Kill a process we stopped waiting for (timed out, or its output refused); its stderr."""
        if proc is None:  # it never started: the host did not answer in time
            return b""
        proc.kill()
        return proc.stderr()

    def run(self, command: str, *, timeout: float, check: bool = True,
            stdin: bytes | None = None) -> Result:
        deadline = time.monotonic() + timeout
        stdout = Tail()
        proc = None
        try:
            proc = self._spawn(command, stdin=stdin, timeout=timeout)
            while chunk := proc.read(deadline):
                stdout.feed(chunk)
            code = proc.wait(deadline)
            stderr = proc.stderr()
        except TimeoutError:
            stderr = self._abandon(proc)
            raise RemoteTimeout(f"command timed out after {timeout:g}s", host=self.host.name,
                                command=command, output=output_tail(stdout.value(), stderr)) from None
        finally:
            if proc is not None:
                proc.close()
        result = Result(command, code, text(stdout.value()), text(stderr))
        if check and not result.ok:
            raise CommandFailed(f"command exited with {code}", exit_code=code, host=self.host.name,
                                command=command, output=output_tail(stdout.value(), stderr))
        return result

    def pull(self, remote_dir: str, local_dir: Path, *, timeout: float,
             max_bytes: int | None = None, exclude: tuple[str, ...] = ()) -> Pulled:
        deadline = time.monotonic() + timeout
        command = tarpull.tar_command(remote_dir, compress=self.compress_pulls, exclude=exclude, announce=True)
        label = f"{self.host.name}:{remote_dir}"
        proc = None
        try:
            with tarpull.Staging(Path(local_dir), label=label, max_bytes=max_bytes) as staging:
                proc = self._spawn(command, stdin=None, timeout=timeout)
                broken = None
                try:
                    staging.extract(lambda: proc.read(deadline), announced=True)
                except tarfile.TarError as e:
                    broken = e  # a failed tar or a lost connection says more: check those first
                code = proc.wait(deadline)
                if code != 0:
                    raise CommandFailed(f"pulling {remote_dir} failed (exit {code})", exit_code=code,
                                        host=self.host.name, command=command,
                                        output=text(proc.stderr()), kind=Kind.COLLECT) from broken
                if broken:
                    raise RemoteError(f"pulling {remote_dir}: not a valid tar stream ({broken})",
                                      host=self.host.name, command=command,
                                      output=text(proc.stderr()), kind=Kind.COLLECT) from broken
                return staging.commit()
        except TimeoutError:
            stderr = self._abandon(proc)
            raise RemoteTimeout(f"pulling {remote_dir} timed out after {timeout:g}s", host=self.host.name,
                                command=command, output=text(stderr)) from None
        except (tarpull.TooLarge, tarpull.Refused):
            self._abandon(proc)
            raise
        finally:
            if proc is not None:
                proc.close()
