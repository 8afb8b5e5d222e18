"""The telemetry sampler: standard library only, run on the GPU host beside the benchmark client.

    python harness.pyz telemetry --url http://127.0.0.1:8000 --out telemetry.jsonl --interval 1 \\
        --families vllm:num_requests_running,vllm:kv_cache_usage_perc --duration 60

Every `--interval` seconds it reads the engine's Prometheus `/metrics` and asks nvidia-smi for each
GPU's SM clock, memory used, power and utilization, and appends what it read to `--out`, one JSON
object a line (docs/formats.md "telemetry.jsonl"): `{"t_ns", "source", "values"}` with `t_ns` from
time.monotonic_ns(), the clock the benchmark client stamps its requests with, so a level's [start,
end] can be matched with the samples that bracket it. A sample's `t_ns` is when it was asked for and
its `t_end_ns` when the answer was in: what it says holds at some instant between the two, so a sample
answered before a level started and one asked for after it ended bracket it exactly. It samples once
as it starts (the file is written only once that first round is done: a caller may wait for the file
to be non-empty before it starts the benchmark) and once more as it stops, on SIGTERM or SIGINT, after
`--duration` seconds, or when the process that started it is gone (its parent changed), so it never
outlives a lost SSH session for long.

The host is not trusted, and neither is the engine: an answer to /metrics over `--max-bytes`, or
taking over 5 s in all (sent a byte at a time), is refused, every line is parsed strictly (a line
that is not a sample or a comment counts as malformed and gives no value) and tolerantly (comments,
labels with escapes, NaN and +Inf, a timestamp, a missing final newline), and only the families asked
for are kept. nvidia-smi runs with a timeout and a bounded output; one that hangs past its timeout is
not asked again that run, and a value it could not read (`ERR!`, or no finite number) is null. What
goes wrong is written as a `note` line (the first time each message is seen) and never ends the
sampler: telemetry describes a run, it never fails one. A write the disk cannot take is undone to the
last whole line, and the sampler goes on.

With `--api-key-env NAME` every scrape sends `Authorization: Bearer` with the key held in that
variable (the server's API key, the one the benchmark client sends): vLLM 0.32.0 and SGLang 0.5.23
leave /metrics open whatever the key, but a server behind a proxy, or a template's own guard, may
not. The key is read from the environment only, never from the command line, and no message names
it. A 401 or 403 from /metrics is a note saying whether a key was sent, so a guarded /metrics is
never mistaken for a server without metrics; a NAME not set here is a note too, and the scrapes go
on without it (an exit here would leave no telemetry.jsonl at all, and nothing in the report).
Exit 0, or 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import urlsplit

from .exchange import auth_headers
from .exposition import METRIC_NAME, json_value, parse_exposition, parse_gpu_csv

SCHEMA = "harness.telemetry/1"
MAX_METRICS_BYTES = 4 << 20       # vLLM 0.32 on CPU: 52 KB; a large server with many labels, a few hundred KB
MAX_SMI_BYTES = 256 << 10         # eight GPUs of five fields: well under 1 KB
HTTP_TIMEOUT_S = 5.0
SMI_TIMEOUT_S = 10.0
SMI_ERROR_CELL = re.compile(r"(^|,)\s*(ERR!|N/A|Not Supported|Unknown Error)\s*(?=,|$)", re.M)
"""A cell nvidia-smi could not read, as it prints one outside brackets (`ERR!` for a GPU in trouble):
bracketed, it is read as [N/A] is, None for that GPU's field alone (the table stands)."""
GPU_QUERY = ("index", "clocks.sm", "memory.used", "power.draw", "utilization.gpu")
"""What nvidia-smi is asked per GPU (`--query-gpu`), in its own spelling."""


