"""The harness's hands on a GPU host: standard library only, run in the host's venv (`harness.pyz agent`).

Each subcommand does one lifecycle step locally on the host, where polling is cheap, and prints one JSON
object on stdout, so the orchestrator needs one SSH command per step instead of one per poll:

    probe    --module M[,M...] [--imported F] --port P --bind H --dir D
                                             python, engine import, port holder, disk, GPUs
    wait     --url U --pid-file F --timeout S         health: healthy | died | timeout (+ log tail)
    profile  --spec JSON --url U --dir D ...         start the engine's profiler, keep traffic
                                                      flowing, await every rank's trace file
    stop     --pid-file F --port P --timeout S        kill the server's process group (and the processes
                                                      that left it, by the run's marker), confirm the port closed
    watch    --pid-file F --lease L --lease-s S       beside the server: kill it when the lease lapses
    reap     --workdir W --lease-s S                  stop servers of earlier sweeps whose lease lapsed
    facts    --dir D [--module M] [--distribution N]  python, packages, the engine's version and commit:
                                                      D/NAME.txt each

Python >= 3.9, no third-party imports: it must run in whatever venv the host has.

`wait` and `profile` take `--api-key-env NAME` for a server launched with an API key: every request
then carries `Authorization: Bearer` with the value of that environment variable (the key itself is
never on a command line).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any
from urllib.parse import urlsplit

from .names import MARKER, RunFiles


def emit(obj: dict) -> int:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()
    return 0


def log_tail(path: str, lines: int = 60) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            return "\n".join(f.read().decode("utf-8", "replace").splitlines()[-lines:])
    except OSError:
        return ""


EXCEPTION_LINE = re.compile(r"\b([A-Z]\w*(?:Error|Exception|Exit)): \S")
ARGPARSE_LINE = re.compile(r"^\S+: error: ")


def root_error(path: str, limit: int = 256 * 1024) -> str:
    """The line of a server log most likely to say why it died: the last exception line that does not
    defer to an earlier one ("see root cause above"), else the earliest that does, else argparse's
    `prog: error: ...`; "" when there is none. Engines log one failure several times over, wrapped
    by each process it passes through (vLLM: Worker, EngineCore, API server)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    found = [line.strip() for line in lines if (EXCEPTION_LINE.search(line) or ARGPARSE_LINE.search(line))
             and "WARNING" not in line]
    plain = [line for line in found if "above" not in line.lower()]
    line = plain[-1] if plain else (found[0] if found else "")
    return line if len(line) <= 400 else line[:397] + "..."


HEADERS: dict[str, str] = {}
"""Sent with every request (`--api-key-env`: the server's Authorization)."""


HTTP_BODY_MOST = 4096      # what of an answer's body the agent keeps (a health page, an error message)
HTTP_HEAD_MOST = 64 * 1024


def http(method: str, url: str, body: dict | None = None, timeout: float = 10.0) -> tuple[int, str]:
    """(status, the first HTTP_BODY_MOST bytes of the body as text); status 0 with the reason when the
    connection failed, or when what came back is not an HTTP answer.

    One request on a connection of its own (`Connection: close`), plain HTTP/1.1 to the server on this
    host: every URL the harness gives the agent is one. A socket rather than urllib, which brings
    http.client, email and ssl: 40 ms of CPU at every start of `wait`, on every host at every run's
    start, where the hosts of a sweep start their runs at about the same time."""
    parts = urlsplit(url)
    payload = json.dumps(body).encode() if body is not None else b""
    headers = {"Host": parts.netloc, **HEADERS}
    if body is not None:
        headers["Content-Type"] = "application/json"
    if body is not None or method not in ("GET", "HEAD"):
        headers["Content-Length"] = str(len(payload))
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    request = (f"{method} {target} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
               + "Connection: close\r\n\r\n").encode("latin-1") + payload
    deadline = time.monotonic() + timeout
    got = bytearray()
    try:
        with socket.create_connection((parts.hostname, parts.port or 80), timeout=timeout) as s:
            s.sendall(request)
            while not _answered(got):
                s.settimeout(max(0.001, deadline - time.monotonic()))
                chunk = s.recv(65536)
                if not chunk:
                    break
                got += chunk
    except OSError as e:   # refused, reset, timed out: what came before a cut is still an answer
        if b"\r\n\r\n" not in got:
            return 0, str(e) or type(e).__name__
    return _answer(bytes(got))


# The head is read here with two regular expressions rather than exchange.parse_head: importing the
# benchmark client's exchange brings dataclasses and inspect, 15-25 ms of every start, most of what
# leaving urllib saved.
def _answered(got: bytearray) -> bool:
    """Whether `got` holds an answer's head and all of its body the agent keeps (or too much head)."""
    end = got.find(b"\r\n\r\n")
    if end < 0:
        return len(got) > HTTP_HEAD_MOST
    body = len(got) - end - 4
    if body >= HTTP_BODY_MOST + 64:   # enough, with room for chunk-size lines
        return True
    length = re.search(rb"\r\ncontent-length:[ \t]*(\d+)", got[:end], re.IGNORECASE)
    if length is not None:
        return body >= int(length.group(1))
    return got.endswith(b"\r\n0\r\n\r\n") or got[end + 4:].startswith(b"0\r\n\r\n")


