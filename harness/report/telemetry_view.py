"""A benchmark level's telemetry: what the server's /metrics and the GPUs said while it ran.

A level ran from its first send to its last end (`started_ns`, `ended_ns` in bench.json, on the host's
time.monotonic_ns() clock, the clock of telemetry.jsonl). Its window of samples is the last one
answered at or before the start, the first one asked for at or after the end, and every one between:
the samples that bracket it (a sample holds at some instant between its asking, `t_ns`, and its
answer, `t_end_ns`). A counter gives its increase from the first sample of that window to the last,
which only a bracketed window gives (a level shorter than the interval still has its two brackets); a
gauge its mean and maximum (`running_mean`, `kv_cache_usage_max`, ...) over the samples taken wholly
within the level, or over the window when none was (a bracket may already see the next level's
requests queueing). Then, named the
same for every engine:

    prefix_cache_hit_rate   prefix-cache hits / queries over the level (tokens; vLLM counts every
                            prompt token asked of the cache, SGLang the finished requests' prompt tokens)
    spec_acceptance         accepted draft tokens / draft tokens (vLLM's counters), or the mean of
                            SGLang's spec_accept_rate gauge
    spec_accept_length      1 + accepted / drafts (vLLM), or SGLang's spec_accept_length gauge: tokens
                            a verify step yields

A counter's label set that one scrape lacks and a later one has was created in between, at its first
increment, so it counted from 0 (prometheus_client writes a labelled series only once `.labels()` made
it: SGLang 0.5.23 makes `sglang:cached_tokens_total{cache_source=...}` at the first prefix-cache hit,
`srt/observability/metrics_collector.py` observe_one_finished_request); read as missing, the first
level with a hit had no hit rate at all. SGLang's speculative gauges are 0 when the server does not
speculate (0.5.23 `managers/scheduler_components/metrics_reporter.py`, spec_algorithm.is_none()): a
verify step yields at least its bonus token, so a scrape whose spec_accept_length is 0 speaks of no
speculative decoding and gives neither spec figure (else every SGLang run showed an acceptance of 0 %).

Per GPU (nvidia-smi's `index`), over the same bracketing of the GPU samples: SM clock (mean, MHz),
memory used (max, MiB), power (mean, W) and utilization (mean, %); `gpu` sums the power and takes the
mean of the clocks and utilization and the max of the memory over the GPUs. Nothing here reads a
file: the readers in harness.results.store do.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from harness.remote.exposition import parse_labels
from harness.results.models import TelemetryFile, TelemetryLine, TelemetryMetric

GPU_STATS = (("sm_clock_mhz", "mean"), ("memory_used_mib", "max"), ("power_w", "mean"), ("utilization_pct", "mean"))
"""Each GPU field of a sample and how a level reads it."""
SCALARS = ("running_mean", "running_max", "waiting_mean", "waiting_max", "kv_cache_usage_mean", "kv_cache_usage_max",
           "prefix_cache_hit_rate", "spec_acceptance", "spec_accept_length", "preemptions", "gpu_sm_clock_mhz",
           "gpu_memory_used_mib", "gpu_power_w", "gpu_utilization_pct")
"""The figures compare pools over repeats (their median) and shows."""


def bracket(samples: Sequence[TelemetryLine], start_ns: int, end_ns: int) -> tuple[list[TelemetryLine], bool]:
    """The samples from the last answered at or before `start_ns` to the first asked for at or after
    `end_ns` (by time), and whether both brackets are there."""
    before = [i for i, s in enumerate(samples) if (s.t_end_ns or s.t_ns) <= start_ns]
    after = [i for i, s in enumerate(samples) if s.t_ns >= end_ns]
    lo = before[-1] if before else next((i for i, s in enumerate(samples) if s.t_ns < end_ns), len(samples))
    hi = after[0] if after else max((i for i, s in enumerate(samples) if (s.t_end_ns or s.t_ns) > start_ns),
                                    default=-1)
    return list(samples[lo:hi + 1]), bool(before and after)


def inside(samples: Sequence[TelemetryLine], start_ns: int, end_ns: int) -> list[TelemetryLine]:
    """The samples asked for and answered within [start_ns, end_ns]: what a gauge says of the level
    itself (a bracket may already see the next level's requests queueing)."""
    return [s for s in samples if s.t_ns >= start_ns and (s.t_end_ns or s.t_ns) <= end_ns]


COPIES = {"waiting": ("pp_rank", "0")}
"""Figures that every pipeline stage reports a copy of, by the label and value of the one kept: SGLang
0.5.23 relays each request from pipeline stage to stage (`managers/scheduler_components/
request_receiver.py`), so every stage's scheduler holds the same waiting queue, and each stage's
first TP rank writes `sglang:num_queue_reqs` with its own `pp_rank` (`srt/observability/
metrics_collector.py` SchedulerMetricsCollector.init_new): summed, a --pp-size 2 server's queue
counted each request twice. Running requests are not copies: each stage reports the micro-batch it
ran last, a different one, so their sum stands."""


def value_of(values: dict[str, Any], metric: TelemetryMetric) -> float | None:
    """A family's samples in one scrape combined as the metric says (sum or mean over label sets), the
    breakdowns of a total and the copies (COPIES, `metric.only`) left out; None when the scrape has none
    (or only NaN)."""
    names = {metric.family, f"{metric.family}_total"} if metric.kind == "counter" else {metric.family}
    copy = COPIES.get(metric.key)
    found = []
    for key, v in values.items():
        name, _, rest = key.partition("{")
        if name not in names or not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            continue
        if (metric.breakdown or copy or metric.only) and rest:
            try:
                labels = parse_labels("{" + rest)
            except ValueError:
                continue
            if any(labels.get(b) for b in metric.breakdown):
                continue
            if copy and labels.get(copy[0], copy[1]) != copy[1]:
                continue
            if any(label in labels and labels[label] not in kept for label, kept in metric.only.items()):
                continue   # a rank's copy of a figure another rank stands for
        found.append(float(v))
    if not found:
        return None
    return sum(found) if metric.across == "sum" else sum(found) / len(found)


SPECULATIVE_GAUGES = ("spec_accept_rate", "spec_accept_length")
"""Gauges read only from scrapes whose spec_accept_length is above 0 (the module docstring)."""


def _speculating(within: Sequence[TelemetryLine], metrics: Sequence[TelemetryMetric]) -> list[TelemetryLine]:
    length = next((m for m in metrics if m.key == "spec_accept_length"), None)
    if length is None:
        return list(within)
    return [s for s in within if (value_of(s.values, length) or 0.0) > 0]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def level_summary(t: TelemetryFile, start_ns: int | None, end_ns: int | None) -> dict[str, Any] | None:
    """The level's figures (module docstring); None without a start and end or without any sample."""
    if start_ns is None or end_ns is None:
        return None
    samples = t.samples("metrics")
    window, bracketed = bracket(samples, start_ns, end_ns)
    own = inside(samples, start_ns, end_ns)
    within = own or window
    out: dict[str, Any] = {"samples": len(window), "bracketed": bracketed, "sampled_within": bool(own)}
    speculating = _speculating(within, t.metrics)
    for m in t.metrics:
        series = [v for s in (speculating if m.key in SPECULATIVE_GAUGES else within)
                  if (v := value_of(s.values, m)) is not None]
        if m.kind == "counter":
            first, last = (value_of(window[0].values, m), value_of(window[-1].values, m)) if window else (None, None)
            if first is None and last is not None:
                first = 0.0      # not yet made at the first scrape: it counted from 0 (module docstring)
            grew = last - first if bracketed and first is not None and last is not None else None
            out[m.key] = grew if grew is None or grew >= 0 else None   # a restarted server counts from 0
        elif series:
            out[f"{m.key}_mean"], out[f"{m.key}_max"] = statistics.fmean(series), max(series)
    out["prefix_cache_hit_rate"] = _ratio(out.get("prefix_cache_hits"), out.get("prefix_cache_queries"))
    accepted = out.get("spec_accepted_tokens")
    out["spec_acceptance"] = _ratio(accepted, out.get("spec_draft_tokens")) \
        if out.get("spec_draft_tokens") else out.get("spec_accept_rate_mean")
    drafts = out.get("spec_drafts")
    out["spec_accept_length"] = 1 + accepted / drafts if drafts and accepted is not None \
        else out.get("spec_accept_length_mean")
    gpus = _gpus(t, start_ns, end_ns)
    if gpus:
        out["gpus"] = gpus
        for field, _ in GPU_STATS:
            got = [g[field] for g in gpus if g.get(field) is not None]
            how = sum if field == "power_w" else max if field == "memory_used_mib" else statistics.fmean
            out[f"gpu_{field}"] = how(got) if got else None
    if out["samples"] == 0 and not gpus:
        return None
    return out


def _gpus(t: TelemetryFile, start_ns: int, end_ns: int) -> list[dict[str, Any]]:
    samples = t.samples("gpu")
    by_gpu: dict[int, list[TelemetryLine]] = {}
    for s in samples:
        index = s.values.get("gpu")
        if isinstance(index, int) and not isinstance(index, bool):
            by_gpu.setdefault(index, []).append(s)
    out = []
    for index in sorted(by_gpu):
        window, bracketed = bracket(by_gpu[index], start_ns, end_ns)
        within = inside(by_gpu[index], start_ns, end_ns) or window
        gpu: dict[str, Any] = {"gpu": index, "samples": len(within), "bracketed": bracketed}
        for field, how in GPU_STATS:
            got = [float(v) for s in within if isinstance(v := s.values.get(field), (int, float))
                   and not isinstance(v, bool) and math.isfinite(v)]
            gpu[field] = (statistics.fmean(got) if how == "mean" else max(got)) if got else None
        if window:
            out.append(gpu)
    return out


def pooled(summaries: Sequence[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Repeats of one configuration at one level: the median of each figure, the GPUs of the first."""
    got = [s for s in summaries if s]
    if not got:
        return None
    out: dict[str, Any] = {"runs": len(got), "bracketed": all(s.get("bracketed") for s in got),
                           "sampled_within": all(s.get("sampled_within", True) for s in got)}
    for key in SCALARS:
        values = [s[key] for s in got if s.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    if any("gpus" in s for s in got):
        out["gpus"] = next(s["gpus"] for s in got if "gpus" in s)
    return out


def unsampled(rows: Sequence[dict[str, Any]]) -> str | None:
    """What a reader must know of the levels no sample of /metrics fell within (shorter than the
    interval): their gauges are the samples just before and after them, the levels around them."""
    short = [f"{r['config']} {r.get('scenario') or ''} {r.get('request_rate') or r.get('concurrency') or ''}"
             for r in rows if has_figures(r.get("telemetry")) and not r["telemetry"].get("sampled_within", True)]
    if not short:
        return None
    return ("no sample of /metrics within " + ", ".join(" ".join(s.split()) for s in short)
            + " (shorter than the sampling interval): their running, waiting and KV-cache figures are the "
            "samples just before and after them, not the level's own")


def has_figures(summary: dict[str, Any] | None) -> bool:
    return bool(summary) and any(summary.get(k) is not None for k in SCALARS)  # type: ignore[union-attr]
