"""Kineto (torch.profiler) Chrome traces for the simulated engine, written as a stream.

`write_trace` lays out `steps` decode steps of one rank the way the real profiler records them: the
kernels of `LatencyModel.step_kernels` on the GPU timeline (pid = device, tid = stream), and on the CPU
either one `cudaGraphLaunch` per step (CUDA graphs: the kernels share its correlation id) or one cpu_op
with a `cudaLaunchKernel` per kernel (eager: the model's launch cost shows up as idle gaps between
kernels). `ac2g` flow events join launches to kernels, vLLM steps get their `execute_context_...`
annotations, and the file ends with `baseTimeNanoseconds`, as Kineto writes it.

Events are formatted and compressed a step at a time, so a trace of any size costs a step's worth of
memory. `pad_to_mb` grows a file to a target size on disk with `python_function` events (what
`with_stack=True` adds in bulk), which leaves GPU time and step counts untouched.
"""

from __future__ import annotations

import gzip
import json
import random
import time
from pathlib import Path
from typing import BinaryIO, Dict, List, Optional, Union

from harness.sim.model import Kernel, LatencyModel

GPU_NAME = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
GPUS_PER_NODE = 8
COMPUTE_STREAM, COMM_STREAM = 7, 20

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


def write_trace(path: Union[str, Path], *, model: LatencyModel, steps: int, rank: int = 0,
                world_size: int = 1, batch: int = 1, pad_to_mb: Optional[float] = None,
                start_ns: Optional[int] = None, seed: int = 0) -> int:
    """Write one rank's trace of `steps` decode steps at `batch` running requests; return its size.

    The file is gzip'd when `path` ends in `.gz`. `start_ns` is the time.time_ns() of the first step
    (default: now, minus the trace's duration, as if the steps had just run).
    """
    path = Path(path)
    itl_us = model.itl_ms(batch) * 1000
    kernels = model.step_kernels(batch)
    base_ns = (time.time_ns() - int(itl_us * steps * 1000)) if start_ns is None else start_ns
    t0 = 5_000_000.0 + 1000.0 * rank  # Kineto's ts is a monotonic clock; base + ts*1000 = wall ns
    writer = _Writer(path, rank=rank, world_size=world_size, model=model, seed=seed)
    try:
        writer.put(writer.header(t0))
        for n in range(steps):
            writer.put(writer.step(t0 + n * itl_us, itl_us, kernels, batch))
        end = t0 + steps * itl_us
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

    def __init__(self, path: Path, *, rank: int, world_size: int, model: LatencyModel, seed: int):
        self.raw: BinaryIO = open(path, "wb")
        self.out: BinaryIO = (gzip.GzipFile(fileobj=self.raw, mode="wb", compresslevel=4)
                              if path.suffix == ".gz" else self.raw)
        self.rank, self.world_size, self.model = rank, world_size, model
        self.device = rank % GPUS_PER_NODE
        self.pid = 41000 + rank  # one process per rank, as the engines run them
        self.tid = self.pid
        self.ext = self.corr = 1
        self.first = True
        self.rng = random.Random(seed * 1_000_003 + rank)
        self.names: Dict[str, str] = {}

    def size(self) -> int:
        return self.raw.tell()

    def put(self, events: List[str]) -> None:
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

    def header(self, t0: float) -> List[str]:
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

    def _flow(self, corr: int, launch_ts: float, kernel_ts: float, stream: int) -> List[str]:
        return [_FLOW % ("s", corr, self.pid, self.tid, launch_ts, ""),
                _FLOW % ("f", corr, self.device, stream, kernel_ts, ', "bp": "e"')]

    def _launch(self, name: str, cbid: int, ts: float, dur: float) -> str:
        return self._cpu("cuda_runtime", name, ts, dur,
                         '"External id": %d, "cbid": %d, "correlation": %d' % (self.ext, cbid, self.corr))

    def step(self, t: float, itl: float, kernels: List[Kernel], batch: int) -> List[str]:
        """One decode step starting at `t` (us) and lasting `itl` us."""
        jitter = [k.us * self.rng.uniform(0.97, 1.03) for k in kernels]
        idle = max(itl - sum(jitter), 0.0)
        ev: List[str] = []
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
            ev += self._flow(self.corr, launch_ts, first, kernels[0].stream if kernels else COMPUTE_STREAM)
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
        if self.model.config.engine == "vllm":
            name = "execute_context_0(0)_generation_%d(%d)" % (batch, batch)
            ev.append(self._cpu("user_annotation", name, t, itl, '"External id": %d' % self.ext))
            ev.append(_X % ("gpu_user_annotation", self._name(name), self.device, COMPUTE_STREAM, first,
                            max(cursor - first, 0.0), '"External id": %d' % self.ext))
            self.ext += 1
        return ev

    def python_functions(self, start: float, end: float, count: int) -> List[str]:
        """Stack-sampling events as with_stack=True records them, spread over the traced window."""
        ev = []
        for _ in range(count):
            ts = self.rng.uniform(start, end)
            ev.append(_X % ("python_function", self._name(self.rng.choice(_PY_FRAMES)), self.pid, self.tid, ts,
                            self.rng.uniform(0.5, 400.0), '"Python parent id": %d, "Python id": %d, '
                            '"Python thread": 0' % (self.ext, self.ext + 1)))
            self.ext += 1
        return ev


def write_key_averages(path: Union[str, Path], *, model: LatencyModel, steps: int, batch: int = 1) -> None:
    """vLLM's `profiler_out.txt`: torch's key_averages() table, sorted by self CUDA time."""
    rows: Dict[str, List[float]] = {}
    for k in model.step_kernels(batch):
        row = rows.setdefault(k.name, [0.0, 0])
        row[0] += k.us * steps
        row[1] += steps
    total = sum(us for us, _ in rows.values()) or 1.0
    width = 60
    head = "%-*s  %12s  %12s  %12s  %12s  %12s" % (width, "Name", "Self CUDA", "Self CUDA %", "CUDA total",
                                                     "CUDA time avg", "# of Calls")
    rule = "-" * len(head)
    lines = [rule, head, rule]
    for name, (us, calls) in sorted(rows.items(), key=lambda kv: -kv[1][0]):
        short = name if len(name) <= width else name[:width - 3] + "..."
        lines.append("%-*s  %12s  %11.2f%%  %12s  %12s  %12d" % (width, short, _fmt_us(us), 100 * us / total,
                                                                 _fmt_us(us), _fmt_us(us / calls), calls))
    lines += [rule, "Self CUDA time total: %s" % _fmt_us(total), ""]
    Path(path).write_text("\n".join(lines))


def _fmt_us(us: float) -> str:
    return "%.3fms" % (us / 1000) if us >= 1000 else "%.3fus" % us
