"""What compare and the report show of a results folder: the simulator's time scale labelled, the
roofline's columns only with roofline facts, and the terminal tables within 80 columns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from harness.report import compare
from harness.report.html import render_report

GLM5 = {"path": "/models/GLM-5-NVFP4", "served_name": "glm-5", "active_params_b": 40, "bytes_per_weight": 1.16,
        "kv_bytes_per_token": 44928}
ANALYSIS = {"per_step_ms": 91.7, "top": [{"name": "unrolled_elementwise_kernel<direct_copy_kernel_cuda>",
                                          "share": 0.73}],
            "categories": {"copy": 0.73, "communication": 0.07, "moe": 0.07, "norm": 0.04, "elementwise": 0.03}}


def level(concurrency: int, itl: float) -> dict:
    return {"concurrency": concurrency, "requests": 8, "completed": 8, "failed": 0, "output_tok_s": 1000 / itl,
            "ttft_ms": {"p50": 2 * itl}, "itl_ms": {"p50": itl, "p99": 1.5 * itl}, "tpot_ms": {"p50": itl}}


def write_sweep(root: Path, *, engine: str = "sim", env: dict | None = None, model: dict | None = None,
                configs: tuple[str, ...] = ("tp8", "tp8-no-cuda-graph-and-a-long-name")) -> Path:
    """A results folder as a sweep leaves it: per run a manifest, bench.json and analysis.json."""
    sweep = root / "demo-1"
    sweep.mkdir(parents=True)
    (sweep / "sweep.json").write_text(json.dumps({"runs": [{"run_id": f"{name}-1"} for name in configs]}))
    for i, name in enumerate(configs):
        run = sweep / "runs" / f"{name}-1"
        run.mkdir(parents=True)
        manifest = {"run_id": f"{name}-1", "status": "ok", "engine": engine, "host": {"name": "h", "gpus": 8,
                                                                                     "gpu": "RTX PRO 6000 Blackwell"},
                    "config": {"name": name, "env": env or {}}, "model": model or {"path": "/m"}, "gpus_used": 8}
        (run / "manifest.json").write_text(json.dumps(manifest))
        (run / "bench.json").write_text(json.dumps({"prompt_tokens": 16,
                                                    "levels": [level(1, 4.7 + i), level(8, 5.8 + i)]}))
        (run / "analysis.json").write_text(json.dumps(ANALYSIS))
    return sweep


def shown(renderable, width: int = 80) -> str:
    console = Console(record=True, width=width)
    console.print(renderable)
    return console.export_text()


def test_a_fast_simulator_labels_its_latencies_as_its_wall_clock_and_its_gpu_time_as_modelled(tmp_path):
    rows = compare.collect([write_sweep(tmp_path, env={"HARNESS_SIM_TIME_SCALE": "0.05"})])
    assert {r["time_scale"] for r in rows} == {0.05}
    table = " ".join(shown(compare.table(rows)).split())
    assert "simulated engine at time scale 0.05: 20x faster than the GPUs it models" in table
    assert "Latencies and tok/s are its wall clock" in table
    assert "GPU time of the modelled GPUs a step by category, ms" in table
    assert "20x faster" in compare.as_markdown(rows)
    assert "20x faster" in render_report([tmp_path])


@pytest.mark.parametrize("engine,env", [("sim", {}), ("sim", {"HARNESS_SIM_TIME_SCALE": "1"}),
                                        ("vllm", {"HARNESS_SIM_TIME_SCALE": "0.05"})])
def test_real_speed_and_real_engines_carry_no_scale_note(tmp_path, engine, env):
    rows = compare.collect([write_sweep(tmp_path, engine=engine, env=env)])
    assert {r["time_scale"] for r in rows} == {1.0} and compare.time_note(rows) is None
    assert "time scale" not in shown(compare.table(rows)) + compare.as_markdown(rows) + render_report([tmp_path])


def test_configurations_at_different_scales_are_named_with_theirs(tmp_path):
    rows = compare.collect([write_sweep(tmp_path, env={"HARNESS_SIM_TIME_SCALE": "0.05"}, configs=("a",)),
                            write_sweep(tmp_path / "other", env={"HARNESS_SIM_TIME_SCALE": "0.5"}, configs=("b",))])
    assert compare.time_note(rows).startswith("simulated engine at different time scales (a 0.05, b 0.5)")


def test_without_roofline_facts_no_view_shows_empty_roofline_columns(tmp_path):
    rows = compare.collect([write_sweep(tmp_path)])
    assert all(r["theoretical_ms"] is None for r in rows)
    assert "roof" not in shown(compare.table(rows)) and "eff =" not in shown(compare.table(rows))
    assert "roofline" not in compare.as_markdown(rows) and "efficiency" not in compare.as_markdown(rows)
    page = render_report([tmp_path])
    assert "roofline<br>ms" not in page and "Efficiency =" not in page
    assert "theoretical_ms" in compare.as_csv(rows).splitlines()[0]   # csv keeps its columns for scripts


def test_with_roofline_facts_every_view_shows_them(tmp_path):
    rows = compare.collect([write_sweep(tmp_path / "r", model=GLM5)])
    assert rows[0]["theoretical_ms"] == pytest.approx(3.24, abs=0.005)
    assert "roof" in shown(compare.table(rows)) and "| roofline ms | efficiency |" in compare.as_markdown(rows)
    page = render_report([tmp_path / "r"])
    assert "roofline<br>ms" in page and "Efficiency =" in page and "3.24" in page


@pytest.mark.parametrize("width", [80, 120])
def test_the_tables_fit_the_terminal_and_cut_no_cell(tmp_path, width):
    rows = compare.collect([write_sweep(tmp_path, env={"HARNESS_SIM_TIME_SCALE": "0.05"})])
    text = shown(compare.table(rows), width)
    assert max(map(len, text.splitlines())) <= width
    assert "…" not in text   # a cut cell or header ends in an ellipsis
    assert "73% +0" in text and "copy" in text and "+21%" in text
    name = "tp8-no-cuda-graph-and-a-long-name"   # whole on one line, or wrapped: never cut
    assert name in text or (name[:20] in text and "name" in text)


def test_a_narrow_terminal_drops_the_smallest_categories_rather_than_cutting_them(tmp_path):
    rows = compare.collect([write_sweep(tmp_path)])
    wide, narrow = shown(compare.table(rows), 120), shown(compare.table(rows), 62)
    assert "norm" in wide and "norm" not in narrow and "copy" in narrow
    assert "…" not in narrow


def test_gpu_time_shows_milliseconds_a_step_and_their_change_so_a_share_that_moves_alone_is_seen(tmp_path):
    """Attention's share falls from 50% to 25% while its kernels take the same 5 ms a step: GEMM grew."""
    sweep = write_sweep(tmp_path, engine="vllm", configs=("base", "other"))
    for name, per_step, cats in (("base", 10.0, {"gemm": 0.5, "attention": 0.5}),
                                 ("other", 20.0, {"gemm": 0.75, "attention": 0.25})):
        (sweep / "runs" / f"{name}-1" / "analysis.json").write_text(json.dumps(
            {"per_step_ms": per_step, "steps": 10, "gpu_idle_ms": 30.0, "categories": cats,
             "category_ms": {c: share * per_step for c, share in cats.items()},
             "top": [{"name": "nvjet_tst_128x64", "share": 0.5}]}))
    text = shown(compare.table(compare.collect([sweep], baseline="base")), width=120)
    other = next(line for line in text.splitlines() if line.split()[:2] == ["other", "all"])
    assert other.split()[2:] == ["20.00", "+10.00", "3.00", "+0.00", "15.00", "+10.00", "5.00", "+0.00"]
    assert "idle: no kernel running" in " ".join(text.split())


