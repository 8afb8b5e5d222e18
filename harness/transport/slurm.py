"""A node of a Slurm allocation as a transport: every command a job step, run by srun on the login host.

`SlurmTransport` is a `ProcessTransport` whose processes are the login host's: each command (and
each file put and each tar-stream pull) becomes

    srun --jobid J --overlap --nodelist NODE -N1 -n1 --cpus-per-task=1 --export=ALL --quiet \
        bash --norc -c 'exec PYTHON -c "$1" "$2"' harness-step WRAPPER CMD

run over the login host's own transport (SSH, or this machine). `--overlap` lets a step share the
node with the steps still running (a server, the benchmark, the heartbeat, a pull); one task on one
node is one command there. The run's lifecycle, its bounded output, its deadlines and the safe pull
are the shared ones of harness/transport/process.py, unchanged (the deadline is kept here: the login
transport's own timers get a step's whole life). WRAPPER, run on the node by the venv's Python
(standard library only), adds:

- the step's id: its first line is `harness-step JOB.STEP` (whatever the node's shell printed before
  it, 64 kB at most, is dropped), taken off the output before anyone reads it and kept in
  `Result.step` (the manifest records the step that launched the server: `placement.step_id`);
- srun's own failures told apart from the command's: a step that never wrote that line never ran, so
  a command that ends without it (the node down, the job gone, srun refused) raises UnreachableError
  naming the node and job, and the executor treats the node as it treats a host that went away;
- a step that lasts as long as what its command started. Slurm ends every process left in a step
  when the step ends (proctrack/cgroup does, whatever setsid did), so the launch's step must outlive
  the launch command while the server runs. The wrapper becomes the subreaper of what the command
  starts and waits for all of it before it exits; the command's own end is marked in the output,
  which comes framed (`LENGTH\n` and that many bytes, then `end CODE\n`), so `run` returns as soon
  as the command ends, and the srun that holds the server's step is kept (`close` ends it, and with
  it the server, should teardown not have).

A run spanning several nodes gets one transport per node; each is its own (host, transport) pair.

The job itself may end under the sweep (its time limit, a scancel, a preemption). Then every step
fails, and each failure alone looks like a node gone away, which the executor retries with a
backoff of minutes per node. So a step that fails asks squeue once whether the job still holds its
nodes (`JobWatch`, shared by every transport of the job); once it has ended, the failure is
`JobEnded`, naming the job and why, and every later command of every node of the job fails so at
once, without an srun.
"""

from __future__ import annotations

import re
import secrets
import shlex
import threading
import time
from pathlib import Path
from typing import Any

from harness.errors import CommandFailed, HarnessError, RemoteError, RemoteTimeout, UnreachableError
from harness.transport import tarpull
from harness.transport.base import HostSpec, Pulled, Result, Transport, output_tail, shell_path, text
from harness.transport.process import Process, ProcessTransport

STEP_LINE = re.compile(rb"^harness-step (\d+(?:_\d+)?)\.(\d+)$")
FRAME = re.compile(rb"^(\d{1,7})$")
END = re.compile(rb"^end (-?\d{1,5})$")
JOB_ID = re.compile(r"^\d+(?:_\d+)?$")
NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
CHUNK = 65536      # the largest frame the wrapper writes (its os.read)
HELD_S = 7 * 86400  # how long the login host's own timers let an srun live: a step may hold a server
HEAD_LIMIT = 200   # a step line or a frame header is short: a longer line is not the wrapper's
BEFORE_LIMIT = 64 << 10
"""What may come before the step line and is dropped: what the node's shell printed as it started (a
`BASH_ENV` file, which srun's copy of the login environment may name: Lmod sets one)."""
SQUEUE_TIMEOUT_S = 30
ENDING_WAIT_S = 20   # how long a job squeue calls COMPLETING is asked again for its final state
# squeue's states of a job that no longer holds its nodes, and how the error says each
ENDED = {"TIMEOUT": "reached its time limit", "CANCELLED": "was cancelled", "DEADLINE": "reached its deadline",
         "PREEMPTED": "was preempted", "NODE_FAIL": "lost a node", "BOOT_FAIL": "failed to boot its nodes",
         "COMPLETED": "completed", "FAILED": "failed", "OUT_OF_MEMORY": "ran out of memory",
         "REVOKED": "was revoked", "SPECIAL_EXIT": "ended"}
