"""One pass over one rank's trace file, keeping only running totals.

Per event the work is a category test and a dictionary update, so the pass runs at the speed of the
scanner. A large plain file can be read as byte ranges in several processes (`summarize_range`), whose
totals join in file order (`Totals.then`). What it keeps:

- GPU kernels (`kernel`, plus `gpu_memcpy` / `gpu_memset`, which always count as copy): total
  duration and launch count per name, and each one's start, duration and name per device, for the
  idle time and the stages. (Durations as the trace has them, not ends: at the 5e12 us of a real
  trace's clock, a float's end - start is off by up to a nanosecond, which hundreds of launches add up.)
- CPU ops (`cpu_op`): self time per name, with one stack per thread. Each op's whole duration is
  credited to its name and subtracted from its enclosing op's name, so nothing per op outlives its
  end. This relies on each thread's ops reaching the trace in start order, parents first, which
  PyTorch guarantees: its profiler records an op when it is entered and writes each thread's
  records in that order (torch/csrc/profiler/collection.cpp). Across a range boundary, the ops a
  range began with nothing open are handed to the ops still open at the end of the range before.
- Steps: engines run each forward step inside a `record_function` range whose name says its stage;
  the rules are the engines' own (`harness.engines.step_span_rules()`), so this module names no
  engine. Kineto writes such a range as a CPU `user_annotation` on the calling thread and, when
  kernels ran inside it, a `gpu_user_annotation` on the device, from its first kernel's start to its
  last kernel's end. The CPU spans count each stage's steps and their wall time (a trace with only
  the GPU copies counts those of the stream that has the most); a kernel belongs to the stage of the
  GPU span it starts in. Kineto writes the GPU spans after every kernel, so the kernels are kept
  and split into stages in `finish`. Idle steps (stage "") are not counted.
- Idle: device-wide, between the first kernel start and the last kernel end on each device, the time
  when no kernel, memcpy or memset runs on any stream. Gaps between kernels are what a launch-bound
  decode step looks like, and the busy union does not count two streams' overlap twice.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from harness.analysis.kineto import iter_event_batches
from harness.engines import StepSpans, step_span_rules
from harness.errors import InputError

_GPU_CATS = frozenset(("kernel", "gpu_memcpy", "gpu_memset"))
_WANTED = _GPU_CATS | {"cpu_op", "user_annotation", "gpu_user_annotation"}
_EPS = 0.0005
"""Half a nanosecond, in the trace's microseconds: Kineto's timestamps are whole nanoseconds."""


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
    steps: dict[str, list] = field(default_factory=dict)         # stage -> [steps, wall_us]
    stage_kernels: dict[str, dict[str, list]] = field(default_factory=dict)  # stage -> kernels
    gpu_spans: int = 0
    """GPU step spans seen: without any, kernel time cannot be split into stages."""

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
    except (TypeError, AttributeError, OverflowError) as e:
        # An event of the wrong shape that the reader let through (a pid that is a list).
        raise InputError(f"malformed trace event ({e})", file=str(path)) from e
    return totals


class _StepNames(dict):
    """An annotation's name -> its stage by the first engine's rule that knows it (None: no step span).
    Names repeat, so each is classified once."""

    def __init__(self, rules: list[StepSpans]):
        super().__init__()
        self.rules = rules

    def __missing__(self, name: str) -> str | None:
        stage = next((s for rule in self.rules if (s := rule.stage(name)) is not None), None)
        self[name] = stage
        return stage


@dataclass
class Totals:
    """Running totals of a file, or of a byte range of it."""

    roots: dict[tuple, tuple[array, array]] | None = None
    """Per thread, the ops that began with nothing open: in a range after the first, they may be
    children of an op still open at the end of the range before (kept only for such ranges)."""
    meta: dict = field(default_factory=dict)
    kernels: dict[str, list] = field(default_factory=dict)      # name -> [total_us, count, name id]
    copy_names: set[str] = field(default_factory=set)
    cpu_ops: dict[str, list] = field(default_factory=dict)
    stacks: dict[tuple, list] = field(default_factory=dict)     # thread -> [(end, name)] of open ops
    intervals: dict[object, tuple[array, array, array]] = field(default_factory=dict)
    """Per device, each kernel's start, duration and name id (its place in `kernels`)."""
    step_names: _StepNames = field(default_factory=lambda: _StepNames(step_span_rules()))
    cpu_steps: dict[str, list] = field(default_factory=dict)    # stage -> [steps, wall_us]
    gpu_spans: dict[object, list] = field(default_factory=dict)  # device -> [(start, end, stage, stream)]

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
                    stat = kernels[name] = [0.0, 0, len(kernels)]
                    if cat != "kernel":
                        copy_names.add(name)
                stat[0] += dur
                stat[1] += 1
                device = intervals.get(pid)
                if device is None:
                    device = intervals[pid] = (array("d"), array("d"), array("i"))
                device[0].append(ts)
                device[1].append(dur)
                device[2].append(stat[2])
            else:
                self._span(cat, self.step_names[name], pid, tid, ts, dur)

    def _span(self, cat: str, stage: str | None, pid: object, tid: object, ts: float, dur: float) -> None:
        """A step span of a counted stage (not an idle step, not some other annotation)."""
        if not stage:
            return
        if cat == "user_annotation":
            stat = self.cpu_steps.setdefault(stage, [0, 0.0])
            stat[0] += 1
            stat[1] += dur
        else:
            self.gpu_spans.setdefault(pid, []).append((ts, ts + dur, stage, tid))

    def then(self, later: Totals) -> Totals:
        """These totals followed by those of the next range of the same file."""
        for thread, (starts, durs) in (later.roots or {}).items():
            carried = self.stacks.get(thread, [])
            for ts, dur in zip(starts, durs, strict=True):
                while carried and carried[-1][0] <= ts + _EPS:
                    carried.pop()
                if not carried:
                    break
                self.cpu_ops[carried[-1][1]][0] -= dur
        for thread, stack in later.stacks.items():
            self.stacks[thread] = self.stacks.get(thread, []) + stack
        ids = _merge_kernels(self.kernels, later.kernels)
        _merge(self.cpu_ops, later.cpu_ops)
        self.copy_names |= later.copy_names
        for device, (starts, durs, names) in later.intervals.items():
            mine = self.intervals.setdefault(device, (array("d"), array("d"), array("i")))
            mine[0].extend(starts)
            mine[1].extend(durs)
            mine[2].extend(map(ids.__getitem__, names))
        _merge(self.cpu_steps, later.cpu_steps)
        for device, spans in later.gpu_spans.items():
            self.gpu_spans.setdefault(device, []).extend(spans)
        self.meta.update(later.meta)
        return self

    def finish(self, path: Path) -> FileSummary:
        names = list(self.kernels)
        busy = window = 0.0
        by_stage: dict[str, tuple] = {}   # stage -> (total_us per name id, count per name id)
        for device, (starts, durs, ids) in self.intervals.items():
            starts, durs, ids = _by_start(starts, durs, ids)
            b, w = _busy_and_window(starts, durs)
            busy, window = busy + b, window + w
            _split(starts, durs, ids, _disjoint(self.gpu_spans.get(device, [])), by_stage, len(names))
        return FileSummary(path=path, rank=_rank(self.meta),
                           kernels={name: stat[:2] for name, stat in self.kernels.items()},
                           copy_names=self.copy_names, cpu_ops=self.cpu_ops, busy_us=busy,
                           window_us=window, steps=self.cpu_steps or self._gpu_steps(),
                           stage_kernels={stage: _named(names, *per_id) for stage, per_id in by_stage.items()},
                           gpu_spans=sum(map(len, self.gpu_spans.values())))

    def _gpu_steps(self) -> dict[str, list]:
        """Each stage's steps from the GPU spans of the stream that has the most, when the trace
        has no CPU ones (a capture of GPU activity alone)."""
        streams = Counter((device, span[3]) for device, spans in self.gpu_spans.items() for span in spans)
        if not streams:
            return {}
        device, stream = streams.most_common(1)[0][0]
        steps: dict[str, list] = {}
        for start, end, stage, tid in self.gpu_spans[device]:
            if tid == stream:
                stat = steps.setdefault(stage, [0, 0.0])
                stat[0] += 1
                stat[1] += end - start
        return steps


