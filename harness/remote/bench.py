"""The decode benchmark client: standard library only, run on the GPU host, next to the server.

The harness ships it in its host zipapp and runs it inside the host's venv, so it imports nothing outside
the standard library (the GLM-5 campaign's timing script died on `ModuleNotFoundError: requests`) and
nothing from the rest of `harness` but its siblings in this package (below). It runs as

    python harness.pyz bench --url http://127.0.0.1:30000 --model NAME --concurrency 1,8,32 --out bench.json

Each concurrency level runs in order: `--warmup` requests that are not measured, then `--requests`
requests (default: twice the concurrency, at least 16) with `concurrency` of them in flight (a closed
loop: a stream sends its next request when its last one ends), or as many as fit in `--duration`
seconds. `--plan '{"scenarios": [...], "slo": {...}, "search": {...}, "random_state": N}'` runs
workloads instead (docs/formats.md "Workloads"): each scenario's levels, closed loop or open loop
(requests sent at the instants an arrival process drew, whatever is in flight), every request its own
prompt of exactly `input_tokens` tokens (PromptMaker: the server's /tokenize, else calibrated from its
usage), then the probes of the max_load search (bisect_max_load); with an SLO every level records its
goodput. Requests are greedy (temperature 0), streamed, ask for usage, and ignore EOS by default so
every request decodes `--max-tokens` tokens. Results: bench.json (docs/formats.md "bench.json and
requests.jsonl") and requests.jsonl beside it; a short summary goes to stderr. Exit 0 when every level
completed (or failed no more than --max-failed-share of its requests); 4 when a level failed more,
naming the errors; 3 when no request of any level completed; 2 on bad arguments.

This module is the client's front: `run_benchmark` (a run's levels in order, then the max_load
search's probes), `write_results` (bench.json, requests.jsonl) and the command line (`main`). The
rest lives in rooms of one concern each, so that the hot path stays small enough to read whole and
the arithmetic can be tested without a socket:

    exchange.py   a request and its response as bytes: Target and build_target (what is sent, where),
                  parse_exchange (the response, parsed after the level, into an Outcome)
    loop.py       the hot path: the selector loop that sends and stamps, closed loop and open loop, and
                  run_level (in this process or in worker processes); its docstring says what fidelity
                  costs and where it is measured
    workload.py   what is sent when: prompts (synthetic, or of exact token lengths: PromptMaker) and
                  the open loop's arrival schedules
    levels.py     a level's summary (summarize_level), the records of requests.jsonl, goodput and the
                  SLO verdicts; its docstring defines every figure of bench.json
    maxload.py    the max_load bisection
    stats.py      percentiles and distributions (the harness's reproduce and reports use them too)

Each imports none but stats.py and the rooms listed above it, and only this one imports them all, so
there is no cycle.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import random
import re
import socket
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

from .exchange import APIS, auth_headers, build_target
from .levels import SLO_FORM, is_slo, scenario_fields, summarize_level
from .loop import Exchange, run_level
from .maxload import bisect_max_load
from .names import RunFiles
from .stats import several_per_chunk
from .workload import ARRIVALS, PromptMaker, arrival_offsets, synthetic_prompt

SCHEMA = "harness.bench/1"
DEFAULT_MAX_TOKENS = 128
DEFAULT_TIMEOUT_S = 600.0
DEFAULT_PROMPT_WORDS = 16


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _number(value: Any) -> bool:
    """Whether `value` is a finite number (JSON's `Infinity` and `NaN` are not; a boolean is not one)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_scenario(sc: Any, searched: bool) -> None:
    name = sc.get("name") if isinstance(sc, dict) else None
    _check(isinstance(name, str) and bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.\-]*", name)),
           f"a scenario needs a name of letters, digits, '.', '_', '-' (got {sc!r})")
    for key in ("input_tokens", "output_tokens"):
        _check(_whole(sc.get(key)), f"scenario {name}: {key} must be a positive integer")
    conc, rate = sc.get("concurrency"), sc.get("request_rate")
    _check((conc is None) != (rate is None), f"scenario {name}: give concurrency (closed loop) or request_rate "
           "(open loop), one of them")
    _check(isinstance(conc or [], list) and all(_whole(c) for c in conc or ()), f"scenario {name}: concurrency "
           "levels are positive integers")
    _check(isinstance(rate or [], list) and all(_number(r) and r > 0 for r in rate or ()), f"scenario {name}: "
           "request rates are positive numbers")
    _check(searched or bool(conc or rate), f"scenario {name}: no levels")
    _check(sc.get("arrival", "poisson") in ARRIVALS, f"scenario {name}: arrival is one of {', '.join(ARRIVALS)}")
    _check(_number(sc.get("burstiness", 1.0)) and sc.get("burstiness", 1.0) > 0,
           f"scenario {name}: burstiness must be above 0")
    _check(sc.get("requests") is None or _whole(sc["requests"]), f"scenario {name}: requests must be at least 1")


