"""What the commands print, whatever the names in it: kernel names from a trace (`operator[/x]`), host and
folder names, a journal's reasons and the user's paths print as written (never as rich markup), an output
the command cannot write is refused before any work, and the winner is of one workload."""

from __future__ import annotations

import json
import shutil
import socket
import time
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from tests.conftest import harness

FAST = {"HARNESS_SIM_TIME_SCALE": "0.02", "HARNESS_SIM_STARTUP_S": "0.3"}
KERNELS = ["void k<float>::operator[/x](int)", "other[bold red]kernel :cd: [/]"]
"""A C++ name with brackets (real ones have `operator[]`), and one that is all markup and an emoji code."""


@pytest.fixture(scope="module")
def swept(tmp_path_factory) -> Path:
    """A sweep of the simulated engine, profiled, into a results folder whose name holds `[/]`."""
    tmp = tmp_path_factory.mktemp("cli-output")
    inventory = {"all": {"hosts": {"localhost": {"transport": "local", "workdir": str(tmp / "work")}}}}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pb = {"name": "marks", "hosts": "localhost", "engine": "sim", "flavor": "sglang",
          "model": {"path": "/models/GLM-5-NVFP4", "served_name": "glm-5"},
          "server": {"port": port, "args": {"tp-size": 8}, "env": FAST, "startup_timeout_s": 30},
          "configs": [{"name": "a"}, {"name": "b", "args": {"kv-cache-dtype": "bf16"}}],
          "benchmark": {"prompt": "hello there", "max_tokens": 8, "concurrency": [1, 2], "requests": 2,
                        "warmup": 0, "timeout_s": 30},
          "profile": {"mode": "engine", "num_steps": 3, "timeout_s": 30}}
    (tmp / "inventory.yaml").write_text(yaml.safe_dump(inventory))
    (tmp / "playbook.yaml").write_text(yaml.safe_dump(pb, sort_keys=False))
    out = tmp / "out[/]x"
    run = harness("sweep", tmp / "playbook.yaml", "-i", tmp / "inventory.yaml", "-o", out)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Traceback" not in run.stderr
    (sweep,) = [p for p in out.iterdir() if p.is_dir()]
    assert f"results: {sweep}" in " ".join(run.stdout.split())
    return sweep


def test_a_sweep_into_a_folder_named_with_markup_finishes_and_names_it(swept):
    assert "[/]" in str(swept) and (swept / "summary.json").exists()


def renamed(sweep: Path, dest: Path) -> Path:
    """A copy of the sweep whose top kernels are named KERNELS, in every analysis.json."""
    copy = dest / sweep.name
    shutil.copytree(sweep, copy)
    for path in copy.glob("runs/*/analysis.json"):
        data = json.loads(path.read_text())

        def rename(node):
            if isinstance(node, dict):
                for key, value in node.items():
                    if key in ("top", "top3") and isinstance(value, list):
                        for kernel, name in zip(value, KERNELS, strict=False):   # the first two
                            kernel["name"] = name
                    else:
                        rename(value)
            elif isinstance(node, list):
                for value in node:
                    rename(value)
        rename(data)
        path.write_text(json.dumps(data))
    return copy


def test_compare_prints_kernel_names_as_the_trace_wrote_them(swept, tmp_path):
    copy = renamed(swept, tmp_path)
    run = harness("compare", copy)
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr
    shown = run.stdout
    assert "operator[/x]" in shown and "other[bold red]kernel :cd: [/]" in shown
    html = tmp_path / "report.html"
    assert harness("report", copy, "-o", html).returncode == 0


def test_status_prints_a_journals_host_and_reason_as_written(swept, tmp_path):
    copy = tmp_path / swept.name
    shutil.copytree(swept, copy)
    with (copy / "journal.jsonl").open("a") as f:
        f.write(json.dumps({"t": time.time(), "run_id": "x-1", "state": "failed", "host": "h[bold]",
                            "reason": "boom [/] [red]late"}) + "\n")
    run = harness("status", copy)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    assert "boom [/] [red]late" in run.stdout and "h[bold]" in run.stdout


def shown(renderable) -> str:
    console = Console(record=True, width=200)
    console.print(renderable)
    return console.export_text()


def test_the_reproduce_view_prints_names_as_written(swept, tmp_path):
    from harness.report.reproduce_view import render_comparison
    from harness.reproduce import compare_runs
    copy = renamed(swept, tmp_path)
    a, b = sorted((copy / "runs").iterdir())[:2]
    text = shown(render_comparison(compare_runs(a, b), before="original (r[/]1)", after="now (h[bold]x)"))
    assert "operator[/x]" in text and "original (r[/]1)" in text and "now (h[bold]x)" in text


