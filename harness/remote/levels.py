"""A level's summary: each request's line of requests.jsonl (`request_record`), the level of bench.json
(`summarize_level`: distributions, the decode window, goodput under an SLO), what a scenario's level
adds (`scenario_fields`), and the SLO verdicts that goodput and max_load rest on (`request_meets`,
`level_meets`).

A room of its own: arithmetic on Outcomes, after the level, with no socket and no clock, so every
figure of bench.json is defined here (below) and tested in one place.

Definitions (per request; a level's distributions pool its completed requests):
    TTFT = first chunk carrying text (or reasoning text) - request sent (open loop: - its scheduled
           send time, so a late send counts against the latency a user would have seen)
    ITL  = gaps between consecutive text-carrying chunks (pooled over the level's requests): per chunk
    ITL per token (itl_token_ms) = each gap / the tokens its chunk carried (usage per chunk when the
           engine sends it, else the request's completion_tokens / its text chunks). An engine may put
           several tokens in one chunk, or send a token that decodes to no text as an event with empty
           text (counted as empty_events, not as a chunk): then ITL per chunk is a multiple of TPOT
           and ITL per token is the figure to compare with a client that counts every event
    TPOT = (E2E - TTFT) / (completion_tokens - 1), for requests of two tokens or more
    E2E  = last text-carrying chunk - request sent (open loop: - scheduled)
    schedule lag (open loop) = sent - scheduled; achieved rate = (sent - 1) / (last send - first send)
    goodput = requests meeting every SLO bound (each its own TTFT, TPOT, E2E, ITL percentile) / duration
    completion_tokens from the server's usage; without usage, the chunk count (tokens_from: "chunks")
    failed = an error of the connection or the server (exchange.py: a status, an error event, an abort,
           a usage count that is none), or, when every request asked for exactly `asked` tokens
           (ignore_eos), a usage that counts fewer (`short_answer`): a failed request counts in
           `failed` and `errors` only, and a level with one does not meet its SLO
    level duration = first send to last finish; output_tok_s = completed requests' tokens / duration.
           A request that failed before it was sent (its connection refused) has no send time and
           starts nothing; a level that sent nothing has no duration (0) and no rates (null)
    decode = the steady-state window, rule "first-wave" (named in bench.json as decode.rule): among
             the first `concurrency` requests sent, from the last of their first tokens to the first
             of their last tokens, so every stream of the batch decodes and no newcomer's prefill
             interrupts. Over a whole closed-loop level that window is always empty (a finished
             stream's successor is still in prefill). per_user_tok_s and aggregate_tok_s are the
             window's tokens (chunks scaled by each request's usage/chunks ratio) per second.
    percentiles: linear interpolation between closest ranks (numpy's default method "linear");
    std is the population standard deviation (numpy's default ddof=0).
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

from .exchange import Outcome
from .stats import distribution

DECODE_RULE = "first-wave"  # the decode window's definition, named in bench.json (module docstring)


def _ms(ns: int) -> float:
    return ns / 1e6


def request_record(concurrency: int | None, index: int, o: Outcome) -> dict:
    """One line of requests.jsonl. TTFT and E2E count from the scheduled send time in an open loop
    (a late send is the client's delay, which a user of the server would have waited too), else
    from the send."""
    tokens = o.tokens if o.tokens is not None else len(o.times)
    ttft = e2e = tpot = None
    origin = o.sent_ns if o.scheduled_ns is None else o.scheduled_ns
    if o.times:
        ttft, e2e = _ms(o.times[0] - origin), _ms(o.times[-1] - origin)
        if tokens >= 2:
            tpot = (e2e - ttft) / (tokens - 1)
    itl = [_ms(b - a) for a, b in zip(o.times, o.times[1:])]
    return {"concurrency": concurrency, "index": index, "scheduled_ns": o.scheduled_ns, "start_ns": o.sent_ns,
            "end_ns": o.end_ns,
            "ttft_ms": ttft, "itl_ms": itl, "itl_token_ms": _per_token(itl, o, tokens),
            "tpot_ms": tpot, "e2e_ms": e2e, "output_tokens": tokens,
            "tokens_from": "usage" if o.tokens is not None else "chunks", "chunks": len(o.times),
            "empty_events": o.empty_events, "prompt_tokens": o.prompt_tokens, "status": o.status,
            "error": o.error}


def _per_token(itl: list[float], o: Outcome, tokens: int) -> list[float]:
    """Each gap divided by the tokens its (later) chunk carried: from usage per chunk when the engine
    sends it, else the request's tokens over its text chunks (an engine may send several tokens in one
    chunk, or a token that decodes to no text in an event of its own)."""
    if o.chunk_tokens and len(o.chunk_tokens) == len(o.times):
        counts = [b - a for a, b in zip(o.chunk_tokens, o.chunk_tokens[1:])]
        return [gap / n for gap, n in zip(itl, counts) if n > 0]
    per_chunk = tokens / len(o.times) if o.times else 1
    return [gap / per_chunk for gap in itl] if per_chunk > 0 else []


def short_answer(o: Outcome, asked: int | None) -> Outcome:
    """`o`, failed when it completed with fewer tokens than the `asked` its request was to decode
    whatever its end-of-sequence (ignore_eos), by the server's own usage: the server stopped it short
    without saying so. A count of chunks is no token count (a chunk may carry several) and holds it to
    nothing."""
    if asked is None or o.error is not None or o.tokens is None or o.tokens >= asked:
        return o
    return dataclasses.replace(o, error=f"short answer: {o.tokens} of the {asked} tokens asked with ignore_eos")


def _sent(o: Outcome) -> bool:
    """Whether the request went out: a failed one without a send time (0: its connection refused, no
    socket to be had) never did; a completed one did."""
    return o.error is None or o.sent_ns != 0


def decode_window(outcomes: Sequence[Outcome], concurrency: int) -> dict | None:
    """Steady-state decode of the first wave: every one of its streams is past its first token and
    none has finished, so no prefill of a newcomer interrupts. Chunk counts are scaled to tokens by
    each request's usage/chunks ratio. None when the window is empty."""
    sent = sorted(filter(_sent, outcomes), key=lambda o: o.sent_ns)
    wave = [o for o in sent[:concurrency] if o.error is None and o.times]
    if not wave:
        return None
    start, end = max(o.times[0] for o in wave), min(o.times[-1] for o in wave)
    if end <= start:
        return None
    window_s = (end - start) / 1e9
    tokens = [sum(start < t <= end for t in o.times) * (o.tokens or len(o.times)) / len(o.times)
              for o in wave]
    return {"rule": DECODE_RULE, "window_s": window_s, "streams": len(wave),
            "per_user_tok_s": sum(tokens) / len(wave) / window_s, "aggregate_tok_s": sum(tokens) / window_s}


