"""One pass over one rank's trace file, keeping only running totals.

Per event the work is a category test and a dictionary update, so the pass runs at the speed of the
scanner. A large plain file can be read as byte ranges in several processes (`summarize_range`), whose
totals join in file order (`Totals.then`). What it keeps:

- GPU kernels (`kernel`, plus `gpu_memcpy` / `gpu_memset`, which always count as copy): total
  duration and launch count per name, and each one's interval per device for the idle time.
- CPU ops (`cpu_op`): self time per name, with one stack per thread. Each op's whole duration is
  credited to its name and subtracted from its enclosing op's name, so nothing per op outlives its
  end. This relies on each thread's ops reaching the trace in start order, parents first, which
  PyTorch guarantees: its profiler records an op when it is entered and writes each thread's
  records in that order (torch/csrc/profiler/collection.cpp). Across a range boundary, the ops a
  range began with nothing open are handed to the ops still open at the end of the range before.
- Steps: vLLM wraps every engine step in a record_function range named
  `execute_context_{n}({tokens})_generation_{m}({tokens})`. Each `user_annotation` (CPU) with a name
  starting `execute_context` is one step; when a trace has only the GPU-side copies
  (`gpu_user_annotation`), the steps are those on the stream that has the most.
- Idle: device-wide, between the first kernel start and the last kernel end on each device, the time
  when no kernel, memcpy or memset runs on any stream. Gaps between kernels are what a launch-bound
  decode step looks like, and the busy union does not count two streams' overlap twice.
"""

from __future__ import annotations

import re
from array import array
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from harness.analysis.kineto import iter_event_batches
from harness.errors import InputError

_GPU_CATS = frozenset(("kernel", "gpu_memcpy", "gpu_memset"))
_WANTED = _GPU_CATS | {"cpu_op", "user_annotation", "gpu_user_annotation"}
_STEP_PREFIX = "execute_context"
_EPS = 0.0005
"""Half a nanosecond, in the trace's microseconds: Kineto's timestamps are whole nanoseconds."""
_RANK_IN_NAME = tuple(re.compile(p) for p in (r"_rank(\d+)", r"-TP-(\d+)", r"(?:^|[-_.])tp(\d+)"))
"""vLLM's global `_rank{g}` first, then SGLang's `-TP-{r}`, then vLLM's `tp{t}`."""


@dataclass
class FileSummary:
    """Totals of one trace file, in microseconds as the trace has them."""

    path: Path
    rank: int | None
    kernels: dict[str, list] = field(default_factory=dict)       # name -> [total_us, count]
    copy_names: set[str] = field(default_factory=set)            # names seen as gpu_memcpy/memset
    cpu_ops: dict[str, list] = field(default_factory=dict)       # name -> [self_us, count]
    busy_us: float = 0.0
    window_us: float = 0.0
    steps: int | None = None

    @property
    def kernel_us(self) -> float:
        return sum(total for total, _ in self.kernels.values())

    @property
    def idle_us(self) -> float:
        return self.window_us - self.busy_us


def summarize(path: Path) -> FileSummary:
    """Read one trace file once and return its totals."""
    return summarize_range(path).finish(path)


def summarize_range(path: Path, start: int = 0, stop: int | None = None) -> Totals:
    """The totals of the events in bytes [start, stop) of a plain trace file (see kineto.event_start_at);
    ranges read in different processes are joined in file order with `Totals.then`."""
    totals = Totals(roots={} if start else None)
    try:
        for batch in iter_event_batches(path, totals.meta, _WANTED, start=start, stop=stop):
            totals.add(batch)
    except (TypeError, AttributeError) as e:
        # An event whose ts, dur or name is missing or of the wrong type.
        raise InputError(f"malformed trace event ({e})", file=str(path)) from e
    return totals