def asked_exactly(body: dict) -> int | None:
    """The tokens every answer to `body` must have: its max_tokens when it asks the server to ignore
    end-of-sequence and sets nothing else that may end an answer sooner or give it another length (stop
    strings or tokens, another limit: `extra_body` may add them); else None, and no answer is held to a
    length."""
    n = body.get("max_tokens")
    if body.get("ignore_eos") is not True or not isinstance(n, int) or isinstance(n, bool) \
            or any(k in body for k in ("stop", "stop_token_ids", "max_completion_tokens", "max_new_tokens")):
        return None
    return n


def _load_label(level: dict) -> str:
    scenario = f"{level['scenario']} " if level.get("scenario") else ""
    if level.get("request_rate") is not None:
        return f"{scenario}rate {level['request_rate']:g}/s"
    return f"{scenario}concurrency {level['concurrency']}"


def run_benchmark(url: str, model: str, *, concurrency: Sequence[int] = (1,), requests: int | None = None,
                  warmup: int = 1, max_tokens: int = DEFAULT_MAX_TOKENS, prompt: str | None = None,
                  prompt_tokens: int | None = None, api: str = "completions", ignore_eos: bool = True,
                  timeout: float = DEFAULT_TIMEOUT_S, duration: float | None = None, workers: int = 1,
                  progress: Callable[[dict], None] | None = None, extra_body: dict | None = None,
                  headers: dict[str, str] | None = None, on_tick: Callable[[dict], None] | None = None,
                  scenarios: Sequence[dict] | None = None, slo: dict[str, float] | None = None,
                  search: dict | None = None, random_state: int = 0) -> dict:
    """Run every level; return bench.json's content plus "requests" (requests.jsonl's lines).

    Without `scenarios`, one level per `concurrency`, every request the same prompt. With them, each
    scenario's levels in turn (closed loop at each of its `concurrency`, or open loop at each of its
    `request_rate`), each request its own prompt of exactly `input_tokens` tokens (PromptMaker),
    asking `output_tokens` with ignore_eos; then, with `search` ({scenario, slo, low, high, steps}),
    the probes of the highest load of that scenario that meets the SLO (bisect_max_load), each an
    ordinary level marked `probe`, after every scenario's own levels. `random_state` fixes the
    arrivals and prompts (level i draws from random_state + i). `slo` adds goodput to every level.

    `requests` is per level (default: max(2 x concurrency, 16), or max(2 x rate, 16) in an open
    loop; with `duration`, a cap). Raises ValueError on bad arguments; failed requests are recorded,
    never raised. `progress` is called with each level as it finishes. `ignore_eos` is sent only
    when true (some servers refuse unknown fields, transformers serve with HTTP 422); `extra_body`
    adds engine-specific fields to every request.
    """
    _check(isinstance(scenarios or [], (list, tuple)), "scenarios: a list of scenarios")
    scenarios = list(scenarios or ())
    _check(bool(concurrency) and all(c >= 1 for c in concurrency), "concurrency must be positive integers")
    _check(requests is None or requests >= 1, "requests must be at least 1")
    _check(warmup >= 0, "warmup must be 0 or more")
    _check(max_tokens >= 1, "max_tokens must be at least 1")
    _check(prompt is None or prompt_tokens is None, "give a prompt or prompt_tokens, not both")
    _check(prompt_tokens is None or prompt_tokens >= 1, "prompt_tokens must be at least 1")
    _check(api in APIS, f"api must be one of {', '.join(APIS)}")
    _check(timeout > 0 and (duration is None or duration > 0), "timeout and duration must be positive")
    _check(workers >= 1, "workers must be at least 1")
    _check(extra_body is None or isinstance(extra_body, dict), "extra_body: a JSON object of fields")
    _check(not scenarios or (prompt is None and prompt_tokens is None),
           "scenarios make their own prompts: give no prompt nor prompt_tokens with them")
    _check(not scenarios or duration is None, "scenarios count their requests: no duration with them")
    _check(search is None or bool(scenarios), "search needs scenarios (the scenario whose load it searches)")
    _check(slo is None or is_slo(slo), "slo: " + SLO_FORM)
    _check(isinstance(random_state, int) and random_state >= 0, "random_state must be an integer, 0 or more")
    searched = None
    if search is not None:
        _check(isinstance(search, dict) and all(_number(search.get(k)) for k in ("low", "high")),
               "search: {scenario, slo, low, high, steps}, low and high numbers (finite)")
        names = [sc.get("name") for sc in scenarios if isinstance(sc, dict)]
        searched = search.get("scenario") or (names[0] if names else None)
        _check(searched in names, f"search: no scenario named {searched!r} (have: {', '.join(map(str, names))})")
        _check(is_slo(search.get("slo")) and bool(search["slo"]), "search: an SLO to meet: " + SLO_FORM)
        _check(_whole(search.get("steps")), "search: steps must be at least 1")
        _check(0 < search.get("low", 0) <= search.get("high", 0), "search: 0 < low <= high")
    for sc in scenarios:
        _check_scenario(sc, sc.get("name") == searched if isinstance(sc, dict) else False)
    if search is not None and next(sc for sc in scenarios if sc["name"] == searched).get("concurrency") is not None:
        # the bisection's own check, before any level runs rather than after them all
        _check(math.ceil(search["low"]) <= math.floor(search["high"]),
               f"search: no whole number of streams lies between low {search['low']:g} and high {search['high']:g}")
    words: int | None = None
    if prompt is not None:
        text = prompt
    else:
        words = None if scenarios else (prompt_tokens or DEFAULT_PROMPT_WORDS)
        text = synthetic_prompt(words or DEFAULT_PROMPT_WORDS)
    base = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if ignore_eos:
        base["ignore_eos"] = True
    body = dict(base)
    body.update({"messages": [{"role": "user", "content": text}]} if api == "chat" else {"prompt": text})
    body.update(extra_body or {})
    target = build_target(url, body, api, headers)

    result: dict[str, Any]
    result = {"schema": SCHEMA, "url": url, "model": model, "api": api,
              "max_tokens": None if scenarios else max_tokens, "prompt_tokens": None, "prompt": prompt,
              "prompt_words": words, "ignore_eos": ignore_eos or bool(scenarios),
              "temperature": 0, "warmup": warmup, "timeout_s": timeout, "duration_limit_s": duration,
              "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "client": {"name": "harness-bench", "python": platform.python_version(),
                         "host": socket.gethostname(), "workers": workers, "clock": "time.monotonic_ns",
                         "percentiles": "linear interpolation (numpy default)",
                         "latency_origin": "the send time; in an open loop the scheduled send time"},
              "slo": slo or None, "random_state": random_state, "scenarios": scenarios or None,
              "levels": [], "requests": []}
    maker = PromptMaker(url, model, api, headers or {}, timeout, extra_body) if scenarios else None
    plan: list[dict] = []
    if scenarios:
        for sc in scenarios:
            kind = "concurrency" if sc.get("concurrency") is not None else "request_rate"
            plan += [{"scenario": sc, kind: load} for load in sc[kind] or ()]
    else:
        plan = [{"concurrency": c} for c in concurrency]
    levels_total = len(plan) + (search["steps"] if search else 0)

    def measure(spec: dict, level_slo: dict | None, probe: bool = False) -> dict:
        index = len(result["levels"])
        sc, c, rate = spec.get("scenario"), spec.get("concurrency"), spec.get("request_rate")
        n: int | None = (sc or {}).get("requests") or requests
        if probe and n is not None:
            # a probe's load is the search's, not one the scenario's `requests` was written for: at least
            # two requests a stream (two seconds of arrivals), or a probe at 128 streams of 32 requests never
            # has more than 32 in flight (seen on an H200: vLLM 0.26.0 reported 24-32 running)
            n = max(n, 2 * c) if c is not None else max(n, math.ceil(2 * (rate or 0)))
        count: int | None
        if rate is None:
            assert c is not None   # a level is closed loop or open
            count = n if n is not None or duration is not None else max(2 * c, 16)
        else:
            count = n or (math.ceil(rate * duration) if duration else max(16, math.ceil(2 * rate)))
        state = random_state + index
        reqs = offsets = None
        asked = asked_exactly(body)
        if sc is not None:
            assert maker is not None and count is not None   # a scenario's level counts its requests
            scenario_body = {**base, "max_tokens": sc["output_tokens"], "ignore_eos": True, **(extra_body or {})}
            asked = asked_exactly(scenario_body)
            texts = maker.prompts(sc["input_tokens"], count + warmup, random.Random(f"prompts/{state}"))
            reqs = [target.request_for(scenario_body | maker.content(t)) for t in texts]
            if rate is not None:
                offsets = arrival_offsets(rate, count, sc.get("arrival", "poisson"), float(sc.get("burstiness", 1.0)),
                                          state)
        streams = c if c is not None else 1
        tick = (_ticker(on_tick, _load_label({"scenario": sc and sc["name"], "concurrency": c, "request_rate": rate}),
                        c, count, duration, sc["output_tokens"] if sc else max_tokens, levels_total, index)
                if on_tick else None)
        outcomes, cpu_s = run_level(target, streams, count, warmup, duration if offsets is None else None, timeout,
                                     workers, tick, reqs, offsets)
        level, records = summarize_level(c, outcomes, level_slo, asked)
        chunks = sum(r["chunks"] for r in records)
        level["client_cpu_s"] = cpu_s
        level["client_cpu_us_per_chunk"] = cpu_s * 1e6 / chunks if chunks else None
        if sc is not None:
            assert maker is not None
            level = scenario_fields(level, records, outcomes, sc, rate, state, maker.source(sc["input_tokens"]), probe)
        result["levels"].append(level)
        result["requests"] += records
        if result["prompt_tokens"] is None:
            result["prompt_tokens"] = next((o.prompt_tokens for o in outcomes if o.prompt_tokens), None)
        if progress:
            progress(level)
        return level

    try:
        for spec in plan:
            measure(spec, slo)
        if search is not None:
            sc = next(s for s in scenarios if s["name"] == searched)
            kind = "concurrency" if sc.get("concurrency") is not None else "request_rate"
            probes: list[int] = []

            def meets(load: float) -> bool:
                level = measure({"scenario": sc, kind: int(load) if kind == "concurrency" else load}, search["slo"],
                                probe=True)
                probes.append(len(result["levels"]) - 1)
                return bool(level["slo_met"])

            found = bisect_max_load(search["low"], search["high"], search["steps"], kind == "concurrency", meets)
            for p, index in zip(found["probes"], probes):
                p["level"] = index
            result["max_load"] = {"scenario": searched, "kind": kind, "low": search["low"], "high": search["high"],
                                  "steps": search["steps"], "slo": search["slo"], **found}
    finally:
        if maker is not None:
            maker.close()
    return result