def _merge(into: dict[str, list], totals: dict[str, list]) -> None:
    for name, (value, count) in totals.items():
        stat = into.get(name)
        if stat is None:
            into[name] = [value, count]
        else:
            stat[0] += value
            stat[1] += count


def _merge_kernels(into: dict[str, list], totals: dict[str, list]) -> list[int]:
    """Add another range's kernels; the list maps its name ids to these totals' ids."""
    ids = []
    for name, (total, count, _) in totals.items():
        stat = into.get(name)
        if stat is None:
            stat = into[name] = [total, count, len(into)]
        else:
            stat[0] += total
            stat[1] += count
        ids.append(stat[2])
    return ids


def _by_start(starts: array, durs: array, ids: array) -> tuple[array, array, array]:
    """One device's kernels in start order, as three arrays: a trace holds hundreds of thousands of
    kernels, which arrays hold in 20 bytes each where tuples of Python numbers take over a hundred.
    Kernels that start together keep their file order (neither the busy union nor the stages, which
    take kernels by their start, depend on it). Already in order, they cost nothing more."""
    if all(map(float.__le__, starts[:-1], starts[1:])):
        return starts, durs, ids
    order = sorted(range(len(starts)), key=starts.__getitem__)
    return (array("d", map(starts.__getitem__, order)), array("d", map(durs.__getitem__, order)),
            array("i", map(ids.__getitem__, order)))