def summarize_level(concurrency: int | None, outcomes: Sequence[Outcome],
                    slo: dict[str, float] | None = None, asked: int | None = None) -> tuple[dict, list[dict]]:
    """A level of bench.json and its requests.jsonl records (indexed in the order they were sent, or
    scheduled in an open loop). With `slo`, the level's goodput (`goodput`); with `asked`, the tokens
    each request had to decode (ignore_eos), a request that decoded fewer is failed (`short_answer`)."""
    outcomes = [short_answer(o, asked) for o in outcomes]
    records = [request_record(concurrency, i, o) for i, o in
               enumerate(sorted(outcomes, key=lambda o: o.sent_ns if o.scheduled_ns is None else o.scheduled_ns))]
    ok = [r for r in records if r["error"] is None]
    # requests refused before they were sent carry no send time (0): they do not start the level
    started_ns = min((o.sent_ns for o in outcomes if _sent(o)), default=None)
    ended_ns = max((o.end_ns for o in outcomes), default=None)
    duration_s = (ended_ns - started_ns) / 1e9 if started_ns is not None and ended_ns is not None else 0.0
    output_tokens = sum(r["output_tokens"] for r in ok)
    level = {
        "concurrency": concurrency, "requests": len(records), "completed": len(ok),
        "failed": len(records) - len(ok), "duration_s": duration_s, "output_tokens": output_tokens,
        "started_ns": started_ns, "ended_ns": ended_ns,   # the clock of telemetry.jsonl
        "output_tok_s": output_tokens / duration_s if duration_s else None,
        "requests_per_s": len(ok) / duration_s if duration_s else None,
        "token_count_mismatches": sum(r["tokens_from"] == "usage" and r["output_tokens"] != r["chunks"]
                                      for r in ok),
        "usage_missing": sum(r["tokens_from"] == "chunks" for r in ok),
        "errors": [{"error": e, "count": n}
                   for e, n in Counter(r["error"] for r in records if r["error"]).most_common(10)],
        "ttft_ms": distribution(r["ttft_ms"] for r in ok if r["ttft_ms"] is not None),
        "itl_ms": distribution(x for r in ok for x in r["itl_ms"]),
        "itl_token_ms": distribution(x for r in ok for x in r["itl_token_ms"]),
        "tokens_per_chunk": (output_tokens / chunks) if (chunks := sum(r["chunks"] for r in ok)) else None,
        "empty_events": sum(r["empty_events"] for r in ok),
        "tpot_ms": distribution(r["tpot_ms"] for r in ok if r["tpot_ms"] is not None),
        "e2e_ms": distribution(r["e2e_ms"] for r in ok if r["e2e_ms"] is not None),
        "decode": decode_window(outcomes, concurrency) if concurrency else None,
    }
    if slo:
        good = sum(request_meets(r, slo) for r in records)
        level.update(slo=slo, slo_met_requests=good, goodput_req_s=good / duration_s if duration_s else None)
        level["slo_met"] = level_meets(level, slo)
    return level, records


