"""Kineto (torch.profiler) Chrome traces for the simulated engine, written as a stream.

`write_trace` lays out one rank's forward steps (`Step`: requests in prefill and in decode) the way the
real profiler records them: the kernels of `LatencyModel.step_kernels` (`prefill_kernels` for a
prefill) on the GPU timeline (pid = device, tid = stream), and on the CPU either one `cudaGraphLaunch`
per step (CUDA graphs: the kernels share its correlation id) or one cpu_op with a `cudaLaunchKernel`
per kernel (eager: the model's launch cost shows up as idle gaps between kernels). `ac2g` flow events
join launches to kernels, and the file ends with `baseTimeNanoseconds`, as Kineto writes it.

Every step sits inside its engine's step span, as Kineto writes a torch `record_function`: a CPU
`user_annotation` on the engine's thread over the whole step and, when kernels ran in it, a
`gpu_user_annotation` (pid = the device, tid = the stream) from its first kernel's start to its last
kernel's end. The names (`step_span_name`):
- vLLM 0.26.0 / 0.32.0: `execute_context_{n}({prefill tokens})_generation_{m}({decode tokens})`, n
  requests in prefill and m in decode; an idle step (nothing scheduled) is
  `execute_context_0(0)_generation_0(0)` with the CPU span only.
- SGLang 0.5.23 (`model_executor/model_runner.py` forward, `utils/profile_utils.py`
  build_step_span_name): `step[EXTEND bs=1 toks=1024]`, `step[DECODE bs=8]`, `step[MIXED bs=9]`,
  `step[IDLE bs=0]`.

`write_frontend_trace` is vLLM's API-server trace: CPU ops only, no rank, no step.

Events are formatted and compressed a step at a time, so a trace of any size costs a step's worth of
memory. `pad_to_mb` grows a file to a target size on disk with `python_function` events (what
`with_stack=True` adds in bulk), which leaves GPU time and step counts untouched.
"""

from __future__ import annotations

import gzip
import json
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Union

from harness.sim.model import IDLE_STEP_MS, Kernel, LatencyModel

GPU_NAME = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
GPUS_PER_NODE = 8
COMPUTE_STREAM, COMM_STREAM = 7, 20



@dataclass(frozen=True)
class Step:
    """One forward step as a rank ran it: requests in prefill (with their new tokens) and in decode."""

    prefill: int = 0
    prefill_tokens: int = 0
    decode: int = 0

    @property
    def requests(self) -> int:
        return self.prefill + self.decode

    @property
    def idle(self) -> bool:
        return self.requests == 0


Steps = Union[int, Sequence[Step]]
"""A count of decode steps (at the call's `batch`) or the steps themselves."""


def as_steps(steps: Steps, batch: int = 1) -> Sequence[Step]:
    return [Step(decode=batch)] * steps if isinstance(steps, int) else steps


def step_span_name(engine: str, step: Step) -> str:
    """The record_function name the engine gives a step (see the module docstring for the versions)."""
    if engine == "vllm":
        return "execute_context_%d(%d)_generation_%d(%d)" % (step.prefill, step.prefill_tokens, step.decode,
                                                             step.decode)
    if step.idle:
        return "step[IDLE bs=0]"
    if step.prefill and step.decode:
        return "step[MIXED bs=%d]" % step.requests
    if step.prefill:
        return "step[EXTEND bs=%d toks=%d]" % (step.prefill, step.prefill_tokens)
    return "step[DECODE bs=%d]" % step.decode


def step_us(model: LatencyModel, step: Step) -> float:
    """How long a step lasts, as the scheduler times it."""
    if step.idle:
        return IDLE_STEP_MS * 1000
    if step.prefill:
        return model.prefill_ms(step.prefill_tokens) * 1000
    return model.itl_ms(step.decode) * 1000


def step_kernels(model: LatencyModel, step: Step) -> list[Kernel]:
    if step.idle:
        return []
    if step.prefill:
        return model.prefill_kernels(step.requests, step.prefill_tokens)
    return model.step_kernels(step.decode)