def _busy_and_window(starts: array, durs: array) -> tuple[float, float]:
    """Length of the union of one device's kernels (in start order), and of its span from first start
    to last end."""
    first = run_start = starts[0]
    run_end = first + durs[0]
    busy = 0.0
    for start, dur in zip(starts, durs, strict=True):
        end = start + dur
        if start > run_end:
            busy += run_end - run_start
            run_start, run_end = start, end
        elif end > run_end:
            run_end = end
    return busy + run_end - run_start, run_end - first


def _disjoint(spans: list[tuple]) -> list[tuple]:
    """One device's GPU step spans as disjoint (start, end, stage), in time order: the copies of one
    step on several streams overlap, and one kernel must land in one step."""
    out: list[list] = []
    for start, end, stage, _ in sorted(spans):
        if out and start <= out[-1][1] + _EPS:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end, stage])
    return [tuple(span) for span in out]


def _split(starts: array, durs: array, ids: array, spans: list[tuple], by_stage: dict[str, tuple],
           names: int) -> None:
    """Add each kernel (in start order) that starts inside a span to that span's stage: the kernels
    of a span are a slice of the sorted arrays, found by bisection."""
    for start, end, stage in spans:
        lo = bisect_left(starts, start - _EPS)
        hi = bisect_right(starts, end + _EPS, lo=lo)
        if stage not in by_stage:
            by_stage[stage] = [0.0] * names, [0] * names
        totals, counts = by_stage[stage]
        for dur, name in zip(durs[lo:hi], ids[lo:hi], strict=True):
            totals[name] += dur
            counts[name] += 1


def _named(names: list[str], totals: list[float], counts: list[int]) -> dict[str, list]:
    """Totals by name id as name -> [total_us, count], for the names that ran."""
    return {name: [total, count] for name, total, count in zip(names, totals, counts, strict=True) if count}


def _rank(meta: dict) -> int | None:
    """The rank torch.distributed recorded in the trace, if it did."""
    info = meta.get("distributedInfo")
    if isinstance(info, dict) and isinstance(info.get("rank"), int):
        return info["rank"]
    return None
