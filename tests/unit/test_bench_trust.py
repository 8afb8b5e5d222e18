"""A bench.json is the host's word: finite figures that cannot all be true (a rate that is not its own
division, counts that do not add up, a level longer than the benchmark the orchestrator timed) are read
as not measured, named with the run and the field, and never win; a consistent file reads as written.
And compare never shows a bad or partial result as a good one: a configuration with failures, or a load
only one configuration measured, is no winner."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from rich.console import Console

from harness.remote.bench import run_benchmark, write_results
from harness.remote.exchange import Outcome
from harness.remote.levels import summarize_level
from harness.report import compare
from harness.report.html import render_report
from harness.report.noise import bootstrap_ci, verdict
from harness.results import BenchFile, SweepLayout, load_run, load_runs, store
from tests.unit.test_bench import serve  # noqa: F401  (a fixture: a scripted streaming server)
from tests.unit.test_load import counting  # noqa: F401  (a fixture: a server that counts tokens)

MAX_TOKENS = 16
ESC = "\x1b"


def outcomes(concurrency: int, n: int = 8, tokens: int = MAX_TOKENS, gap_ms: float = 5.0) -> list[Outcome]:
    """`n` requests of `tokens` chunks each, `concurrency` at a time, every chunk `gap_ms` apart: no
    socket, no clock, the arithmetic bench.py does on the host."""
    out, t0 = [], 10**12
    for i in range(n):
        sent = t0 + (i // concurrency) * int((tokens + 2) * gap_ms * 1e6) + i * 1000
        times = [sent + int((k + 2) * gap_ms * 1e6) + 17 * i for k in range(tokens)]
        out.append(Outcome(sent, times[-1], times, tokens, 5, 200, None))
    return out


def real_level(concurrency: int, slo: dict | None = None) -> dict:
    level, _ = summarize_level(concurrency, outcomes(concurrency), slo)
    return json.loads(json.dumps(level))


def write_run(sweep: Path, run_id: str, levels: list[dict], *, config: str | None = None, status: str = "ok",
              bench_s: float | None = 60.0, extra: dict | None = None) -> Path:
    run = sweep / "runs" / run_id
    run.mkdir(parents=True)
    manifest = {"run_id": run_id, "status": status, "engine": "vllm", "config": {"name": config or run_id},
                "phases": {"bench": {"seconds": bench_s}} if bench_s is not None else {}}
    if status == "failed":
        manifest["error"] = {"kind": "bench", "message": "requests failed"}
    (run / "manifest.json").write_text(json.dumps(manifest))
    (run / "bench.json").write_text(json.dumps({"schema": "harness.bench/1", "max_tokens": MAX_TOKENS,
                                                "levels": levels} | (extra or {})))
    (run / "launch.sh").write_text(f"exec vllm serve /m --name {config or run_id}\n")
    return run


def shown(renderable, width: int = 160) -> str:
    console = Console(record=True, width=width)
    console.print(renderable)
    return console.export_text()


# ---- a consistent file reads exactly as written ----------------------------------------------------

def test_what_the_benchmark_client_writes_reads_exactly_as_written(serve, counting, tmp_path):  # noqa: F811
    """The client's own files, with failed requests, workers, scenarios closed and open, an SLO and a
    max_load search: not one figure refused, and load_run's model is the file's."""
    server = serve("status500", "midstream_error", "no_done")
    files = {
        "single": run_benchmark(server.url, "m", concurrency=[1, 4], requests=6, max_tokens=12, warmup=0),
        "workers": run_benchmark(serve().url, "m", concurrency=[4], requests=8, max_tokens=12, warmup=0,
                                 workers=2),
        "scenarios": run_benchmark(
            counting.url, "m", warmup=0, random_state=3, slo={"ttft_ms_p99": 600000, "itl_ms_p50": 600000},
            scenarios=[{"name": "chat", "input_tokens": 8, "output_tokens": 3, "concurrency": [1, 2], "requests": 4},
                       {"name": "rag", "input_tokens": 8, "output_tokens": 2, "request_rate": [400.0],
                        "requests": 6, "arrival": "constant"}],
            search={"scenario": "chat", "slo": {"ttft_ms_p99": 600000}, "low": 1, "high": 4, "steps": 3}),
    }
    sweep = tmp_path / "s-1"
    for name, result in files.items():
        run = sweep / "runs" / name
        write_results(result, run / "bench.json")
        (run / "manifest.json").write_text(json.dumps({
            "run_id": name, "status": "ok", "config": {"name": name}, "phases": {"bench": {"seconds": 600.0}},
            "benchmark": {"extra_body": {}}}))
        read = load_run(SweepLayout(sweep).run(name))
        raw = BenchFile.model_validate(json.loads((run / "bench.json").read_text()))
        assert read.notes == [] and read.bench is not None, read.notes
        assert read.bench.dump() == raw.dump() and raw.checked(bench_s=600.0) is raw
    assert files["scenarios"]["max_load"]["probes"] and compare.not_measured([sweep]) == []


# ---- each way a level cannot be true -----------------------------------------------------------------

def scaled(level: dict, **changes) -> dict:
    return level | changes


FAULTS = {
    # name: (change to a consistent level at concurrency 4, the field refused ("level": all of it), words)
    "a rate of 1e308": (lambda lv: scaled(lv, output_tok_s=1e308), "output_tok_s", "disagrees with output_tokens"),
    "a rate twice its division": (lambda lv: scaled(lv, output_tok_s=2 * lv["output_tok_s"]), "output_tok_s",
                                  "duration_s"),
    "requests a second not its division": (lambda lv: scaled(lv, requests_per_s=3 * lv["requests_per_s"]),
                                           "requests_per_s", "completed / duration_s"),
    "a negative duration": (lambda lv: scaled(lv, duration_s=-lv["duration_s"]), "level", "duration_s"),
    "a negative count": (lambda lv: scaled(lv, completed=-8, failed=16), "level", "completed -8 is not a count"),
    "more completed than requests": (lambda lv: scaled(lv, completed=80, failed=0, requests=8), "level",
                                     "completed 80 is more than requests 8"),
    "counts that do not add up": (lambda lv: scaled(lv, failed=3), "level", "is not requests 8"),
    "a count beyond any benchmark": (lambda lv: scaled(lv, output_tokens=10**30), "level", "is not a count"),
    "more tokens than were asked": (lambda lv: scaled(lv, output_tokens=lv["output_tokens"] * 100,
                                                      output_tok_s=lv["output_tok_s"] * 100), "level",
                                    "more than completed 8 x 16 tokens"),
    "percentiles out of order": (lambda lv: scaled(lv, itl_ms=lv["itl_ms"] | {"p50": 10 * lv["itl_ms"]["p99"]}),
                                 "itl_ms", "p50"),
    "a mean outside min and max": (lambda lv: scaled(lv, ttft_ms=lv["ttft_ms"] | {"mean": -1e9}), "ttft_ms", "mean"),
    "a duration not its clock's": (lambda lv: scaled(lv, duration_s=lv["duration_s"] * 5,
                                                     output_tok_s=lv["output_tok_s"] / 5,
                                                     requests_per_s=lv["requests_per_s"] / 5), "level",
                                   "ended_ns - started_ns"),
    "a level longer than the benchmark": (lambda lv: scaled(lv, duration_s=1000.0, started_ns=0, ended_ns=10**12,
                                                            output_tok_s=lv["output_tokens"] / 1000.0,
                                                            requests_per_s=lv["completed"] / 1000.0), "level",
                                          "longer than the whole benchmark phase (60 s"),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_a_level_that_cannot_be_true_is_not_measured_and_says_which_run_field_and_why(tmp_path, fault):
    change, field, words = FAULTS[fault]
    honest = real_level(4)
    sweep = tmp_path / "s-1"
    write_run(sweep, "liar-1", [real_level(1), change(honest)])
    run = load_run(SweepLayout(sweep).run("liar-1"))
    first, level = run.levels
    assert first.not_measured == {} and first.output_tok_s is not None   # its other level stands
    assert list(level.not_measured) == [field], level.not_measured
    (note,) = run.notes
    assert note.startswith("liar-1: bench.json concurrency 4: ") and words in note and "not measured" in note
    if field == "level":
        assert not level.trusted and level.output_tok_s is None and level.itl_ms is None
        assert level.ttft_ms is None and level.requests_per_s is None
    else:
        assert level.trusted and getattr(level, field) is None and field in note


def test_slo_met_and_max_load_must_be_what_the_levels_say(tmp_path):
    slo = {"ttft_ms_p99": 10_000.0}
    own, probe_1, probe_4 = real_level(2, slo), real_level(1, slo), real_level(4, slo)
    probe_1["probe"] = probe_4["probe"] = True
    own["ttft_ms"]["p99"] = 20_000.0
    own["ttft_ms"]["max"] = 20_000.0           # the level misses its bound, yet says it met it
    assert own["slo_met"] is True
    max_load = {"scenario": "s", "kind": "concurrency", "value": 64, "met": True, "low": 1, "high": 64,
                "steps": 2, "slo": slo, "probes": [{"load": 1, "met": True, "level": 1},
                                                   {"load": 4, "met": True, "level": 2}]}
    sweep = tmp_path / "s-1"
    write_run(sweep, "r-1", [own, probe_1, probe_4], extra={"max_load": max_load})
    run = load_run(SweepLayout(sweep).run("r-1"))
    assert run.levels[0].slo_met is None and run.bench.max_load is None
    assert any("slo_met true where ttft_ms_p99 is 20000, above its bound 10000" in n for n in run.notes)
    assert any(n.startswith("r-1: bench.json: max_load value 64") for n in run.notes)
    # the same file with the answer its probes found reads as written
    (sweep / "runs" / "r-1" / "bench.json").write_text(json.dumps({"max_tokens": MAX_TOKENS, "levels": [
        real_level(2, slo), probe_1, probe_4], "max_load": max_load | {"value": 4}}))
    run = load_run(SweepLayout(sweep).run("r-1"))
    assert run.notes == [] and run.bench.max_load.value == 4


def test_extra_body_that_asks_for_more_tokens_is_the_limit(tmp_path):
    level = real_level(4)
    sweep = tmp_path / "s-1"
    write_run(sweep, "r-1", [level], extra={"max_tokens": 4})      # the file says 4; the requests asked 16
    assert load_run(SweepLayout(sweep).run("r-1")).notes != []
    manifest = json.loads((sweep / "runs" / "r-1" / "manifest.json").read_text())
    manifest["benchmark"] = {"extra_body": {"max_tokens": MAX_TOKENS}}
    (sweep / "runs" / "r-1" / "manifest.json").write_text(json.dumps(manifest))
    assert load_run(SweepLayout(sweep).run("r-1")).notes == []


def test_a_bench_json_beyond_its_size_bound_is_not_read(tmp_path, monkeypatch):
    sweep = tmp_path / "s-1"
    write_run(sweep, "r-1", [real_level(1)])
    monkeypatch.setattr(store, "MAX_BENCH_BYTES", 100)
    assert load_run(SweepLayout(sweep).run("r-1")).bench is None


# ---- compare: such a run never wins, and the user sees why -------------------------------------------

def test_a_run_whose_figures_contradict_themselves_never_wins_and_compare_says_why(tmp_path):
    sweep = tmp_path / "s-1"
    write_run(sweep, "honest-1", [real_level(1), real_level(4)])
    liar = real_level(4)
    write_run(sweep, "liar-1", [real_level(1), liar | {"output_tok_s": 1e308}])
    rows = compare.collect([sweep])
    best = compare.winner(rows)
    assert best["config"] == "honest-1" and best["left_out"] == ["liar-1 (figures its bench.json contradicts)"]
    row = next(r for r in rows if r["config"] == "liar-1" and r["concurrency"] == 4)
    assert row["output_tok_s"] is None and row["tok_s_vs_baseline"] is None
    assert row["error"].startswith("liar-1: bench.json concurrency 4: output_tok_s 1e+308 disagrees")
    table = " ".join(shown(compare.table(rows)).split())
    assert "winner at concurrency 4: honest-1" in table and "output_tok_s 1e+308 disagrees" in table
    assert "1e+308" not in " ".join(shown(compare.table(rows)).split("\n")[:8])   # never as a figure
    assert any("liar-1: bench.json" in line for line in compare.not_measured([sweep]))   # compare warns, the
    assert "output_tok_s 1e+308 disagrees with output_tokens" in render_report([sweep])  # report lists it


def test_a_level_refused_whole_is_no_ok_run_and_keeps_no_counts(tmp_path):
    sweep = tmp_path / "s-1"
    write_run(sweep, "a-1", [real_level(4)])
    write_run(sweep, "b-1", [real_level(4) | {"completed": 800, "failed": -792, "output_tok_s": 1e9}])
    rows = compare.collect([sweep])
    b = next(r for r in rows if r["config"] == "b-1")
    assert (b["ok"], b["completed"], b["failed"], b["output_tok_s"]) == (0, 0, 0, None)
    assert compare.winner(rows)["config"] == "a-1"


def test_a_host_string_in_a_refused_level_is_shown_escaped(tmp_path):
    sweep = tmp_path / "s-1"
    level = real_level(4) | {"scenario": f"chat{ESC}[2J", "output_tok_s": 5e9}
    write_run(sweep, "r-1", [level])
    rows = compare.collect([sweep])
    text = shown(compare.table(rows)) + compare.as_markdown(rows)
    assert ESC not in text and "chat\\x1b[2J" in text and "output_tok_s 5e+09" in text


def test_a_configuration_with_a_failed_run_is_not_the_winner(tmp_path):
    """A failed repeat leaves the lucky one: before, its figures won with no word of the failure."""
    sweep = tmp_path / "s-1"
    fast, slow = real_level(4), real_level(4)
    slow.update(output_tok_s=slow["output_tok_s"] / 2, duration_s=slow["duration_s"] * 2,
                requests_per_s=slow["requests_per_s"] / 2, started_ns=None, ended_ns=None)
    write_run(sweep, "fast-1", [fast], config="fast")
    write_run(sweep, "fast-2", [], config="fast", status="failed")
    write_run(sweep, "slow-1", [slow], config="slow")
    rows = compare.collect([sweep])
    best = compare.winner(rows)
    assert best["config"] == "slow" and best["left_out"] == ["fast (1 failed run)"]
    assert "left out: fast (1 failed run)" in compare.winner_text(best)


def test_a_configuration_that_lost_requests_is_not_the_winner_and_none_left_says_so(tmp_path):
    sweep = tmp_path / "s-1"
    lossy = real_level(4)
    lossy.update(requests=10, failed=2)
    write_run(sweep, "lossy-1", [lossy])
    rows = compare.collect([sweep])
    assert compare.winner(rows) is None
    assert "no winner: lossy-1: 2 failed requests at 4" in " ".join(shown(compare.table(rows)).split())


def test_requests_lost_at_another_load_do_not_keep_a_configuration_from_winning(tmp_path):
    """A request lost at concurrency 1 says nothing of concurrency 4, where the winner is named."""
    sweep = tmp_path / "s-1"
    lossy_low = real_level(1)
    lossy_low.update(requests=lossy_low["requests"] + 1, failed=1)
    better = real_level(4)
    for key in ("output_tok_s", "requests_per_s"):
        better[key] *= 2
    better["duration_s"] /= 2
    better.update(started_ns=None, ended_ns=None)
    write_run(sweep, "a-1", [lossy_low, better])
    write_run(sweep, "b-1", [real_level(1), real_level(4)])
    best = compare.winner(compare.collect([sweep]))
    assert (best["config"], best["concurrency"], best["left_out"]) == ("a-1", 4, [])


def test_a_load_only_one_configuration_measured_is_no_contest_won(tmp_path):
    """A level the others lack (a host's invention, or theirs lost): before, its lone row won."""
    sweep = tmp_path / "s-1"
    high = real_level(4)
    high.update(concurrency=10**6)
    better = real_level(4)
    for key in ("output_tok_s", "requests_per_s"):
        better[key] *= 2
    better["duration_s"] /= 2
    better.update(started_ns=None, ended_ns=None)
    write_run(sweep, "a-1", [real_level(4), high])
    write_run(sweep, "b-1", [better])
    best = compare.winner(compare.collect([sweep]))
    assert (best["config"], best["concurrency"]) == ("b-1", 4)


def test_the_slo_is_not_met_by_a_row_whose_failed_repeat_missed_it(tmp_path):
    slo = {"ttft_ms_p99": 10_000.0}
    sweep = tmp_path / "s-1"
    met, missed = real_level(4, slo), real_level(4, slo)
    missed.update(failed=2, requests=10, slo_met=False)
    write_run(sweep, "c-1", [met], config="c")
    write_run(sweep, "c-2", [missed], config="c", status="failed")
    (row,) = compare.collect([sweep])
    assert row["slo_met"] is False


def test_a_verdict_needs_intervals_that_are_intervals():
    assert verdict((math.nan, math.nan), (1.0, 2.0), higher_is_better=True) is None
    assert verdict((5.0, 4.0), (1.0, 2.0), higher_is_better=True) is None
    assert bootstrap_ci([1.0, math.nan, 2.0, 3.0]) == bootstrap_ci([1.0, 2.0, 3.0])


def test_an_interval_is_given_only_beside_its_figure(tmp_path):
    """One run: its ITL interval comes from requests.jsonl; when the level's ITL is refused there is no
    figure for it to judge."""
    sweep = tmp_path / "s-1"
    for name in ("a-1", "b-1"):
        level = real_level(4)
        if name == "b-1":
            level["itl_ms"]["p50"] = 10 * level["itl_ms"]["max"]
        run = write_run(sweep, name, [level])
        (run / "requests.jsonl").write_text("".join(
            json.dumps({"concurrency": 4, "itl_ms": [5.0 + i * 0.01, 5.1, 5.2], "error": None}) + "\n"
            for i in range(8)))
    rows = {r["config"]: r for r in compare.collect([sweep])}
    assert rows["a-1"]["itl_ms_p50_ci"] is not None
    assert rows["b-1"]["itl_ms_p50"] is None and rows["b-1"]["itl_ms_p50_ci"] is None
    assert rows["b-1"]["itl_verdict"] is None


def test_load_runs_is_the_reader_compare_and_the_report_share(tmp_path):
    sweep = tmp_path / "s-1"
    write_run(sweep, "r-1", [real_level(4) | {"output_tok_s": 1e308}])
    (run,) = load_runs(sweep)
    assert run.levels[0].output_tok_s is None and run.notes
