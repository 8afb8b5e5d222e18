"""What a user reads in the morning when the results folder holds what a host or a damaged disk wrote:
the real `harness` command on real files shows every run's fate and every figure as the file gives
it, never a traceback, never a host's control sequences sent to the terminal."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import harness
from tests.unit.test_compare_view import write_sweep

ESC = "\x1b"


def edit(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def strict_json(text: str):
    """JSON as other tools read it: NaN and Infinity are not JSON."""
    def refuse(name: str):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_nan_and_infinite_figures_in_bench_json_show_as_not_measured(tmp_path):
    sweep = write_sweep(tmp_path)
    bench = sweep / "runs" / "tp8-no-cuda-graph-and-a-long-name-1" / "bench.json"

    def odd(b: dict) -> None:
        b["levels"][0]["output_tok_s"] = float("nan")
        b["levels"][1]["ttft_ms"]["p50"] = float("inf")
        b["levels"][1]["itl_ms"]["p50"] = -5.0
    edit(bench, odd)
    table = harness("compare", sweep)
    assert table.returncode == 0 and "Traceback" not in table.stderr, table.stderr
    assert "nan" not in table.stdout.lower() and "inf" not in table.stdout.lower()
    rows = strict_json(harness("compare", sweep, "--format", "json").stdout)
    long = {r["concurrency"]: r for r in rows if r["config"].startswith("tp8-no")}
    assert long[1]["output_tok_s"] is None and long[1]["tok_s_vs_baseline"] is None
    assert long[8]["ttft_ms_p50"] is None and long[8]["itl_ms_p50"] is None
    page = harness("report", sweep, "-o", tmp_path / "report.html")
    assert page.returncode == 0 and "Traceback" not in page.stderr, page.stderr


def test_a_huge_figure_is_shown_in_a_few_characters(tmp_path):
    sweep = write_sweep(tmp_path)
    edit(sweep / "runs" / "tp8-no-cuda-graph-and-a-long-name-1" / "bench.json",
         lambda b: b["levels"][1].update(output_tok_s=1e308))
    table = harness("compare", sweep)
    assert table.returncode == 0, table.stderr
    assert "1e+308" in table.stdout and "%" in table.stdout
    assert max(map(len, table.stdout.splitlines())) < 200
    page = harness("report", sweep, "-o", tmp_path / "report.html")
    assert page.returncode == 0 and "1e+308" in (tmp_path / "report.html").read_text()


def test_control_sequences_from_a_host_are_shown_escaped_never_sent(tmp_path):
    sweep = write_sweep(tmp_path)
    run = sweep / "runs" / "tp8-1"
    edit(run / "manifest.json", lambda m: m.update(
        status="failed", config={"name": f"tp8{ESC}[2J"},
        error={"kind": "launch", "message": f"died {ESC}]0;owned{ESC}\\ [/] {ESC}[31mred"}))
    (sweep / "journal.jsonl").write_text(json.dumps({"t": 1.0, "run_id": "tp8-1", "state": "failed",
                                                     "host": f"h{ESC}[1A", "reason": f"{ESC}]0;x{ESC}\\"}) + "\n")
    trace = tmp_path / "trace" / "x.trace.json"
    trace.parent.mkdir()
    trace.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "kernel", "name": f"evil{ESC}[2Jkernel",
                                                  "ts": 0, "dur": 10, "pid": 0, "tid": 1}]}))
    for args in (("compare", sweep), ("status", sweep), ("analyze", trace.parent)):
        shown = harness(*args)
        assert "Traceback" not in shown.stderr, shown.stderr
        assert ESC not in shown.stdout + shown.stderr, args
    compared = harness("compare", sweep)
    assert "tp8\\x1b[2J" in compared.stdout and "died \\x1b]0;owned" in compared.stdout
    assert "evil\\x1b[2Jkernel" in harness("analyze", trace.parent).stdout


def test_a_skipped_run_and_an_ok_run_without_results_say_why_they_have_no_figures(tmp_path):
    sweep = write_sweep(tmp_path, configs=("tp8", "ep8", "tp8-late"))
    (sweep / "runs" / "ep8-1" / "bench.json").unlink()
    late = sweep / "runs" / "tp8-late-1"
    (late / "bench.json").unlink()
    edit(late / "manifest.json", lambda m: m.update(status="skipped", skipped="the deadline had passed"))
    table = " ".join(harness("compare", sweep).stdout.split())
    assert "ep8: no benchmark results: ep8-1/bench.json is missing" in table
    assert "tp8-late: skipped: the deadline had passed" in table
    rows = {r["config"]: r for r in json.loads(harness("compare", sweep, "--format", "json").stdout)}
    assert rows["ep8"]["error"].startswith("no benchmark results") and rows["tp8"]["error"] is None
    assert harness("report", sweep, "-o", tmp_path / "r.html").returncode == 0
    page = (tmp_path / "r.html").read_text()
    assert "the deadline had passed" in page and "bench.json is missing" in page


def test_a_run_whose_benchmark_file_cannot_be_read_is_one_failure_naming_the_file(tmp_path):
    sweep = write_sweep(tmp_path, configs=("tp8", "ep8"))
    (sweep / "runs" / "ep8-1" / "bench.json").write_text('{"schema": "harness.bench/1", "lev')
    assert harness("report", sweep, "-o", tmp_path / "r.html").returncode == 0
    section = (tmp_path / "r.html").read_text().split('<section id="failures">')[1].split("</section>")[0]
    failures = [f for f in section.split('<div class="failure">')[1:] if "ep8-1" in f]
    assert len(failures) == 1 and "ep8-1/bench.json: cannot read it" in failures[0], failures


def test_a_run_whose_manifest_cannot_be_read_is_named_not_dropped_in_silence(tmp_path):
    sweep = write_sweep(tmp_path, configs=("tp8", "ep8"))
    (sweep / "runs" / "ep8-1" / "manifest.json").write_text('{"schema": "harness.run/1", "run_id": "ep')
    for fmt in ("table", "json", "csv"):
        compared = harness("compare", sweep, "--format", fmt)
        assert compared.returncode == 0, compared.stderr
        assert "ep8-1/manifest.json: cannot read it" in compared.stderr and "run ep8-1 left out" in compared.stderr
    assert harness("report", sweep, "-o", tmp_path / "r.html").returncode == 0
    assert "run ep8-1 left out" in (tmp_path / "r.html").read_text()


def test_a_journal_that_is_not_text_is_an_error_naming_it(tmp_path):
    sweep = write_sweep(tmp_path)
    (sweep / "journal.jsonl").write_bytes(b'{"t": 1.0, "run_id": "tp8-1", "state": "ok"}\n\xff\xfe\n')
    shown = harness("status", sweep)
    assert shown.returncode == 2 and "Traceback" not in shown.stderr, shown.stderr
    assert f"{sweep / 'journal.jsonl'}: not UTF-8 text" in " ".join(shown.stderr.split())


def test_a_damaged_sweep_record_is_named_not_taken_for_a_sweep_that_stopped_early(tmp_path):
    sweep = write_sweep(tmp_path)
    (sweep / "sweep.json").write_text("garbage")
    shown = harness("status", sweep)
    assert shown.returncode == 2 and "Traceback" not in shown.stderr, shown.stderr
    assert str(sweep / "sweep.json") in " ".join(shown.stderr.split()) and "--resume" not in shown.stdout


def test_a_run_whose_traces_are_gone_shows_the_analysis_saved_with_it(tmp_path):
    """A run folder whose profile/ was removed (the traces take gigabytes), or its analysis.json named
    directly: the saved analysis is shown, saying so. Before, both were errors."""
    trace = tmp_path / "x.trace.json"
    trace.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "kernel", "name": "gemm_kernel", "ts": 0,
                                                  "dur": 10, "pid": 0, "tid": 1}]}))
    run = tmp_path / "run"
    run.mkdir()
    saved = harness("analyze", trace, "--format", "json")
    assert saved.returncode == 0, saved.stderr
    (run / "analysis.json").write_text(saved.stdout)
    for path in (run, run / "analysis.json"):
        shown = harness("analyze", path)
        assert shown.returncode == 0, shown.stderr
        assert "gemm_kernel" in shown.stdout and "analysis saved with the run" in shown.stderr
    (run / "profile").mkdir()
    (run / "profile" / "broken.trace.json").write_text("{")
    assert harness("analyze", run).returncode == 2   # traces that are there are read, never passed over


def test_a_sweep_interrupted_with_runs_left_is_stopped_not_finished(tmp_path):
    """Ctrl-C records the sweep's end too; its runs not done make it one to resume, not a finished one."""
    sweep = write_sweep(tmp_path)
    record = json.loads((sweep / "sweep.json").read_text())
    (sweep / "sweep.json").write_text(json.dumps(record | {"started": 1.0, "finished": 3.0}))
    (first, second, *_) = [r["run_id"] for r in record["runs"]]
    (sweep / "journal.jsonl").write_text("".join(json.dumps(e) + "\n" for e in (
        {"t": 1.0, "run_id": first, "state": "ok", "host": "gpu-01"},
        {"t": 2.0, "run_id": second, "state": "interrupted", "host": "gpu-01"})))
    shown = harness("status", sweep)
    assert shown.returncode == 1, shown.stdout + shown.stderr
    assert "stopped before the end" in " ".join(shown.stdout.split()) and "(finished)" not in shown.stdout