def _slo_parts(metric: str) -> tuple[str, str]:
    """"ttft_ms_p99" -> ("ttft_ms", "p99")."""
    name, _, stat = metric.rpartition("_")
    return name, stat


def request_meets(record: dict, slo: dict[str, float]) -> bool:
    """Whether one completed request meets every bound: its TTFT, TPOT and E2E against their bounds
    (whatever statistic the bound names: a request has one value of each), its own ITL percentile
    for itl_ms_*. A request of one token has no TPOT nor ITL, and meets those bounds; a failed one
    meets none."""
    if record["error"] is not None:
        return False
    for metric, bound in slo.items():
        name, stat = _slo_parts(metric)
        if name == "itl_ms":
            if not record["itl_ms"]:
                continue
            value = distribution(record["itl_ms"])[stat]
        else:
            value = record.get(name)
            if value is None:
                if name == "tpot_ms":
                    continue
                return False
        if value > bound:
            return False
    return True


def level_meets(level: dict, slo: dict[str, float]) -> bool:
    """Whether a level as a whole meets the SLO (what max_load searches for): every request completed
    and each bound holds for the level's own statistic (ttft_ms_p99: the p99 of the level's TTFTs;
    itl_ms_p99: of its pooled ITLs)."""
    if not level["completed"] or level["failed"]:
        return False
    for metric, bound in slo.items():
        name, stat = _slo_parts(metric)
        value = (level.get(name) or {}).get(stat)
        if value is None and name in ("tpot_ms", "itl_ms"):
            continue   # outputs of one token: no gaps to bound
        if value is None or value > bound:
            return False
    return True


SLO_FORM = "metrics like ttft_ms_p99 or itl_ms_p50, each to a bound in ms above 0"


def is_slo(slo: Any) -> bool:
    """Whether `slo` has the form the verdicts above judge: SLO_FORM."""
    return isinstance(slo, dict) and all(
        isinstance(k, str) and re.fullmatch(r"(ttft|itl|tpot|e2e)_ms_(mean|p50|p90|p95|p99|max)", k) is not None
        and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for k, v in slo.items())


def scenario_fields(level: dict, records: list[dict], outcomes: Sequence[Outcome], sc: dict, rate: float | None,
                    state: int, source: str, probe: bool) -> dict:
    """What a scenario's level adds to bench.json (and its requests to requests.jsonl): the workload,
    the prompts' lengths as the server counted them, and in an open loop the schedule's keeping."""
    reported = Counter(r["prompt_tokens"] for r in records if r["error"] is None and r["prompt_tokens"] is not None)
    kind = "concurrency" if rate is None else "request_rate"
    head = {"scenario": sc["name"], "workload": {"scenario": sc["name"], "input_tokens": sc["input_tokens"],
                                                 "output_tokens": sc["output_tokens"], "kind": kind,
                                                 "load": level["concurrency"] if rate is None else rate},
            "concurrency": level["concurrency"], "request_rate": rate, "probe": probe, "random_state": state,
            "prompt_source": source,
            "prompt_tokens_reported": {str(k): v for k, v in sorted(reported.items(), key=lambda kv: kv[0])},
            "prompt_tokens_mismatches": sum(n for k, n in reported.items() if k != sc["input_tokens"]),
            "prompt_tokens_unreported": sum(r["error"] is None and r["prompt_tokens"] is None for r in records),
            "latency_origin": "sent" if rate is None else "scheduled"}
    if rate is not None:
        head["arrival"], head["burstiness"] = sc.get("arrival", "poisson"), float(sc.get("burstiness", 1.0))
        sent = sorted(o.sent_ns for o in outcomes if o.sent_ns)
        head["achieved_rate_req_s"] = ((len(sent) - 1) / ((sent[-1] - sent[0]) / 1e9)
                                       if len(sent) > 1 and sent[-1] > sent[0] else None)
        head["schedule_lag_ms"] = distribution((o.sent_ns - o.scheduled_ns) / 1e6 for o in outcomes
                                               if o.sent_ns and o.scheduled_ns is not None)
    for r in records:
        r.update(scenario=sc["name"], request_rate=rate, probe=probe)
    return head | {k: v for k, v in level.items() if k not in head}
