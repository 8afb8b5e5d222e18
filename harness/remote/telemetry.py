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

The host is not trusted, and neither is the engine: an answer to /metrics over `--max-bytes` is
refused unread, every line is parsed strictly (a line that is not a sample or a comment counts as
malformed and gives no value) and tolerantly (comments, labels with escapes, NaN and +Inf, a
timestamp, a missing final newline), and only the families asked for are kept. nvidia-smi runs with a
timeout and a bounded output; one that hangs past its timeout is not asked again that run. What goes
wrong is written as a `note` line (the first time each message is seen) and never ends the sampler:
telemetry describes a run, it never fails one.
Exit 0, or 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import http.client
import json
import math
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from typing import Any
from urllib.parse import urlsplit

SCHEMA = "harness.telemetry/1"
MAX_METRICS_BYTES = 4 << 20       # vLLM 0.32 on CPU: 52 KB; a large server with many labels, a few hundred KB
MAX_SMI_BYTES = 256 << 10         # eight GPUs of five fields: well under 1 KB
HTTP_TIMEOUT_S = 5.0
SMI_TIMEOUT_S = 10.0
GPU_QUERY = ("index", "clocks.sm", "memory.used", "power.draw", "utilization.gpu")
"""What nvidia-smi is asked per GPU (`--query-gpu`), in its own spelling."""
GPU_KEYS = {"index": "gpu", "clocks.sm": "sm_clock_mhz", "clocks.current.sm": "sm_clock_mhz",
            "memory.used": "memory_used_mib", "memory.total": "memory_total_mib", "power.draw": "power_w",
            "power.draw.instant": "power_w", "power.draw.average": "power_w", "utilization.gpu": "utilization_pct",
            "name": "name"}
"""nvidia-smi's column headers (as it prints them: `clocks.sm` comes back as `clocks.current.sm
[MHz]`) -> the keys of a gpu sample; any other column keeps its header's name, dots as underscores."""
SAMPLE_SUFFIXES = ("", "_total", "_sum", "_count")
"""The sample names a family is kept under: a gauge's own name, a counter's `_total` (prometheus_client
names a counter `NAME_total` and writes a `NAME_created` gauge beside it, left out), a histogram's or
summary's `_sum` and `_count` (never its buckets)."""

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_HEAD = re.compile(_NAME)
_SAMPLE = re.compile(rf"^({_NAME})(\{{.*\}})?[ \t]+(\S+)(?:[ \t]+(-?\d+))?[ \t]*$")
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\\n]|\\.)*)"[ \t]*(,|$)')
_FLOAT = re.compile(r"^[+-]?(\d+\.?\d*([eE][+-]?\d+)?|\.\d+([eE][+-]?\d+)?|[Ii]nf|[Nn]a[Nn])$")
_UNESCAPE = {"\\": "\\", '"': '"', "n": "\n"}


# --------------------------------------------------------------------------- the exposition format

def parse_value(text: str) -> float:
    """A sample value as the exposition format names them: a decimal float, `NaN`, `+Inf`, `-Inf`
    (ValueError else: Python's own spellings, `1_000` or `infinity`, and Go's hexadecimal floats too)."""
    if not _FLOAT.match(text):
        raise ValueError(f"not a sample value: {text[:40]!r}")
    return float(text)


def parse_labels(text: str) -> dict[str, str]:
    """`{a="x",b="y\\"z"}` -> {"a": "x", "b": 'y"z'}; ValueError when it is not a label set."""
    inner, at, labels = text[1:-1], 0, {}
    while at < len(inner.rstrip(" \t")):
        m = _LABEL.match(inner, at)
        if not m:
            raise ValueError(f"malformed labels: {text[:80]!r}")
        raw = m.group(2)
        labels[m.group(1)] = re.sub(r"\\(.)", lambda e: _UNESCAPE.get(e.group(1), "\\" + e.group(1)), raw)
        at = m.end()
        if m.group(3) == "" and at < len(inner):
            raise ValueError(f"malformed labels: {text[:80]!r}")
    return labels