_X = '{"ph": "X", "cat": "%s", "name": %s, "pid": %d, "tid": %d, "ts": %.3f, "dur": %.3f, "args": {%s}}'
_FLOW = '{"ph": "%s", "id": %d, "pid": %d, "tid": %d, "ts": %.3f, "cat": "ac2g", "name": "ac2g"%s}'
_PY_FRAMES = (
    "sglang/srt/managers/scheduler.py(1021): event_loop_overlap",
    "sglang/srt/managers/scheduler.py(1873): run_batch",
    "sglang/srt/model_executor/model_runner.py(2134): forward",
    "sglang/srt/model_executor/cuda_graph_runner.py(912): replay",
    "sglang/srt/layers/sampler.py(88): forward",
    "vllm/v1/worker/gpu_model_runner.py(2410): execute_model",
    "vllm/v1/worker/gpu_model_runner.py(1830): _prepare_inputs",
    "torch/nn/modules/module.py(1773): _call_impl",
    "torch/utils/_contextlib.py(120): decorate_context",
    "<built-in method item of Tensor object at 0x7f3a2c1e8f90>",
    "<built-in method copy_ of Tensor object at 0x7f3a2c1e9a30>",
    "threading.py(327): wait",
)


def write_trace(path: str | Path, *, model: LatencyModel, steps: Steps, rank: int = 0,
                world_size: int = 1, batch: int = 1, pad_to_mb: float | None = None,
                start_ns: int | None = None, random_state: int = 0) -> int:
    """Write one rank's trace of `steps` (a list of `Step`, or a count of decode steps at `batch`
    running requests); return its size.

    The file is gzip'd when `path` ends in `.gz`. `start_ns` is the time.time_ns() of the first step
    (default: now, minus the trace's duration, as if the steps had just run).
    """
    path = Path(path)
    steps = as_steps(steps, batch)
    total_us = sum(step_us(model, s) for s in steps)
    base_ns = (time.time_ns() - int(total_us * 1000)) if start_ns is None else start_ns
    t0 = 5_000_000.0 + 1000.0 * rank  # Kineto's ts is a monotonic clock; base + ts*1000 = wall ns
    writer = _Writer(path, rank=rank, world_size=world_size, model=model, random_state=random_state)
    try:
        writer.put(writer.header(t0))
        t = t0
        for s in steps:
            writer.put(writer.step(t, s))
            t += step_us(model, s)
        end = t
        if pad_to_mb:
            target = int(pad_to_mb * 1024 * 1024)
            while writer.size() < target:
                writer.put(writer.python_functions(t0, end, 2000))
        writer.put([json.dumps({"name": "Record Window End", "ph": "i", "s": "g", "pid": "", "tid": "",
                                "ts": round(end + 10, 3)})])
        writer.close(base_ns - int(t0 * 1000))
    except BaseException:
        writer.raw.close()
        raise
    return path.stat().st_size