def _ticker(on_tick: Callable[[dict], None], label: str, concurrency: int | None, count: int | None,
            duration: float | None, max_tokens: int, levels: int, index: int) -> Callable[[list[Exchange]], None]:
    """Once a second, where the level stands: requests done (and failed) of how many, elapsed, an ETA,
    and tokens a second so far (completed requests x max_tokens: an estimate until the level ends)."""
    started = time.monotonic()

    def tick(finished: list[Exchange]) -> None:
        elapsed = time.monotonic() - started
        done, failed = len(finished), sum(x.error is not None for x in finished)
        total = count if count is not None else None
        eta = (elapsed / done * (total - done) if total and done else
               (duration - elapsed if duration else None))
        on_tick({"concurrency": concurrency, "load": label, "level": index + 1, "levels": levels, "done": done,
                 "failed": failed, "of": total, "elapsed_s": round(elapsed, 1),
                 "eta_s": None if eta is None else round(max(0.0, eta), 1),
                 "tok_s_estimate": round((done - failed) * max_tokens / elapsed, 1) if elapsed else None})
    return tick


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    try:
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def write_results(result: dict, out_path) -> None:
    """bench.json at `out_path` (without the per-request lines) and requests.jsonl beside it."""
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(out, json.dumps({k: v for k, v in result.items() if k != "requests"}, indent=2) + "\n")
    _write_atomic(out.with_name(RunFiles.REQUESTS), "".join(json.dumps(r) + "\n" for r in result["requests"]))


