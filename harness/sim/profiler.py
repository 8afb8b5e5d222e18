"""The engines' profiler endpoints, with their real semantics (ENGINES.md, "Profiling").

SGLang: `/start_profile` opens a session (500 if one is open); with `num_steps` it closes itself after
that many forward steps and writes the traces then, so with no traffic it never closes and nothing is
written. `/stop_profile` closes the open session, writing into the directory that session was started
with, or answers 500 when none is open (including after a num_steps session already closed itself).
`start_step` is an absolute forward count, as upstream treats it. Files: one per local rank,
`[{prefix}-]{profile_id}-TP-{r}[-DP-{d}][-PP-{p}][-EP-{e}][-EXTEND|-DECODE].trace.json.gz`. Not
simulated: `merge_profiles` (no merged file) and the MEM activity's memory snapshots.

vLLM: only with `--profiler-config.profiler=torch` and a `torch_profiler_dir` (otherwise the server
answers 404); start and stop are idempotent; `delay_iterations` and `max_iterations` are honoured.
Files per worker: `dp{d}_pp{p}_tp{t}_dcp0_ep{e}_rank{g}.{ms}.pt.trace.json.gz` and
`{worker}.profiler_out.txt`.

Writing happens under the profiler's lock on a worker thread: the scheduler waits for it (real engines
export from the scheduler/worker process, so decoding stalls while traces flush) but HTTP stays live.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from harness.sim.model import LatencyModel
from harness.sim.trace import write_key_averages, write_trace

Reply = Tuple[int, str]
ALREADY = "Profiling is already in progress. Call /stop_profile first."
NOT_IN_PROGRESS = "Profiling is not in progress. Call /start_profile first."


def sglang_rank_names(*, tp: int, dp: int, pp: int, ep: int, nnodes: int = 1, node_rank: int = 0
                      ) -> List[Tuple[int, str]]:
    """(global rank, file-name part) of every rank on this node, in SGLang's naming."""
    world = tp * pp
    per_node = max(1, world // max(1, nnodes))
    names = []
    for g in range(node_rank * per_node, min(world, (node_rank + 1) * per_node)):
        t, p = g % tp, g // tp
        name = f"TP-{t}"
        if dp > 1:
            name += f"-DP-{t // max(1, tp // dp)}"
        if pp > 1:
            name += f"-PP-{p}"
        if ep > 1:
            name += f"-EP-{t // max(1, tp // ep)}"
        names.append((g, name))
    return names


def vllm_worker_names(*, tp: int, dp: int, pp: int, expert_parallel: bool, nnodes: int = 1,
                      node_rank: int = 0) -> List[Tuple[int, str]]:
    """(global rank, worker name) of every worker on this node, in vLLM's naming."""
    world = tp * pp * dp
    per_node = max(1, world // max(1, nnodes))
    names = []
    for g in range(node_rank * per_node, min(world, (node_rank + 1) * per_node)):
        t, p, d = g % tp, (g // tp) % pp, g // (tp * pp)
        e = d * tp + t if expert_parallel else 0
        names.append((g, f"dp{d}_pp{p}_tp{t}_dcp0_ep{e}_rank{g}"))
    return names


@dataclass
class _Session:
    output_dir: Path
    num_steps: Optional[int]
    start_at: int
    prefix: str
    by_stage: bool
    write_traces: bool
    profile_id: str = field(default_factory=lambda: str(time.time()))
    prefill_steps: int = 0
    decode_steps: int = 0
    tokens: int = 0

    @property
    def steps(self) -> int:
        return self.prefill_steps + self.decode_steps

    def record(self, batch: int, prefill: bool) -> None:
        if prefill:
            self.prefill_steps += 1
        else:
            self.decode_steps += 1
        self.tokens += batch

    def batch(self) -> int:
        return max(1, round(self.tokens / max(1, self.steps)))


async def _export(write: Callable[[_Session], None], s: _Session, log: Callable[[str], None]) -> bool:
    """Write a session's files off the event loop; a failure (disk full) is logged, as the engines do,
    and never takes the decode loop down with it."""
    try:
        await asyncio.to_thread(write, s)
        return True
    except OSError as e:
        log(f"Failed to save profiler traces to {s.output_dir}: {e}")
        return False


class SglangProfiler:
    def __init__(self, *, model: LatencyModel, ranks: List[Tuple[int, str]], world_size: int,
                 trace_mb: Optional[float], fail: bool, log: Callable[[str], None]):
        self.model, self.ranks, self.world_size = model, ranks, world_size
        self.trace_mb, self.fail, self.log = trace_mb, fail, log
        self.session: Optional[_Session] = None
        self.forward_ct = 0
        self.lock = asyncio.Lock()

    async def start(self, body: Dict[str, Any]) -> Reply:
        async with self.lock:
            if self.fail:
                return self._refuse("CUDA error: an illegal memory access was encountered")
            if self.session is not None:
                return self._refuse(ALREADY)
            out = body.get("output_dir") or os.environ.get("SGLANG_TORCH_PROFILER_DIR") or "/tmp"
            try:
                Path(out).mkdir(parents=True, exist_ok=True)
            except OSError as e:
                return self._refuse(str(e))
            start_step = body.get("start_step")
            activities = body.get("activities") or ["CPU", "GPU"]
            self.session = _Session(
                output_dir=Path(out), num_steps=body.get("num_steps"),
                start_at=max(int(start_step), self.forward_ct + 1) if start_step is not None else self.forward_ct + 1,
                prefix=body.get("profile_prefix") or "", by_stage=bool(body.get("profile_by_stage")),
                write_traces=bool({"CPU", "GPU"} & set(activities)))
            self.log(f"Profiling starts. Traces will be saved to: {out} (with profile id: {self.session.profile_id})")
            return 200, "Start profiling.\n"

    async def stop(self) -> Reply:
        async with self.lock:
            if self.fail:
                return self._refuse("CUDA error: an illegal memory access was encountered")
            if self.session is None:
                return self._refuse(NOT_IN_PROGRESS)
            await self._finish()
            return 200, "Stop profiling. This will take some time.\n"

    async def on_step(self, batch: int, prefill: bool) -> None:
        self.forward_ct += 1
        s = self.session
        if s is None or self.forward_ct < s.start_at:
            return
        s.record(batch, prefill)
        if s.num_steps is not None and s.steps >= s.num_steps:
            async with self.lock:
                if self.session is s:
                    await self._finish()

    def _refuse(self, message: str) -> Reply:
        # Upstream raises in the tokenizer manager: the client gets a 500, the log gets the traceback.
        self.log("Exception in ASGI application\nTraceback (most recent call last):\n"
                 '  File "sglang/srt/managers/tokenizer_communicator_mixin.py", line 312, in _execute_profile\n'
                 f"    raise RuntimeError(result.message)\nRuntimeError: {message}")
        return 500, message

    async def _finish(self) -> None:
        s = self.session
        assert s is not None
        self.session = None
        if await _export(self._write, s, self.log) and s.write_traces:
            self.log(f"Profiling done. Traces are saved to: {s.output_dir}")

    def _write(self, s: _Session) -> None:
        if not s.write_traces:
            return  # CUDA_PROFILER only: nsys records, torch writes nothing
        stages = [("-EXTEND", s.prefill_steps), ("-DECODE", s.decode_steps)] if s.by_stage else [("", s.steps)]
        for rank, name in self.ranks:
            for stage, steps in stages:
                filename = f"{s.profile_id}-{name}{stage}.trace.json.gz"
                if s.prefix:
                    filename = f"{s.prefix}-{filename}"
                write_trace(s.output_dir / filename, model=self.model, steps=steps, rank=rank,
                            world_size=self.world_size, batch=s.batch(), pad_to_mb=self.trace_mb)


class VllmProfiler:
    def __init__(self, *, config: Dict[str, Any], model: LatencyModel, workers: List[Tuple[int, str]],
                 world_size: int, trace_mb: Optional[float], fail: bool, log: Callable[[str], None]):
        self.config, self.model, self.workers, self.world_size = config, model, workers, world_size
        self.trace_mb, self.fail, self.log = trace_mb, fail, log
        self.enabled = config.get("profiler") == "torch" and bool(config.get("torch_profiler_dir"))
        self.session: Optional[_Session] = None
        self.delay = 0
        self.lock = asyncio.Lock()

    async def start(self) -> Reply:
        async with self.lock:
            if self.fail:
                return 500, "Internal Server Error"
            if self.session is None:
                out = Path(self.config["torch_profiler_dir"])
                try:
                    out.mkdir(parents=True, exist_ok=True)
                except OSError as e:
                    self.log(f"Failed to start profiler: {e}")
                    return 500, "Internal Server Error"
                self.delay = int(self.config.get("delay_iterations") or 0)
                self.session = _Session(output_dir=out, num_steps=int(self.config.get("max_iterations") or 0)
                                        or None, start_at=0, prefix="", by_stage=False, write_traces=True)
                self.log(f"Starting profiler, traces will be saved to {out}")
            return 200, ""

    async def stop(self) -> Reply:
        async with self.lock:
            if self.fail:
                return 500, "Internal Server Error"
            if self.session is not None:
                await self._finish()
            return 200, ""

    async def on_step(self, batch: int, prefill: bool) -> None:
        s = self.session
        if s is None:
            return
        if self.delay > 0:
            self.delay -= 1
            return
        s.record(batch, prefill)
        if s.num_steps is not None and s.steps >= s.num_steps:
            async with self.lock:
                if self.session is s:
                    await self._finish()

    async def _finish(self) -> None:
        s = self.session
        assert s is not None
        self.session = None
        if await _export(self._write, s, self.log):
            self.log(f"Profiler stopped; traces written to {s.output_dir}")

    def _write(self, s: _Session) -> None:
        gz = self.config.get("torch_profiler_use_gzip", True) not in (False, "false", "False", 0)
        suffix = ".pt.trace.json.gz" if gz else ".pt.trace.json"
        for rank, worker in self.workers:
            stamp = time.time_ns() // 1_000_000
            write_trace(s.output_dir / f"{worker}.{stamp}{suffix}", model=self.model, steps=s.steps, rank=rank,
                        world_size=self.world_size, batch=s.batch(), pad_to_mb=self.trace_mb)
            write_key_averages(s.output_dir / f"{worker}.profiler_out.txt", model=self.model, steps=s.steps,
                               batch=s.batch())
