"""Warm-up, the decode benchmark and the profile capture, all run ON the host.

The benchmark client (`harness/remote/bench.py`, standard library only) runs inside the host's venv
next to the server, so no network sits between client and server in the measurement. The telemetry
sampler (`harness/remote/telemetry.py`) runs beside it in the background, started just before it and
stopped just after it in the same command: no round trip of its own. The profile
protocol is the engine's (`Engine.capture`, plain data) and the host agent follows it there.
"""

from __future__ import annotations

import json
import math
import shlex
import time
from dataclasses import asdict
from typing import Any

from harness.engines import CaptureSettings
from harness.errors import Kind, RemoteTimeout
from harness.lifecycle.context import RunContext
from harness.lifecycle.server import agent_with_key, alive_check, key_words, server_alive, with_key
from harness.remote import tool_command
from harness.results.answers import Profiled, Traces
from harness.results.layout import RunFiles, node_name


def prompt_file(ctx: RunContext) -> str:
    """The playbook's prompt in a file beside the run, uploaded once: a command line cannot carry a
    prompt of hundreds of KB (the kernel's limit is 128 KiB a word), and one starting with `-` would
    be read as an option."""
    path = ctx.paths.prompt
    if not ctx.found.prompt_file:
        prompt = ctx.run.benchmark.prompt
        assert prompt is not None  # called only for a playbook that gives one
        ctx.transport.put(prompt.encode("utf-8"), path, mode=0o600)
        ctx.found.prompt_file = path
    return path


def bench_plan(ctx: RunContext) -> dict | None:
    """The scenarios, SLO and max_load search for the benchmark client (`--plan`), or None for the
    single workload of the old keys (which then goes as --concurrency, --max-tokens, the prompt)."""
    pb, b = ctx.sweep.playbook, ctx.run.benchmark
    if not b.scenarios and not pb.slo:
        return None
    plan: dict = {"random_state": b.random_state}
    if pb.slo:
        plan["slo"] = dict(pb.slo)
    if b.scenarios:
        plan["scenarios"] = [sc.model_dump(exclude_none=True) for sc in b.scenarios]
    ml = pb.search.max_load if pb.search is not None else None
    if ml is not None and b.scenarios:
        name = ml.scenario or b.scenarios[0].name
        closed = next(sc for sc in b.scenarios if sc.name == name).kind == "concurrency"
        plan["search"] = {"scenario": name, "slo": dict(ml.slo or pb.slo), "steps": ml.steps,
                          "low": int(ml.low) if closed else ml.low, "high": int(ml.high) if closed else ml.high}
    return plan


PROMPT_S = 0.1
"""Seconds allowed to build one scenario request's prompt (a tokenizer call takes about a millisecond)."""


def _waves(ctx: RunContext) -> float:
    """The worst case, in request timeouts: every request of every level runs into its own timeout,
    one wave after another: the warm-up's waves (its requests at most `load` at a time, ended before
    the level starts), then the level's (an open loop's requests are all in flight at once: one wave,
    after its schedule; its warm-up goes one request after another)."""
    pb, b = ctx.sweep.playbook, ctx.run.benchmark
    if not b.scenarios:
        return sum(math.ceil(b.warmup / c) + math.ceil((b.requests or max(16, 2 * c)) / c) for c in b.concurrency)
    ml = pb.search.max_load if pb.search is not None else None
    levels = [(sc, load, False) for sc in b.scenarios for load in sc.loads]
    if ml is not None:
        searched = next((sc for sc in b.scenarios if sc.name == (ml.scenario or b.scenarios[0].name)), b.scenarios[0])
        levels += [(searched, ml.low, True)] * ml.steps   # the lowest load takes longest
    waves = 0.0
    for sc, load, probe in levels:
        n = sc.requests or b.requests or max(16, 2 * int(load) + 1)
        if probe:   # a probe sends two requests a stream (two seconds of arrivals) at least: bench.py
            n = max(n, 2 * int(load) if sc.kind == "concurrency" else math.ceil(2 * load))
        if sc.kind == "concurrency":
            waves += math.ceil(b.warmup / int(load)) + math.ceil(n / int(load))
        else:
            waves += 1 + b.warmup + n / load / b.timeout_s
        # building its prompts: a count or two at the server's tokenizer a request, off the level's clock
        waves += (n + b.warmup) * PROMPT_S / b.timeout_s
    return waves


TELEMETRY_FIRST_S = 30
"""How long the benchmark waits for the sampler's first round (its /metrics read is bounded to 5 s and
nvidia-smi to 10 s); a sampler that never gets there delays the benchmark by this much, no more."""
TELEMETRY_STOP_S = 30
"""How long the sampler has for its last round once told to stop, before it is killed."""