GONE = re.compile(r"Slurm job \S+ has expired|Invalid job id|Job has expired|Expired or invalid job")

# What runs on the node (Python >= 3.9, standard library only). PR_SET_CHILD_SUBREAPER (36) makes what
# the command leaves running (a server, setsid or not) our child once its parent exits, so the
# step, and with it the server, lasts until all of it has ended.
WRAPPER = """\
import ctypes, os, subprocess, sys
try:
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)
except Exception:
    pass
out = sys.stdout.buffer
env = os.environ
out.write(("harness-step %s.%s\\n" % (env.get("SLURM_JOB_ID", ""), env.get("SLURM_STEP_ID", ""))).encode())
out.flush()
# BASH_ENV was read by the shell that started us (its exports are ours): read again, its output would
# come before the command's own
child = subprocess.Popen(["bash", "--norc", "-c", sys.argv[1]], stdout=subprocess.PIPE,
                         env={k: v for k, v in env.items() if k != "BASH_ENV"})
while True:
    data = os.read(child.stdout.fileno(), 65536)
    if not data:
        break
    out.write(b"%d\\n" % len(data) + data)
    out.flush()
code = child.wait()
code = code if code >= 0 else 128 - code
out.write(b"end %d\\n" % code)
out.flush()
while True:
    try:
        os.wait()
    except ChildProcessError:
        break
sys.exit(code)
"""


def srun_command(job_id: str, node: str, command: str, *, python: str = "python3", cpus: int = 1) -> str:
    """The login host's command line that runs `command` on `node` as a step of job `job_id`, with
    `cpus` CPUs: the node's whole share of the allocation (`slurm.cpus_per_node`), since the step
    that launches a server is the server's; `--overlap` lets the other steps share them."""
    if not JOB_ID.match(job_id):
        raise ValueError(f"not a Slurm job id: {job_id!r}")
    if not NODE_NAME.match(node):
        raise ValueError(f"not a Slurm node name: {node!r}")
    if type(cpus) is not int or cpus < 1:
        raise ValueError(f"not a CPU count: {cpus!r}")
    # srun takes options from the environment too, and the harness may run inside a job of its own (a
    # batch job on the cluster): its `--export=NONE` (SLURM_EXPORT_ENV) would start the step without
    # PATH, its `-c N` (SRUN_CPUS_PER_TASK) ask more CPUs than the step has. Said on the command line,
    # they are ours: the command line wins.
    return shlex.join(["srun", f"--jobid={job_id}", "--overlap", f"--nodelist={node}", "-N1", "-n1",
                       f"--cpus-per-task={cpus}", "--export=ALL", "--quiet",
                       "bash", "--norc", "-c", f'exec {shell_path(python)} -c "$1" "$2"', "harness-step",
                       WRAPPER, command])


def ended_reason(state: str, reason: str) -> str | None:
    """How squeue's `STATE|REASON` of a job that no longer holds its nodes is said; None for a job
    that still does (or a state this harness does not know: nothing is concluded from it)."""
    if state == "COMPLETING" and reason == "TimeLimit":
        return "reached its time limit (squeue: COMPLETING, TimeLimit)"
    if state not in ENDED:
        return None
    return f"{ENDED[state]} (squeue: {state}{', ' + reason if reason not in ('', 'None') else ''})"


class JobEnded(UnreachableError):
    """The job of a node ended (time limit, scancel...): its nodes are gone for the rest of the sweep.
    What a run left in its folder may still be pulled through the login host (`SlurmTransport.pull`)."""

    collectable = True