def _answer(got: bytes) -> tuple[int, str]:
    head, found, body = got.partition(b"\r\n\r\n")
    status = re.match(rb"HTTP/\d(?:\.\d)? (\d{3})(?:[ \t]|\r|$)", head)
    if not found or status is None:
        first = head.split(b"\r\n", 1)[0][:100]
        return 0, f"not an HTTP answer: {first.decode('latin-1')!r}" if got else "no answer"
    if re.search(rb"\r\ntransfer-encoding:[^\r]*chunked", head, re.IGNORECASE):
        body = _dechunked(body)
    return int(status.group(1)), body[:HTTP_BODY_MOST].decode("utf-8", "replace")


def _dechunked(data: bytes) -> bytes:
    """The body of a chunked answer, as much of it as `data` holds."""
    out, at = bytearray(), 0
    while len(out) < HTTP_BODY_MOST:
        line_end = data.find(b"\r\n", at)
        size = re.match(rb"[0-9A-Fa-f]+", data[at:line_end]) if line_end >= 0 else None
        if size is None or int(size.group(0), 16) == 0:
            break
        start = line_end + 2
        out += data[start:start + int(size.group(0), 16)]
        at = start + int(size.group(0), 16) + 2
    return bytes(out)


# --- process and port facts -------------------------------------------------------------------------

def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def read_pid(path: str) -> int | None:
    """The pid a pid file records, if it still names the process (or process group) we started.

    A pid file holds `PID START BOOT`: the process's start time (field 22 of /proc/PID/stat, in clock
    ticks since boot) and the boot id. Pids are reused: after a reboot, or once the group has emptied,
    the same number can name an unrelated job, and signalling it killed two of them in an audit. So a
    pid whose start time or boot differs is stale, and so is a record without them. While any member of
    a group lives, Linux gives its number to no new process: a recorded group leader that is gone
    (no /proc/PID) still names our group, whose members may linger."""
    try:
        with open(path) as f:
            words = f.read().split()
        pid = int(words[0])
    except (OSError, ValueError, IndexError):
        return None
    if len(words) < 3 or words[2] != boot_id():
        return None
    started = start_time(pid)
    return pid if started is None or started == words[1] else None


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (after the command, which may hold spaces and parentheses)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def write_pid(path: str, pid: int) -> None:
    """A pid file with the identity `read_pid` checks, written without following a planted link."""
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"{pid} {start_time(pid)} {boot_id()}\n")
    os.replace(tmp, path)


