"""SGLang (`python -m sglang.launch_server`), as its releases 0.5.x behave.

Facts, each with the release it was read from:
- Flags: `--tp-size` (`--tensor-parallel-size`), `--pp-size`, `--dp-size`; with `--enable-dp-attention`
  the DP ranks live inside the TP group, else each DP replica is a TP group of its own (0.5.23
  `server_args.py`).
- Profiler (0.5.23 `managers/scheduler_components/profiler_manager.py`): `/start_profile` with
  `num_steps` returns at once and stops by itself after that many forward steps, writing the traces
  then; with no traffic it never stops. A `/stop_profile` after such a session answers a bare 500
  ("Profiling is not in progress") or closes an older session into that session's directory, so the
  harness never sends one. Files: `[{prefix}-]{profile_id}-TP-{t}[-DP-{d}][-PP-{p}][-EP-{e}]
  [-EXTEND|-DECODE].trace.json.gz`; `merge_profiles` adds `merged-{profile_id}.trace.json.gz`.
- Steps (0.5.23 `model_executor/model_runner.py` forward, `utils/profile_utils.py`
  build_step_span_name): every forward step runs inside `record_function("step[DECODE bs=8]")`,
  `"step[EXTEND bs=1 toks=1024]"`, `MIXED`, `IDLE`, and with speculative decoding `VERIFY` and `DRAFT`.
- Health: connection refused while loading, then `/health` 503 until the warm-up generation is done.
- Metrics (0.5.23 `srt/observability/metrics_collector.py`): `/metrics` only with `--enable-metrics`
  (else a 404), open with or without the API key (`srt/utils/auth.py` decide_request_auth lets every
  path beginning /health, /ready or /metrics through). `sglang:token_usage` is the KV pool's used share
  (the fullest of its full, SWA and mamba pools), `sglang:prompt_tokens_total` and
  `sglang:cached_tokens_total` (by `cache_source`) count the prompt and prefix-cached tokens of
  finished requests, each label set made at its first increment (`cached_tokens_total`'s at the first
  prefix hit: absent before it); `sglang:spec_accept_rate` / `spec_accept_length` are gauges of the
  last batches, both 0 without speculative decoding (`scheduler_components/metrics_reporter.py`);
  with priority scheduling the queue gauges add per-`priority` samples beside the total. Scheduler
  gauges are labelled `model_name`, `engine_type`, `tp_rank`, `pp_rank`, `moe_ep_rank` (`dp_rank`
  with DP) and written by the first attention-TP rank of every DP group and pipeline stage (by every
  rank under --enable-metrics-for-all-schedulers: `metrics_for` keeps those first ranks' copies); each
  stage holds the same waiting queue (`scheduler_components/request_receiver.py` relays every
  request), so the report reads `num_queue_reqs` at `pp_rank` 0 (harness/report/telemetry_view.py).
- Several hosts (0.5.23 `arg_groups/fields/parallel.py`, `entrypoints/engine.py`): `--nnodes N`,
  `--node-rank R`, `--dist-init-addr HOST:PORT` (alias `--nccl-init-addr`), the same command on every
  node; torch.distributed meets at node 0's address, so node 0 is not up until every node joined.
  Nodes of rank >= 1 run no tokenizer and serve a dummy `/health` (always 200) on `--port`; they ignore
  SIGTERM and wait for node 0's ShutdownReq broadcast (the harness stops node 0 first, then kills the
  rest). With no `output_dir` in /start_profile each rank writes into its own node's
  SGLANG_TORCH_PROFILER_DIR, which is why a multi-node capture sends none.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from harness.engines.base import CaptureSettings, Engine, Metric, NodeInfo, StepSpans, TraceNaming, arg, flag, register

NAMING = TraceNaming(glob="*.trace.json.gz", rank=r"-TP-(\d+)(?:-DP-(\d+))?(?:-PP-(\d+))?",
                     not_ranks=r"^merged-", prefer=r"-DECODE\.")
STEPS = StepSpans(prefix="step[", stages=(
    (r"^step\[DECODE ", "decode"),
    (r"^step\[(EXTEND|MIXED|SPLIT_PREFILL|PREBUILT|DLLM_EXTEND)[ \]]", "prefill"),
    (r"^step\[(TARGET_)?VERIFY ", "verify"),
    (r"^step\[DRAFT", "draft"),          # a draft worker's steps; DRAFT_EXTEND(_V2) modes too
    (r"^step\[IDLE ", ""),
))
METRICS = (
    Metric("running", "sglang:num_running_reqs", breakdown=("priority",)),
    Metric("waiting", "sglang:num_queue_reqs", breakdown=("priority",)),
    Metric("kv_cache_usage", "sglang:token_usage", across="mean"),
    Metric("prefix_cache_queries", "sglang:prompt_tokens", "counter"),
    Metric("prefix_cache_hits", "sglang:cached_tokens", "counter"),
    Metric("spec_accept_rate", "sglang:spec_accept_rate", across="mean"),
    Metric("spec_accept_length", "sglang:spec_accept_length", across="mean"),
    Metric("generation_tokens", "sglang:generation_tokens", "counter"),
)
SCHEDULER_GAUGES = frozenset({"running", "waiting", "kv_cache_usage", "spec_accept_rate", "spec_accept_length"})
"""The keys of the families the schedulers write (SchedulerMetricsCollector); the token counters are
the tokenizer manager's, one process whatever the ranks."""
HINTS = {
    "500": "SGLang answers a bare 500 when a profile is already in progress (an earlier num_steps "
           "session that never saw traffic) or after it stopped by itself; restart the server or wait "
           "for the earlier session's traces in its own output_dir",
    "": "SGLang writes traces only when profiling stops: keep traffic flowing for num_steps steps, check "
        "SGLANG_TORCH_PROFILER_DIR is writable on every node, and raise profile.timeout_s for large models",
}