class JobWatch:
    """Whether one job still holds its nodes, asked of squeue when one of its steps fails, and kept
    once it has ended: every transport of the job (each node's, the heartbeat's) shares one."""

    def __init__(self, job_id: str):
        if not JOB_ID.match(job_id):
            raise ValueError(f"not a Slurm job id: {job_id!r}")
        self.job_id = job_id
        self.ended: str | None = None   # why, once the job has ended: `Slurm job 42 reached its time limit`
        self._lock = threading.Lock()

    def check(self, login: ProcessTransport, srun_said: str) -> str | None:
        """Why the job ended, or None while it holds its nodes (or Slurm cannot be asked): one squeue
        at a time, the others waiting for its answer."""
        with self._lock:
            if self.ended is None:
                why = self._ask(login, srun_said)
                self.ended = f"Slurm job {self.job_id} {why}" if why else None
            return self.ended

    def _ask(self, login: ProcessTransport, srun_said: str) -> str | None:
        deadline = time.monotonic() + ENDING_WAIT_S
        said_gone = GONE.search(srun_said)
        while True:
            try:
                said = login.run(f"squeue -h -t all -j {self.job_id} -o '%T|%r'", timeout=SQUEUE_TIMEOUT_S,
                                 check=False)
            except HarnessError:   # the login host or the controller did not answer: nothing is concluded
                said = None
            lines = said.stdout.strip().splitlines() if said is not None and said.ok else []
            state, _, reason = (lines[-1].strip() if lines else "").partition("|")
            if said is not None and not lines and (GONE.search(said.stderr) or said_gone):
                # purged already (MinJobAge): squeue no longer knows it, and srun said it ended
                return "has ended (" + (f"srun: {said_gone[0]}" if said_gone else "squeue: Invalid job id") + ")"
            if state == "COMPLETING" and reason != "TimeLimit" and time.monotonic() < deadline:
                time.sleep(0.5)   # its steps are being killed: its final state says why
                continue
            if state == "COMPLETING":
                return ended_reason(state, reason) or f"has ended (squeue: COMPLETING, {reason})"
            if said is None and said_gone:
                return f"has ended (srun: {said_gone[0]})"
            return ended_reason(state, reason)