def port_listeners(port: int) -> list[dict]:
    """Processes with a listening TCP socket on `port`, from /proc (no ss/lsof needed)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    if parts[3] == "0A" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(parts[9])
        except OSError:
            continue
    holders: list[dict] = []
    if not inodes:
        return holders
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in inodes:
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        cmd = f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
                except OSError:  # it exited while we looked
                    continue
                holders.append({"pid": int(pid), "command": cmd[:300]})
                break
    return holders or [{"pid": None, "command": "unknown (not visible to this user)"}]


def port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def gpus() -> dict:
    """The GPUs and the processes on them. A cell nvidia-smi cannot fill (`[N/A]` for memory on some
    GPUs, `ERR!`) is None, that GPU kept; a process name may hold commas (the first and last fields
    are the pid and the memory, the name is what lies between)."""
    if not shutil.which("nvidia-smi"):
        return {"available": False}
    def query(what: str, fields: str) -> list[list[str]]:
        out = subprocess.run(["nvidia-smi", f"--query-{what}={fields}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
        tail = fields.count(",") - 1   # the fields after the name
        rows = [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]
        return [[r[0], ", ".join(r[1:len(r) - tail]), *r[len(r) - tail:]] for r in rows]
    try:
        devices = [{"index": int(i), "name": n, "memory_used_mib": _mib(u), "memory_total_mib": _mib(t)}
                   for i, n, u, t in query("gpu", "index,name,memory.used,memory.total")]
        apps = [{"pid": p, "name": n, "memory_mib": m}
                for p, n, m in query("compute-apps", "pid,process_name,used_memory")]
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        return {"available": True, "error": str(e)}
    return {"available": True, "devices": devices, "processes": apps}


def _mib(cell: str) -> float | None:
    """A memory figure nvidia-smi printed; None for what it could not read (`[N/A]`, `ERR!`)."""
    try:
        value = float(cell)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


# --- subcommands --------------------------------------------------------------------------------------

def cmd_probe(a) -> int:
    out: dict = {"python": sys.version.split()[0], "executable": sys.executable}
    if a.module:   # one module, or alternatives separated by commas: the first that imports
        modules, errors = a.module.split(","), []
        for module in modules:
            r = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True,
                               timeout=300)
            if r.returncode == 0:
                out["module"] = module
                break
            lines = r.stderr.strip().splitlines()
            errors.append(lines[-1] if lines else f"exit {r.returncode}")
        if "module" not in out:
            out["module_error"] = errors[0] if len(errors) == 1 else "; ".join(
                f"{m}: {e}" for m, e in zip(modules, errors))
        elif a.imported:
            with contextlib.suppress(OSError):   # only a shortcut: unmarked, the next probe imports again
                open(a.imported, "a").close()
    out["module_ok"] = not a.module or "module" in out
    holders = port_listeners(a.port) if a.port else []   # port 0: not asked about
    out["port_free"] = not a.port or (not holders and not port_open(a.bind, a.port))
    if not out["port_free"]:
        out["port_holders"] = holders
    os.makedirs(a.dir, exist_ok=True)
    out["disk_free_gb"] = round(shutil.disk_usage(a.dir).free / 1e9, 2)
    out["gpus"] = gpus()
    return emit(out)


# --- facts ----------------------------------------------------------------------------------------------

NO_PIP = "# no pip in this venv: the distributions that importlib.metadata finds"


def cmd_facts(a) -> int:
    """The host's facts that the venv's Python answers, each into DIR/NAME.txt as the shell's facts are
    (harness/facts.py): `python`, `pip_freeze`, and for an engine `engine_git` and `engine_version`.
    One start of the venv's Python and one import of importlib.metadata for the four, which were five
    starts and two imports: a fifth of a second of CPU beside each host's first server start."""
    import importlib.metadata as metadata
    modules = [m for m in a.module.split(",") if m]   # alternatives, as the probe takes them
    answers = [("python", lambda: f"Python {sys.version.split()[0]}\n"),   # as `python --version` says
               ("pip_freeze", lambda: packages(metadata))]
    if modules:
        answers.append(("engine_git", lambda: engine_git(modules)))
    if modules or a.distribution:
        answers.append(("engine_version", lambda: engine_version(metadata, a.distribution, modules)))
    for name, answer in answers:
        try:
            text = answer()
        except Exception as e:   # a broken distribution's metadata, say: the other facts still come
            text = f"# could not tell: {type(e).__name__}: {e}\n"
        with open(os.path.join(a.dir, name + ".txt"), "w") as f:
            f.write(text)
    return 0


def packages(metadata) -> str:
    """`pip freeze`; where the venv has no pip (uv makes venvs without it unless seeded), the
    distributions Python itself finds, in the same `name==version` lines under NO_PIP."""
    import importlib.util
    if importlib.util.find_spec("pip") is not None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            done = subprocess.run([sys.executable, "-m", "pip", "freeze"], capture_output=True, text=True,
                                  timeout=600)
            if done.returncode == 0:
                return done.stdout
    names = {f"{name}=={d.version}" for d in metadata.distributions() if (name := d.metadata.get("Name"))}
    return NO_PIP + "\n" + "".join(line + "\n" for line in sorted(names, key=str.lower))


def engine_version(metadata, distribution: str, modules: list[str]) -> str:
    """The installed distribution's version, read without importing the engine (seconds for vLLM or
    SGLang, beside the probe's own import); for an engine without metadata (a source tree on
    PYTHONPATH), or with no distribution named, its module's `__version__`, in a Python of its own.
    What cannot be told is a `#` comment, never a version."""
    if distribution:
        with contextlib.suppress(metadata.PackageNotFoundError):
            return metadata.version(distribution) + "\n"
    if not modules:
        return f"# could not tell: no distribution {distribution!r} installed\n"
    done = subprocess.run([sys.executable, "-c", "import importlib, sys\n"
                           "print(importlib.import_module(sys.argv[1]).__version__)", modules[0]],
                          capture_output=True, text=True, timeout=600)
    if done.returncode == 0 and done.stdout.strip():
        return done.stdout
    lines = done.stderr.strip().splitlines()
    return f"# could not tell: {lines[-1] if lines else f'exit {done.returncode}'}\n"


