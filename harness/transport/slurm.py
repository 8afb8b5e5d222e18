"""A node of a Slurm allocation as a transport: every command a job step, run by srun on the login host.

`SlurmTransport` is a `ProcessTransport` whose processes are the login host's: each command (and
each file put and each tar-stream pull) becomes

    srun --jobid J --overlap --nodelist NODE -N1 -n1 --quiet \
        bash -c 'printf "harness-step ..."; exec bash -c "$1"' harness-step CMD

run over the login host's own transport (SSH, or this machine). `--overlap` lets a step share the
node with the steps still running (the benchmark, the heartbeat, a pull) and one task on one node is
one shell there. The run's lifecycle, its bounded output, its deadlines and the safe pull are the
shared ones of harness/transport/process.py, unchanged; what this module adds is

- the step's id: the first line the step writes is `harness-step JOB.STEP`, taken off the output
  before anyone reads it, and kept in `Result.step` (the manifest records the step that launched the
  server: `placement.step_id`);
- srun's own failures told apart from the command's: a step that never wrote that line never ran, so
  a command that ends without it (the node down, the job gone, srun refused) raises UnreachableError
  naming the node and job, and the executor treats the node as it treats a host that went away.

A run spanning several nodes gets one transport per node; each is its own (host, transport) pair.
"""

from __future__ import annotations

import re
import shlex
import threading
from pathlib import Path
from typing import Any

from harness.errors import CommandFailed, RemoteError, UnreachableError
from harness.transport.base import HostSpec, Pulled, Result, Transport, output_tail, shell_path, text
from harness.transport.process import Process, ProcessTransport

MARK = "harness-step"
STEP_LINE = re.compile(rb"^harness-step (\d+(?:_\d+)?)\.(\d+)$")
JOB_ID = re.compile(r"^\d+(?:_\d+)?$")
NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
HEAD_LIMIT = 200   # the step line is short: a longer first line is not ours
# what the node runs: the step's id first, then the command itself in a bash of its own
WRAPPER = f'printf "{MARK} %s.%s\\n" "$SLURM_JOB_ID" "$SLURM_STEP_ID" && exec bash -c "$1"'


def srun_command(job_id: str, node: str, command: str) -> str:
    """The login host's command line that runs `command` on `node` as a step of job `job_id`."""
    if not JOB_ID.match(job_id):
        raise ValueError(f"not a Slurm job id: {job_id!r}")
    if not NODE_NAME.match(node):
        raise ValueError(f"not a Slurm node name: {node!r}")
    return shlex.join(["srun", f"--jobid={job_id}", "--overlap", f"--nodelist={node}", "-N1", "-n1",
                       "--quiet", "bash", "-c", WRAPPER, "harness-step", command])


class _StepProcess:
    """The login host's srun process, its stdout without the step line (which `on_step` is told)."""

    def __init__(self, proc: Process, on_step, on_close):
        self._proc, self._on_step, self._on_close = proc, on_step, on_close
        self._head = bytearray()
        self._seen = False
        self.given_up = False   # killed by the transport's close while it ran

    def read(self, deadline: float) -> bytes:
        while not self._seen:
            chunk = self._proc.read(deadline)
            if not chunk:
                return b""  # it ended before the step line: srun never ran the command
            self._head += chunk
            line, newline, rest = bytes(self._head).partition(b"\n")
            if not newline:
                if len(self._head) > HEAD_LIMIT:
                    raise RemoteError(f"srun's step wrote {text(bytes(self._head[:80]))!r} before saying "
                                      "which step it is: not the harness's wrapper")
                continue
            found = STEP_LINE.match(line)
            if found is None:
                raise RemoteError(f"srun's step began with {text(line[:80])!r}, not its step id: not the "
                                  "harness's wrapper")
            self._seen = True
            self._on_step(f"{found[1].decode()}.{found[2].decode()}")
            if rest:
                return rest
        return self._proc.read(deadline)

    def wait(self, deadline: float) -> int:
        return self._proc.wait(deadline)

    def stderr(self) -> bytes:
        return self._proc.stderr()

    def kill(self) -> None:
        self._proc.kill()   # SIGTERM first: srun passes it on to the step's processes

    def close(self) -> None:
        self._on_close(self)
        self._proc.close()