class _StepProcess:
    """The login host's srun, its output unframed: the step line told to `on_step`, the command's
    bytes passed on, and its end (`end CODE`) read as the end of the output."""

    def __init__(self, proc: Process, on_step, on_close):
        self._proc, self._on_step, self._on_close = proc, on_step, on_close
        self._buf = bytearray()
        self._seen = False
        self._open = True          # the stream has not ended
        self.code: int | None = None   # the command's exit code, once its end frame came
        self.given_up = False      # killed by the transport's close while it ran

    def _line(self, deadline: float, limit: int = HEAD_LIMIT) -> bytes | None:
        """The next whole line of the stream, None at its end."""
        while b"\n" not in self._buf:
            if len(self._buf) > limit:
                raise RemoteError(f"srun's step wrote {text(bytes(self._buf[:80]))!r}: not the harness's wrapper")
            chunk = self._proc.read(deadline)
            if not chunk:
                return None
            self._buf += chunk
        line, _, rest = bytes(self._buf).partition(b"\n")
        self._buf = bytearray(rest)
        return line

    def _step(self, deadline: float) -> re.Match[bytes] | None:
        """The wrapper's step line, past what the node's shell printed before it (BEFORE_LIMIT at most);
        None when the stream ends first."""
        first, before = None, 0
        while (line := self._line(deadline, BEFORE_LIMIT)) is not None:
            if found := STEP_LINE.match(line):
                return found
            first = line if first is None else first
            before += len(line) + 1
            if before > BEFORE_LIMIT:
                raise RemoteError(f"srun's step began with {text(first[:80])!r} and no step id in "
                                  f"{BEFORE_LIMIT >> 10} kB: not the harness's wrapper")
        return None

    def read(self, deadline: float) -> bytes:
        if not self._open:
            return b""
        if not self._seen:
            found = self._step(deadline)
            if found is None:
                self._open = False
                return b""   # it ended before the step line: srun never ran the command
            self._seen = True
            self._on_step(f"{found[1].decode()}.{found[2].decode()}")
        header = self._line(deadline)
        if header is None:
            self._open = False   # the step ended without its end frame: killed, or srun lost it
            return b""
        if (end := END.match(header)) is not None:
            self._open, self.code = False, int(end[1])
            return b""
        frame = FRAME.match(header)
        if frame is None or int(frame[1]) > CHUNK:
            raise RemoteError(f"srun's step wrote {text(header[:80])!r} where a frame begins: not the "
                              "harness's wrapper")
        size = int(frame[1])
        while len(self._buf) < size:
            chunk = self._proc.read(deadline)
            if not chunk:
                self._open = False
                return b""
            self._buf += chunk
        data = bytes(self._buf[:size])
        del self._buf[:size]
        return data

    def wait(self, deadline: float) -> int:
        if self.code is not None:
            return self.code   # the command ended; the step may go on holding what it started
        return self._proc.wait(deadline)

    def running(self) -> bool:
        """Whether the srun itself still runs (the step holds a server). Not once the login host's
        link was lost: that srun is out of reach (the connection made again has no hold on it), and
        what its step holds is stopped as any server is, by teardown or by the node's watchdog."""
        try:
            self._proc.wait(time.monotonic() + 0.1)   # long enough to see its pipes' end
        except TimeoutError:
            return True
        except RemoteError:
            return False
        return False

    def stderr(self) -> bytes:
        return self._proc.stderr()

    def kill(self) -> None:
        self._proc.kill()   # SIGTERM first: srun passes it on to the step's processes

    def close(self) -> None:
        self._on_close(self)

    def release(self) -> None:
        self._proc.close()



