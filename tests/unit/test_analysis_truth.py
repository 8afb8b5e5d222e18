"""`harness analyze` finds exactly the figures benchmarks/tracegen.py wrote, in every layout, plain and gzip,
whether one process reads a file or several share it by byte ranges."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest

import harness.analysis as analysis
from harness.analysis import analyze_path, kineto
from harness.analysis.categories import categorize
from harness.analysis.summary import summarize

_SPEC = importlib.util.spec_from_file_location(
    "tracegen", Path(__file__).resolve().parents[2] / "benchmarks" / "tracegen.py")
tracegen = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(tracegen)

EXACT_US = 1e-3  # 1e-6 ms


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict:
    """Every layout at two sizes, plain and gzip'd: (layout, mb, suffix) -> (path, truth)."""
    directory = tmp_path_factory.mktemp("traces")
    out = {}
    for layout in tracegen.LAYOUTS:
        for mb in (0.05, 0.6):
            for suffix in (".json", ".json.gz"):
                path = directory / f"{layout}-{mb}.trace{suffix}"
                truth = tracegen.generate(path, mb=mb, layout=layout, random_state=int(mb * 10))
                out[(layout, mb, suffix)] = path, truth
    return out


def assert_summary_is_the_truth(path: Path, truth: dict) -> None:
    s = summarize(path)
    assert {n: k[1] for n, k in s.kernels.items()} == {n: k["count"] for n, k in truth["kernels"].items()}
    for name, k in truth["kernels"].items():
        assert s.kernels[name][0] == pytest.approx(k["total_us"], abs=EXACT_US)
    assert {n: k[1] for n, k in s.cpu_ops.items()} == {n: k["count"] for n, k in truth["cpu_ops"].items()}
    for name, op in truth["cpu_ops"].items():
        assert s.cpu_ops[name][0] == pytest.approx(op["self_us"], abs=EXACT_US)
    assert s.idle_us == pytest.approx(truth["idle_us"], abs=EXACT_US)
    assert s.window_us == pytest.approx(truth["window_us"], abs=EXACT_US)
    assert {stage: count for stage, (count, _) in s.steps.items()} == {"decode": truth["steps"]}
    assert s.rank == truth["rank"]


@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
@pytest.mark.parametrize("mb", [0.05, 0.6])
@pytest.mark.parametrize("layout", tracegen.LAYOUTS)
def test_every_layout_gives_the_generators_truth(traces, layout, mb, suffix):
    assert_summary_is_the_truth(*traces[(layout, mb, suffix)])


@pytest.mark.parametrize("layout", tracegen.LAYOUTS)
def test_the_fast_path_reads_chunks_after_the_first_and_still_gives_the_truth(traces, monkeypatch, layout):
    """Small chunks make most of the file go through the learned layout rather than full decoding."""
    monkeypatch.setattr(kineto, "CHUNK_BYTES", 4096)
    assert_summary_is_the_truth(*traces[(layout, 0.6, ".json.gz")])