def engine_git(modules: list[str]) -> str:
    """The commit of an engine installed from a git checkout (an editable install) and its local changes
    (the first 20 lines of `git status --porcelain`); otherwise what git or the lookup said."""
    import importlib.util
    where = ""
    for module in modules:
        with contextlib.suppress(ImportError, ValueError):   # a dotted name imports its parents
            spec = importlib.util.find_spec(module)
            if spec is not None and spec.origin:
                where = os.path.dirname(spec.origin)
                break
    if not where:
        return f"no source file for {','.join(modules)}\n"
    try:
        head = subprocess.run(["git", "-C", where, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=60)
        if head.returncode != 0:
            return head.stdout + head.stderr
        status = subprocess.run(["git", "-C", where, "status", "--porcelain"], capture_output=True,
                                text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return f"git: {e}\n"
    return head.stdout + "".join(status.stdout.splitlines(keepends=True)[:20])


def cmd_wait(a) -> int:
    start = time.monotonic()
    last = ""
    while True:
        pid = read_pid(a.pid_file)
        if pid is not None and not pid_alive(pid):
            code = None
            try:
                with open(a.exit_file) as f:
                    code = int(f.read().strip() or "0")
            except (OSError, ValueError):
                pass
            return emit({"status": "died", "seconds": time.monotonic() - start, "exit_code": code,
                         "last_answer": last, "log_tail": log_tail(a.log), "error_line": root_error(a.log)})
        status, body = http("GET", a.url, timeout=a.probe_timeout)
        if status == 200:
            return emit({"status": "healthy", "seconds": time.monotonic() - start})
        last = f"HTTP {status}: {body[:200]}" if status else body
        if time.monotonic() - start > a.timeout:
            return emit({"status": "timeout", "seconds": time.monotonic() - start, "last_answer": last,
                         "log_tail": log_tail(a.log), "error_line": root_error(a.log)})
        time.sleep(a.interval)


def _pause(waited: float) -> float:
    """The next poll's sleep: short at first (a signalled process or a closing port is usually gone
    within milliseconds), then at most 0.1 s."""
    return min(0.1, 0.005 + waited)



TOKEN = re.compile(r"[0-9A-Za-z_-]{16,128}")


def read_marker(path: str) -> str:
    """The run's marker from its pid file (`PID START BOOT TOKEN`), "" when it has none (a pid file
    written by an older harness) or is from before a reboot (nothing of that run can still live).
    It is read whether or not the pid still names the wrapper: a server's escaped processes outlive
    its process group."""
    try:
        with open(path) as f:
            words = f.read().split()
    except OSError:
        return ""
    if len(words) < 4 or words[2] != boot_id() or not TOKEN.fullmatch(words[3]):
        return ""
    return words[3]


def marked(token: str) -> list[int]:
    """The live processes of this user whose environment holds `HARNESS_RUN_TOKEN=token` exactly: those
    of the server that left its process group and session (setsid, as Ray's daemons and some launchers
    do), which no signal to the group reaches. Another user's environment is not read (nor could it
    be); a zombie's is empty; a pid reused by another process does not carry this run's marker. The
    environment is only compared, never kept or printed. One pass over /proc: milliseconds."""
    if not token:
        return []
    needle, uid, me = f"{MARKER}={token}".encode(), os.getuid(), os.getpid()
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(name) == me or os.stat(f"/proc/{name}").st_uid != uid:
                continue
            with open(f"/proc/{name}/environ", "rb") as f:
                environ = f.read()
        except OSError:   # gone, or not ours to read
            continue
        if needle in environ.split(b"\0") and pid_alive(int(name)):
            found.append(int(name))
    return found


def server_processes(pgid: int | None, token: str) -> tuple[list[int], list[int]]:
    """The server's live processes: those of the wrapper's process group and session, and those
    outside both that carry the run's marker (escaped)."""
    members = group_members(pgid) if pgid else []
    return members, [pid for pid in marked(token) if pid not in members]


def stop_group(pgid: int | None, timeout: float, token: str = "") -> tuple[str | None, list[int]]:
    """SIGTERM the process group, SIGKILL what is left after half the timeout; the last signal sent,
    and the escaped processes it found (see `marked`).

    The session of that number is signalled with it: the wrapper leads both, and a server process that
    moved to a process group of its own (setpgid) stays in the session. A process that left the session
    too (setsid) is found by the run's marker and signalled with them. A group none of whose members
    we may signal (another user's, under a number that was ours) is left alone."""
    sent, escaped = None, set()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        members, outside = server_processes(pgid, token)
        escaped.update(outside)
        if not (members or outside) or not _signal_group(pgid, sig, outside):
            break
        sent = sig.name
        started = time.monotonic()
        while time.monotonic() < started + timeout / 2 and any(server_processes(pgid, token)):
            time.sleep(_pause(time.monotonic() - started))
    return sent, sorted(escaped)


def _signal_group(pgid: int | None, sig: signal.Signals, escaped: list[int]) -> bool:
    """`sig` to the process group, to every member of the session `pgid` outside it and to the
    escaped processes; whether any was signalled."""
    any_sent = False
    if pgid:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
            any_sent = True
    for pid in (group_members(pgid, session_only=True) if pgid else []) + escaped:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
            any_sent = True
    return any_sent


def cmd_stop(a) -> int:
    """Stop the server (its group, session and escaped processes), then its watchdog: in that order, so
    that a stop cut short (its SSH command killed) leaves the watchdog to end the server."""
    pid, token = read_pid(a.pid_file), read_marker(a.pid_file)
    out: dict = {"pid": pid, "was_running": any(server_processes(pid, token))}
    out["signal"], escaped = stop_group(pid, a.timeout, token)
    out["escaped"] = len(escaped)
    stop_group(read_pid(os.path.join(os.path.dirname(a.pid_file), RunFiles.WATCHDOG_PID)), 5)
    started = time.monotonic()
    while port_open(a.bind, a.port) and time.monotonic() < started + a.timeout:
        time.sleep(2 * _pause(time.monotonic() - started))
    members, outside = server_processes(pid, token)
    out["group_alive"], out["escaped_alive"] = bool(members or outside), len(outside)
    if not out["group_alive"]:   # a later reap or stop must not find a pid that may be reused
        remove_pid_files(os.path.dirname(a.pid_file))
    out["port_closed"] = not port_open(a.bind, a.port)
    if not out["port_closed"]:
        out["port_holders"] = port_listeners(a.port)
    if a.gpu_baseline:
        out.update(gpu_released(a.gpu_baseline, a.timeout))
    return emit(out)


def gpu_released(baseline: str, timeout: float, slack_mib: float = 512) -> dict:
    """Wait until every GPU is back to its memory use before the launch (within `slack_mib`). A GPU
    whose memory nvidia-smi cannot read, then or now (an empty field of the baseline, None), is not
    waited for: nothing would tell it released."""
    before = [_mib(x) for x in baseline.split(",")]
    deadline = time.monotonic() + timeout
    while True:
        now = [d["memory_used_mib"] for d in gpus().get("devices", [])]
        released = len(now) == len(before) and all(n is None or b is None or n <= b + slack_mib
                                                   for n, b in zip(now, before))
        if released or time.monotonic() > deadline:
            return {"gpu_released": released, "gpu_memory_used_mib": now, "gpu_memory_before_mib": before}
        time.sleep(0.5)


def group_members(pgid: int, session_only: bool = False) -> list[int]:
    """The live (non-zombie) processes whose process group or session is `pgid` (`session_only`: those
    of the session outside that group). Linux gives a number in use as a group or session id to no new
    process, so these are the processes the group's leader started, whatever groups they moved to."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        in_group, in_session = int(fields[2]) == pgid, int(fields[3]) == pgid
        if fields[0] != "Z" and (in_session and not in_group if session_only else in_group or in_session):
            found.append(int(pid))
    return found


def remove_secrets(run_dir: str) -> None:
    """A stopped server's secrets have no reason to stay on the host."""
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(run_dir, RunFiles.SECRETS))


def lease_age(path: str) -> float:
    try:
        return time.time() - os.stat(path).st_mtime
    except OSError:
        return float("inf")


def lease_stamp(path: str) -> tuple[int, int, int] | None:
    """What a touch of the lease changes (its mtime and ctime, and the file itself); None when it is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_ctime_ns


class Lease:
    """The lease as the watchdog sees it: silent since it last saw a touch, timed by the monotonic clock.

    The host's wall clock may jump (NTP stepping it after a boot or a resumed VM): judged by mtime
    alone, a step forward by more than the lease stopped the server of a live orchestrator, and a
    step back (an mtime in the future) kept a server whose orchestrator was gone until the clock
    caught up, hours later. Any change of the file counts as a touch, whatever time it says; only at
    the start does the mtime's age count (0 when it is in the future), so a lease already stale then
    lapses at once. A lease that is gone is lapsed."""

    def __init__(self, path: str):
        self.path = path
        self.stamp = lease_stamp(path)
        self.seen = time.monotonic() - min(max(0.0, lease_age(path)), 1e9)

    def silent_s(self) -> float:
        stamp = lease_stamp(self.path)
        if stamp is None:
            return float("inf")
        if stamp != self.stamp:
            self.stamp, self.seen = stamp, time.monotonic()
        return time.monotonic() - self.seen


def remove_pid_files(run_dir: str) -> None:
    """A group that has ended leaves no pid file behind: its number can be reused, and a later stop or
    reap (whose check of a pid file accepts a group whose leader is gone) would signal the new owner."""
    for name in (RunFiles.PID, RunFiles.WATCHDOG_PID):
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(run_dir, name))


def cmd_watch(a) -> int:
    """Beside every server: stop it when the orchestrator's lease lapses.

    The orchestrator touches the lease file every few seconds; if it dies, loses the network or
    sleeps, the touches stop and the GPUs are freed `lease_s` later instead of never. A server that
    ends by itself is watched until the lease lapses too (a live orchestrator's stop ends the
    watchdog first): then what is left of it goes (a process that left its session lives on after the
    group has ended), and its pid files with it, so no later reap takes a reused number for it.
    """
    run_dir = os.path.dirname(os.path.abspath(a.pid_file))
    write_pid(os.path.join(run_dir, RunFiles.WATCHDOG_PID), os.getpid())
    lease = Lease(a.lease)
    deadline = time.monotonic() + 60
    while read_pid(a.pid_file) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    pgid, token = read_pid(a.pid_file), read_marker(a.pid_file)
    while True:
        silent = lease.silent_s()
        if silent > a.lease_s:
            if any(server_processes(pgid, token)):
                print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} lease {a.lease} not renewed for {silent:.0f} s "
                      f"(limit {a.lease_s:g} s): stopping server process group {pgid}", flush=True)
                sent, escaped = stop_group(pgid, 30, token)
                print(f"sent {sent}" + (f" (also to {len(escaped)} processes that had left the session)"
                                        if escaped else ""), flush=True)
            remove_secrets(run_dir)
            if not any(server_processes(pgid, token)):
                remove_pid_files(run_dir)
            return 0
        if pgid is None:
            return 0
        time.sleep(min(1.0, a.lease_s / 10))


def cmd_reap(a) -> int:
    """Stop servers and watchdogs of earlier sweeps under `workdir` whose lease has lapsed, with the
    processes that left their server's session.

    The runs are stopped at once, a thread each: one after the other, a few servers that ignore
    SIGTERM (each given 15 s before SIGKILL) outlasted the time the orchestrator gives the reap, and
    the host was set aside with servers still on it."""
    from concurrent.futures import ThreadPoolExecutor  # here: the agent's other commands start without it
    runs = {os.path.dirname(p) for name in (RunFiles.PID, RunFiles.SECRETS)
            for p in glob.glob(os.path.join(a.workdir, "*", "*", name))}
    lapsed = [run_dir for run_dir in sorted(runs)   # the others' orchestrators are still there
              if lease_age(os.path.join(run_dir, RunFiles.LEASE)) > a.lease_s]
    with ThreadPoolExecutor(max_workers=max(1, min(32, len(lapsed)))) as pool:
        stopped = [s for s in pool.map(reap_run, lapsed) if s]
    return emit({"stopped": stopped})


def reap_run(run_dir: str) -> dict | None:
    """Stop one lapsed run's server and watchdog; what was stopped, None when nothing was signalled."""
    pid_file = os.path.join(run_dir, RunFiles.PID)
    pgid, token = read_pid(pid_file), read_marker(pid_file)
    stopped = None
    if any(server_processes(pgid, token)):
        sent, escaped = stop_group(pgid, 30, token)
        if sent:   # a group we may not signal (another user's, under a number that was ours) was not
            stopped = {"run_dir": run_dir, "pid": pgid, "signal": sent, "escaped": len(escaped)}
    stop_group(read_pid(os.path.join(run_dir, RunFiles.WATCHDOG_PID)), 5)
    remove_secrets(run_dir)
    if not any(server_processes(pgid, token)):
        remove_pid_files(run_dir)
    return stopped


# --- profile capture ------------------------------------------------------------------------------
#
# The engine's protocol arrives as data (`--spec`, written by harness/engines): which endpoint starts
# the capture and with what body, whether to stop it and when, how to keep the engine busy, and how its
# trace files are named. This file knows no engine.

TORCH_NAMING = {"glob": "torch-*.pt.trace.json.gz", "rank": r"^torch-()", "not_ranks": ""}


class Traffic:
    """Requests kept flowing in background threads: engines count only steps that have work."""

    def __init__(self, url: str, body: dict, concurrency: int):
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._loop, args=(url, body), daemon=True)
                        for _ in range(concurrency)]
        for t in self.threads:
            t.start()

    def _loop(self, url: str, body: dict) -> None:
        while not self.stop.is_set():
            http("POST", url, body, timeout=120)
            self.stop.wait(0.01)

    def close(self) -> None:
        self.stop.set()