def test_two_sweeps_side_by_side_each_configuration_against_itself_in_the_first(tmp_path):
    before = write_sweep(tmp_path / "before", engine="vllm", configs=("eager", "graphs"))
    after = write_sweep(tmp_path / "after", engine="vllm", configs=("eager", "graphs"))
    for name, itl in (("eager", 2.35), ("graphs", 2.85)):   # the upgrade halved ITL at one stream
        bench = after / "runs" / f"{name}-1" / "bench.json"
        data = json.loads(bench.read_text())
        data["levels"][0] = level(1, itl)
        bench.write_text(json.dumps(data))
    pooled = compare.collect([before, after])
    assert len(pooled) == 4                                  # by configuration: the two sweeps pooled
    rows = compare.collect([before, after], by="sweep")
    by = {(r["configuration"], r["sweep"], r["concurrency"]): r for r in rows}
    assert len(rows) == 8 and by[("eager", "after/demo-1", 1)]["config"] == "eager @ after/demo-1"
    assert by[("eager", "after/demo-1", 1)]["itl_vs_baseline"] == pytest.approx(-0.5)
    assert by[("graphs", "after/demo-1", 1)]["itl_vs_baseline"] == pytest.approx(-0.5)
    assert by[("graphs", "after/demo-1", 8)]["itl_vs_baseline"] == pytest.approx(0)
    assert by[("graphs", "before/demo-1", 1)]["itl_vs_baseline"] == pytest.approx(0)
    text = " ".join(shown(compare.table(rows), width=120).split())
    assert "Δ vs the same configuration @ before/demo-1" in text
    with pytest.raises(Exception, match="no sweep named 'nope'"):
        compare.collect([before, after], by="sweep", baseline="nope")