def telemetry_shell(ctx: RunContext, budget: float) -> tuple[str, str]:
    """Shell that starts the sampler in the background and waits until its first round is written, and
    shell that stops it (SIGTERM: it samples once more and ends). ("", "") when the playbook turns
    telemetry off; GPUs only for an engine whose record lists no /metrics families. The sampler ends
    by itself after the benchmark's budget, or when this shell is gone. When the server asks for an API
    key the sampler sends it too, as the benchmark client does (`--api-key-env`, the run's secrets
    sourced into its own environment only): vLLM 0.32.0 and SGLang 0.5.23 leave /metrics open, but a
    guarded /metrics would otherwise answer every scrape 401. Its subshell `exec`s the sampler, so
    `$tpid` is the sampler itself, which the stop signals."""
    t = ctx.sweep.playbook.telemetry
    if not t.enabled:
        return "", ""
    engine, out = ctx.sweep.engine, shlex.quote(ctx.paths.telemetry)
    metrics = engine.metrics_for(ctx.rendered.args)
    spec = json.dumps([m.as_dict() for m in metrics], separators=(",", ":"))
    sampler = tool_command(ctx.python, ctx.tools_dir, "telemetry", "--url", ctx.base_url + engine.metrics_path,
                           "--out", ctx.paths.telemetry, "--interval", t.interval_s, "--duration", round(budget + 120),
                           "--metrics", spec, *([] if metrics else ["--no-metrics"]), *key_words(ctx))
    start = (f"rm -f {out}; ( {with_key(ctx, 'exec ' + sampler)} ) >/dev/null 2>&1 </dev/null & tpid=$!; i=0; "
             f"while [ ! -s {out} ] && [ $i -lt {TELEMETRY_FIRST_S * 10} ] && [ -e /proc/$tpid ] "
             "&& ! grep -q ') Z' /proc/$tpid/stat 2>/dev/null; do sleep 0.1; i=$((i+1)); done; ")
    return start, stop_sampler(TELEMETRY_STOP_S)


def stop_sampler(grace: float) -> str:
    """Shell that stops the sampler `$tpid`: SIGTERM, SIGKILL after `grace` seconds if it is still
    there. The killer runs in a process group of its own (setsid), which is ended whole once the
    sampler is gone: its sleep goes with it. (Killing its subshell alone left the sleep running on the
    host for the whole grace; a trap in the subshell that killed its sleep missed it when the signal
    came before the sleep's pid was noted, seen on a loaded machine.) Where the signal comes before
    the killer has its own group, the killer itself is ended, and its group once more should it have
    made one in between."""
    return (f"kill -TERM $tpid 2>/dev/null; setsid sh -c 'sleep {grace:g}; kill -KILL \"$1\"' harness-killer $tpid "
            ">/dev/null 2>&1 </dev/null & killer=$!; wait $tpid 2>/dev/null; "
            "kill -- -$killer 2>/dev/null || { kill $killer; kill -- -$killer || :; } 2>/dev/null; ")


def bench(ctx: RunContext) -> None:
    b = ctx.run.benchmark
    plan = bench_plan(ctx)
    words: list[str | int | float] = ["--url", ctx.base_url, "--model", ctx.sweep.playbook.model.name, "--api", b.api,
                                      "--warmup", b.warmup, "--timeout", b.timeout_s, "--out", ctx.paths.bench_json]
    if not b.scenarios:
        words += ["--concurrency", ",".join(map(str, b.concurrency)), "--max-tokens", b.max_tokens]
        words += ["--prompt-file", prompt_file(ctx)] if b.prompt else ["--prompt-tokens", b.prompt_tokens or 16]
        words.append("--ignore-eos" if b.ignore_eos else "--no-ignore-eos")
    if plan is not None:
        words += ["--plan", json.dumps(plan, separators=(",", ":"))]
    if b.requests:
        words += ["--requests", b.requests]
    if b.extra_body:
        words += ["--extra-body", json.dumps(b.extra_body)]
    words += ["--max-failed-share", b.max_failed_share, "--progress-file", ctx.paths.bench_progress, *key_words(ctx)]
    command = with_key(ctx, ctx.in_venv(tool_command("python", ctx.tools_dir, "bench", *words)))
    budget = 120 + b.timeout_s * _waves(ctx)
    # one round trip: the sampler started, the benchmark, the sampler stopped, whether the server outlived it
    start, stop = telemetry_shell(ctx, budget)
    command = f"{start}{command}; code=$?; {stop}{alive_check(ctx)}; exit $code"
    try:
        result = ctx.sh(command, timeout=budget, check=False)
    except RemoteTimeout:
        if not server_alive(ctx):
            raise ctx.fail(Kind.SERVER_DIED, "the server died during the benchmark") from None
        raise
    alive = result.stdout.split()[-1:] == ["alive"]
    if not alive:
        raise ctx.fail(Kind.SERVER_DIED, "the server died during the benchmark",
                       output=result.stderr or result.stdout)
    said = [line.removeprefix("bench.py: ") for line in result.stderr.splitlines() if line.startswith("bench.py: ")]
    if result.exit_code in (3, 4):   # requests failed: the numbers of this run cannot be believed
        raise ctx.fail(Kind.BENCH, "requests failed: " + "; ".join(said), output=result.stderr)
    if result.exit_code != 0:
        raise ctx.fail(Kind.BENCH, f"the benchmark client failed (exit {result.exit_code})",
                       output=result.stderr or result.stdout)
    ctx.found.bench_stderr = result.stderr[-4000:]