def traces(directory: str, naming: dict) -> dict[str, int]:
    return {os.path.basename(p): os.path.getsize(p)
            for p in glob.glob(os.path.join(directory, "**", naming["glob"]), recursive=True)}


def rank_keys(names, naming: dict) -> set:
    """The ranks these files cover (each rank is the tuple of the naming's groups); front ends out."""
    keys = set()
    for name in names:
        if naming.get("not_ranks") and re.search(naming["not_ranks"], name):
            continue
        m = re.search(naming["rank"], name)
        if m:
            keys.add(m.groups())
    return keys


def await_traces(directory: str, naming: dict, ranks: int, deadline: float, stable_s: float) -> dict[str, int]:
    """Wait until a trace exists for every rank and no size changed for `stable_s` seconds."""
    last: dict[str, int] = {}
    stable_since = time.monotonic()
    while time.monotonic() < deadline:
        now = traces(directory, naming)
        if now != last:
            last, stable_since = now, time.monotonic()
        if len(rank_keys(now, naming)) >= ranks and time.monotonic() - stable_since >= stable_s:
            return now
        time.sleep(0.25)
    return last


def request_body(a, max_tokens: int) -> dict:
    body = {"model": a.model, "prompt": a.prompt, "max_tokens": max_tokens, "temperature": 0, "stream": False}
    if a.ignore_eos:
        body["ignore_eos"] = True
    body.update(json.loads(a.extra_body) if a.extra_body else {})
    return body


