"""Kineto traces of any size whose figures are known in advance, for the analyzer's tests and benchmark.

    python benchmarks/tracegen.py OUT.trace.json[.gz] --mb 250 [--layout torch] [--truth OUT.truth.json]

One rank's decode steps, as torch.profiler records them: per step a vLLM step annotation, CPU op trees
on two threads, a `cudaLaunchKernel` and an `ac2g` flow pair per kernel, `python_function` samples (what
`with_stack=True` adds in bulk), and on the GPU the kernels of a layer on the compute stream with gaps
between them (the launch-bound idle), a memcpy, and all-reduce kernels on a second stream that run inside
a compute kernel (so overlap must not count twice). Steps are added until the JSON text reaches the size
asked for.

Every duration is a whole number of nanoseconds, so the truth (kernel time and count by name and
category, idle time, CPU self time by op, steps) is summed exactly in integers while writing, and the
file prints the same values (microseconds, three decimals) in every layout:

- torch:  libkineto's output_json.cpp, which every engine's per-rank file uses: each event over several
          lines, `"ph"` first.
- lines:  one `json.dumps` event per line (what harness.sim writes).
- compact: the whole document on one line, `json.dumps` spacing.
- tight:  one line, `separators=(",", ":")`.
- sorted: `json.dumps(indent=2, sort_keys=True)`: keys in another order, `args` first.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
from pathlib import Path
from typing import BinaryIO

LAYOUTS = ("torch", "lines", "compact", "tight", "sorted")
CPU_PID, GPU_PID, COMPUTE, COMM = 4242, 0, 7, 20
THREADS = (4242, 4250)
STEP_NAME = "execute_context_0(0)_generation_8(8)"
_HOLE = "events go here"

# (name, category, mean duration ns); the names are real ones, escapes and braces included.
LAYER = (
    ("void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>(__nv_bfloat16*, unsigned int)", "norm", 3_400),
    ("nvjet_tst_128x64_64x8_1x1_v_bz_TNT", "gemm", 11_300),
    ("void flashinfer::BatchDecodeWithPagedKVCacheKernel<128u, 4u>(Params)", "attention", 9_100),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)"
     "::{lambda()#3}::operator()() const::{lambda()#8}::operator()() const::{lambda(c10::BFloat16)#1}, "
     "at::detail::Array<char*, 2> >(int, at::detail::Array<char*, 2>)", "copy", 41_700),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "gemm", 7_900),
    ("fused_moe_kernel \"bf16\" \u00b5s\tE=256", "moe", 15_200),
    ("void vllm::moe::topkGatingSoftmax<8, 256>(float const*, int*)", "moe", 2_600),
    ("void vllm::act_and_mul_kernel<c10::BFloat16, &vllm::silu_kernel>(c10::BFloat16*, int)", "elementwise", 2_900),
    ("void vllm::rotary_embedding_kernel<c10::BFloat16, true>(long const*, c10::BFloat16*)", "elementwise", 1_800),
    ("triton_poi_fused_0", "elementwise", 1_300),
)
ALLREDUCE = ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication", 5_200)
MEMCPY = ("Memcpy HtoD (Pinned -> Device)", "copy", 1_400)
LAYERS = 4
CPU_TREES = (  # (name, self ns, children): what one thread does at the start of a step
    ("aten::linear", 4_100, (("aten::t", 1_200, ()), ("aten::mm", 8_300, ()))),
    ("aten::copy_", 2_700, (("aten::empty", 900, (("aten::resize_", 300, ()),)),)),
    ("aten::zeros", 1_100, ()),
)
PY_FRAMES = ("vllm/v1/worker/gpu_model_runner.py(2410): execute_model",
             "torch/nn/modules/module.py(1773): _call_impl", "threading.py(327): wait")


def generate(path: Path, *, mb: float, layout: str = "torch", random_state: int = 0, rank: int = 0,
             python_share: float = 0.3) -> dict:
    """Write the trace to `path` (gzip'd when it ends in .gz) and return its truth."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}")
    gen = _Generator(path, layout=layout, random_state=random_state, rank=rank, python_share=python_share)
    try:
        gen.run(int(mb * (1 << 20)))
    finally:
        gen.close()
    return gen.truth()


class _Generator:
    def __init__(self, path: Path, *, layout: str, random_state: int, rank: int, python_share: float):
        self.path, self.layout, self.rank = Path(path), layout, rank
        self.raw: BinaryIO = open(self.path, "wb")  # noqa: SIM115  (the generator owns the file: close() closes it)
        self.out: BinaryIO = (gzip.GzipFile(fileobj=self.raw, mode="wb", compresslevel=3)
                              if self.path.name.endswith(".gz") else self.raw)
        self.rng = random.Random(random_state * 7919 + rank)
        self.python_share = python_share
        self.encoder = {"lines": json.JSONEncoder(), "compact": json.JSONEncoder(),
                        "tight": json.JSONEncoder(separators=(",", ":")),
                        "sorted": json.JSONEncoder(indent=2, sort_keys=True)}.get(layout)
        self.sep = {"torch": ",\n", "lines": ",\n", "sorted": ",\n", "compact": ", ", "tight": ","}[layout]
        self.written = 0
        self.first = True
        self.tail = ""
        self.corr = 1
        self.now = 5_000_000_000 + 1_000_000 * rank  # ns on the profiler's clock
        self.kernels: dict[str, list] = {}          # name -> [category, total ns, count]
        self.cpu: dict[str, list] = {}              # name -> [self ns, count]
        self.busy = self.steps = 0
        self.first_kernel: int | None = None
        self.last_end = 0

    # ------------------------------------------------------------ document

    def run(self, target_bytes: int) -> None:
        self._head()
        while self.steps == 0 or self.written < target_bytes:
            self._step()
        self._tail()

    def _write(self, text: str) -> None:
        data = text.encode()
        self.written += len(data)
        self.out.write(data)

    def _head(self) -> None:
        top = {"schemaVersion": 1,
               "deviceProperties": [{"id": 0, "name": "NVIDIA H200", "totalGlobalMem": 150_754_820_096,
                                     "computeMajor": 9, "computeMinor": 0, "numSms": 132}],
               "distributedInfo": {"backend": "nccl", "rank": self.rank, "world_size": 8},
               "with_stack": 1}
        rest = {"traceName": self.path.name, "displayTimeUnit": "ms",
                "baseTimeNanoseconds": 1_700_000_000_000_000_000}
        if self.layout == "torch":
            head = "{\n" + "".join(f'  "{k}": {json.dumps(v)},\n' for k, v in top.items()) + '  "traceEvents": [\n'
            self.tail = "\n  ],\n" + ",\n".join(f'  "{k}": {json.dumps(v)}' for k, v in rest.items()) + "\n}\n"
        else:  # the encoder lays out the document around a placeholder for the events
            text = self.encoder.encode({**top, "traceEvents": [_HOLE], **rest})
            head, self.tail = text.split(json.dumps(_HOLE))
        self._write(head)
        meta = [("process_name", CPU_PID, 0, {"name": "python3"}),
                ("process_name", GPU_PID, 0, {"name": "python3"}),
                ("process_labels", GPU_PID, 0, {"labels": "GPU 0"}),
                ("thread_name", GPU_PID, COMPUTE, {"name": "stream 7 "})]
        self._events([{"name": n, "ph": "M", "ts": self.now / 1000, "pid": p, "tid": t, "args": a}
                      for n, p, t, a in meta])

    def _tail(self) -> None:
        self._events([{"name": "Record Window End", "ph": "i", "s": "g", "pid": "", "tid": "",
                       "ts": self.now / 1000}])
        self._write(self.tail)

    def close(self) -> None:
        if self.out is not self.raw:
            self.out.close()
        self.raw.close()

    def _events(self, events: list[dict]) -> None:
        render = _torch if self.layout == "torch" else self.encoder.encode
        self._write(("" if self.first else self.sep) + self.sep.join(map(render, events)))
        self.first = False

    # ------------------------------------------------------------ one step

    def _step(self) -> None:
        rng, t0 = self.rng, self.now
        events: list[dict] = []
        cpu_end = t0
        for tid in THREADS:
            cursor = t0 + rng.randrange(0, 5_000)
            for tree in rng.sample(CPU_TREES, len(CPU_TREES)):
                cursor = self._cpu_tree(events, tid, cursor, tree) + rng.choice((0, 0, 700))
            cpu_end = max(cpu_end, cursor)
        cursor = cpu_end + 10_000
        self._kernel(events, MEMCPY, cursor, rng.randrange(1_000, 2_000), "gpu_memcpy")
        for _ in range(LAYERS):
            for kernel in LAYER:
                cursor = self.last_end + rng.randrange(300, 4_000)
                dur = kernel[2] + rng.randrange(-kernel[2] // 10, kernel[2] // 10 + 1)
                self._kernel(events, kernel, cursor, dur, "kernel")
                if kernel[1] == "gemm":  # the all-reduce runs on its own stream inside this GEMM
                    self._kernel(events, ALLREDUCE, cursor + 100, rng.randrange(200, dur - 200), "kernel",
                                 stream=COMM)
        events.append(_x("user_annotation", STEP_NAME, CPU_PID, THREADS[0], t0, self.last_end - t0,
                         {"External id": self.corr}))
        share = self.python_share
        for _ in range(int(len(events) * share / (1 - share)) if share < 1 else 0):
            events.append(_x("python_function", rng.choice(PY_FRAMES), CPU_PID, THREADS[0],
                             rng.randrange(t0, self.last_end), rng.randrange(500, 400_000),
                             {"Python parent id": self.corr, "Python id": self.corr + 1, "Python thread": 0}))
        self.steps += 1
        self.now = self.last_end + rng.randrange(20_000, 60_000)
        self._events(events)

    def _cpu_tree(self, events: list[dict], tid: int, start: int, tree: tuple) -> int:
        """Append one op and its children (in start order, parents first, as torch does); its end."""
        name, self_ns, children = tree
        index = len(events)
        events.append({})
        cursor = start + self_ns // 2
        for child in children:
            cursor = self._cpu_tree(events, tid, cursor, child)
        end = cursor + self_ns - self_ns // 2
        events[index] = _x("cpu_op", name, CPU_PID, tid, start, end - start, {"External id": self.corr})
        stat = self.cpu.setdefault(name, [0, 0])
        stat[0] += self_ns
        stat[1] += 1
        return end

    def _kernel(self, events: list[dict], kernel: tuple, start: int, dur: int, cat: str,
                stream: int = COMPUTE) -> None:
        name, category, _ = kernel
        corr = self.corr = self.corr + 1
        launch = start - 9_000
        events.append(_x("cuda_runtime", "cudaLaunchKernel", CPU_PID, THREADS[0], launch, 4_000,
                         {"External id": corr, "cbid": 211, "correlation": corr}))
        events.append({"ph": "s", "id": corr, "pid": CPU_PID, "tid": THREADS[0], "ts": launch / 1000,
                       "cat": "ac2g", "name": "ac2g"})
        args = {"External id": corr, "queued": 0, "device": 0, "context": 1, "stream": stream,
                "correlation": corr, "registers per thread": 64, "shared memory": 0, "blocks per SM": 1.2,
                "warps per SM": 4.8, "grid": [132, 1, 1], "block": [128, 1, 1],
                "est. achieved occupancy %": 12}
        events.append(_x(cat, name, GPU_PID, stream, start, dur, args))
        events.append({"ph": "f", "id": corr, "pid": GPU_PID, "tid": stream, "ts": start / 1000,
                       "cat": "ac2g", "name": "ac2g", "bp": "e"})
        stat = self.kernels.setdefault(name, [category, 0, 0])
        stat[1] += dur
        stat[2] += 1
        if stream == COMPUTE:  # the comm kernels lie inside a compute kernel: the busy time is this stream's
            self.busy += dur
            self.last_end = start + dur
            if self.first_kernel is None:
                self.first_kernel = start

    # ------------------------------------------------------------ the truth

    def truth(self) -> dict:
        """What an exact analysis of this file finds, in microseconds as the trace has them."""
        kernel_ns = sum(total for _, total, _ in self.kernels.values())
        categories: dict[str, int] = {}
        for category, total, _ in self.kernels.values():
            categories[category] = categories.get(category, 0) + total
        window = self.last_end - (self.first_kernel or 0)
        return {
            "schema": "tracegen.truth/1", "file": self.path.name, "layout": self.layout, "rank": self.rank,
            "json_bytes": self.written, "steps": self.steps, "kernel_us": kernel_ns / 1000,
            "window_us": window / 1000, "idle_us": (window - self.busy) / 1000,
            "kernels": {name: {"category": category, "total_us": total / 1000, "count": count}
                        for name, (category, total, count) in self.kernels.items()},
            "categories_us": {c: ns / 1000 for c, ns in categories.items()},
            "cpu_ops": {name: {"self_us": ns / 1000, "count": count} for name, (ns, count) in self.cpu.items()},
        }


def _x(cat: str, name: str, pid: int, tid: int, ts_ns: int, dur_ns: int, args: dict) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts_ns / 1000,
            "dur": dur_ns / 1000, "args": args}


def _torch(ev: dict) -> str:
    """One event as libkineto's output_json.cpp lays it out."""
    ev = dict(ev)
    args = ev.pop("args", None)
    if ev["ph"] == "X":
        text = ('  {\n    "ph": "X", "cat": "%s", "name": %s, "pid": %d, "tid": %d,\n    "ts": %.3f, "dur": %.3f'
                % (ev["cat"], json.dumps(ev["name"]), ev["pid"], ev["tid"], ev["ts"], ev["dur"]))
    else:
        text = "  {\n    " + json.dumps(ev)[1:-1]
    if args:
        text += ',\n    "args": {\n      ' + json.dumps(args)[1:-1] + "\n    }"
    return text + "\n  }"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the trace to write; gzip'd when it ends in .gz")
    parser.add_argument("--mb", type=float, default=250.0, help="size of the JSON text in MiB")
    parser.add_argument("--layout", choices=LAYOUTS, default="torch")
    parser.add_argument("--random-state", type=int, default=0)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--truth", type=Path, help="where to write the truth (default OUT.truth.json)")
    args = parser.parse_args(argv)
    truth = generate(args.out, mb=args.mb, layout=args.layout, random_state=args.random_state, rank=args.rank)
    truth_path = args.truth or args.out.with_name(args.out.name.split(".")[0] + ".truth.json")
    truth_path.write_text(json.dumps(truth, indent=1, ensure_ascii=False))
    print(f"wrote {args.out} ({truth['json_bytes'] / (1 << 20):.1f} MiB of JSON, {truth['steps']} steps) "
          f"and {truth_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