def format_level(level: dict) -> str:
    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    decode = level["decode"]
    line = (f"{_load_label(level)}: {level['completed']}/{level['requests']} completed, "
            f"{f(level['output_tok_s'])} tok/s, TTFT p50 {f(level['ttft_ms']['p50'])} ms, "
            f"ITL p50 {f(level['itl_ms']['p50'])} p99 {f(level['itl_ms']['p99'])} ms"
            + (f" (per token {f(level['itl_token_ms']['p50'])} p99 {f(level['itl_token_ms']['p99'])}, "
               f"{level['tokens_per_chunk']:.2f} tokens a chunk)" if several_per_chunk(level) else "")
            + f", TPOT p50 {f(level['tpot_ms']['p50'])} ms, "
            f"decode {f(decode and decode['per_user_tok_s'])} tok/s/user")
    if level["usage_missing"]:
        line += f"\n  {level['usage_missing']} responses had no usage: tokens counted from chunks"
    if level.get("goodput_req_s") is not None:
        line += (f"\n  goodput {f(level['goodput_req_s'])} req/s ({level['slo_met_requests']} of "
                 f"{level['requests']} within the SLO; the level {'meets' if level['slo_met'] else 'misses'} it)")
    if level.get("schedule_lag_ms"):
        lag = level["schedule_lag_ms"]
        line += (f"\n  open loop: {f(level['achieved_rate_req_s'])} req/s achieved of {level['request_rate']:g}, "
                 f"schedule lag p50 {f(lag['p50'])} p99 {f(lag['p99'])} ms")
    if level.get("prompt_tokens_mismatches"):
        line += (f"\n  {level['prompt_tokens_mismatches']} prompts were not {level['workload']['input_tokens']} tokens "
                 f"as the server counted them ({level['prompt_source']}): {level['prompt_tokens_reported']}")
    for e in level["errors"][:3]:
        line += f"\n  {e['count']} failed: {e['error']}"
    return line


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,8,32, got {text!r}")
    return values