def torch_window(a, out: dict, deadline: float) -> dict[str, int]:
    """The server runs under torchprof.py: open its window, drive N decode steps, close it, await the files."""
    answers = out["answers"]
    def marker(*names: str, until: float) -> str | None:
        while time.monotonic() < until:
            for name in names:
                if os.path.exists(os.path.join(a.dir, name)):
                    return name
            time.sleep(0.1)
        return None
    open(os.path.join(a.dir, ".start"), "w").close()
    opened = marker(".started", ".failed", until=min(deadline, time.monotonic() + 120))
    answers.append({"call": "open the torch.profiler window", "answer": opened or "no answer"})
    if opened != ".started":
        out["error"] = ("the server did not open the profiler window: " + (_read(a.dir, ".failed") or
                        "is it launched through torchprof.py ({{ tools.torchprof }} in the template)?"))
        return {}
    body = request_body(a, a.num_steps)
    replies: list[tuple[int, str]] = []
    threads = [threading.Thread(target=lambda: replies.append(
        http("POST", a.url + "/v1/completions", body, a.timeout))) for _ in range(a.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    refused = [f"HTTP {code}: {text[:200]}" for code, text in replies if code != 200]
    answers.append({"call": f"{a.concurrency} x POST /v1/completions ({a.num_steps} tokens)",
                    "answer": refused[0] if refused else "200"})
    if refused and len(refused) == len(replies):
        out["error"] = f"every request sent while profiling failed ({refused[0]}): the trace holds no steps"
    open(os.path.join(a.dir, ".stop"), "w").close()
    closed = marker(".done", ".failed", until=deadline)
    answers.append({"call": "close the torch.profiler window", "answer": closed or "no answer"})
    if closed != ".done":
        out["error"] = "the profiler window did not close: " + (_read(a.dir, ".failed") or "timed out")
    return traces(a.dir, TORCH_NAMING)


def _read(directory: str, name: str) -> str:
    try:
        with open(os.path.join(directory, name)) as f:
            return f.read()[-2000:]
    except OSError:
        return ""


def _call(a, answers: list, path: str, body, deadline: float) -> tuple[int, str]:
    status, text = http("POST", a.url + path, body, timeout=max(1.0, deadline - time.monotonic()))
    answers.append({"call": f"POST {path}", "request": body, "status": status, "body": text[:500]})
    return status, text


def engine_capture(a, spec: dict, out: dict, deadline: float) -> tuple[dict[str, int], int, str]:
    """Follow the engine's protocol: start, traffic, await every rank's file, stop. Returns the files,
    and the status and text of the call that failed (200 when none did)."""
    answers, naming = out["answers"], spec["naming"]
    status, text = _call(a, answers, spec["start"]["path"], spec["start"].get("body"), deadline)
    if status != 200:
        return traces(a.dir, naming), status, text
    traffic = spec.get("traffic", "flow")
    if isinstance(traffic, dict):   # one request that covers the capture (nsys brackets the steps)
        code, reply = http("POST", a.url + "/v1/completions", request_body(a, int(traffic["max_tokens"])),
                           timeout=max(1.0, deadline - time.monotonic()))
        answers.append({"call": "POST /v1/completions", "status": code, "body": reply[:200]})
        flowing = None
    else:
        flowing = Traffic(a.url + "/v1/completions", request_body(a, a.max_tokens), a.concurrency)
    try:
        if spec.get("await") == "exit":
            files: dict[str, int] = {}
        else:
            files = await_traces(a.dir, naming, spec["ranks"], deadline, a.stable_s)
    finally:
        if flowing:
            flowing.close()
    if spec.get("stop"):
        status, text = _call(a, answers, spec["stop"]["path"], None, deadline)
        if spec.get("await") != "exit":
            files = traces(a.dir, naming)
    return files, status, text


def cmd_profile(a) -> int:
    if a.prompt_file:
        with open(a.prompt_file, encoding="utf-8") as f:
            a.prompt = f.read()
    os.makedirs(a.dir, exist_ok=True)
    start = time.monotonic()
    deadline = start + a.timeout
    answers: list = []
    spec: dict[str, Any] = json.loads(a.spec) if a.spec else {"naming": TORCH_NAMING, "ranks": 1}
    naming = spec["naming"]
    out: dict = {"dir": a.dir, "expected_ranks": spec["ranks"], "answers": answers}
    if not a.spec:
        files = torch_window(a, out, deadline)
        status, text = 200, ""
        if not files and "error" not in out:
            out["error"] = f"no torch.profiler trace in {a.dir}"
            out["hint"] = "launch the server through torchprof.py in the template, and check server.log"
    else:
        files, status, text = engine_capture(a, spec, out, deadline)
        if status == 200 and spec.get("await") == "exit":
            return emit(dict(out, status="pending", files=[], ranks_found=0, missing_ranks=0, bytes=0,
                             seconds=time.monotonic() - start,
                             note="nsys writes its report into the profile directory when the server exits"))
    hints = spec.get("hints") or {}
    found = rank_keys(files, naming)
    missing = max(0, spec["ranks"] - len(found))
    out.update(files=[{"name": n, "bytes": s, "rank": n in _rank_files(files, naming)}
                      for n, s in sorted(files.items())],
               ranks_found=len(found), missing_ranks=missing, seconds=time.monotonic() - start,
               bytes=sum(files.values()))
    if "error" in out:
        out["status"] = "failed"
    elif status != 200:
        answer = f"HTTP {status}" if status else f"no answer ({text})"
        out.update(status="failed",
                   error=f"the engine answered {answers[-1]['call']} with {answer}: {text[:300]!r}"
                   + ("" if files else f"; {a.dir} stayed empty"),
                   hint=hints.get(str(status), hints.get("", "")))
    elif missing:
        out.update(status="partial" if found else "failed",
                   error=f"traces from {len(found)} of {spec['ranks']} ranks in {a.dir} after "
                         f"{time.monotonic() - start:.0f} s", hint=hints.get("", ""))
    else:
        out["status"] = "ok"
    return emit(out)


def cmd_traces(a) -> int:
    """Another node of a server on several hosts: wait for its own ranks' traces (node 0's capture
    started them), and say what is there."""
    naming = json.loads(a.naming)
    start = time.monotonic()
    files = await_traces(a.dir, naming, a.ranks, start + a.timeout, a.stable_s)
    found = rank_keys(files, naming)
    return emit({"dir": a.dir, "files": [{"name": n, "bytes": s, "rank": n in _rank_files(files, naming)}
                                         for n, s in sorted(files.items())],
                 "ranks_found": len(found), "missing_ranks": max(0, a.ranks - len(found)),
                 "bytes": sum(files.values()), "seconds": time.monotonic() - start})


def _rank_files(files, naming: dict) -> set:
    return {n for n in files if rank_keys([n], naming)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="agent", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("probe")
    pr.add_argument("--module", default="", help="a module the engine needs, or alternatives separated by "
                    "commas (the first that imports); empty: no check")
    pr.add_argument("--imported", default="", help="a file made once --module imports (the host's later "
                    "runs skip the import)")
    pr.add_argument("--port", type=int, required=True, help="the server's port; 0: not checked")
    pr.add_argument("--bind", default="127.0.0.1")
    pr.add_argument("--dir", required=True)
    w = sub.add_parser("wait")
    w.add_argument("--url", required=True)
    w.add_argument("--pid-file", required=True)
    w.add_argument("--exit-file", default="")
    w.add_argument("--log", default="")
    w.add_argument("--timeout", type=float, required=True)
    w.add_argument("--interval", type=float, default=0.25)
    w.add_argument("--probe-timeout", type=float, default=30.0)
    s = sub.add_parser("stop")
    s.add_argument("--pid-file", required=True)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--bind", default="127.0.0.1")
    s.add_argument("--timeout", type=float, default=30.0)
    s.add_argument("--gpu-baseline", default="", help="MiB used per GPU before launch: wait for it again")
    f = sub.add_parser("profile")
    f.add_argument("--spec", default="", help="the engine's capture protocol (JSON); none: the torch "
                   "window of torchprof.py")
    f.add_argument("--url", required=True)
    f.add_argument("--model", required=True)
    f.add_argument("--dir", required=True)
    f.add_argument("--num-steps", type=int, default=10)
    f.add_argument("--concurrency", type=int, default=1)
    f.add_argument("--prompt", default="Hello")
    f.add_argument("--prompt-file", default="", help="a file holding the prompt (UTF-8)")
    f.add_argument("--max-tokens", type=int, default=64)
    f.add_argument("--timeout", type=float, default=600.0)
    f.add_argument("--stable-s", type=float, default=1.0)
    f.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    f.add_argument("--extra-body", default="", help="a JSON object of fields added to every request")
    for sp in (w, f):
        sp.add_argument("--api-key-env", default="", help="an environment variable holding the server's API "
                        "key: sent as Authorization: Bearer")
    t = sub.add_parser("traces")
    t.add_argument("--dir", required=True)
    t.add_argument("--naming", required=True, help="the engine's trace naming (JSON)")
    t.add_argument("--ranks", type=int, required=True)
    t.add_argument("--timeout", type=float, default=600.0)
    t.add_argument("--stable-s", type=float, default=1.0)
    wd = sub.add_parser("watch")
    wd.add_argument("--pid-file", required=True)
    wd.add_argument("--lease", required=True)
    wd.add_argument("--lease-s", type=float, default=60.0)
    fa = sub.add_parser("facts")
    fa.add_argument("--dir", required=True, help="where NAME.txt of each fact is written")
    fa.add_argument("--module", default="", help="the engine's module (alternatives separated by commas)")
    fa.add_argument("--distribution", default="", help="the engine's installed distribution, for its version")
    r = sub.add_parser("reap")
    r.add_argument("--workdir", required=True)
    r.add_argument("--lease-s", type=float, default=60.0)
    a = p.parse_args(argv)
    if getattr(a, "api_key_env", ""):
        from .exchange import auth_headers  # here: the agent's other commands start without it
        try:
            HEADERS.update(auth_headers(a.api_key_env))
        except ValueError as e:
            p.error(str(e))
    commands = {"probe": cmd_probe, "wait": cmd_wait, "stop": cmd_stop, "profile": cmd_profile,
                "watch": cmd_watch, "reap": cmd_reap, "traces": cmd_traces, "facts": cmd_facts}
    return commands[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
