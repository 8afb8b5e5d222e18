"""Better only beyond the noise: bootstrap intervals of medians, the verdict they allow, and the winner
with its launch command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from harness.report import compare
from harness.report.noise import bootstrap_ci, grouped_ci, verdict


def test_an_interval_holds_the_median_and_is_the_same_every_time():
    values = [10.0, 10.4, 9.8, 10.1, 10.3, 9.9]
    lo, hi = bootstrap_ci(values)
    assert lo <= 10.05 <= hi and hi - lo < 1
    assert bootstrap_ci(values) == (lo, hi)                       # a fixed random_state: one folder, one answer
    assert bootstrap_ci([3.0]) is None and grouped_ci([[1.0, 2.0]]) is None


def test_whole_requests_are_resampled_so_one_slow_request_widens_the_interval():
    steady = [[2.0, 2.0, 2.1]] * 8
    one_slow = steady[:7] + [[9.0, 9.0, 9.0]]
    a, b = grouped_ci(steady), grouped_ci(one_slow)
    assert a == (2.0, 2.0) and b[1] >= a[1]


@pytest.mark.parametrize("ci, ref, higher, said", [
    ((5.0, 6.0), (3.0, 4.0), True, "better"), ((5.0, 6.0), (3.0, 4.0), False, "worse"),
    ((1.0, 2.0), (3.0, 4.0), True, "worse"), ((3.5, 6.0), (3.0, 4.0), True, "within noise"),
    (None, (3.0, 4.0), True, None)])
def test_the_verdict_needs_intervals_apart(ci, ref, higher, said):
    assert verdict(ci, ref, higher_is_better=higher) == said


def sweep(root: Path, repeats: dict[str, list[float]]) -> Path:
    """A results folder: each configuration's repeats at concurrency 8 with these tok/s."""
    sweep = root / "s-1"
    for name, rates in repeats.items():
        for i, rate in enumerate(rates, 1):
            run = sweep / "runs" / f"{name}-{i}"
            run.mkdir(parents=True)
            (run / "manifest.json").write_text(json.dumps(
                {"run_id": f"{name}-{i}", "status": "ok", "engine": "vllm", "config": {"name": name}}))
            (run / "bench.json").write_text(json.dumps({"levels": [
                {"concurrency": 8, "completed": 8, "output_tok_s": rate, "itl_ms": {"p50": 1000 / rate}}]}))
            (run / "launch.sh").write_text(f"#!/usr/bin/env bash\nsource /v/bin/activate\n"
                                           f"exec vllm serve /m --max-num-seqs {name}\n")
    return sweep


def test_a_clear_winner_is_named_with_its_launch_command(tmp_path):
    rows = compare.collect([sweep(tmp_path, {"64": [900, 910, 905], "256": [1500, 1480, 1510]})])
    best = compare.winner(rows)
    assert (best["config"], best["verdict"], best["launch"]) == ("256", "better", "vllm serve /m --max-num-seqs 256")
    other = next(r for r in rows if r["config"] == "64")      # the baseline is 256 (the first in run-id order)
    assert other["tok_s_verdict"] == "worse" and other["itl_verdict"] == "worse"
    text = Console(record=True, width=120)
    text.print(compare.table(rows))
    out = " ".join(text.export_text().split())
    assert "winner at concurrency 8: 256, 1,500 tok/s" in out and "ahead of 64 beyond the noise" in out
    assert compare.launch_line(rows) == "launch: vllm serve /m --max-num-seqs 256"


def test_overlapping_repeats_are_called_within_the_noise_not_better(tmp_path):
    rows = compare.collect([sweep(tmp_path, {"a": [1000, 1100, 950], "b": [1020, 980, 1090]})])
    b = next(r for r in rows if r["config"] == "b")
    assert b["tok_s_verdict"] == "within noise"
    text = Console(record=True, width=120)
    text.print(compare.table(rows))
    out = " ".join(text.export_text().split())
    assert "≈" in out and "within the noise of" in out