class Refused(ValueError):
    """An answer other than 200, with its status: a 401 or 403 says the server wants credentials."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def fetch_metrics(url: str, *, max_bytes: int = MAX_METRICS_BYTES, timeout: float = HTTP_TIMEOUT_S,
                  headers: dict[str, str] | None = None) -> str:
    """GET `url` (the engine's /metrics) as text; ValueError naming what was wrong with the answer
    (status, size, encoding), OSError when it could not be had. Never reads more than max_bytes + 1,
    nor for longer than `timeout` in all: a socket's timeout bounds each read, and an answer sent a
    byte at a time would otherwise hold the sampler (and its stop) for hours."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"url must look like http://HOST:PORT/metrics, got {url!r}")
    conn_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = conn_class(parts.hostname, parts.port, timeout=timeout)
    cut = threading.Event()
    sock: list[socket.socket] = []

    def cut_off() -> None:   # at the deadline: the read under way ends (the socket is shut down)
        cut.set()
        for s in sock:       # the connection's own: http.client lets go of it once the head is read
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    timer = threading.Timer(timeout, cut_off)
    timer.daemon = True
    try:
        conn.connect()
        sock.append(conn.sock)
        timer.start()
        conn.request("GET", (parts.path or "/") + (f"?{parts.query}" if parts.query else ""),
                     headers={"Accept": "text/plain", "Accept-Encoding": "identity", **(headers or {})})
        response = conn.getresponse()
        if response.status != 200:
            raise Refused(f"GET {parts.path} answered HTTP {response.status}", response.status)
        length = response.getheader("Content-Length")
        if length and length.isdigit() and int(length) > max_bytes:
            raise ValueError(f"the /metrics answer of {int(length):,} bytes is over the {max_bytes:,} byte "
                             "limit: refused unread")
        body = response.read(max_bytes + 1)
        if cut.is_set():
            raise ValueError(f"the /metrics answer took over {timeout:g} s: refused")
        if len(body) > max_bytes:
            raise ValueError(f"the /metrics answer is over the {max_bytes:,} byte limit: refused")
        try:
            return body.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"the /metrics answer is not UTF-8 ({e})") from None
    except (http.client.HTTPException, OSError) as e:
        if cut.is_set():
            raise ValueError(f"the /metrics answer took over {timeout:g} s: refused") from None
        if isinstance(e, OSError):
            raise
        raise ValueError(f"not an HTTP answer: {type(e).__name__}: {e}") from None
    finally:
        timer.cancel()
        conn.close()


class Hung(ValueError):
    """A command that gave no answer within its timeout (and was killed)."""


def run_bounded(argv: list[str], *, timeout: float, max_bytes: int) -> str:
    """A command's stdout, read for at most `timeout` seconds (Hung past it) and `max_bytes` bytes
    (ValueError past them), the command killed then, as text; ValueError on a non-zero exit."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    assert proc.stdout is not None
    deadline, chunks, size = time.monotonic() + timeout, [], 0
    try:
        fd = proc.stdout.fileno()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Hung(f"{argv[0]} gave no answer within {timeout:g} s")
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            data = os.read(fd, 65536)
            if not data:
                break
            chunks.append(data)
            size += len(data)
            if size > max_bytes:
                raise ValueError(f"{argv[0]} printed over {max_bytes:,} bytes")
        code = proc.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise Hung(f"{argv[0]} did not exit within {timeout:g} s") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    if code != 0:
        raise ValueError(f"{os.path.basename(argv[0])} exited {code}")
    return b"".join(chunks).decode("utf-8", "replace")


# --------------------------------------------------------------------------- the sampler

class Sampler:
    """One round of samples at a time (`sample`), its lines kept in `lines` until the caller takes them."""

    def __init__(self, url: str | None, families: list[str] | None, *, max_bytes: int = MAX_METRICS_BYTES,
                 headers: dict[str, str] | None = None, smi: str | None = "nvidia-smi",
                 smi_timeout: float = SMI_TIMEOUT_S, key_env: str | None = None):
        self.url, self.families = url, families
        self.max_bytes, self.headers = max_bytes, headers or {}
        self.key_env = key_env       # the variable the API key in `headers` came from: named in notes
        self.smi = shutil.which(smi) if smi else None
        self.smi_timeout = smi_timeout
        self.lines: list[dict] = []
        self.noted: set[str] = set()
        self.counts = {"metrics": 0, "gpu": 0, "errors": 0}
        if smi and self.smi is None:
            self.note("gpu", f"{smi} is not on PATH here: no GPU samples", error=False)
        elif not smi:
            self.note("gpu", "GPU sampling turned off (--no-gpu)", error=False)

    def take(self) -> list[dict]:
        lines, self.lines = self.lines, []
        return lines

    def note(self, about: str, message: str, *, error: bool = True) -> None:
        """A note line, once per distinct message (a failing /metrics fails every interval)."""
        if error:
            self.counts["errors"] += 1
        if message in self.noted:
            return
        self.noted.add(message)
        self.lines.append({"t_ns": time.monotonic_ns(), "source": "note",
                           "values": {"about": about, "error": error, "message": message}})

    def sample(self) -> None:
        if self.url:
            self.sample_metrics()
        if self.smi:
            self.sample_gpus()

    def sample_metrics(self) -> None:
        assert self.url is not None
        sent = time.monotonic_ns()
        try:
            text = fetch_metrics(self.url, max_bytes=self.max_bytes, headers=self.headers)
        except Refused as e:
            return self.note("metrics", f"{self.url}: {e}{self.refusal(e.status)}")
        except (OSError, ValueError) as e:
            return self.note("metrics", f"{self.url}: {e}")
        got = time.monotonic_ns()
        values, bad = parse_exposition(text, self.families)
        if bad:
            self.note("metrics", f"{self.url}: {bad} malformed lines left out")
        if self.families and not values:
            self.note("metrics", f"{self.url}: none of the families asked for is there "
                                 f"({', '.join(self.families[:4])}{', ...' if len(self.families) > 4 else ''})")
        self.counts["metrics"] += 1
        self.lines.append({"t_ns": sent, "t_end_ns": got, "source": "metrics",
                           "values": {k: json_value(v) for k, v in values.items()}})

    def refusal(self, status: int) -> str:
        """What a 401 or 403 from /metrics means here (nothing for another status): the server wants
        credentials for its metrics, and either got none or refused the API key sent."""
        if status not in (401, 403):
            return ""
        if "Authorization" in self.headers:
            return (f": the server refused the API key sent (from ${self.key_env or 'its variable'}); "
                    "no server metrics while it does")
        return (": the server asks for credentials on /metrics and none were sent (the sampler sends the "
                "server's API key when the run gives the server one); no server metrics while it does")

    def sample_gpus(self) -> None:
        assert self.smi is not None
        sent = time.monotonic_ns()
        try:
            text = run_bounded([self.smi, f"--query-gpu={','.join(GPU_QUERY)}", "--format=csv"],
                               timeout=self.smi_timeout, max_bytes=MAX_SMI_BYTES)
            gpus = parse_gpu_csv(SMI_ERROR_CELL.sub(r"\1 [\2]", text))
        except Hung as e:   # a hung nvidia-smi stays hung (a driver in trouble): asked again, it would
            self.smi = None  # hold up every round of /metrics by its timeout
            return self.note("gpu", f"nvidia-smi: {e}: no more GPU samples this run")
        except (OSError, ValueError) as e:
            return self.note("gpu", f"nvidia-smi: {e}")
        got = time.monotonic_ns()
        for gpu in gpus:
            for key, value in gpu.items():
                if isinstance(value, float) and not math.isfinite(value):   # no reading: never a figure
                    self.note("gpu", f"nvidia-smi: {key} of GPU {gpu.get('gpu')} is {value}: left out")
                    gpu[key] = None
            self.counts["gpu"] += 1
            self.lines.append({"t_ns": sent, "t_end_ns": got, "source": "gpu", "values": gpu})


def _open_out(path: str) -> int:
    """The output file for appending (a descriptor), created 0600, never through a link someone planted."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0), 0o600)