def _json(text: str) -> Any:
    """A JSON argument; argparse's own error (exit 2) for one that is none, nested past the parser's
    stack included."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise argparse.ArgumentTypeError(f"not JSON: {str(e)[:200]}") from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench.py",
                                description="Decode benchmark of an OpenAI-compatible server.")
    p.add_argument("--url", required=True, help="server root, e.g. http://127.0.0.1:30000")
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--api", choices=sorted(APIS), default="completions")
    p.add_argument("--concurrency", type=_positive_ints, help="levels, e.g. 1,8,32 (default 1)")
    p.add_argument("--requests", type=int,
                   help="measured requests per level (default max(2 x concurrency, 16))")
    p.add_argument("--duration", type=float, help="seconds per level instead of a request count")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests before each level (default 1)")
    p.add_argument("--max-tokens", type=int, help=f"output tokens a request (default {DEFAULT_MAX_TOKENS})")
    p.add_argument("--plan", type=_json, help="a JSON object: scenarios (a list, as the playbook's "
                   "benchmark.scenarios), slo, search (max_load: scenario, slo, low, high, steps), random_state; "
                   "instead of --concurrency, --max-tokens and the prompt options")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", help="a file holding the prompt (UTF-8), for prompts a command line "
                     "cannot carry (hundreds of KB, or starting with '-')")
    src.add_argument("--prompt-tokens", type=int,
                     help=f"a synthetic prompt of N words (default {DEFAULT_PROMPT_WORDS})")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask the server to ignore end-of-sequence (--no-ignore-eos sends no such field)")
    p.add_argument("--extra-body", type=_json, default=None,
                   help="a JSON object of fields added to every request (engine-specific)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per request")
    p.add_argument("--workers", type=int, default=1,
                   help="processes to split each level's streams over (default 1; raise it only beyond "
                        "~20,000 chunks/s and where cores are free beside the server's)")
    p.add_argument("--out", default=RunFiles.BENCH, help="bench.json path; requests.jsonl goes beside it")
    p.add_argument("--progress-file", help="a JSON file rewritten once a second with where the level stands")
    p.add_argument("--api-key-env", help="an environment variable holding the server's API key, sent as "
                   "Authorization: Bearer (the key itself never on the command line)")
    p.add_argument("--max-failed-share", type=float, default=0.0,
                   help="exit 4 when more than this share of a level's requests failed (default 0: any)")
    return p


def failures(result: dict, max_share: float = 0.0) -> list[str]:
    """One line per level whose failed requests exceed `max_share`, with the commonest errors."""
    lines = []
    for level in result["levels"]:
        if level.get("probe"):   # a probe of max_load that lost requests merely misses the SLO
            continue
        if level["requests"] and level["failed"] / level["requests"] > max_share:
            why = "; ".join(f"{e['count']} x {e['error']}" for e in level["errors"][:3])
            lines.append(f"{_load_label(level)}: {level['failed']} of {level['requests']} "
                         f"requests failed ({why})")
    return lines


def raise_file_limit() -> None:
    """Let this process open as many sockets as the host allows: a level of 2,000 streams holds 2,000
    connections, past the soft limit of 1,024 file descriptors that most hosts set. The soft limit goes
    up to the hard one (an unlimited hard one: as far as the kernel allows); where it cannot, it stays,
    and a request that finds no descriptor fails as a refused connection does (loop.py)."""
    try:
        import resource
    except ImportError:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # an unlimited hard limit: the kernel's own ceiling (fs.nr_open, 2**20 by default), else less
    for limit in [hard] if hard != resource.RLIM_INFINITY else [1 << 20, 1 << 16]:
        if soft == resource.RLIM_INFINITY or soft >= limit:
            return
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
            return
        except (ValueError, OSError):
            continue


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    raise_file_limit()
    if args.prompt_file:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                args.prompt = f.read()
        except (OSError, UnicodeDecodeError) as e:
            print(f"bench.py: error: cannot read --prompt-file: {e}", file=sys.stderr)
            return 2
    out = Path(args.out)
    if out.is_dir() or out.with_name(RunFiles.REQUESTS).is_dir():
        print(f"bench.py: error: --out {args.out}: bench.json and requests.jsonl are files; a directory is there",
              file=sys.stderr)
        return 2
    plan = args.plan or {}
    if args.plan is not None:
        given = [o for o, v in (("--concurrency", args.concurrency), ("--max-tokens", args.max_tokens),
                                ("--prompt", args.prompt), ("--prompt-tokens", args.prompt_tokens)) if v is not None]
        if not isinstance(plan, dict) or set(plan) - {"scenarios", "slo", "search", "random_state"}:
            print("bench.py: error: --plan is a JSON object of scenarios, slo, search and random_state",
                  file=sys.stderr)
            return 2
        if given and plan.get("scenarios"):
            print(f"bench.py: error: --plan's scenarios replace {', '.join(given)}: give one or the other",
                  file=sys.stderr)
            return 2
    try:
        headers = auth_headers(args.api_key_env)
    except ValueError as e:
        print(f"bench.py: error: {e}", file=sys.stderr)
        return 2
    try:
        result = run_benchmark(
            args.url, args.model, concurrency=args.concurrency or [1], requests=args.requests, warmup=args.warmup,
            max_tokens=args.max_tokens or DEFAULT_MAX_TOKENS, prompt=args.prompt, prompt_tokens=args.prompt_tokens,
            api=args.api,
            ignore_eos=args.ignore_eos, timeout=args.timeout, duration=args.duration, workers=args.workers,
            extra_body=args.extra_body, headers=headers, scenarios=plan.get("scenarios"), slo=plan.get("slo"),
            search=plan.get("search"), random_state=plan.get("random_state", 0),
            progress=lambda level: print(format_level(level), file=sys.stderr, flush=True),
            on_tick=(lambda state: _write_atomic(Path(args.progress_file), json.dumps(state)))
            if args.progress_file else None)
    except ValueError as e:
        print(f"bench.py: error: {e}", file=sys.stderr)
        return 2
    write_results(result, args.out)
    if args.progress_file:   # its job is done: bench.json says how it ended
        with contextlib.suppress(OSError):
            os.unlink(args.progress_file)
    if not any(level["completed"] for level in result["levels"]):
        errors = Counter(r["error"] for r in result["requests"] if r["error"])
        why = errors.most_common(1)[0][0] if errors else "no request was sent"
        print(f"bench.py: no request completed at any level against {args.url} (most common error: {why})",
              file=sys.stderr)
        return 3
    failed = failures(result, args.max_failed_share)
    for line in failed:
        print(f"bench.py: {line}", file=sys.stderr)
    return 4 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
