"""Warm-up, the decode benchmark and the profile capture, all run ON the host.

The benchmark client (`harness/remote/bench.py`, standard library only) runs inside the host's venv
next to the server, so no network sits between client and server in the measurement. The profile
protocol is the engine's (`Engine.capture`, plain data) and the host agent follows it there.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict

from harness.engines import CaptureSettings
from harness.errors import RemoteTimeout
from harness.lifecycle.context import RunContext
from harness.lifecycle.server import agent_with_key, alive_check, key_words, server_alive, with_key
from harness.remote import tool_command
from harness.results.layout import RunFiles, node_name


def prompt_file(ctx: RunContext) -> str:
    """The playbook's prompt in a file beside the run, uploaded once: a command line cannot carry a
    prompt of hundreds of KB (the kernel's limit is 128 KiB a word), and one starting with `-` would
    be read as an option."""
    path = f"{ctx.paths.root}/prompt.txt"
    if not ctx.found.prompt_file:
        prompt = ctx.run.benchmark.prompt
        assert prompt is not None  # called only for a playbook that gives one
        ctx.transport.put(prompt.encode("utf-8"), path, mode=0o600)
        ctx.found.prompt_file = path
    return path


def bench(ctx: RunContext) -> None:
    b = ctx.run.benchmark
    words: list[str | int | float] = ["--url", ctx.base_url, "--model", ctx.sweep.playbook.model.name, "--api", b.api,
             "--concurrency", ",".join(map(str, b.concurrency)), "--warmup", b.warmup,
             "--max-tokens", b.max_tokens, "--timeout", b.timeout_s, "--out", ctx.paths.bench_json]
    if b.requests:
        words += ["--requests", b.requests]
    words += ["--prompt-file", prompt_file(ctx)] if b.prompt else ["--prompt-tokens", b.prompt_tokens or 16]
    words.append("--ignore-eos" if b.ignore_eos else "--no-ignore-eos")
    if b.extra_body:
        words += ["--extra-body", json.dumps(b.extra_body)]
    words += ["--max-failed-share", b.max_failed_share, "--progress-file", ctx.paths.bench_progress, *key_words(ctx)]
    command = with_key(ctx, ctx.in_venv(tool_command("python", ctx.tools_dir, "bench", *words)))
    # the worst case: every request of every level runs into its own timeout, one wave after another
    waves = sum(-(-((b.requests or max(16, 2 * c)) + b.warmup) // c) for c in b.concurrency)
    budget = 120 + b.timeout_s * waves
    # one round trip: the benchmark, then whether the server outlived it
    command = f"{command}; code=$?; {alive_check(ctx)}; exit $code"
    try:
        result = ctx.sh(command, timeout=budget, check=False)
    except RemoteTimeout:
        if not server_alive(ctx):
            raise ctx.fail("server_died", "the server died during the benchmark") from None
        raise
    alive = result.stdout.split()[-1:] == ["alive"]
    if not alive:
        raise ctx.fail("server_died", "the server died during the benchmark",
                       output=result.stderr or result.stdout)
    said = [line.removeprefix("bench.py: ") for line in result.stderr.splitlines() if line.startswith("bench.py: ")]
    if result.exit_code in (3, 4):   # requests failed: the numbers of this run cannot be believed
        raise ctx.fail("bench", "requests failed: " + "; ".join(said), output=result.stderr)
    if result.exit_code != 0:
        raise ctx.fail("bench", f"the benchmark client failed (exit {result.exit_code})",
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
    answer = agent_with_key(ctx, *args, timeout=p.timeout_s + 120)
    if ctx.peers and spec is not None and spec.get("await") != "exit":
        answer = _peer_traces(ctx, answer, spec, per_node, p.timeout_s - (time.monotonic() - started))
    answer["num_steps"] = p.num_steps
    answer["mode"] = p.mode
    return answer


def _peer_traces(ctx: RunContext, answer: dict, spec: dict, per_node: int, left_s: float) -> dict:
    """Node 0's capture started every rank; each other node writes its own ranks' traces into its own
    profile folder. Wait for them there (their names as they come back: node<k>/NAME under profile/)
    and count every node's ranks in the answer."""
    files, found, problems = list(answer.get("files") or []), answer.get("ranks_found") or 0, []
    for peer in ctx.peers:
        got = peer.agent("traces", "--dir", peer.paths.profile_dir, "--naming",
                         json.dumps(spec["naming"], separators=(",", ":")), "--ranks", per_node,
                         "--timeout", max(30.0, left_s), timeout=max(30.0, left_s) + 120)
        files += [f | {"name": f"{node_name(peer.node_rank)}/{f['name']}"} for f in got.get("files") or []]
        found += got.get("ranks_found") or 0
        if got.get("missing_ranks"):
            problems.append(f"{peer.label} wrote {got.get('ranks_found') or 0} of {per_node} in "
                            f"{peer.paths.profile_dir}")
    expected = per_node * len(ctx.nodes)
    merged = answer | {"files": files, "ranks_found": found, "expected_ranks": expected,
                       "missing_ranks": max(0, expected - found),
                       "bytes": sum(f.get("bytes") or 0 for f in files)}
    if answer.get("status") == "ok" and problems:
        merged |= {"status": "partial" if found else "failed",
                   "error": f"traces from {found} of {expected} ranks: " + "; ".join(problems)}
    elif answer.get("status") == "partial" and not problems:
        merged["error"] = f"traces from {found} of {expected} ranks ({RunFiles.PROFILE}/ on node 0: "\
                          f"{answer.get('error')})"
    return merged