def test_the_report_ends_its_comparison_with_the_winner_and_its_launch_command(tmp_path):
    from harness.report.html import render_report
    page = render_report([sweep(tmp_path, {"64": [900, 910, 905], "256": [1500, 1480, 1510]})])
    assert "winner at concurrency 8: 256" in page and "<code>vllm serve /m --max-num-seqs 256</code>" in page


def test_harness_compare_prints_the_winners_launch_command_whole_at_80_columns(tmp_path):
    import os

    from tests.conftest import harness
    results = sweep(tmp_path, {"64": [900, 910, 905], "256-" + "x" * 60: [1500, 1480, 1510]})
    done = harness("compare", results, env={**os.environ, "COLUMNS": "80"})
    assert done.returncode == 0, done.stderr
    assert f"launch: vllm serve /m --max-num-seqs 256-{'x' * 60}" in done.stdout.splitlines()


def test_the_pareto_frontier_keeps_what_nothing_beats_on_both_axes():
    from harness.report.plots import pareto
    points = [(100, 50), (200, 40), (150, 45), (120, 30), (200, 10), (50, 60)]
    assert pareto(points) == [(50, 60), (100, 50), (150, 45), (200, 40)]
    assert pareto([(1, 1)]) == [(1, 1)] and pareto([]) == []


def test_the_report_plots_latency_against_load_and_the_frontier_per_user_against_per_gpu(tmp_path):
    from harness.report.html import render_report
    root = sweep(tmp_path, {"64": [900], "256": [1500]})
    for name in ("64", "256"):   # TPOT for the per-user axis, and a second level for the load curve
        bench = root / "runs" / f"{name}-1" / "bench.json"
        data = json.loads(bench.read_text())
        data["levels"][0]["tpot_ms"] = {"p50": 8.0}
        first = data["levels"][0]
        data["levels"].append({"concurrency": 32, "completed": 8, "output_tok_s": 2.5 * first["output_tok_s"],
                               "itl_ms": {"p50": 12.0}, "tpot_ms": {"p50": 12.5}})
        bench.write_text(json.dumps(data))
    page = render_report([root])
    assert "Inter-token latency against load" in page and "Pareto frontier" in page
    assert 'class="frontier"' in page and "256 c32: 3,750.0 and 80.0" in page


def pooled_median_interval(groups, *, resamples, random_state):
    """grouped_ci's definition, computed the plain way: pool each resample's groups and take the median."""
    import random
    import statistics
    groups = [g for g in groups if g]
    rng = random.Random(random_state)
    stats = sorted(statistics.median([x for g in rng.choices(groups, k=len(groups)) for x in g])
                   for _ in range(resamples))
    return stats[int(0.025 * (resamples - 1))], stats[int(0.975 * (resamples - 1))]


def test_the_grouped_interval_is_exactly_the_median_of_the_pooled_resamples():
    import random

    rng = random.Random(7)
    for case in range(40):
        # ties (rounded values), empty groups, odd and even totals
        groups = [[round(rng.random() * 10, rng.choice([0, 1, 3])) for _ in range(rng.randint(0, 9))]
                  for _ in range(rng.randint(2, 10))]
        if sum(1 for g in groups if g) < 2:
            continue
        assert grouped_ci(groups, resamples=200, random_state=case) == \
            pooled_median_interval(groups, resamples=200, random_state=case)


def test_requests_the_host_wrote_badly_are_left_out_of_the_report_and_the_rest_shown(tmp_path):
    """requests.jsonl comes from the host: bytes that are not UTF-8, a line that is not a record and a
    torn last line cost those lines only."""
    from harness.report.html import render_report
    root = sweep(tmp_path, {"64": [900], "256": [1500]})
    good = json.dumps({"concurrency": 8, "ttft_ms": 41.5, "itl_ms": [9.0, 11.0]})
    for name in ("64", "256"):
        (root / "runs" / f"{name}-1" / "requests.jsonl").write_bytes(
            good.encode() + b'\n{"ttft_ms": "\xff\xfe"}\n[1, 2]\n' + good.encode()[:17])
    page = render_report([root])
    assert "Time to first token" in page and "41.5" in page
