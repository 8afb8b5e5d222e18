"""The text formats the telemetry sampler reads, parsed with the standard library alone and no sockets:
Prometheus' text exposition format (what an engine's /metrics answers) and nvidia-smi's CSV. The
sampler (`telemetry.py`) parses on the host; the reports (`harness/report/telemetry_view.py`) read the
sample keys it wrote (`sample_key`) back with `parse_labels`, so they import this module and not the
sampler, which holds an HTTP client.

Strict but tolerant, as the host is not trusted: a line that is not a sample or a comment is counted
as malformed and gives no value; comments, labels with escapes, NaN and +Inf, a timestamp and a
missing final newline are all read as the format allows.
"""

from __future__ import annotations

import csv
import math
import re
from typing import Any

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

METRIC_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
"""A metric or family name as the exposition format allows it."""
_NAME = METRIC_NAME
_HEAD = re.compile(_NAME)
_SAMPLE = re.compile(rf"^({_NAME})(\{{.*\}})?[ \t]+(\S+)(?:[ \t]+(-?\d+))?[ \t]*$")
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\\n]|\\.)*)"[ \t]*(,|$)')
_FLOAT = re.compile(r"^[+-]?(\d+\.?\d*([eE][+-]?\d+)?|\.\d+([eE][+-]?\d+)?|[Ii]nf|[Nn]a[Nn])$")
_UNESCAPE = {"\\": "\\", '"': '"', "n": "\n"}


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
