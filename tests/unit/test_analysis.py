"""`harness analyze`: exact figures from small Kineto traces written the way torch writes them."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from rich.console import Console

import harness.analysis as analysis
from harness.analysis import analyze_path, kineto
from harness.analysis.categories import NAMES
from harness.errors import InputError
from harness.report.analysis_view import render_analysis, short_name
from harness.results import RunManifest, write_model
from harness.results.models import ConfigRecord, ProfileRecord

GEMM = "nvjet_tst_128x64_64x8_1x1_v_bz_TNT"
CAST = ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda("
        "at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#8}::operator()() const::"
        "{lambda(c10::BFloat16)#1}, {lambda()#2}, at::detail::Array<char*, 2> >(int, at::detail::Array<char*, 2>)")
NCCL = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
NORM = "void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>(__nv_bfloat16*, unsigned int)"
MOE = 'fused_moe_kernel "bf16" µ'  # a quote and a non-ASCII letter: the name must come back unescaped
MEMCPY = "Memcpy DtoD (Device -> Device)"
STEP = "execute_context_0(0)_generation_8(8)"
"""A decode step of 8 requests, as vLLM 0.26 and 0.32 name the range around each engine step."""


def x(cat: str, name: str, ts: float, dur: float, pid: object = 0, tid: object = 7, **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur,
            "args": args}


def noise(ts: float) -> list[dict]:
    """Events the analysis must step over: a runtime call, a flow pair, metadata, an instant."""
    return [x("cuda_runtime", "cudaLaunchKernel", ts, 3, pid=4242, tid=4242, correlation=1),
            {"ph": "s", "id": 1, "pid": 4242, "tid": 4242, "ts": ts, "cat": "ac2g", "name": "ac2g"},
            {"ph": "f", "id": 1, "pid": 0, "tid": 7, "ts": ts, "cat": "ac2g", "name": "ac2g", "bp": "e"},
            {"name": "process_name", "ph": "M", "ts": ts, "pid": 0, "tid": 0, "args": {"name": "GPU 0"}},
            {"name": "Record Window End", "ph": "i", "s": "g", "pid": "", "tid": "", "ts": ts}]


def one_step_events() -> list[dict]:
    """1000 us of GPU work in 1050 us on device 0, with two 50 us gaps, and CPU ops on two threads.

    busy: [0,350] gemm+cast, gap, [400,750] nccl, gemm, norm (stream 9, overlapping), memcpy (stream 8),
    gap, [800,1050] gemm, moe.
    """
    k = "kernel"
    gpu = [x(k, GEMM, 0, 100, grid=[132, 1, 1]), x(k, CAST, 100, 250), x(k, NCCL, 400, 100),
           x(k, GEMM, 500, 100), x(k, NORM, 550, 140, tid=9), x("gpu_memcpy", MEMCPY, 690, 60, tid=8),
           x(k, GEMM, 800, 100), x(k, MOE, 900, 150)]
    cpu = [x("cpu_op", "aten::linear", 0, 100, pid=4242, tid=1),        # self 100 - 5 - 50 = 45
           x("cpu_op", "aten::t", 5, 5, pid=4242, tid=1),
           x("cpu_op", "aten::mm", 10, 50, pid=4242, tid=1),
           x("cpu_op", "aten::zeros", 100, 4, pid=4242, tid=1),         # starts as linear ends: a sibling
           x("cpu_op", "aten::copy_", 120, 200, pid=4242, tid=1),       # self 200 - 10
           x("cpu_op", "aten::empty", 130, 10, pid=4242, tid=1),        # self 10 - 2
           x("cpu_op", "aten::resize_", 132, 2, pid=4242, tid=1),
           x("cpu_op", "aten::copy_", 0, 50, pid=4242, tid=2)]          # another thread's stack
    return cpu + gpu + noise(1100)


def write_trace(path: Path, events: list[dict], *, layout: str = "kineto", before: dict | None = None,
                after: dict | None = None) -> Path:
    """A trace file as torch's Kineto writes it (layout "kineto"), or as json.dump does ("compact")."""
    before = {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA H200"}], **(before or {})}
    after = {"traceName": str(path), "displayTimeUnit": "ms", "baseTimeNanoseconds": 1700000000000000000,
             **(after or {})}
    if layout == "compact":
        text = json.dumps({**before, "traceEvents": events, **after})
    else:
        head = "".join(f'  "{k}": {json.dumps(v)},\n' for k, v in before.items())
        tail = ",\n".join(f'  "{k}": {json.dumps(v)}' for k, v in after.items())
        body = ",\n".join(_kineto_event(ev) for ev in events)
        text = "{\n" + head + '  "traceEvents": [\n' + body + "\n],\n" + tail + "\n}"
    path.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.write(text)
    return path


def _kineto_event(ev: dict) -> str:
    """One event in the layout of libkineto's output_json.cpp."""
    if ev.get("ph") != "X":
        return "  " + json.dumps(ev)
    text = (f'  {{\n    "ph": "X", "cat": "{ev["cat"]}", "name": {json.dumps(ev["name"])}, '
            f'"pid": {json.dumps(ev["pid"])}, "tid": {json.dumps(ev["tid"])},\n'
            f'    "ts": {ev["ts"]:.3f}, "dur": {ev["dur"]:.3f}')
    if ev.get("args"):
        text += ',\n    "args": {\n      ' + json.dumps(ev["args"])[1:-1] + "\n    }"
    return text + "\n  }"


def rank_events(total_us: float) -> list[dict]:
    return [x("kernel", GEMM, 0, total_us / 2), x("kernel", NCCL, total_us / 2, total_us / 2)]


def without_files(result: dict) -> dict:
    """The figures alone: what does not depend on the file's name or size."""
    return {k: v for k, v in result.items() if k not in ("files", "ranks")} | {
        "ranks": [{k: v for k, v in r.items() if k != "file"} for r in result["ranks"]]}


# ---------------------------------------------------------------- one file


@pytest.fixture(scope="module")
def one_step(tmp_path_factory) -> dict:
    path = write_trace(tmp_path_factory.mktemp("t") / "trace.json", one_step_events())
    return analyze_path(path)


def test_kernels_are_ranked_by_total_time_with_their_share_category_and_count(one_step):
    assert one_step["schema"] == "harness.analysis/1"
    assert one_step["total_gpu_ms"] == 1.0
    assert [(k["name"], k["category"], k["total_ms"], k["share"], k["count"]) for k in one_step["top"]] == [
        (GEMM, "gemm", 0.3, 0.3, 3),
        (CAST, "copy", 0.25, 0.25, 1),
        (MOE, "moe", 0.15, 0.15, 1),
        (NORM, "norm", 0.14, 0.14, 1),
        (NCCL, "communication", 0.1, 0.1, 1),
        (MEMCPY, "copy", 0.06, 0.06, 1),
    ]


def test_categories_share_all_kernel_time_and_list_every_category(one_step):
    assert one_step["categories"] == {"communication": 0.1, "norm": 0.14, "moe": 0.15, "attention": 0.0,
                                      "gemm": 0.3, "copy": 0.31, "elementwise": 0.0, "other": 0.0}


def test_gpu_idle_is_the_time_no_stream_runs_between_the_first_and_last_kernel(one_step):
    assert one_step["gpu_idle_ms"] == 0.1
    assert one_step["gpu_idle_share"] == round(100 / 1050, 4)


def test_cpu_ops_are_ranked_by_self_time_per_thread(one_step):
    assert [(op["name"], op["self_ms"], op["count"]) for op in one_step["cpu_top"]] == [
        ("aten::copy_", 0.24, 2), ("aten::mm", 0.05, 1), ("aten::linear", 0.045, 1),
        ("aten::empty", 0.008, 1), ("aten::t", 0.005, 1), ("aten::zeros", 0.004, 1),
        ("aten::resize_", 0.002, 1)]


def test_top_limits_both_rankings(tmp_path):
    result = analyze_path(write_trace(tmp_path / "t.json", one_step_events()), top=2)
    assert [k["name"] for k in result["top"]] == [GEMM, CAST]
    assert [op["name"] for op in result["cpu_top"]] == ["aten::copy_", "aten::mm"]


def test_without_step_spans_or_a_requested_count_there_is_no_per_step_figure(one_step):
    assert (one_step["steps"], one_step["steps_source"], one_step["per_step_ms"]) == (None, None, None)
    assert (one_step["stages"], one_step["category_ms"], one_step["outside_steps_ms"]) == (None, None, None)


def test_a_single_file_is_one_rank_without_a_straggler(one_step):
    cpu_ms = round(sum(op["self_ms"] for op in one_step["cpu_top"]), 4)   # every op of the trace is there
    assert one_step["ranks"] == [{"rank": 0, "file": "trace.json", "total_gpu_ms": 1.0, "cpu_ms": cpu_ms,
                                  "idle_ms": 0.1,
                                  "top3": [{"name": GEMM, "total_ms": 0.3, "share": 0.3},
                                           {"name": CAST, "total_ms": 0.25, "share": 0.25},
                                           {"name": MOE, "total_ms": 0.15, "share": 0.15}]}]
    assert one_step["rank_spread"] == {"basis": "gpu_kernels", "min_ms": 1.0, "max_ms": 1.0, "spread_pct": 0.0,
                                       "straggler": None}


@pytest.mark.parametrize("name", ["trace.json.gz", "trace.json"])
@pytest.mark.parametrize("layout", ["kineto", "compact"])
def test_gzip_and_json_dump_layouts_give_the_same_figures(tmp_path, one_step, name, layout):
    path = write_trace(tmp_path / name, one_step_events(), layout=layout)
    assert without_files(analyze_path(path)) == without_files(one_step)


@pytest.mark.parametrize("layout", ["kineto", "compact"])
def test_reading_in_tiny_chunks_gives_the_same_figures(tmp_path, monkeypatch, one_step, layout):
    """Chunk edges then fall inside names, numbers and the top-level keys."""
    monkeypatch.setattr(kineto, "CHUNK_BYTES", 37)
    path = write_trace(tmp_path / "t.json", one_step_events(), layout=layout)
    assert without_files(analyze_path(path)) == without_files(one_step)


def test_an_event_outside_kinetos_usual_layout_is_still_counted(tmp_path):
    events = one_step_events()
    odd = json.dumps(x("kernel", GEMM, 2000, 1000))  # one line, not Kineto's indented lines
    text = write_trace(tmp_path / "t.json", events).read_text().replace(
        '"traceEvents": [\n', '"traceEvents": [\n  ' + odd + ",\n")
    (tmp_path / "t.json").write_text(text)
    result = analyze_path(tmp_path / "t.json")
    assert result["total_gpu_ms"] == 2.0
    assert result["top"][0] == {"name": GEMM, "category": "gemm", "total_ms": 1.3, "share": 0.65, "count": 4}


def test_top_level_keys_are_read_before_or_after_the_events(tmp_path):
    before = write_trace(tmp_path / "a.json", rank_events(100), before={"distributedInfo": {"rank": 5}})
    after = write_trace(tmp_path / "b.json", rank_events(100), after={"distributedInfo": {"rank": 6}})
    assert analyze_path(before)["ranks"][0]["rank"] == 5
    assert analyze_path(after)["ranks"][0]["rank"] == 6


def test_a_trace_without_kernels_gives_an_empty_but_valid_analysis(tmp_path):
    path = write_trace(tmp_path / "cpu_only.json", [x("cpu_op", "aten::mm", 0, 10)] + noise(20))
    result = analyze_path(path, requested_steps=4)
    assert (result["total_gpu_ms"], result["per_step_ms"], result["top"]) == (0.0, 0.0, [])
    assert (result["steps"], result["steps_source"], result["stages"]) == (4, "request", None)
    assert result["category_ms"] == dict.fromkeys(NAMES, 0.0)
    assert (result["gpu_idle_ms"], result["gpu_idle_share"]) == (0.0, 0.0)
    assert set(result["categories"].values()) == {0.0}
    assert result["cpu_top"] == [{"name": "aten::mm", "self_ms": 0.01, "count": 1}]
    assert result["rank_spread"]["straggler"] is None
    json.dumps(result)


# ---------------------------------------------------------------- steps


def decode_steps(count: int, *, streams=(7, 9)) -> list[dict]:
    """`count` steps 300 us apart, each a CPU span of 250 us and its GPU copies on `streams`: together
    they cover every kernel of one_step_events()."""
    return ([x("user_annotation", STEP, i * 300, 250, pid=4242, tid=1) for i in range(count)]
            + [x("gpu_user_annotation", STEP, i * 300, 250, tid=t) for i in range(count) for t in streams])


def test_the_engines_step_spans_count_the_steps_and_hold_their_kernels(tmp_path):
    result = analyze_path(write_trace(tmp_path / "t.json", one_step_events() + decode_steps(4)))
    assert (result["steps"], result["steps_source"], result["per_step_ms"]) == (4, "trace", 0.25)
    assert list(result["stages"]) == ["decode"]
    decode = result["stages"]["decode"]
    assert (decode["steps"], decode["step_ms"], decode["total_gpu_ms"]) == (4, 0.25, 1.0)
    assert decode["top"] == result["top"] and decode["categories"] == result["categories"]
    assert result["category_ms"] == decode["category_ms"] == {
        cat: round(share / 4, 4) for cat, share in result["categories"].items()}
    assert result["outside_steps_ms"] == 0.0


def test_gpu_side_step_spans_count_when_the_cpu_ones_are_missing(tmp_path):
    """A capture of GPU activity alone: the steps are those of the stream with the most spans."""
    gpu_copies = [x("gpu_user_annotation", STEP, i * 300, 250, tid=7) for i in range(5)]
    other_stream = [x("gpu_user_annotation", STEP, 0, 250, tid=9)]
    result = analyze_path(write_trace(tmp_path / "t.json", one_step_events() + gpu_copies + other_stream))
    assert (result["steps"], result["steps_source"], result["per_step_ms"]) == (5, "trace", 0.2)


def test_the_traces_own_steps_win_over_the_count_asked_of_the_profiler(tmp_path):
    path = write_trace(tmp_path / "t.json", one_step_events() + decode_steps(4))
    result = analyze_path(path, requested_steps=10)
    assert (result["steps"], result["steps_source"], result["per_step_ms"]) == (4, "trace", 0.25)


def test_cpu_step_spans_without_gpu_copies_give_steps_but_no_kernel_time_a_step(tmp_path):
    """Nothing says which kernels ran in which step, so none is claimed; the wall time is known."""
    steps = [x("user_annotation", STEP, i * 300, 250, pid=4242, tid=1) for i in range(4)]
    result = analyze_path(write_trace(tmp_path / "t.json", one_step_events() + steps))
    assert (result["steps"], result["steps_source"], result["per_step_ms"]) == (4, "trace", None)
    assert result["stages"]["decode"]["step_ms"] == 0.25
    assert (result["category_ms"], result["outside_steps_ms"]) == (None, None)


# ---------------------------------------------------------------- directories and ranks


def four_ranks(directory: Path, totals_us=(1000, 1000, 1020, 1200)) -> Path:
    """SGLang 0.5.23's per-rank naming (`{profile_id}-TP-{t}`); rank 3 is 18% above the median."""
    for rank, total in enumerate(totals_us):
        write_trace(directory / f"1700000000.1-TP-{rank}.trace.json.gz", rank_events(total))
    return directory


def test_a_profile_directory_is_read_one_file_per_rank_with_the_straggler_named(tmp_path):
    result = analyze_path(four_ranks(tmp_path / "profile"), requested_steps=10)
    assert [(f["name"], f["rank"]) for f in result["files"]] == [
        (f"1700000000.1-TP-{r}.trace.json.gz", r) for r in range(4)]
    assert all(f["bytes"] > 0 for f in result["files"])
    assert [(r["rank"], r["total_gpu_ms"]) for r in result["ranks"]] == [(0, 1.0), (1, 1.0), (2, 1.02), (3, 1.2)]
    assert result["total_gpu_ms"] == 1.055
    assert result["per_step_ms"] == 0.1055
    assert result["top"][0] == {"name": GEMM, "category": "gemm", "total_ms": 0.5275, "share": 0.5, "count": 1}
    assert result["rank_spread"] == {"basis": "gpu_kernels", "min_ms": 1.0, "max_ms": 1.2, "spread_pct": 19.8,
                                     "straggler": 3}


def test_ranks_within_five_percent_have_no_straggler(tmp_path):
    result = analyze_path(four_ranks(tmp_path, (1000, 1000, 1020, 1040)))
    assert result["rank_spread"]["straggler"] is None


def test_merged_and_prefill_files_beside_the_per_rank_decode_files_are_left_out(tmp_path):
    write_trace(tmp_path / "merged-1700000000.1.trace.json.gz", rank_events(9000))
    for rank in range(2):
        write_trace(tmp_path / f"1700000000.1-TP-{rank}-EXTEND.trace.json.gz", rank_events(5000))
        write_trace(tmp_path / f"1700000000.1-TP-{rank}-DECODE.trace.json.gz", rank_events(1000))
    result = analyze_path(tmp_path)
    assert [f["name"] for f in result["files"]] == [f"1700000000.1-TP-{r}-DECODE.trace.json.gz" for r in range(2)]
    assert result["total_gpu_ms"] == 1.0


def test_vllm_file_names_give_the_global_rank_and_the_front_end_is_no_rank(tmp_path):
    """vLLM 0.26: `rank{g}.{ns}` per worker, `dp.._ep.._rank{g}` with an expert-parallel group, and the
    API front end's `{host}_{pid}.async_llm.{ns}` with no rank (CPU only: it would halve every mean)."""
    write_trace(tmp_path / "dp0_pp0_tp1_dcp0_ep1_rank9.1700000000.pt.trace.json.gz", rank_events(100))
    write_trace(tmp_path / "rank2.1700000000.pt.trace.json.gz", rank_events(300))
    write_trace(tmp_path / "vm_15880.async_llm.1700000001.pt.trace.json.gz", [])
    result = analyze_path(tmp_path)
    assert [(r["rank"], r["total_gpu_ms"]) for r in result["ranks"]] == [(2, 0.3), (9, 0.1)]
    assert result["total_gpu_ms"] == 0.2


def test_files_no_engine_names_are_each_a_rank_in_name_order(tmp_path):
    """The harness's own torch wrapper (profile.mode torch) writes `torch-{pid}.pt.trace.json.gz`."""
    write_trace(tmp_path / "torch-4242.pt.trace.json.gz", rank_events(100))
    write_trace(tmp_path / "torch-977.pt.trace.json.gz", rank_events(300))
    assert [(r["rank"], r["file"]) for r in analyze_path(tmp_path)["ranks"]] == [
        (0, "torch-4242.pt.trace.json.gz"), (1, "torch-977.pt.trace.json.gz")]


def test_a_run_directory_reads_its_profile_and_the_step_count_in_its_manifest(tmp_path):
    run = tmp_path / "runs" / "tp8-0001"
    four_ranks(run / "profile")
    write_model(run / "manifest.json", RunManifest(run_id="tp8-0001", config=ConfigRecord(name="tp8"), status="ok",
                                                   profile=ProfileRecord(status="ok", num_steps=5)))
    result = analyze_path(run)
    assert (result["steps"], result["steps_source"], result["per_step_ms"]) == (5, "request", 0.211)
    assert analyze_path(run, requested_steps=10)["per_step_ms"] == 0.1055


def test_large_inputs_are_read_in_parallel_with_the_same_figures(tmp_path, monkeypatch):
    serial = analyze_path(four_ranks(tmp_path, (1000, 1200)))
    monkeypatch.setattr(analysis, "PARALLEL_MIN_BYTES", 0)
    assert analyze_path(tmp_path) == serial


# ---------------------------------------------------------------- bad input


def test_a_truncated_gzip_is_an_input_error_naming_the_file(tmp_path):
    path = write_trace(tmp_path / "cut.trace.json.gz", one_step_events() * 20)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(InputError, match="cut.trace.json.gz"):
        analyze_path(tmp_path)


@pytest.mark.parametrize("damage", ["header", "block", "crc"])
def test_a_corrupt_gzip_is_an_input_error_naming_the_file(tmp_path, damage):
    """Each way a gzip stream breaks raises its own exception class (BadGzipFile for the header and the
    CRC, the inflater's own error for a bad block): each is the same InputError."""
    path = tmp_path / "bad.json.gz"
    if damage == "header":
        path.write_bytes(b"\x1f\x8b\x08\x00" + b"not deflate data at all" * 10)
    else:
        write_trace(path, one_step_events() * 20)
        data = bytearray(path.read_bytes())
        # the first block's header (after the 10-byte header and the file name gzip.open writes); the CRC
        at = data.index(0, 10) + 1 if damage == "block" else len(data) - 8
        data[at:at + 4] = bytes(b ^ 0xFF for b in data[at:at + 4])
        path.write_bytes(bytes(data))
    with pytest.raises(InputError, match="bad.json.gz"):
        analyze_path(path)


@pytest.mark.parametrize("text, why", [
    ('{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 1, "dur"', "ends in the middle"),
    ('{"schemaVersion": 1}', "no traceEvents"),
    ('[1, 2]', "expected '{'"),
    ('{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": "soon", '
     '"dur": 1}]}', "malformed trace event"),
])
def test_a_file_that_is_not_a_whole_trace_is_an_input_error(tmp_path, text, why):
    path = tmp_path / "t.json"
    path.write_text(text)
    with pytest.raises(InputError, match=why) as caught:
        analyze_path(path)
    assert str(path) in str(caught.value)


def test_a_missing_path_or_a_directory_without_traces_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="no such trace file"):
        analyze_path(tmp_path / "nowhere")
    with pytest.raises(InputError, match="no trace files"):
        analyze_path(tmp_path)