class SlurmTransport(ProcessTransport):
    """Node `node` of job `job_id`, reached through `login` (a transport the caller opened; closed
    with this one). `host` names the node as the sweep knows it."""

    def __init__(self, host: HostSpec, login: Transport, *, job_id: str, node: str, python: str = "python3",
                 cpus: int = 1, watch: JobWatch | None = None):
        srun_command(job_id, node, ":", cpus=cpus)   # validates them
        if not isinstance(login, ProcessTransport):   # the SSH and the local transport are
            raise TypeError(f"srun runs over a ProcessTransport, not {type(login).__name__}")
        self.host, self.login, self.job_id, self.node, self.python = host, login, job_id, node, python
        self.cpus = cpus
        self.watch = watch if watch is not None else JobWatch(job_id)
        if self.watch.job_id != job_id:
            raise ValueError(f"the watch of job {self.watch.job_id} for a node of job {job_id}")
        self._spawner: ProcessTransport = login
        # the sruns in flight: `close` (the heartbeat, once the node is lost) kills them, since an
        # srun whose node died waits on it forever, and a local login has no connection to drop
        self._live: set[_StepProcess] = set()
        self._kept: list[_StepProcess] = []   # ended commands whose steps hold what they started
        self._lock = threading.Lock()
        self._current: _StepProcess | None = None   # the last command's (one thread uses a transport)
        self.step: str | None = None   # the last command's step, None while it has not started

    @property
    def compress_pulls(self) -> bool:
        return self._spawner.compress_pulls

    def _spawn(self, command: str, *, stdin: bytes | None, timeout: float, lasting: bool = False) -> Process:
        self.step = None
        if self.watch.ended:   # every srun would fail: said at once
            raise self._ended(command)
        self._reap()
        # The deadline is kept here (ProcessTransport.run and pull stop waiting at it and kill the
        # srun); the login transport's own timers (SSH: a watchdog, coreutils timeout) get the step's
        # whole life instead, or they would end a kept srun, and the server its step holds, early.
        srun = self._spawner._spawn(srun_command(self.job_id, self.node, command, python=self.python,
                                                 cpus=self.cpus),
                                    stdin=stdin, timeout=max(timeout, HELD_S), lasting=True)
        with self._lock:
            proc = self._current = _StepProcess(srun, self._started, self._done)
            self._live.add(proc)
        return proc

    def _done(self, proc: _StepProcess) -> None:
        """A command is over: its srun closed, or kept while its step holds what the command started."""
        with self._lock:
            self._live.discard(proc)
            keep = proc.code is not None and not proc.given_up and proc.running()
            if keep:
                self._kept.append(proc)
        if not keep:
            proc.release()

    def _reap(self) -> None:
        """Close the kept sruns whose steps have ended (their servers stopped)."""
        with self._lock:
            ended = [p for p in self._kept if not p.running()]
            self._kept = [p for p in self._kept if p not in ended]
        for proc in ended:
            proc.release()

    def _started(self, step: str) -> None:
        self.step = step

    def _lost(self, command: str) -> UnreachableError:
        return UnreachableError(f"node {self.node} of job {self.job_id} was given up on (its connection closed "
                                "while the command ran)", host=self.host.name, command=command)

    def _ended(self, command: str, output: str = "") -> JobEnded:
        return JobEnded(f"node {self.node} is gone with its job: {self.watch.ended}; no new allocation is taken "
                        "(`harness sweep --resume --retry-failed` runs what failed on a new one)",
                        host=self.host.name, command=command, output=output)

    def _failed(self, command: str, stderr: str) -> JobEnded | None:
        """A step that failed as srun's (never started, or cut short): JobEnded when its job has ended."""
        return self._ended(command, stderr) if self.watch.check(self._spawner, stderr) else None

    def _cut_short(self, command: str, result: Result) -> UnreachableError:
        """The step ended before the command did: the wrapper itself was killed, by the node going
        down, the job ending or srun losing the step; never the command's own failure (that comes
        in its end frame)."""
        said = result.stderr.strip().splitlines()
        return UnreachableError(f"the step on node {self.node} of job {self.job_id} ended before its command did "
                                f"(srun exit {result.exit_code}" + (f": {said[-1][:300]})" if said else ")"),
                                host=self.host.name, command=command, output=result.stderr)

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
            raise self._failed(command, result.stderr) or self._not_started(command, result.stderr)
        if self._current is not None and self._current.code is None:
            raise self._failed(command, result.stderr) or self._cut_short(command, result)
        result = Result(result.command, result.exit_code, result.stdout, result.stderr, step=self.step)
        if check and not result.ok:
            raise CommandFailed(f"command exited with {result.exit_code}", exit_code=result.exit_code,
                                host=self.host.name, command=command,
                                output=output_tail(result.stdout.encode(), result.stderr.encode()))
        return result

    def put(self, data: bytes, remote_path: str, *, mode: int = 0o644) -> None:
        target = shell_path(remote_path)
        parent = shell_path(str(Path(remote_path).parent)) if "/" in remote_path else "."
        # a name of its own: nodes often share the home folder, and two may upload the same file at once
        tmp = shell_path(f"{remote_path}.tmp-{secrets.token_hex(4)}")
        # umask 077 first: a secret is never readable by others, even before the chmod
        self.run(f"umask 077 && mkdir -p {parent} && cat > {tmp} && chmod {mode:o} {tmp} && mv -f {tmp} {target} "
                 f"|| {{ rc=$?; rm -f {tmp}; exit $rc; }}", timeout=120 + len(data) / 1e6, stdin=data)

    def pull(self, remote_dir: str, local_dir: Path, *, timeout: float,
             max_bytes: int | None = None, exclude: tuple[str, ...] = ()) -> Pulled:
        deadline = time.monotonic() + timeout
        if self.watch.ended is None:
            try:
                return self._pull_from_node(remote_dir, local_dir, timeout=timeout, max_bytes=max_bytes,
                                            exclude=exclude)
            except UnreachableError:   # JobEnded among them: the job may have ended during the pull
                if self.watch.ended is None:
                    raise
        # the node is gone; its folder may be on a filesystem the login host shares (in the time left)
        return self._pull_from_login(remote_dir, local_dir, deadline=deadline, max_bytes=max_bytes, exclude=exclude)

    def _pull_from_node(self, remote_dir: str, local_dir: Path, *, timeout: float, max_bytes: int | None,
                        exclude: tuple[str, ...]) -> Pulled:
        """The pull as a step on the node, its failures told apart as `run`'s are (a pull cut short
        leaves nothing at `local_dir`). Whatever went wrong before the step said how its command
        ended (tar failed, or its stream broke off or could not be read) asks first whether the job
        has ended: the stream of a cancelled job's step breaks off anywhere, and its srun may even
        exit 0."""
        try:
            return super().pull(remote_dir, local_dir, timeout=timeout, max_bytes=max_bytes, exclude=exclude)
        except (RemoteTimeout, UnreachableError, tarpull.TooLarge):
            raise   # the pull's own deadline or limit, or the login host lost: not the step's end
        except RemoteError as e:
            command, output = e.command or remote_dir, e.output or ""
            current = self._current
            if current is not None and current.given_up:
                raise self._lost(command) from None
            if self.step is None or (current is not None and current.code is None):
                if ended := self._failed(command, output):
                    raise ended from e
                if isinstance(e, CommandFailed):   # srun's own failure: the command never ended
                    raise (self._not_started(command, output) if self.step is None else
                           self._cut_short(command, Result(command, e.exit_code, "", output))) from None
            raise

    def _pull_from_login(self, remote_dir: str, local_dir: Path, *, deadline: float, max_bytes: int | None,
                         exclude: tuple[str, ...]) -> Pulled:
        """The folder of a node whose job has ended, pulled from the login host by `deadline`: there on
        a shared filesystem (a cluster's usual workdir), not on a node's local disk, which is JobEnded.
        Over a connection of its own: the heartbeat closes this transport's (`close`) once the node is
        lost."""
        from harness.transport import connect  # the package's, which imports this module
        login = connect(self.login.host)
        try:
            return login.pull(remote_dir, local_dir, timeout=max(1.0, deadline - time.monotonic()),
                              max_bytes=max_bytes, exclude=exclude)
        except CommandFailed as e:
            raise JobEnded(f"node {self.node} is gone with its job ({self.watch.ended}), and {remote_dir} is not "
                           f"on the login host {self.login.host.name} either: a workdir on the node's own disk is "
                           "gone with it", host=self.host.name, command=e.command, output=e.output) from e
        except RemoteTimeout as e:
            raise JobEnded(f"node {self.node} is gone with its job ({self.watch.ended}), and pulling {remote_dir} "
                           f"from the login host {self.login.host.name} ran out of time ({e.message})",
                           host=self.host.name, command=e.command, output=e.output) from e
        finally:
            login.close()

    @property
    def gone(self) -> str | None:
        return self.watch.ended

    def placement(self, step: str | None) -> dict[str, Any]:
        """Where a run on this node ran, for its manifest: `step` is the step that launched its server."""
        return {"scheduler": "slurm", "job_id": self.job_id, "step_id": step, "nodes": [self.node]}

    def close(self) -> None:
        """Kill the sruns in flight (their commands fail as unreachable) and those still holding a
        step (a server teardown did not stop ends with its step), then the login connection."""
        with self._lock:
            live, kept, self._kept = list(self._live), self._kept, []
        for proc in live:
            proc.given_up = True
            proc.kill()
        for proc in kept:
            proc.kill()
            proc.release()
        self.login.close()