def profile(ctx: RunContext) -> dict:
    """Capture a trace from every rank; a refusal is recorded, never a run failure (the benchmark stands)."""
    pb, b = ctx.sweep.playbook, ctx.run.benchmark
    p, engine = pb.profile, ctx.sweep.engine
    args: list[str | int | float] = [
        "profile", "--url", ctx.base_url, "--model", pb.model.name, "--dir", ctx.paths.profile_dir,
        "--num-steps", p.num_steps, "--concurrency", p.concurrency, "--timeout", p.timeout_s,
        "--max-tokens", max(b.max_tokens, 4 * p.num_steps)]
    spec: dict | None = None
    per_node = max(1, engine.ranks(ctx.rendered.args) // len(ctx.nodes))   # each node holds its share
    if p.mode != "torch":   # torch: the window of the harness's own wrapper, whatever the engine
        capture = engine.capture(CaptureSettings(ctx.paths.profile_dir, p.num_steps, p.start_step,
                                                 nsys=p.mode == "nsys", nodes=len(ctx.nodes)))
        assert capture is not None and engine.traces is not None  # the playbook checked profile_modes
        spec = capture | {"ranks": per_node, "naming": asdict(engine.traces)}
        args += ["--spec", json.dumps(spec, separators=(",", ":"))]
    if b.prompt:
        args += ["--prompt-file", prompt_file(ctx)]
    if not b.ignore_eos:
        args.append("--no-ignore-eos")
    if b.extra_body:
        args += ["--extra-body", json.dumps(b.extra_body)]
    started = time.monotonic()
    answer = agent_with_key(ctx, Profiled, *args, timeout=p.timeout_s + 120)
    if ctx.peers and spec is not None and spec.get("await") != "exit":
        answer = _peer_traces(ctx, answer, spec, per_node, p.timeout_s - (time.monotonic() - started))
    return answer.record() | {"num_steps": p.num_steps, "mode": p.mode}


def _peer_traces(ctx: RunContext, answer: Profiled, spec: dict, per_node: int, left_s: float) -> Profiled:
    """Node 0's capture started every rank; each other node writes its own ranks' traces into its own
    profile folder. Wait for them there (their names as they come back: node<k>/NAME under profile/)
    and count every node's ranks in the answer."""
    files, found, problems = list(answer.files), answer.ranks_found, []
    for peer in ctx.peers:
        got = peer.agent(Traces, "traces", "--dir", peer.paths.profile_dir, "--naming",
                         json.dumps(spec["naming"], separators=(",", ":")), "--ranks", per_node,
                         "--timeout", max(30.0, left_s), timeout=max(30.0, left_s) + 120)
        files += [f.model_copy(update={"name": f"{node_name(peer.node_rank)}/{f.name}"}) for f in got.files]
        found += got.ranks_found
        if got.missing_ranks:
            problems.append(f"{peer.label} wrote {got.ranks_found} of {per_node} in {peer.paths.profile_dir}")
    expected = per_node * len(ctx.nodes)
    merged: dict[str, Any] = {"files": files, "ranks_found": found, "expected_ranks": expected,
                              "missing_ranks": max(0, expected - found), "bytes": sum(f.bytes for f in files)}
    if answer.status == "ok" and problems:
        merged |= {"status": "partial" if found else "failed",
                   "error": f"traces from {found} of {expected} ranks: " + "; ".join(problems)}
    elif answer.status == "partial" and not problems:
        merged["error"] = f"traces from {found} of {expected} ranks ({RunFiles.PROFILE}/ on node 0: "\
                          f"{answer.error})"
    return answer.model_copy(update=merged)
