"""A simulated SGLang / vLLM server: the real launch flags, HTTP protocol, profiler and trace files,
with latencies from a documented model instead of a GPU.

It exists for the demo, the tests and users' dry runs of a sweep; it is never the only test of an
engine adapter. Standard library only, so it runs in any Python >= 3.9 environment that can import
`harness`.

Usage:

    python -m harness.sim sglang --model-path /models/GLM-5-NVFP4 --tp-size 8 \\
        --kv-cache-dtype fp8_e4m3 --port 30000
    python -m harness.sim vllm serve /models/GLM-5-NVFP4 -tp 8 --port 8000 \\
        --profiler-config.profiler=torch --profiler-config.torch_profiler_dir=/tmp/prof

    HARNESS_SIM_TIME_SCALE=0.05 HARNESS_SIM_FAULT=crash_after=20 python -m harness.sim sglang ...

The flags are those of `python -m sglang.launch_server` (0.5.23) and `vllm serve` (0.32.0); an unknown
or removed flag fails as it does there (argparse, exit 2). Then: connection refused while loading;
SGLang /health 503 while starting, 200 once "The server is fired up and ready to roll!"; /v1/models,
/v1/completions and /v1/chat/completions (streaming or not, with usage, max_tokens, ignore_eos and
--stream-interval; tokens without text with HARNESS_SIM_EMPTY_TEXT_EVERY); SGLang /server_info,
/model_info, /start_profile, /stop_profile and (with --enable-metrics) /metrics; vLLM /ping, /version,
/metrics and, with a profiler configured, /start_profile and /stop_profile (one session at a time, 409
for a second, as 0.32 has it); with `--api-key`, a 401 without `Authorization: Bearer` on the paths
each engine guards. Traces hold each engine's step spans (vLLM 0.26/0.32
`execute_context_...`, SGLang 0.5.23 `step[DECODE bs=8]`) and carry its file names (vLLM's `rank{g}`
for dense models, its front end's `async_llm` file). SIGTERM and SIGINT exit at once, after flushing
the emit log.

Modules: `flags` (the command lines), `knobs` (the environment: time scale, startup, trace size, emit
log, faults; the list is in its docstring), `model` (the latency model: GLM-5 TP8 with an FP8 KV cache
is 97 ms a token, and how each flag moves it), `engine` (continuous batching and the stream format),
`profiler` (each engine's profiler semantics and file names), `trace` (`write_trace`, the streaming
Kineto trace writer, reusable on its own), `http` and `server`.
"""