class _Writer:
    """Formats events and pushes them through gzip; counters give every event its own ids."""

    def __init__(self, path: Path, *, rank: int, world_size: int, model: LatencyModel, random_state: int):
        self.raw: BinaryIO = open(path, "wb")  # noqa: SIM115  (the writer owns the file: close() closes it)
        self.out: gzip.GzipFile | BinaryIO = (gzip.GzipFile(fileobj=self.raw, mode="wb", compresslevel=4)
                                              if path.suffix == ".gz" else self.raw)
        self.rank, self.world_size, self.model = rank, world_size, model
        self.device = rank % GPUS_PER_NODE
        self.pid = 41000 + rank  # one process per rank, as the engines run them
        self.tid = self.pid
        self.ext = self.corr = 1
        self.first = True
        self.rng = random.Random(random_state * 1_000_003 + rank)
        self.names: dict[str, str] = {}
        self.kernels: dict[Step, list[Kernel]] = {}

    def _kernels(self, step: Step) -> list[Kernel]:
        """A step's kernels, kept for the steps of the same shape (a few dozen shapes at most)."""
        kernels = self.kernels.get(step)
        if kernels is None:
            if len(self.kernels) >= 64:
                self.kernels.clear()
            kernels = self.kernels[step] = step_kernels(self.model, step)
        return kernels

    def size(self) -> int:
        return self.raw.tell()

    def put(self, events: list[str]) -> None:
        if not events:
            return
        text = ",\n".join(events)
        self.out.write((text if self.first else ",\n" + text).encode())
        self.first = False

    def close(self, base_ns: int) -> None:
        self.out.write(('\n], "traceName": "", "displayTimeUnit": "ms", "baseTimeNanoseconds": %d}\n'
                        % base_ns).encode())
        if self.out is not self.raw:
            self.out.close()
        self.raw.close()

    def header(self, t0: float) -> list[str]:
        devices = [{"id": d, "name": GPU_NAME, "totalGlobalMem": 102_006_259_712, "computeMajor": 12,
                    "computeMinor": 0, "maxThreadsPerBlock": 1024, "maxThreadsPerMultiprocessor": 1536,
                    "regsPerBlock": 65536, "warpSize": 32, "sharedMemPerBlock": 49152, "numSms": 188,
                    "regsPerMultiprocessor": 65536, "sharedMemPerBlockOptin": 101376,
                    "sharedMemPerMultiprocessor": 102400}
                   for d in range(min(GPUS_PER_NODE, max(1, self.world_size)))]
        dist = {"backend": "nccl", "rank": self.rank, "world_size": self.world_size, "pg_count": 1,
                "pg_config": [{"pg_name": "0", "pg_desc": "default_pg", "backend_config": "cuda:nccl",
                               "pg_size": self.world_size, "ranks": list(range(self.world_size))}],
                "nccl_version": "2.27.3"}
        top = ('{\n  "schemaVersion": 1,\n  "deviceProperties": %s,\n  "distributedInfo": %s,\n'
               '  "cuda_runtime_version": 12090, "cuda_driver_version": 13000, "with_flops": 0,'
               ' "record_shapes": 0, "profile_memory": 0, "with_stack": 0,\n  "traceEvents": [\n'
               % (json.dumps(devices), json.dumps(dist)))
        self.out.write(top.encode())
        meta = [("process_name", self.pid, 0, {"name": "python3"}),
                ("process_labels", self.pid, 0, {"labels": "CPU"}),
                ("process_sort_index", self.pid, 0, {"sort_index": self.pid}),
                ("thread_name", self.pid, self.tid, {"name": "thread %d (python3)" % self.tid}),
                ("process_name", self.device, 0, {"name": "python3"}),
                ("process_labels", self.device, 0, {"labels": "GPU %d" % self.device}),
                ("process_sort_index", self.device, 0, {"sort_index": 5_000_000 + self.device}),
                ("thread_name", self.device, COMPUTE_STREAM, {"name": "stream %d " % COMPUTE_STREAM}),
                ("thread_name", self.device, COMM_STREAM, {"name": "stream %d " % COMM_STREAM})]
        return [json.dumps({"name": name, "ph": "M", "ts": t0, "pid": pid, "tid": tid, "args": args})
                for name, pid, tid, args in meta]

    def _name(self, name: str) -> str:
        quoted = self.names.get(name)
        if quoted is None:
            quoted = self.names[name] = json.dumps(name)
        return quoted

    def _cpu(self, cat: str, name: str, ts: float, dur: float, args: str) -> str:
        return _X % (cat, self._name(name), self.pid, self.tid, ts, dur, args)

    def _kernel(self, k: Kernel, ts: float, dur: float, ext: int, corr: int) -> str:
        args = ('"External id": %d, "queued": 0, "device": %d, "context": 1, "stream": %d, "correlation": %d, '
                '"registers per thread": 64, "shared memory": 0, "grid": [%d, %d, %d], "block": [%d, %d, %d], '
                '"est. achieved occupancy %%": 0' % (ext, self.device, k.stream, corr, *k.grid, *k.block))
        return _X % ("kernel", self._name(k.name), self.device, k.stream, ts, dur, args)

    def _flow(self, corr: int, launch_ts: float, kernel_ts: float, stream: int) -> list[str]:
        return [_FLOW % ("s", corr, self.pid, self.tid, launch_ts, ""),
                _FLOW % ("f", corr, self.device, stream, kernel_ts, ', "bp": "e"')]

    def _launch(self, name: str, cbid: int, ts: float, dur: float) -> str:
        return self._cpu("cuda_runtime", name, ts, dur,
                         '"External id": %d, "cbid": %d, "correlation": %d' % (self.ext, cbid, self.corr))

    def step(self, t: float, step: Step) -> list[str]:
        """One forward step starting at `t` (us), inside its step span."""
        itl = step_us(self.model, step)
        name = step_span_name(self.model.config.engine, step)
        span_ext = self.ext
        self.ext += 1
        # the span opens before anything it holds, as record_function's range is entered first
        ev: list[str] = [self._cpu("user_annotation", name, t, itl, '"External id": %d' % span_ext)]
        kernels = self._kernels(step)
        if not kernels:
            return ev  # an idle step: scheduler work on the host, nothing on the GPU
        first, last = self._gpu_work(ev, t, itl, kernels, step.requests)
        ev.append(_X % ("gpu_user_annotation", self._name(name), self.device, kernels[0].stream, first,
                        max(last - first, 0.0), '"External id": %d' % span_ext))
        return ev

    def _gpu_work(self, ev: list[str], t: float, itl: float, kernels: list[Kernel], batch: int
                  ) -> tuple[float, float]:
        """A step's input copy, launches and kernels; returns its first kernel's start and last one's end."""
        jitter = [k.us * self.rng.uniform(0.97, 1.03) for k in kernels]
        idle = max(itl - sum(jitter), 0.0)
        # Host-side input preparation: the step's token ids go to the device.
        ev.append(self._cpu("cpu_op", "aten::copy_", t + 2, 28, '"External id": %d' % self.ext))
        ev.append(self._launch("cudaMemcpyAsync", 41, t + 10, 9))
        ev.append(_X % ("gpu_memcpy", '"Memcpy HtoD (Pinned -> Device)"', self.device, COMPUTE_STREAM, t + 21,
                        1.4, '"External id": %d, "device": %d, "context": 1, "stream": %d, "correlation": %d, '
                        '"bytes": %d, "memory bandwidth (GB/s)": 5.7' % (self.ext, self.device, COMPUTE_STREAM,
                                                                          self.corr, 8 * batch)))
        self.ext += 1
        self.corr += 1
        if self.model.config.cuda_graphs:
            gap = 0.4
            cursor = t + max(idle - gap * len(kernels), 40.0)
            launch_ts = cursor - 18
            ev.append(self._cpu("cpu_op", "CUDAGraph::replay", launch_ts - 3, 16, '"External id": %d' % self.ext))
            ev.append(self._launch("cudaGraphLaunch", 311, launch_ts, 12))
            first = cursor
            for k, dur in zip(kernels, jitter):
                ev.append(self._kernel(k, cursor, dur, self.ext, self.corr))
                cursor += dur + gap
            cursor -= gap
            ev += self._flow(self.corr, launch_ts, first, kernels[0].stream)
            self.ext += 1
            self.corr += 1
        else:
            gap = idle / max(1, len(kernels))
            cursor = t + 40
            first = cursor + gap
            for k, dur in zip(kernels, jitter):
                start = cursor + gap
                op_ts = start - gap * 0.9
                ev.append(self._cpu("cpu_op", k.op, op_ts, gap * 0.85, '"External id": %d' % self.ext))
                ev.append(self._launch("cudaLaunchKernel", 211, op_ts + gap * 0.5, min(5.0, gap * 0.3)))
                ev.append(self._kernel(k, start, dur, self.ext, self.corr))
                ev += self._flow(self.corr, op_ts + gap * 0.5, start, k.stream)
                self.ext += 1
                self.corr += 1
                cursor = start + dur
        return first, cursor

    def python_functions(self, start: float, end: float, count: int) -> list[str]:
        """Stack-sampling events as with_stack=True records them, spread over the traced window."""
        ev = []
        for _ in range(count):
            ts = self.rng.uniform(start, end)
            ev.append(_X % ("python_function", self._name(self.rng.choice(_PY_FRAMES)), self.pid, self.tid, ts,
                            self.rng.uniform(0.5, 400.0), '"Python parent id": %d, "Python id": %d, '
                            '"Python thread": 0' % (self.ext, self.ext + 1)))
            self.ext += 1
        return ev