def sample_key(name: str, labels: dict[str, str]) -> str:
    """A sample's name as the exposition writes it, labels sorted: `name{a="x",b="y"}`."""
    if not labels:
        return name
    body = ",".join('{}="{}"'.format(k, v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n"))
                    for k, v in sorted(labels.items()))
    return f"{name}{{{body}}}"


def kept_names(families: Any) -> set[str]:
    return {f + suffix for f in families for suffix in SAMPLE_SUFFIXES}


def parse_exposition(text: str, families: Any = None) -> tuple[dict[str, float], int]:
    """The samples of a Prometheus text exposition (format 0.0.4) whose family is one of `families`
    (None: every one), keyed by `sample_key`, and how many lines were malformed (of those whose name
    is one kept, or cannot be told). Comments (`# HELP`, `# TYPE` and any other) are skipped; a
    sample repeated keeps its last value."""
    keep = None if families is None else kept_names(families)
    out: dict[str, float] = {}
    bad = 0
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if keep is not None:   # a family not kept is not parsed (nor judged): most of a large answer
            head = _HEAD.match(line)
            if head is not None and head.group(0) not in keep and line[head.end():head.end() + 1] in "{ \t":
                continue
        m = _SAMPLE.match(line)
        if not m:
            bad += 1
            continue
        name, labels, value = m.group(1), m.group(2), m.group(3)
        if keep is not None and name not in keep:
            continue
        try:
            out[sample_key(name, parse_labels(labels) if labels else {})] = parse_value(value)
        except ValueError:
            bad += 1
    return out, bad


def json_value(v: float) -> float | str:
    """A value JSON can hold: NaN and the infinities as the exposition spells them."""
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return v


def fetch_metrics(url: str, *, max_bytes: int = MAX_METRICS_BYTES, timeout: float = HTTP_TIMEOUT_S,
                  headers: dict[str, str] | None = None) -> str:
    """GET `url` (the engine's /metrics) as text; ValueError naming what was wrong with the answer
    (status, size, encoding), OSError when it could not be had. Never reads more than max_bytes + 1."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"url must look like http://HOST:PORT/metrics, got {url!r}")
    conn_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = conn_class(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request("GET", (parts.path or "/") + (f"?{parts.query}" if parts.query else ""),
                     headers={"Accept": "text/plain", "Accept-Encoding": "identity", **(headers or {})})
        response = conn.getresponse()
        if response.status != 200:
            raise ValueError(f"GET {parts.path} answered HTTP {response.status}")
        length = response.getheader("Content-Length")
        if length and length.isdigit() and int(length) > max_bytes:
            raise ValueError(f"the /metrics answer of {int(length):,} bytes is over the {max_bytes:,} byte "
                             "limit: refused unread")
        body = response.read(max_bytes + 1)
        if len(body) > max_bytes:
            raise ValueError(f"the /metrics answer is over the {max_bytes:,} byte limit: refused")
        try:
            return body.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"the /metrics answer is not UTF-8 ({e})") from None
    except http.client.HTTPException as e:
        raise ValueError(f"not an HTTP answer: {type(e).__name__}: {e}") from None
    finally:
        conn.close()


# --------------------------------------------------------------------------- nvidia-smi

def _number(text: str, unit: str) -> float | None:
    text = text.strip()
    if not text or text.startswith("["):      # [N/A], [Not Supported], [Unknown Error]
        return None
    if unit and text.endswith(unit):
        text = text[:-len(unit)].strip()
    return float(text)


def parse_gpu_csv(text: str) -> list[dict[str, Any]]:
    """nvidia-smi's `--format=csv` (header with units, values with units): one dict a GPU, keys from
    GPU_KEYS, numbers where the header gives a unit (or the column is the index), None for [N/A].
    ValueError when it is not that table."""
    rows = [r for r in csv.reader(text.splitlines(), skipinitialspace=True) if r]
    if not rows:
        raise ValueError("nvidia-smi printed nothing")
    columns = []
    for head in rows[0]:
        m = re.fullmatch(r"\s*([A-Za-z0-9_.]+)\s*(?:\[([^\]]*)\])?\s*", head)
        if not m:
            raise ValueError(f"not an nvidia-smi CSV header: {head[:60]!r}")
        name, unit = m.group(1), (m.group(2) or "")
        columns.append((GPU_KEYS.get(name, name.replace(".", "_")), unit))
    out = []
    for row in rows[1:]:
        if len(row) != len(columns):
            raise ValueError(f"an nvidia-smi row of {len(row)} fields under {len(columns)} columns")
        gpu: dict[str, Any] = {}
        for (key, unit), cell in zip(columns, row):
            if key == "gpu":
                gpu[key] = int(cell)
            elif unit:
                gpu[key] = _number(cell, unit)
            else:
                gpu[key] = cell.strip()
        out.append(gpu)
    return out


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
                 smi_timeout: float = SMI_TIMEOUT_S):
        self.url, self.families = url, families
        self.max_bytes, self.headers = max_bytes, headers or {}
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

    def sample_gpus(self) -> None:
        assert self.smi is not None
        sent = time.monotonic_ns()
        try:
            text = run_bounded([self.smi, f"--query-gpu={','.join(GPU_QUERY)}", "--format=csv"],
                               timeout=self.smi_timeout, max_bytes=MAX_SMI_BYTES)
            gpus = parse_gpu_csv(text)
        except Hung as e:   # a hung nvidia-smi stays hung (a driver in trouble): asked again, it would
            self.smi = None  # hold up every round of /metrics by its timeout
            return self.note("gpu", f"nvidia-smi: {e}: no more GPU samples this run")
        except (OSError, ValueError) as e:
            return self.note("gpu", f"nvidia-smi: {e}")
        got = time.monotonic_ns()
        for gpu in gpus:
            self.counts["gpu"] += 1
            self.lines.append({"t_ns": sent, "t_end_ns": got, "source": "gpu", "values": gpu})


def _open_out(path: str):
    """The output file for appending, created 0600, never through a link someone planted."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0), 0o600)
    return os.fdopen(fd, "a", encoding="utf-8")


def _write(out, lines: list[dict]) -> None:
    """Whole lines in one write, flushed: a reader sees every line complete or not at all."""
    if lines:
        out.write("".join(json.dumps(x, separators=(",", ":")) + "\n" for x in lines))
        out.flush()


def run(args: argparse.Namespace) -> int:
    spec = args.metrics or []
    families = sorted({f for f in args.families.split(",") if f} | {m["family"] for m in spec}) or None
    headers = {}
    if args.api_key_env:
        if not os.environ.get(args.api_key_env):
            print(f"telemetry: error: --api-key-env: {args.api_key_env} is not set", file=sys.stderr)
            return 2
        headers["Authorization"] = f"Bearer {os.environ[args.api_key_env]}"
    stopping: list[int] = []
    wake, wake_w = os.pipe()      # a signal writes a byte here (set_wakeup_fd): the wait ends at once
    os.set_blocking(wake, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: stopping.append(signum))
    parent, started = os.getppid(), time.monotonic()
    sampler = Sampler(None if args.no_metrics else args.url, families, max_bytes=args.max_bytes, headers=headers,
                      smi=None if args.no_gpu else args.nvidia_smi, smi_timeout=args.smi_timeout)
    with _open_out(args.out) as out:
        begun = time.monotonic_ns()
        sampler.sample()   # the sample at the start; the file stays empty until it is done
        head = {"t_ns": begun, "source": "start",
                "values": {"schema": SCHEMA, "url": args.url, "interval_s": args.interval, "families": families,
                           "metrics": spec, "gpu_query": list(GPU_QUERY), "pid": os.getpid()}}
        _write(out, [head, *sampler.take()])
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
                _write(out, sampler.take())
        sampler.sample()   # the sample at the stop
        _write(out, [*sampler.take(), {"t_ns": time.monotonic_ns(), "source": "stop",
                                       "values": {"why": why, **sampler.counts}}])
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
    p.add_argument("--api-key-env", help="an environment variable holding the server's API key")
    return p


def _valid(args: argparse.Namespace) -> str | None:
    if not (0.01 <= args.interval <= 3600):
        return "--interval must be between 0.01 and 3600 seconds"
    if args.duration is not None and args.duration < 0:
        return "--duration must be 0 or more"
    if args.max_bytes < 1 or args.smi_timeout <= 0:
        return "--max-bytes and --smi-timeout must be positive"
    families = [f for f in args.families.split(",") if f]
    if any(not re.fullmatch(_NAME, f) for f in families):
        return "--families: metric names are letters, digits, '_' and ':'"
    spec = args.metrics
    if spec is not None and not (isinstance(spec, list) and all(
            isinstance(m, dict) and isinstance(m.get("family"), str) and re.fullmatch(_NAME, m["family"])
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