@dataclass
class Totals:
    """Running totals of a file, or of a byte range of it."""

    roots: dict[tuple, tuple[array, array]] | None = None
    """Per thread, the ops that began with nothing open: in a range after the first, they may be
    children of an op still open at the end of the range before (kept only for such ranges)."""
    meta: dict = field(default_factory=dict)
    kernels: dict[str, list] = field(default_factory=dict)
    copy_names: set[str] = field(default_factory=set)
    cpu_ops: dict[str, list] = field(default_factory=dict)
    stacks: dict[tuple, list] = field(default_factory=dict)     # thread -> [(end, name)] of open ops
    intervals: dict[object, tuple[array, array]] = field(default_factory=dict)
    cpu_steps: int = 0
    gpu_steps: Counter = field(default_factory=Counter)

    def add(self, batch: list) -> None:
        kernels, copy_names, cpu_ops = self.kernels, self.copy_names, self.cpu_ops
        stacks, intervals, roots = self.stacks, self.intervals, self.roots
        for cat, name, pid, tid, ts, dur in batch:
            if cat == "cpu_op":
                stack = stacks.get((pid, tid))
                if stack is None:
                    stack = stacks[(pid, tid)] = []
                # ts + dur in floats can land a hair past the next op's ts (pytorch/pytorch#122425).
                while stack and stack[-1][0] <= ts + _EPS:
                    stack.pop()
                stat = cpu_ops.get(name)
                if stat is None:
                    stat = cpu_ops[name] = [0.0, 0]
                stat[0] += dur
                stat[1] += 1
                if stack:
                    cpu_ops[stack[-1][1]][0] -= dur
                elif roots is not None:
                    root = roots.get((pid, tid))
                    if root is None:
                        root = roots[(pid, tid)] = (array("d"), array("d"))
                    root[0].append(ts)
                    root[1].append(dur)
                stack.append((ts + dur, name))
            elif cat in _GPU_CATS:
                stat = kernels.get(name)
                if stat is None:
                    stat = kernels[name] = [0.0, 0]
                    if cat != "kernel":
                        copy_names.add(name)
                stat[0] += dur
                stat[1] += 1
                device = intervals.get(pid)
                if device is None:
                    device = intervals[pid] = (array("d"), array("d"))
                device[0].append(ts)
                device[1].append(ts + dur)
            elif name.startswith(_STEP_PREFIX):
                if cat == "user_annotation":
                    self.cpu_steps += 1
                else:
                    self.gpu_steps[(pid, tid)] += 1

    def then(self, later: Totals) -> Totals:
        """These totals followed by those of the next range of the same file."""
        for thread, (starts, durs) in (later.roots or {}).items():
            carried = self.stacks.get(thread, [])
            for ts, dur in zip(starts, durs):
                while carried and carried[-1][0] <= ts + _EPS:
                    carried.pop()
                if not carried:
                    break
                self.cpu_ops[carried[-1][1]][0] -= dur
        for thread, stack in later.stacks.items():
            self.stacks[thread] = self.stacks.get(thread, []) + stack
        _merge(self.kernels, later.kernels)
        _merge(self.cpu_ops, later.cpu_ops)
        self.copy_names |= later.copy_names
        for device, (starts, ends) in later.intervals.items():
            mine = self.intervals.setdefault(device, (array("d"), array("d")))
            mine[0].extend(starts)
            mine[1].extend(ends)
        self.cpu_steps += later.cpu_steps
        self.gpu_steps += later.gpu_steps
        self.meta.update(later.meta)
        return self

    def finish(self, path: Path) -> FileSummary:
        busy = window = 0.0
        for starts, ends in self.intervals.values():
            b, w = _busy_and_window(starts, ends)
            busy, window = busy + b, window + w
        steps = self.cpu_steps or max(self.gpu_steps.values(), default=0) or None
        return FileSummary(path=path, rank=_rank(path, self.meta), kernels=self.kernels,
                           copy_names=self.copy_names, cpu_ops=self.cpu_ops, busy_us=busy,
                           window_us=window, steps=steps)


def _merge(into: dict[str, list], totals: dict[str, list]) -> None:
    for name, (value, count) in totals.items():
        stat = into.get(name)
        if stat is None:
            into[name] = [value, count]
        else:
            stat[0] += value
            stat[1] += count


def _busy_and_window(starts: array, ends: array) -> tuple[float, float]:
    """Length of the union of one device's intervals, and of its span from first start to last end."""
    intervals = sorted(zip(starts, ends))
    first = run_start = intervals[0][0]
    run_end = intervals[0][1]
    busy = 0.0
    for start, end in intervals:
        if start > run_end:
            busy += run_end - run_start
            run_start, run_end = start, end
        elif end > run_end:
            run_end = end
    return busy + run_end - run_start, run_end - first


def _rank(path: Path, meta: dict) -> int | None:
    """The rank torch.distributed recorded, else the one in the engine's file name (-TP-3, _rank3, tp3)."""
    info = meta.get("distributedInfo")
    if isinstance(info, dict) and isinstance(info.get("rank"), int):
        return info["rank"]
    for pattern in _RANK_IN_NAME:
        if match := pattern.search(path.name):
            return int(match.group(1))
    return None
