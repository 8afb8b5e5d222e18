"""The engines' profiler endpoints, with their real semantics (docs/engines.md).

SGLang 0.5.23: `/start_profile` opens a session (500 if one is open); with `num_steps` it closes itself
after that many forward steps and writes the traces then, so with no traffic it never closes and
nothing is written. `/stop_profile` closes the open session, writing into the directory that session
was started with, or answers 500 when none is open (including after a num_steps session already
closed itself). `start_step` is an absolute forward count, as upstream treats it. Files: one per local
rank, `[{prefix}-]{profile_id}-TP-{r}[-DP-{d}][-PP-{p}][-EP-{e}][-EXTEND|-DECODE].trace.json.gz`. Not
simulated: `merge_profiles` (no merged file) and the MEM activity's memory snapshots.

vLLM, as 0.32.0 behaves (0.26.0 where it agrees): the endpoints exist only with a profiler configured
at launch (`--profiler-config.profiler=torch` and a `torch_profiler_dir`; `cuda` for nsys, which
writes nothing itself), otherwise 404. A session's step bounds come from the launch flags
(`max_iterations`, `delay_iterations`, 0.26 and 0.32) or from the JSON body of /start_profile
(`{"max_iterations": N, "delay_iterations": K, "profile_prefix": "x"}`, 0.32; 0.26 ignores any body).
With `max_iterations` each worker stops itself after N engine steps and writes its files then, but
the session stays active: a second /start_profile answers 409 (`CONFLICT`) until /stop_profile, which
stops the workers still recording, writes the front end's files, and answers 200 (200 too with no
session). Files, per worker (0.26 and 0.32):
- `rank{g}.{ns}.pt.trace.json.gz` when the model has no expert-parallel group (dense models:
  `vllm/distributed/utils.py` get_worker_rank_suffix falls back to the global rank),
  `dp{d}_pp{p}_tp{t}_dcp{c}_ep{e}_rank{g}.{ns}.pt.trace.json.gz` with one (--enable-expert-parallel),
  and `{profile_prefix}_` before either;
- `{worker}.profiler_out.txt`, the key_averages table (0.32's name; 0.26 writes `profiler_out_{g}.txt`);
- from the API front end, unless `--profiler-config.ignore_frontend true`, at /stop_profile:
  `{host}_{pid}.async_llm.{ns}.pt.trace.json.gz` (CPU ops only, no rank) and
  `{host}_{pid}.async_llm.profiler_out.txt`.

Writing happens under the profiler's lock on a worker thread: the scheduler waits for it (real engines
export from the scheduler/worker process, so decoding stalls while traces flush) but HTTP stays live.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Union

from harness.sim.model import LatencyModel
from harness.sim.trace import Step, write_frontend_key_averages, write_frontend_trace, write_key_averages, write_trace

Reply = tuple[int, Union[str, dict[str, Any]]]
"""A status and a body: text, or a JSON object."""
ALREADY = "Profiling is already in progress. Call /stop_profile first."
NOT_IN_PROGRESS = "Profiling is not in progress. Call /start_profile first."
VLLM_ACTIVE = ("A profiling session is already active. Call /stop_profile before starting another "
               "session.")


def sglang_rank_names(*, tp: int, dp: int, pp: int, ep: int, replicas: int = 1, nnodes: int = 1,
                      node_rank: int = 0) -> list[tuple[int, str]]:
    """(global rank, file-name part) of every rank on this node, in SGLang's naming: `dp` attention-DP
    groups inside the TP group, or `replicas` data-parallel replicas, each a TP x PP group of its own
    (0.5.23: one of the two is 1; the profiler adds `-DP-{d}` when their product is over 1)."""
    world = tp * pp * replicas
    per_node = max(1, world // max(1, nnodes))
    names = []
    for g in range(node_rank * per_node, min(world, (node_rank + 1) * per_node)):
        t, p, r = g % tp, (g // tp) % pp, g // (tp * pp)
        name = f"TP-{t}"
        if replicas > 1:
            name += f"-DP-{r}"
        elif dp > 1:
            name += f"-DP-{t // max(1, tp // dp)}"
        if pp > 1:
            name += f"-PP-{p}"
        if ep > 1:
            name += f"-EP-{t // max(1, tp // ep)}"
        names.append((g, name))
    return names


def vllm_worker_names(*, tp: int, dp: int, pp: int, expert_parallel: bool, nnodes: int = 1,
                      node_rank: int = 0) -> list[tuple[int, str]]:
    """(global rank, rank suffix) of every worker on this node, as vLLM's get_worker_rank_suffix
    names them (0.26 / 0.32): the bare global rank unless the model has an expert-parallel group."""
    world = tp * pp * dp
    per_node = max(1, world // max(1, nnodes))
    names = []
    for g in range(node_rank * per_node, min(world, (node_rank + 1) * per_node)):
        t, p, d = g % tp, (g // tp) % pp, g // (tp * pp)
        if expert_parallel:
            names.append((g, f"dp{d}_pp{p}_tp{t}_dcp0_ep{d * tp + t}_rank{g}"))
        else:
            names.append((g, f"rank{g}"))
    return names


@dataclass
class _Session:
    output_dir: Path
    num_steps: int | None
    start_at: int
    prefix: str
    by_stage: bool
    write_traces: bool
    profile_id: str = field(default_factory=lambda: str(time.time()))
    started_ns: int = field(default_factory=time.time_ns)
    recorded: list[Step] = field(default_factory=list)
    admitted: int = 0
    """Requests admitted while the session was active (what vLLM's front end saw come and go)."""

    @property
    def steps(self) -> int:
        return len(self.recorded)

    def record(self, step: Step) -> None:
        self.recorded.append(step)

    def stage(self, prefill: bool) -> list[Step]:
        """The steps SGLang's profile_by_stage puts in its -EXTEND (prefill) or -DECODE file."""
        return [s for s in self.recorded if bool(s.prefill) == prefill]


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
    def __init__(self, *, model: LatencyModel, ranks: list[tuple[int, str]], world_size: int,
                 trace_mb: float | None, fail: bool, log: Callable[[str], None]):
        self.model, self.ranks, self.world_size = model, ranks, world_size
        self.trace_mb, self.fail, self.log = trace_mb, fail, log
        self.session: _Session | None = None
        self.forward_ct = 0
        self.lock = asyncio.Lock()

    async def start(self, body: dict[str, Any]) -> Reply:
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

    async def on_step(self, step: Step) -> None:
        self.forward_ct += 1
        s = self.session
        if s is None or self.forward_ct < s.start_at:
            return
        s.record(step)
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
        stages = ([("-EXTEND", s.stage(prefill=True)), ("-DECODE", s.stage(prefill=False))] if s.by_stage
                  else [("", s.recorded)])
        for rank, name in self.ranks:
            for stage, steps in stages:
                filename = f"{s.profile_id}-{name}{stage}.trace.json.gz"
                if s.prefix:
                    filename = f"{s.prefix}-{filename}"
                write_trace(s.output_dir / filename, model=self.model, steps=steps, rank=rank,
                            world_size=self.world_size, pad_to_mb=self.trace_mb)


class VllmProfiler:
    """vLLM 0.32's profiler session: one at a time, bounded by launch flags or the start body."""

    def __init__(self, *, config: dict[str, Any], model: LatencyModel, workers: list[tuple[int, str]],
                 world_size: int, trace_mb: float | None, fail: bool, log: Callable[[str], None]):
        self.config, self.model, self.workers, self.world_size = config, model, workers, world_size
        self.trace_mb, self.fail, self.log = trace_mb, fail, log
        kind = config.get("profiler")
        self.torch = kind == "torch" and bool(config.get("torch_profiler_dir"))
        self.enabled = self.torch or kind == "cuda"
        self.frontend = config.get("ignore_frontend") not in (True, "true", "True", 1)
        self.active: _Session | None = None
        """The session the API server holds open, until /stop_profile."""
        self.session: _Session | None = None
        """The same session while the workers still record it (None once they stopped themselves)."""
        self.delay = 0
        self.lock = asyncio.Lock()

    async def start(self, body: dict[str, Any]) -> Reply:
        async with self.lock:
            if self.fail:
                return 500, "Internal Server Error"
            if self.active is not None:
                return 409, {"error": {"message": VLLM_ACTIVE, "type": "Conflict", "param": None, "code": 409}}
            try:
                bounds = self._bounds(body)
            except ValueError as e:
                return 400, {"error": {"message": str(e), "type": "BadRequestError", "param": None, "code": 400}}
            out = Path(self.config.get("torch_profiler_dir") or ".")
            if self.torch:
                try:
                    out.mkdir(parents=True, exist_ok=True)
                except OSError as e:
                    self.log(f"Failed to start profiler: {e}")
                    return 500, "Internal Server Error"
            max_iterations, self.delay = bounds
            prefix = body.get("profile_prefix") or ""
            self.active = self.session = _Session(output_dir=out, num_steps=max_iterations, start_at=0,
                                                  prefix=str(prefix), by_stage=False, write_traces=self.torch)
            self.log(f"Starting profiler, traces will be saved to {out}")
            return 200, ""

    def _bounds(self, body: dict[str, Any]) -> tuple[int | None, int]:
        """max_iterations (None: until /stop_profile) and delay_iterations: the body's, else the flags'."""
        values = []
        for key in ("max_iterations", "delay_iterations"):
            value = body.get(key, self.config.get(key))
            if value is None:
                value = 0
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{key} must be a non-negative integer, got {value!r}")
            values.append(value)
        return values[0] or None, values[1]

    async def stop(self) -> Reply:
        async with self.lock:
            if self.fail:
                return 500, "Internal Server Error"
            s = self.active
            if s is None:
                return 200, ""
            if self.session is not None:
                await self._finish()
            self.active = None
            if self.frontend and s.write_traces:
                await _export(self._write_frontend, s, self.log)
            return 200, ""

    async def on_step(self, step: Step) -> None:
        if self.active is not None:
            self.active.admitted += step.prefill
        s = self.session
        if s is None:
            return
        if self.delay > 0:
            self.delay -= 1
            return
        s.record(step)
        if s.num_steps is not None and s.steps >= s.num_steps:
            async with self.lock:
                if self.session is s:
                    await self._finish()

    async def _finish(self) -> None:
        """The workers stop recording and write their files; the session itself stays active."""
        s = self.session
        assert s is not None
        self.session = None
        if s.write_traces and await _export(self._write, s, self.log):
            self.log(f"Profiler stopped; traces written to {s.output_dir}")

    def _gz(self) -> str:
        gz = self.config.get("torch_profiler_use_gzip", True) not in (False, "false", "False", 0)
        return ".pt.trace.json.gz" if gz else ".pt.trace.json"

    def _write(self, s: _Session) -> None:
        for rank, suffix in self.workers:
            worker = f"{s.prefix}_{suffix}" if s.prefix else suffix
            write_trace(s.output_dir / f"{worker}.{time.time_ns()}{self._gz()}", model=self.model, steps=s.recorded,
                        rank=rank, world_size=self.world_size, pad_to_mb=self.trace_mb)
            write_key_averages(s.output_dir / f"{worker}.profiler_out.txt", model=self.model, steps=s.recorded)

    def _write_frontend(self, s: _Session) -> None:
        name = f"{socket.gethostname()}_{os.getpid()}.async_llm"
        now = time.time_ns()
        write_frontend_trace(s.output_dir / f"{name}.{now}{self._gz()}", pid=os.getpid(), start_ns=s.started_ns,
                             end_ns=now, requests=s.admitted)
        write_frontend_key_averages(s.output_dir / f"{name}.profiler_out.txt", requests=s.admitted)