def test_harness_compare_by_sweep_on_the_command_line(tmp_path):
    from tests.conftest import harness
    before = write_sweep(tmp_path / "before", engine="vllm", configs=("eager",))
    after = write_sweep(tmp_path / "after", engine="vllm", configs=("eager",))
    done = harness("compare", before, after, "--by", "sweep", "--format", "json")
    assert done.returncode == 0, done.stderr
    labels = [r["config"] for r in json.loads(done.stdout)]
    assert labels == ["eager @ before/demo-1"] * 2 + ["eager @ after/demo-1"] * 2
    wrong = harness("compare", before, after, "--by", "host")
    assert wrong.returncode == 2 and "unknown --by 'host': config or sweep" in wrong.stderr


@pytest.mark.parametrize("seconds, said", [(27, "27 s"), (0.4, "0 s"), (119, "119 s"), (150, "2 min"),
                                           (3599, "60 min"), (7200, "2.0 h"), (-3, "0 s")])
def test_time_left_is_said_in_units_a_person_uses(seconds, said):
    from harness.report.live import how_long
    assert how_long(seconds) == said


def test_the_winner_line_says_which_side_has_a_single_run():
    """The winner measured twice (an interval) against a runner-up measured once: the line said "one run
    each" beside the winner's own interval."""
    from harness.report.compare import winner_text
    w = {"config": "tp8", "output_tok_s": 2748.0, "ci": [2744.0, 2751.0], "runner_up": "ep8",
         "runner_up_tok_s": 2700.0, "runner_up_ci": None, "verdict": None}
    line = winner_text(w)
    assert "ep8 has one run: no interval" in line and "one run each" not in line
    both = winner_text(w | {"ci": None})
    assert "one run each: no interval" in both


def test_markdown_marks_a_change_within_the_noise_as_the_table_does(tmp_path):
    from harness.report.compare import as_markdown
    row = {"config": "ep8", "concurrency": 1, "ok": True, "baseline": "tp8", "output_tok_s": 100.0,
           "itl_vs_baseline": 0.001, "itl_verdict": "within noise", "tok_s_vs_baseline": -0.2,
           "tok_s_verdict": "worse", "misses": []}
    text = as_markdown([row])
    assert "| ≈+0% | -20% |" in text and "≈ within the noise" in text