def data_parallel(args: Mapping[str, Any]) -> tuple[int, int]:
    """(replicas, attention-DP groups inside each TP group): `--dp-size` and `--attn-dp-size`, or, in the
    older spelling `--dp-size N --enable-dp-attention` (no --attn-dp-size), N groups in one replica
    (0.5.23 `arg_groups/parallel_hook.py` _handle_deprecated_dp_attention)."""
    dp = arg(args, "dp-size", "data-parallel-size")
    attn_dp = arg(args, "attn-dp-size", "attention-data-parallel-size")
    if attn_dp == 1 and flag(args, "enable-dp-attention"):
        return 1, dp
    return dp, attn_dp


@dataclass(frozen=True)
class SGLang(Engine):
    def ranks(self, args: Mapping[str, Any]) -> int:
        tp = arg(args, "tp-size", "tensor-parallel-size", "tp")
        pp = arg(args, "pp-size", "pipeline-parallel-size")
        return tp * pp * data_parallel(args)[0]   # attention DP lives inside the TP group

    def nodes(self, args: Mapping[str, Any]) -> int:
        return arg(args, "nnodes")

    def metrics_for(self, args: Mapping[str, Any]) -> tuple[Metric, ...]:
        """With --enable-metrics-for-all-schedulers every rank writes the scheduler gauges, each rank of
        an attention group a copy of its group's: they are read at the ranks that write them without
        the flag, the first of each attention-DP group (tp_rank a multiple of tp / attention DP)."""
        if not flag(args, "enable-metrics-for-all-schedulers"):
            return self.metrics
        tp = arg(args, "tp-size", "tensor-parallel-size", "tp")
        stride = max(1, tp // max(1, data_parallel(args)[1]))
        first = (("tp_rank", tuple(str(r) for r in range(0, tp, stride))),)
        return tuple(replace(m, only=first) if m.key in SCHEDULER_GAUGES else m for m in self.metrics)

    def node_args(self, node: NodeInfo) -> dict[str, Any]:
        if node.count == 1:
            return {}
        return {"nnodes": node.count, "node-rank": node.rank, "dist-init-addr": node.head_endpoint}

    def capture(self, how: CaptureSettings) -> dict[str, Any]:
        body: dict[str, Any] = {"num_steps": how.num_steps,
                                "activities": ["CUDA_PROFILER"] if how.nsys else ["CPU", "GPU"]}
        if how.nodes == 1:   # several nodes: every rank writes into its own node's SGLANG_TORCH_PROFILER_DIR
            body = {"output_dir": how.directory} | body
        if how.start_step is not None or how.nsys:
            body["start_step"] = how.start_step if how.start_step is not None else 3
        if how.nsys:
            # the engine only brackets the steps with cudaProfilerStart/Stop; nsys writes its report
            # when the server exits, so one request long enough to cover the range is all it needs
            traffic: Any = {"max_tokens": body["start_step"] + how.num_steps + 4}
        else:
            traffic = "flow"   # num_steps counts only steps with work
        return {"start": {"path": "/start_profile", "body": body}, "stop": None, "traffic": traffic,
                "await": "exit" if how.nsys else "files", "hints": HINTS}


ENGINE = register(SGLang(
    name="sglang", launcher="python -m sglang.launch_server", module="sglang", default_port=30000,
    template="sglang.sh.j2", help_command="python -m sglang.launch_server --help",
    distribution="sglang",
    traces=NAMING, steps=STEPS, profile_modes=("engine", "nsys", "torch", "none"),
    env_prefixes=("SGLANG_",), metrics=METRICS,
    metrics_hint="SGLang serves /metrics only with --enable-metrics: add `enable-metrics: true` to server.args",
    rendezvous_port=25000, node_flags=("nnodes", "node-rank", "dist-init-addr", "nccl-init-addr"),
    oom_hint="lower --mem-fraction-static, shorten --context-length or use more GPUs (--tp-size)",
    # 0.5.23 mem_cache/kv_cache_configurator.py: the weights leave no room for the KV cache
    oom_log=r"leave no GPU memory for the KV cache|Not enough GPU memory for"))
