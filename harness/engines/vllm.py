"""vLLM (`vllm serve`), as 0.26.0 (CUDA 13, on an H200) and 0.32.0 (the CPU build) behave.

Facts, each with the release it was seen in:
- Flags: `--tensor-parallel-size/-tp`, `--pipeline-parallel-size/-pp`, `--data-parallel-size/-dp`;
  plain `--help` lists argument groups only since 0.11, `--help=all` every flag (31-41 s on the CPU
  build).
- Profiler: configured at launch only (`--profiler-config.profiler torch
  --profiler-config.torch_profiler_dir DIR`; `VLLM_TORCH_PROFILER_DIR` is ignored since 0.16), else
  `/start_profile` is a 404. `--profiler-config.max_iterations N` makes each worker stop itself
  after N engine steps (0.26 and 0.32; 0.32 also takes `{"max_iterations": N}` in the /start_profile
  body, 0.26 ignores any body). Without it a capture holds every step until /stop_profile (318 steps
  for a "10 step" window on the H200). 0.32 refuses a second start with 409 until /stop_profile, so
  the harness always stops once the ranks' files are in. `torch_profiler_with_stack` defaults on
  (30 MB traces and a 59-92 s stop for a 3 M-parameter model on CPU); the template turns it off and
  sets `ignore_frontend` (no API-server trace).
- Files: `rank{g}.{ns}.pt.trace.json.gz` per worker when the model has no expert-parallel group
  (dense models; 0.26 `distributed/utils.py` get_worker_rank_suffix falls back to it),
  `dp{d}_pp{p}_tp{t}_dcp{c}_ep{e}_rank{g}.{ns}.pt.trace.json.gz` with one, `{prefix}_` before either
  with a profile prefix; the front end's `{host}_{pid}.async_llm.{ns}.pt.trace.json.gz` (CPU only, no
  rank); `rank0.profiler_out.txt` / `profiler_out_0.txt` key_averages tables.
- Steps: every engine step runs inside `execute_context_{n}({tokens})_generation_{m}({tokens})`
  (CPU `user_annotation` and GPU `gpu_user_annotation`): n requests in prefill, m in decode; steps
  with neither are idle (48 of 318 on the H200). With `--profiler-config.detailed_trace_annotation
  true` the name is `execute_{tokens}_context_{n}(sq..sk..sqsq..sqsk..)_generation_{m}(sq..)` (0.26.0
  and 0.32.0 `v1/worker/gpu_worker.py` annotate_profile).
- Health: connection refused until the engine is up, then `/health` 200.
- Metrics (0.26.0 and 0.32.0 `v1/metrics/loggers.py`, `v1/spec_decode/metrics.py`): `/metrics` in the
  Prometheus text format, open with or without the API key (0.32.0
  `entrypoints/serve/middleware/authenticate.py` guards only /v1, /v2, /inference and /cohere; the
  CPU build answered /metrics 200 under `--api-key`, with no key and with a wrong one), every sample
  labelled `engine` (one per data-parallel engine) and `model_name`, each engine's series made at
  start (present from the first scrape); counters as `NAME_total` with a `NAME_created` beside.
  `vllm:kv_cache_usage_perc` is a fraction (1 = 100 %) despite its name; the prefix-cache counters
  count tokens; the spec-decode counters exist only with `--speculative-config`.
- Several hosts (0.26.0 and 0.32.0 `engine/arg_utils.py` ParallelConfig group, `entrypoints/cli/serve.py`
  run_headless): `--nnodes/-n N`, `--node-rank/-r R`, `--master-addr HOST` (default 127.0.0.1),
  `--master-port PORT` (default 29501) on every node, and `--headless` on every node but 0: those run
  only workers ("headless multiproc executor") and no API server, so nothing answers HTTP there. The
  world size (tp x pp x dp) must divide by `--nnodes`. Each node's workers write their traces into
  that node's own `--profiler-config.torch_profiler_dir`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from harness.engines.base import CaptureSettings, Engine, Metric, NodeInfo, StepSpans, TraceNaming, arg, register

NAMING = TraceNaming(glob="*.pt.trace.json.gz", rank=r"(?:^|_)rank(\d+)\.", not_ranks=r"\.async_llm\.")
# `execute_context_1(17)_generation_3(3)`; with `--profiler-config.detailed_trace_annotation true`
# `execute_20_context_1(sq17sk17sqsq289sqsk289)_generation_3(sq3sk96sqsq3sqsk96)` (0.26 and 0.32)
STEPS = StepSpans(prefix="execute_", stages=(
    (r"^execute_(?:\d+_)?context_[1-9]\d*\(", "prefill"),          # any request in prefill (mixed too)
    (r"^execute_(?:\d+_)?context_0\([^)]*\)_generation_[1-9]", "decode"),
    (r"^execute_(?:\d+_)?context_0\([^)]*\)_generation_0\(", ""),  # no request at all: idle
))
METRICS = (
    Metric("running", "vllm:num_requests_running"),
    Metric("waiting", "vllm:num_requests_waiting"),
    Metric("kv_cache_usage", "vllm:kv_cache_usage_perc", across="mean"),
    Metric("prefix_cache_queries", "vllm:prefix_cache_queries", "counter"),
    Metric("prefix_cache_hits", "vllm:prefix_cache_hits", "counter"),
    Metric("spec_drafts", "vllm:spec_decode_num_drafts", "counter"),
    Metric("spec_draft_tokens", "vllm:spec_decode_num_draft_tokens", "counter"),
    Metric("spec_accepted_tokens", "vllm:spec_decode_num_accepted_tokens", "counter"),
    Metric("preemptions", "vllm:num_preemptions", "counter"),
    Metric("generation_tokens", "vllm:generation_tokens", "counter"),
)
HINTS = {
    "404": "vLLM answers 404 when no profiler was configured at launch: the template must pass "
           "--profiler-config.profiler torch --profiler-config.torch_profiler_dir DIR",
    "409": "a profiling session was already open (vLLM >= 0.32 allows one at a time): restart the server",
    "": "vLLM flushes traces slowly on large models (minutes): raise profile.timeout_s",
}


@dataclass(frozen=True)
class VLLM(Engine):
    def ranks(self, args: Mapping[str, Any]) -> int:
        return (arg(args, "tensor-parallel-size", "tp") * arg(args, "pipeline-parallel-size", "pp")
                * arg(args, "data-parallel-size", "dp"))

    def nodes(self, args: Mapping[str, Any]) -> int:
        return arg(args, "nnodes", "n")

    def node_args(self, node: NodeInfo) -> dict[str, Any]:
        if node.count == 1:
            return {}
        return {"nnodes": node.count, "node-rank": node.rank, "master-addr": node.head_address,
                "master-port": node.rendezvous_port} | ({"headless": True} if node.rank else {})

    def capture(self, how: CaptureSettings) -> dict[str, Any]:
        # the step bounds are launch flags too (templates/vllm.sh.j2): 0.26 reads them only there
        body: dict[str, Any] = {"max_iterations": how.num_steps}
        if how.start_step:
            body["delay_iterations"] = how.start_step
        return {"start": {"path": "/start_profile", "body": body}, "stop": {"path": "/stop_profile"},
                "traffic": {"max_tokens": how.num_steps + 8} if how.nsys else "flow",
                "await": "exit" if how.nsys else "files", "hints": HINTS}


ENGINE = register(VLLM(
    name="vllm", launcher="vllm serve", module="vllm", default_port=8000, template="vllm.sh.j2",
    help_command="vllm serve --help=all",
    distribution="vllm",
    traces=NAMING, steps=STEPS, profile_modes=("engine", "nsys", "torch", "none"),
    env_prefixes=("VLLM_",), metrics=METRICS, rendezvous_port=29501,
    node_flags=("nnodes", "n", "node-rank", "r", "master-addr", "master-port", "headless"),
    oom_hint="lower --gpu-memory-utilization or --max-model-len, or use more GPUs (-tp)",
    # 0.26.0 and 0.32.0 v1/core/kv_cache_utils.py: no room for any KV cache block, or not for one request
    oom_log=r"No available memory for the cache blocks|larger than the available KV cache memory"))