class Out:
    """telemetry.jsonl, written a round at a time: whole lines or none. A write the disk cannot take
    (full, over a quota) is undone to the last whole line and its lines dropped, and the sampler goes
    on: once the disk takes lines again, a note says how many were lost and why (the start line, which
    says what the file is, is kept until it is written: it comes first all the same)."""

    def __init__(self, path: str, sampler: Sampler):
        self.fd, self.sampler = _open_out(path), sampler
        self.lost, self.why = 0, ""
        self.head: list[dict] = []

    def write(self, lines: list[dict], *, head: bool = False) -> None:
        if head:
            self.head, lines = lines[:1], lines[1:]
        if not lines and not self.head:
            return
        lost = [{"t_ns": time.monotonic_ns(), "source": "note",
                 "values": {"about": "telemetry", "error": True,
                            "message": f"{self.lost} lines not written: {self.why}"}}] if self.lost else []
        lines = [*self.head, *lost, *lines]
        data = "".join(json.dumps(x, separators=(",", ":")) + "\n" for x in lines).encode()
        try:
            end = os.fstat(self.fd).st_size
        except OSError:
            end = None
        done = 0
        try:
            while done < len(data):
                done += os.write(self.fd, data[done:])
        except OSError as e:
            if end is not None:
                with contextlib.suppress(OSError):
                    os.ftruncate(self.fd, end)
            self.lost += len(lines) - len(lost) - len(self.head)
            self.why = e.strerror or str(e)
            self.sampler.counts["errors"] += 1
            return
        self.lost, self.head = 0, []

    def close(self) -> None:
        os.close(self.fd)