def write_key_averages(path: str | Path, *, model: LatencyModel, steps: Steps, batch: int = 1) -> None:
    """vLLM's `profiler_out.txt`: torch's key_averages() table, sorted by self CUDA time."""
    rows: dict[str, list[float]] = {}
    for step, times in Counter(as_steps(steps, batch)).items():
        for k in step_kernels(model, step):
            row = rows.setdefault(k.name, [0.0, 0])
            row[0] += k.us * times
            row[1] += times
    _write_table(path, "Self CUDA", rows)


FRONTEND_OPS = ("aten::empty", "aten::to", "aten::_to_copy", "aten::copy_")
"""What the API-server trace holds: a few CPU ops per request it streamed (the names are this
simulator's; what vLLM 0.26/0.32's front-end file shows is that it has CPU ops only, no rank)."""


def write_frontend_trace(path: str | Path, *, pid: int, start_ns: int, end_ns: int, requests: int,
                         random_state: int = 0) -> int:
    """vLLM's API-server trace (`{host}_{pid}.async_llm.{ns}.pt.trace.json.gz`): CPU ops on the front
    end's thread over the session, no kernel, no step span, no distributedInfo; return its size."""
    path = Path(path)
    rng = random.Random(random_state)
    t0 = 1_000_000.0
    window = max(1.0, (end_ns - start_ns) / 1000)
    events: list[dict[str, Any]]
    events = [{"name": "process_name", "ph": "M", "ts": t0, "pid": pid, "tid": 0, "args": {"name": "python3"}},
              {"name": "thread_name", "ph": "M", "ts": t0, "pid": pid, "tid": pid,
               "args": {"name": "thread %d (python3)" % pid}}]
    for n in range(max(1, requests) * len(FRONTEND_OPS)):
        events.append({"ph": "X", "cat": "cpu_op", "name": FRONTEND_OPS[n % len(FRONTEND_OPS)], "pid": pid,
                       "tid": pid, "ts": round(t0 + rng.uniform(0, window), 3), "dur": round(rng.uniform(2, 40), 3),
                       "args": {"External id": n + 1}})
    events.sort(key=lambda e: e["ts"])
    trace = {"schemaVersion": 1, "deviceProperties": [], "with_flops": 0, "record_shapes": 0, "profile_memory": 0,
             "with_stack": 0, "traceEvents": events, "traceName": "", "displayTimeUnit": "ms",
             "baseTimeNanoseconds": start_ns - int(t0 * 1000)}
    data = json.dumps(trace).encode()
    with open(path, "wb") as f:
        f.write(gzip.compress(data, compresslevel=4) if path.suffix == ".gz" else data)
    return path.stat().st_size