@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
@pytest.mark.parametrize("layout", tracegen.LAYOUTS)
def test_byte_ranges_read_by_worker_processes_join_into_the_truth(traces, monkeypatch, layout, suffix):
    """A gzip'd file's ranges are ranges of its JSON text, found by inflating up to them."""
    path, truth = traces[(layout, 0.6, suffix)]
    monkeypatch.setattr(analysis, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(analysis, "RANGE_MIN_BYTES", 0)
    monkeypatch.setattr(analysis.os, "cpu_count", lambda: 5)  # five ranges, however many cores
    ranges = analysis._ranges(path, 5)
    assert len(ranges) == 5
    split = analyze_path(path, top=100)
    monkeypatch.setattr(analysis, "PARALLEL_MIN_BYTES", 1 << 40)
    assert split == analyze_path(path, top=100)
    assert_analysis_is_the_truth(split, truth)


@pytest.mark.parametrize("chunk", [8192, 1 << 20])
@pytest.mark.parametrize("layout", tracegen.LAYOUTS)
def test_one_pass_over_a_gzip_file_finds_the_same_starts_as_one_search_each(traces, monkeypatch, layout, chunk):
    """Offsets far apart (skipped), close together (windows that overlap) and past the end; with small
    chunks, the windows of neighbouring offsets overlap more often than not."""
    monkeypatch.setattr(kineto, "CHUNK_BYTES", chunk)
    path, _ = traces[(layout, 0.6, ".json.gz")]
    size = kineto.json_size(path)
    assert size is not None
    offsets = sorted({0, 1, 100, 5000, 5001, 9000, size // 3, size // 3 + 10, size // 2, size - 10, size, size + 99}
                     | {size * k // 16 for k in range(1, 16)})
    each = [kineto.event_start_at(path, offset) for offset in offsets]
    assert kineto.event_starts_at(path, offsets) == each
    assert sum(start is not None for start in each) > 16 and each[-1] is None


@pytest.mark.parametrize("pieces", [2, 3, 16])
@pytest.mark.parametrize("skip_cost", [0.0, 0.22, 0.5])
def test_ranges_are_cut_so_that_their_readers_end_together(pieces, skip_cost):
    """A range's reader first skips (inflates) all before it: with that cost, later ranges are shorter
    and every reader's work is the same; without it, the ranges are equal."""
    size = 10**9
    points = [0, *analysis._split_points(size, pieces, skip_cost=skip_cost), size]
    assert points == sorted(points) and len(set(points)) == pieces + 1
    costs = [skip_cost * a + (b - a) for a, b in zip(points, points[1:], strict=False)]
    assert max(costs) - min(costs) <= 2


def assert_analysis_is_the_truth(result: dict, truth: dict) -> None:
    """analysis.json rounds to 0.1 us and shares to 4 places; within that, it is the truth."""
    kernel_us = truth["kernel_us"]
    assert result["total_gpu_ms"] == pytest.approx(kernel_us / 1000, abs=6e-5)
    assert result["gpu_idle_ms"] == pytest.approx(truth["idle_us"] / 1000, abs=6e-5)
    assert result["steps"] == truth["steps"]
    assert {k["name"]: (k["count"], k["category"]) for k in result["top"]} == {
        n: (k["count"], k["category"]) for n, k in truth["kernels"].items()}
    for k in result["top"]:
        assert k["total_ms"] == pytest.approx(truth["kernels"][k["name"]]["total_us"] / 1000, abs=6e-5)
    for category, share in result["categories"].items():
        assert share == pytest.approx(truth["categories_us"].get(category, 0.0) / kernel_us, abs=6e-5)
    assert {op["name"]: op["count"] for op in result["cpu_top"]} == {
        n: op["count"] for n, op in truth["cpu_ops"].items()}


def test_the_generators_categories_are_the_analyzers():
    for name, category, _ in tracegen.LAYER + (tracegen.ALLREDUCE, tracegen.MEMCPY):
        assert categorize(name) == category


def test_the_generator_writes_the_size_asked_for_and_valid_json(tmp_path):
    path = tmp_path / "t.trace.json"
    truth = tracegen.generate(path, mb=0.5, layout="compact")
    assert truth["json_bytes"] == path.stat().st_size >= 0.5 * (1 << 20)
    assert len(json.loads(path.read_text())["traceEvents"]) > 1000


def test_an_event_in_another_key_order_midway_is_still_counted(tmp_path, monkeypatch):
    """The learned layout cannot vouch for that chunk, which is then decoded in full."""
    monkeypatch.setattr(kineto, "CHUNK_BYTES", 4096)
    path = tmp_path / "t.trace.json"
    truth = tracegen.generate(path, mb=0.3, layout="lines")
    odd = {"name": "odd_gemm_kernel", "dur": 1000.0, "ts": 1.0, "pid": 99, "tid": 1, "cat": "kernel", "ph": "X"}
    text = path.read_text()
    middle = text.index('{"ph": "X"', len(text) // 2)
    path.write_text(text[:middle] + json.dumps(odd) + ",\n" + text[middle:])
    s = summarize(path)
    assert s.kernels["odd_gemm_kernel"] == [1000.0, 1]
    assert sum(n for _, n in s.kernels.values()) == 1 + sum(k["count"] for k in truth["kernels"].values())


def ranges_read_here(monkeypatch, *, parallel_from: int, cpus: int) -> list:
    """Ranges shared from `parallel_from` bytes of text on `cpus` cores; the list of those this process read."""
    monkeypatch.setattr(analysis, "PARALLEL_MIN_BYTES", parallel_from)
    monkeypatch.setattr(analysis, "RANGE_MIN_BYTES", 0)
    monkeypatch.setattr(analysis.os, "cpu_count", lambda: cpus)
    read_here: list = []
    real = analysis.summarize_range
    monkeypatch.setattr(analysis, "summarize_range", lambda *r: read_here.append(r) or real(*r))
    return read_here


def test_the_worker_processes_read_their_ranges_themselves(traces, monkeypatch):
    """This process reads its own share alone: the other ranges' totals come from worker processes."""
    path, truth = traces[("torch", 0.6, ".json")]
    read_here = ranges_read_here(monkeypatch, parallel_from=0, cpus=3)
    assert_analysis_is_the_truth(analyze_path(path, top=100), truth)
    assert len(analysis._ranges(path, 3)) == 3 and [start for _, start, _ in read_here] == [0]


def test_a_worker_that_cannot_run_costs_time_not_the_answer(traces, monkeypatch):
    path, truth = traces[("compact", 0.6, ".json")]
    monkeypatch.setattr(analysis, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(analysis, "RANGE_MIN_BYTES", 0)
    monkeypatch.setattr(analysis.sys, "executable", "/bin/false")  # starts, writes nothing, exits 1
    assert_analysis_is_the_truth(analyze_path(path, top=100), truth)
    monkeypatch.setattr(analysis.sys, "executable", "/nonexistent/python")  # cannot start at all
    assert_analysis_is_the_truth(analyze_path(path, top=100), truth)


def test_a_broken_event_in_a_workers_range_is_an_input_error_naming_the_file(traces, tmp_path, monkeypatch):
    source, _ = traces[("torch", 0.6, ".json")]
    text = source.read_bytes()
    at = text.index(b'"ts":', len(text) * 3 // 4)
    broken = tmp_path / "broken.trace.json"
    broken.write_bytes(text[:at] + b'"ts": @' + text[at + 6:])
    monkeypatch.setattr(analysis, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(analysis, "RANGE_MIN_BYTES", 0)
    monkeypatch.setattr(analysis.os, "cpu_count", lambda: 2)
    with pytest.raises(analysis.InputError, match="broken.trace.json"):
        analyze_path(broken)


def test_kernels_out_of_start_order_give_the_same_figures(tmp_path):
    """Kineto mostly writes a device's kernels in start order; when it does not, they are put in order."""
    def trace(events):
        return {"traceEvents": [{"ph": "X", "cat": "kernel", "name": n, "pid": 0, "tid": 7, "ts": ts, "dur": d}
                                for n, ts, d in events]}
    events = [("a", 10.0, 5.0), ("b", 12.0, 1.0), ("c", 30.0, 2.5), ("a", 31.0, 4.0), ("b", 50.0, 1.0)]
    (tmp_path / "in_order.trace.json").write_text(json.dumps(trace(events)))
    (tmp_path / "shuffled.trace.json").write_text(json.dumps(trace([events[i] for i in (3, 0, 4, 2, 1)])))
    ordered, shuffled = summarize(tmp_path / "in_order.trace.json"), summarize(tmp_path / "shuffled.trace.json")
    assert (shuffled.busy_us, shuffled.window_us) == (ordered.busy_us, ordered.window_us) == (5.0 + 5.0 + 1.0, 41.0)
    assert shuffled.kernels == ordered.kernels


def test_a_gzip_stream_whose_trailer_cannot_give_its_length_is_read_whole(tmp_path):
    text = b'{"traceEvents": [' + b", ".join([b'{"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 1, '
                                             b'"ts": 1.0, "dur": 1.0}'] * 1000) + b"]}"
    path = tmp_path / "odd.trace.json.gz"
    path.write_bytes(gzip.compress(text))
    assert kineto.json_size(path) == len(text)
    trailer = path.read_bytes()
    path.write_bytes(trailer[:-4] + (1).to_bytes(4, "little"))   # a length shorter than the file: wrapped
    assert kineto.json_size(path) is None
    assert analysis._ranges(path, 4) == [(0, None)]


def test_a_gzip_file_is_shared_by_the_size_of_its_text_not_of_the_file(traces, monkeypatch):
    path, truth = traces[("torch", 0.6, ".json.gz")]
    text = kineto.json_size(path)
    assert path.stat().st_size < text
    read_here = ranges_read_here(monkeypatch, parallel_from=(path.stat().st_size + text) // 2, cpus=2)
    assert_analysis_is_the_truth(analyze_path(path, top=100), truth)
    assert [start for _, start, _ in read_here] == [0]   # the rest of the text went to a worker