class SlurmTransport(ProcessTransport):
    """Node `node` of job `job_id`, reached through `login` (a transport the caller opened; closed
    with this one). `host` names the node as the sweep knows it."""

    def __init__(self, host: HostSpec, login: Transport, *, job_id: str, node: str):
        srun_command(job_id, node, ":")   # validates both
        if not isinstance(login, ProcessTransport):   # the SSH and the local transport are
            raise TypeError(f"srun runs over a ProcessTransport, not {type(login).__name__}")
        self.host, self.login, self.job_id, self.node = host, login, job_id, node
        self._spawner: ProcessTransport = login
        # the sruns in flight: `close` (the heartbeat, once the node is lost) kills them, since an
        # srun whose node died waits on it forever, and a local login has no connection to drop
        self._live: set[_StepProcess] = set()
        self._lock = threading.Lock()
        self._current: _StepProcess | None = None   # the last command's (one thread uses a transport)
        self.step: str | None = None   # the last command's step, None while it has not started

    @property
    def compress_pulls(self) -> bool:
        return self._spawner.compress_pulls

    def _spawn(self, command: str, *, stdin: bytes | None, timeout: float) -> Process:
        self.step = None
        srun = self._spawner._spawn(srun_command(self.job_id, self.node, command), stdin=stdin, timeout=timeout)
        with self._lock:
            proc = self._current = _StepProcess(srun, self._started, self._live.discard)
            self._live.add(proc)
        return proc

    def _started(self, step: str) -> None:
        self.step = step

    def _lost(self, command: str) -> UnreachableError:
        return UnreachableError(f"node {self.node} of job {self.job_id} was given up on (its connection closed "
                                "while the command ran)", host=self.host.name, command=command)

    def _not_started(self, command: str, stderr: str) -> UnreachableError:
        said = stderr.strip().splitlines()
        return UnreachableError(f"srun could not run a step on node {self.node} of job {self.job_id}"
                                + (f": {said[-1][:300]}" if said else ""),
                                host=self.host.name, command=command, output=stderr)

    def run(self, command: str, *, timeout: float, check: bool = True,
            stdin: bytes | None = None) -> Result:
        result = super().run(command, timeout=timeout, check=False, stdin=stdin)
        if self._current is not None and self._current.given_up:
            raise self._lost(command)
        if self.step is None:
            raise self._not_started(command, result.stderr)
        result = Result(result.command, result.exit_code, result.stdout, result.stderr, step=self.step)
        if check and not result.ok:
            raise CommandFailed(f"command exited with {result.exit_code}", exit_code=result.exit_code,
                                host=self.host.name, command=command,
                                output=output_tail(result.stdout.encode(), result.stderr.encode()))
        return result

    def put(self, data: bytes, remote_path: str, *, mode: int = 0o644) -> None:
        target = shell_path(remote_path)
        parent = shell_path(str(Path(remote_path).parent)) if "/" in remote_path else "."
        tmp = shell_path(f"{remote_path}.tmp-put")
        # umask 077 first: a secret is never readable by others, even before the chmod
        self.run(f"umask 077 && mkdir -p {parent} && rm -f {tmp} && cat > {tmp} && chmod {mode:o} {tmp} "
                 f"&& mv -f {tmp} {target}", timeout=120, stdin=data)

    def pull(self, remote_dir: str, local_dir: Path, *, timeout: float,
             max_bytes: int | None = None, exclude: tuple[str, ...] = ()) -> Pulled:
        try:
            return super().pull(remote_dir, local_dir, timeout=timeout, max_bytes=max_bytes, exclude=exclude)
        except CommandFailed as e:
            if self._current is not None and self._current.given_up:
                raise self._lost(e.command or remote_dir) from None
            if self.step is None:
                raise self._not_started(e.command or remote_dir, e.output) from None
            raise

    def placement(self, step: str | None) -> dict[str, Any]:
        """Where a run on this node ran, for its manifest: `step` is the step that launched its server."""
        return {"scheduler": "slurm", "job_id": self.job_id, "step_id": step, "nodes": [self.node]}

    def close(self) -> None:
        with self._lock:
            live = list(self._live)
        for proc in live:
            proc.given_up = True
            proc.kill()
        self.login.close()