@pytest.mark.parametrize("text, why", [("{not json", "cannot read it"),
                                       ('{"schema": "harness.run/1", "status": "ok"}', "run_id: Field required")])
def test_an_unreadable_manifest_is_an_input_error_naming_it(tmp_path, text, why):
    four_ranks(tmp_path / "profile")
    (tmp_path / "manifest.json").write_text(text)
    with pytest.raises(InputError, match="manifest.json") as raised:
        analyze_path(tmp_path)
    assert why in str(raised.value)


def test_a_run_without_traces_says_what_its_manifest_recorded_of_the_profile(tmp_path):
    answers = [{"call": "POST /stop_profile", "status": 500, "body": "no trace written"}]
    write_model(tmp_path / "manifest.json", RunManifest(
        run_id="c-1", config=ConfigRecord(name="c"), status="failed",
        profile=ProfileRecord(status="failed", error="the engine wrote no trace", answers=answers,
                              hint="look at server.log")))
    with pytest.raises(InputError) as raised:
        analyze_path(tmp_path)
    assert ("the profile is failed: the engine wrote no trace; the engine's last answer: POST /stop_profile -> 500 "
            "'no trace written' (look at server.log)") in str(raised.value)
    write_model(tmp_path / "manifest.json", RunManifest(run_id="c-1", config=ConfigRecord(name="c"), status="ok"))
    with pytest.raises(InputError, match="this run captured no profile"):
        analyze_path(tmp_path)