def write_frontend_key_averages(path: str | Path, *, requests: int) -> None:
    """The front end's `profiler_out.txt`: the same table over its CPU ops (self CPU time)."""
    rows = {name: [12.0 * max(1, requests), max(1, requests)] for name in FRONTEND_OPS}
    _write_table(path, "Self CPU", rows)


def _write_table(path: str | Path, column: str, rows: dict[str, list[float]]) -> None:
    total = sum(us for us, _ in rows.values()) or 1.0
    width = 60
    head = "%-*s  %12s  %12s  %12s  %12s  %12s" % (width, "Name", column, column + " %", column.replace("Self ", "")
                                                     + " total", column.replace("Self ", "") + " time avg",
                                                     "# of Calls")
    rule = "-" * len(head)
    lines = [rule, head, rule]
    for name, (us, calls) in sorted(rows.items(), key=lambda kv: -kv[1][0]):
        short = name if len(name) <= width else name[:width - 3] + "..."
        lines.append("%-*s  %12s  %11.2f%%  %12s  %12s  %12d" % (width, short, _fmt_us(us), 100 * us / total,
                                                                 _fmt_us(us), _fmt_us(us / max(1, calls)), calls))
    lines += [rule, "%s time total: %s" % (column, _fmt_us(total)), ""]
    Path(path).write_text("\n".join(lines))


def _fmt_us(us: float) -> str:
    return "%.3fms" % (us / 1000) if us >= 1000 else "%.3fus" % us