def run(args: argparse.Namespace) -> int:
    spec = args.metrics or []
    families = sorted({f for f in args.families.split(",") if f} | {m["family"] for m in spec}) or None
    try:
        headers, unset = auth_headers(args.api_key_env), ""
    except ValueError:   # scraped without it, said in the file: an exit would leave no file to say so
        headers, unset = {}, f"--api-key-env: {args.api_key_env} is not set here: /metrics asked without the API key"
    stopping: list[int] = []
    wake, wake_w = os.pipe()      # a signal writes a byte here (set_wakeup_fd): the wait ends at once
    os.set_blocking(wake, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: stopping.append(signum))
    parent, started = os.getppid(), time.monotonic()
    sampler = Sampler(None if args.no_metrics else args.url, families, max_bytes=args.max_bytes, headers=headers,
                      smi=None if args.no_gpu else args.nvidia_smi, smi_timeout=args.smi_timeout,
                      key_env=args.api_key_env)
    if unset and not args.no_metrics:
        sampler.note("metrics", unset)
    out = Out(args.out, sampler)
    try:
        begun = time.monotonic_ns()
        sampler.sample()   # the sample at the start; the file stays empty until it is done
        head = {"t_ns": begun, "source": "start",
                "values": {"schema": SCHEMA, "url": args.url, "interval_s": args.interval, "families": families,
                           "metrics": spec, "gpu_query": list(GPU_QUERY), "pid": os.getpid()}}
        out.write([head, *sampler.take()], head=True)
        why, next_at = "", time.monotonic() + args.interval
        while not why:
            left = next_at - time.monotonic()
            if left > 0:
                select.select([wake], [], [], min(left, 1.0))
                with contextlib.suppress(BlockingIOError):
                    os.read(wake, 512)
            if stopping:
                why = f"signal {signal.Signals(stopping[0]).name}"
            elif args.duration is not None and time.monotonic() - started >= args.duration:
                why = "duration"
            elif os.getppid() != parent:
                why = "parent gone"
            elif time.monotonic() >= next_at:
                next_at = max(next_at + args.interval, time.monotonic())
                sampler.sample()
                out.write(sampler.take())
        sampler.sample()   # the sample at the stop
        out.write([*sampler.take(), {"t_ns": time.monotonic_ns(), "source": "stop",
                                     "values": {"why": why, **sampler.counts}}])
    finally:
        out.close()
    print(json.dumps({"why": why, **sampler.counts}))
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="telemetry", description="Sample an engine's /metrics and nvidia-smi "
                                "into a JSON-lines file until stopped.")
    p.add_argument("--url", required=True, help="the engine's metrics URL, e.g. http://127.0.0.1:8000/metrics")
    p.add_argument("--out", required=True, help="the JSON-lines file to append to")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between samples (default 1)")
    p.add_argument("--duration", type=float, default=None, help="stop after this many seconds (default: "
                   "when signalled or when the parent exits)")
    p.add_argument("--families", default="", help="comma-separated metric families to keep (default: all)")
    p.add_argument("--metrics", type=json.loads, default=None, help="JSON list of {key, family, kind, across}: "
                   "the engine's families and what they mean, recorded in the file's start line")
    p.add_argument("--max-bytes", type=int, default=MAX_METRICS_BYTES, help="refuse a /metrics answer "
                   f"larger than this (default {MAX_METRICS_BYTES:,})")
    p.add_argument("--nvidia-smi", default="nvidia-smi", help="the nvidia-smi to run (default: from PATH)")
    p.add_argument("--smi-timeout", type=float, default=SMI_TIMEOUT_S, help="seconds nvidia-smi may take")
    p.add_argument("--no-gpu", action="store_true", help="sample no GPUs")
    p.add_argument("--no-metrics", action="store_true", help="sample no /metrics (an engine with none)")
    p.add_argument("--api-key-env", help="an environment variable holding the server's API key, sent with "
                   "every scrape as `Authorization: Bearer`")
    return p


def _valid(args: argparse.Namespace) -> str | None:
    if not (0.01 <= args.interval <= 3600):
        return "--interval must be between 0.01 and 3600 seconds"
    if args.duration is not None and args.duration < 0:
        return "--duration must be 0 or more"
    if args.max_bytes < 1 or args.smi_timeout <= 0:
        return "--max-bytes and --smi-timeout must be positive"
    families = [f for f in args.families.split(",") if f]
    if any(not re.fullmatch(METRIC_NAME, f) for f in families):
        return "--families: metric names are letters, digits, '_' and ':'"
    spec = args.metrics
    if spec is not None and not (isinstance(spec, list) and all(
            isinstance(m, dict) and isinstance(m.get("family"), str) and re.fullmatch(METRIC_NAME, m["family"])
            for m in spec)):
        return "--metrics: a JSON list of objects, each with a metric family name"
    return None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)   # exits 2 on bad arguments, --metrics that is not JSON too
    problem = _valid(args)
    if problem:
        print(f"telemetry: error: {problem}", file=sys.stderr)
        return 2
    try:
        return run(args)
    except OSError as e:
        print(f"telemetry: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