# ---------------------------------------------------------------- the terminal view


def test_the_view_shows_kernels_categories_steps_idle_and_the_straggler(tmp_path):
    directory = four_ranks(tmp_path)
    write_trace(directory / "1700000000.1-TP-4.trace.json.gz", one_step_events())
    console = Console(record=True, width=160)
    console.print(render_analysis(analyze_path(directory, requested_steps=10), top=5))
    out = console.export_text()
    for expected in ("nvjet_tst_128x64_64x8_1x1_v_bz_TNT", "ncclDevKernel_AllReduce_Sum_bf16_RING_LL",
                     "communication", "ms/step", "GPU idle", "straggler: rank 3", "aten::copy_"):
        assert expected in out
    assert "ncclDevKernelArgsStorage" not in out


def test_kernel_names_lose_their_signature_but_keep_their_template():
    assert short_name(NORM) == "flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>"
    # too long for a table: the kernel, what it does and the types it works on, the rest elided
    assert short_name(CAST) == "unrolled_elementwise_kernel<direct_copy_kernel_cuda, BFloat16, …>"
    fp8_cache = ("void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, unsigned char, "
                 "(vllm::Fp8KVCacheDataType)1>(__nv_bfloat16 const*, __nv_bfloat16 const*, unsigned char*)")
    assert short_name(fp8_cache) == "vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, Fp8KVCacheDataType=1, …>"
    assert short_name(MEMCPY) == MEMCPY