def test_the_search_view_prints_a_trials_reason_as_written():
    from harness.report.search_view import render_search
    from harness.results import SearchFile
    search = SearchFile.model_validate({"objective": "output_tok_s", "direction": "maximize", "budget": 2, "runs": 1,
                                        "trials": [{"number": 0, "config": "c[/]", "state": "failed",
                                                    "reason": "launch: [/] [bold]x"}]})
    text = shown(render_search(search))
    assert "launch: [/] [bold]x" in text and "c[/]" in text


# ---- outputs the command cannot write, refused before any work ---------------------------------------

def test_sweep_into_a_file_is_refused_at_once(tmp_path):
    target = tmp_path / "afile"
    target.write_text("")
    run = harness("sweep", "playbooks/demo.yaml", "-o", target)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip() == f"error: {target}: --output: is a file, not a directory"


def test_report_onto_a_directory_is_refused(swept, tmp_path):
    run = harness("report", swept, "-o", tmp_path)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip() == f"error: {tmp_path}: --output: is a directory: give the path of a file"


def test_bench_onto_a_directory_is_refused_before_it_measures(tmp_path):
    """Nothing listens on the port: a benchmark that ran would take its timeout per request first."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    target = tmp_path / "rdir"
    target.mkdir()
    started = time.monotonic()
    run = harness("bench", "--url", f"http://127.0.0.1:{port}", "--model", "m", "-o", target)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert f"error: {target}: --output: is a directory" in run.stderr
    assert time.monotonic() - started < 30
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rdir"]   # no rdir.tmp left


def test_a_path_the_system_refuses_is_one_line_naming_it(swept, tmp_path):
    """An OSError no check foresaw (here a journal that is a directory) is bad input: exit 2, one line."""
    copy = tmp_path / swept.name
    shutil.copytree(swept, copy)
    (copy / "journal.jsonl").unlink()
    (copy / "journal.jsonl").mkdir()
    run = harness("status", copy)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip() == f"error: {copy / 'journal.jsonl'}: Is a directory"


# ---- the winner: of one workload ---------------------------------------------------------------------

def level(scenario: str, concurrency: int, tok_s: float) -> dict:
    return {"scenario": scenario, "concurrency": concurrency, "completed": 8, "output_tok_s": tok_s,
            "itl_ms": {"p50": 1000 / tok_s},
            "workload": {"scenario": scenario, "input_tokens": 64, "output_tokens": 16, "kind": "concurrency",
                         "load": concurrency}}


def test_the_winner_is_chosen_within_one_workload_and_says_which(tmp_path):
    """Two scenarios at the same top concurrency: the first's rows are compared, not the second's, and a
    configuration is never its own runner-up."""
    sweep = tmp_path / "s-1"
    tok_s = {"seqs-8": {"short": 503, "long": 306}, "seqs-4": {"short": 300, "long": 100}}
    for name, per in tok_s.items():
        run = sweep / "runs" / f"{name}-1"
        run.mkdir(parents=True)
        (run / "manifest.json").write_text(json.dumps(
            {"run_id": f"{name}-1", "status": "ok", "engine": "vllm", "config": {"name": name}}))
        levels = [level("short", 1, per["short"] / 4), level("short", 8, per["short"]),
                  level("long", 8, per["long"]), level("long", 16, per["long"] * 1.5)]
        (run / "bench.json").write_text(json.dumps({"levels": levels}))
    run = harness("compare", sweep)
    assert run.returncode == 0, run.stderr
    out = " ".join(run.stdout.split())
    assert "winner in scenario short (the first of 2 workloads) at concurrency 8: seqs-8, 503 tok/s; " \
           "seqs-4 next (300 tok/s)" in out


def test_a_reader_that_closes_the_pipe_early_gets_no_error_line(tmp_path):
    """`harness analyze --format json | head`: the output outgrows the pipe (300 kB against 64 kB),
    the reader is gone. Before, `error: [Errno 32] Broken pipe` and exit 2, as for a disk refusing."""
    import subprocess
    import sys
    trace = tmp_path / "big.trace.json"
    trace.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": f"kernel_{i}_" + "x" * 100, "ts": i * 10, "dur": 5, "pid": 0, "tid": 1}
        for i in range(3000)]}))
    proc = subprocess.Popen([sys.executable, "-m", "harness", "analyze", str(trace), "--format", "json",
                             "--top", "3000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.read(10)
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1 and stderr == ""