def test_analyze_refuses_a_top_that_shows_no_kernel(tmp_path):
    trace = tmp_path / "x.trace.json"
    trace.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 0, "dur": 10,
                                                  "pid": 0, "tid": 1}]}))
    assert harness("analyze", trace, "--top", "3").returncode == 0
    refused = harness("analyze", trace, "--top", "0")
    assert refused.returncode == 2 and "no GPU kernels" not in refused.stdout


def test_a_multi_line_error_keeps_the_markdown_table_one_row_a_level(tmp_path):
    sweep = write_sweep(tmp_path)
    edit(sweep / "runs" / "tp8-1" / "manifest.json", lambda m: m.update(
        status="failed", error={"kind": "launch", "message": f"CUDA out of memory.\nTried | to {ESC}[2J allocate"}))
    table = harness("compare", sweep, "--format", "markdown").stdout
    rows = [line for line in table.splitlines() if line.startswith("| tp8 |")]
    assert len(rows) == 2 and all(row.endswith("|") for row in rows)
    assert "CUDA out of memory. Tried \\| to \\x1b[2J allocate" in rows[0] and ESC not in table


def test_a_level_shorter_than_the_sampling_interval_says_its_gauges_are_not_its_own(tmp_path):
    """The second level (at 1.2 s to 1.5 s) has no /metrics sample within it: its `running` is the
    samples at 1 s (the first level's one stream) and 2 s (idle), a mean of 0.5 at concurrency 8."""
    sweep = write_sweep(tmp_path, configs=("tp8",))
    run = sweep / "runs" / "tp8-1"
    second = 1_000_000_000

    def timed(b: dict) -> None:
        b["levels"][0].update(started_ns=int(0.1 * second), ended_ns=int(1.1 * second))
        b["levels"][1].update(started_ns=int(1.2 * second), ended_ns=int(1.5 * second))
    edit(run / "bench.json", timed)
    metric = {"key": "running", "family": "sglang:num_running_reqs", "kind": "gauge", "across": "sum"}
    lines = [{"t_ns": 0, "source": "start", "values": {"schema": "harness.telemetry/1", "interval_s": 1.0,
                                                       "metrics": [metric]}}]
    lines += [{"t_ns": t * second // 2, "t_end_ns": t * second // 2 + 1000, "source": "metrics",
               "values": {"sglang:num_running_reqs": running}} for t, running in ((0, 0), (1, 1), (2, 1), (4, 0))]
    (run / "telemetry.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    rows = {r["concurrency"]: r for r in json.loads(harness("compare", sweep, "--format", "json").stdout)}
    assert rows[1]["telemetry"]["sampled_within"] and not rows[8]["telemetry"]["sampled_within"]
    table = " ".join(harness("compare", sweep).stdout.split())
    assert "no sample of /metrics within tp8 8 (shorter than the sampling interval)" in table
    assert "tp8 1," not in table
    assert "no sample of /metrics within tp8 8" in " ".join(harness("compare", sweep, "--format",
                                                                    "markdown").stdout.split())
    assert harness("report", sweep, "-o", tmp_path / "r.html").returncode == 0
    assert "no sample of /metrics within tp8 8" in (tmp_path / "r.html").read_text()


def test_plan_counts_a_run_on_two_hosts_once_and_names_its_nodes(tmp_path):
    (tmp_path / "inv.yaml").write_text("all: {hosts: {a: {transport: local}, b: {transport: local}}}\n")
    (tmp_path / "pb.yaml").write_text(
        "name: mn\nhosts: all\nengine: sim\nmodel: {path: /m}\nserver: {port: 30123, host: 0.0.0.0}\n"
        "configs:\n  - {name: tp2, nodes: 2, args: {tp-size: 2}}\nbenchmark: {prompt: hi, max_tokens: 4}\n")
    shown = harness("plan", tmp_path / "pb.yaml", "-i", tmp_path / "inv.yaml")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0] == "1 run (1 configuration x 1 repeat):"   # it said "2 runs (1 configurations ..."
    assert lines[1:3] == ["  tp2-1  on a, node 0", "  tp2-1  on b, node 1"]


def test_a_journal_line_whose_time_is_no_time_is_skipped_not_shown_as_nan_hours(tmp_path):
    """`t` NaN, infinite or beyond any clock: the line is no event (as a torn one), so status neither
    prints a run's time as 'nan s' nor an estimate of 'nan h' left."""
    sweep = write_sweep(tmp_path)
    record = json.loads((sweep / "sweep.json").read_text())
    (first, second, *_) = [r["run_id"] for r in record["runs"]]
    for bad in ("NaN", "1e308", "-5"):
        (sweep / "journal.jsonl").write_text(
            f'{{"t": 1.0, "run_id": "{first}", "state": "running", "host": "gpu-01"}}\n'
            f'{{"t": {bad}, "run_id": "{first}", "state": "ok", "host": "gpu-01"}}\n'
            f'{{"t": 1.0, "run_id": "{second}", "state": "pending"}}\n')
        shown = harness("status", sweep)
        said = " ".join(shown.stdout.split())
        assert "Traceback" not in shown.stderr and shown.returncode in (0, 1), shown.stderr
        assert "nan" not in said and "inf" not in said and "e+" not in said, said
