"""What `harness reproduce` puts side by side: each level of the original beside the level of the same key in
the reproduction (scenario, load kind, load, probe or not), with the noise of that level alone."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from harness.report.reproduce_view import render_comparison
from harness.reproduce import compare_runs


def level(itl: float, *, scenario: str | None = None, concurrency: int | None = None, rate: float | None = None,
          probe: bool = False) -> dict:
    return {"scenario": scenario, "concurrency": concurrency, "request_rate": rate, "probe": probe, "requests": 8,
            "completed": 8, "failed": 0, "output_tok_s": 1000 / itl, "ttft_ms": {"p50": 2 * itl},
            "itl_ms": {"p50": itl, "p99": 1.5 * itl}, "tpot_ms": {"p50": itl}}


def write_run(runs: Path, run_id: str, levels: list[dict], requests: tuple[dict, ...] | list[dict] = ()) -> Path:
    run = runs / run_id
    run.mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({
        "run_id": run_id, "status": "ok", "engine": "sim", "host": {"name": "h", "gpus": 1, "gpu": "H200"},
        "config": {"name": "a", "env": {}}, "model": {"path": "/m"}, "gpus_used": 1}))
    (run / "bench.json").write_text(json.dumps({"prompt_tokens": 16, "levels": levels}))
    (run / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    return run


# A closed-loop scenario at 8 and its max_load probe at 8 too; an open-loop scenario at two rates (neither has a
# concurrency); a second closed-loop scenario at 8. Paired by concurrency alone, all but one would collide.
ORIGINAL = [level(10.0, scenario="chat", concurrency=8), level(11.0, scenario="chat", concurrency=8, probe=True),
            level(20.0, scenario="burst", rate=2.0), level(30.0, scenario="burst", rate=4.0),
            level(40.0, scenario="long", concurrency=8)]


def reproduction() -> list[dict]:
    """The same levels measured again, in another order, each 10% slower than its original."""
    return [dict(lv, itl_ms={"p50": lv["itl_ms"]["p50"] * 1.1, "p99": lv["itl_ms"]["p99"] * 1.1})
            for lv in reversed(ORIGINAL)]


def itl_p50(rows) -> dict[tuple, tuple[float, float]]:
    return {r.level: (r.before, r.after) for r in rows if r.label == "ITL p50 ms"}


def test_each_level_pairs_with_the_one_of_its_scenario_load_kind_load_and_probe(tmp_path):
    original = write_run(tmp_path / "old" / "runs", "a-1", ORIGINAL)
    again = write_run(tmp_path / "new" / "runs", "a-1", reproduction())
    result = compare_runs(original, again)
    paired = itl_p50(result["rows"])
    assert set(paired) == {("chat", "concurrency", 8, False), ("chat", "concurrency", 8, True),
                           ("burst", "request_rate", 2.0, False), ("burst", "request_rate", 4.0, False),
                           ("long", "concurrency", 8, False)}
    for before, after in paired.values():
        assert after == before * 1.1
    assert all(r.delta is not None and round(r.delta, 6) == 0.1 for r in result["rows"] if r.label == "ITL p50 ms")
    shown = Console(record=True, width=120)
    shown.print(render_comparison(result, before="original", after="now"))
    text = shown.export_text()
    for name in ("chat 8 ", "chat 8*", "burst 2/s", "burst 4/s", "long 8 "):
        assert name in text
    assert "* a probe of search.max_load" in text


def test_a_level_missing_from_the_reproduction_has_no_after(tmp_path):
    original = write_run(tmp_path / "old" / "runs", "a-1", ORIGINAL)
    again = write_run(tmp_path / "new" / "runs", "a-1", [lv for lv in reproduction() if lv["request_rate"] != 4.0])
    paired = itl_p50(compare_runs(original, again)["rows"])
    assert paired[("burst", "request_rate", 4.0, False)] == (30.0, None)
    assert paired[("burst", "request_rate", 2.0, False)][1] == 22.0


def test_the_noise_of_a_level_comes_from_its_own_repeats_and_requests(tmp_path):
    runs = tmp_path / "old" / "runs"
    # the open loop at 2/s: requests of one TTFT (no spread); at 4/s: TTFTs far apart (a wide spread)
    steady = [{"scenario": "burst", "concurrency": None, "request_rate": 2.0, "probe": False, "ttft_ms": 5.0}] * 8
    spread = [{"scenario": "burst", "concurrency": None, "request_rate": 4.0, "probe": False, "ttft_ms": t}
              for t in (1.0, 9.0) * 4]
    original = write_run(runs, "a-1", ORIGINAL, steady + spread)
    # a repeat whose "long" level differs by a fifth from the original's: the spread of the repeats
    write_run(runs, "a-2", [dict(lv, ttft_ms={"p50": 96.0}) if lv["scenario"] == "long" else lv for lv in ORIGINAL])
    again = write_run(tmp_path / "new" / "runs", "a-1", reproduction())
    ttft = {r.level: r for r in compare_runs(original, again)["rows"] if r.label == "TTFT p50 ms"}
    long, chat = ttft[("long", "concurrency", 8, False)], ttft[("chat", "concurrency", 8, False)]
    assert long.noise_source == "spread of 2 repeats" and round(long.noise, 6) == round(16 / 88, 6)
    assert chat.noise_source == "spread of 2 repeats" and chat.noise == 0.02   # the repeats agree: the floor
    calm, wild = ttft[("burst", "request_rate", 2.0, False)], ttft[("burst", "request_rate", 4.0, False)]
    assert calm.noise_source == wild.noise_source == "spread of 2 repeats"


def test_without_repeats_the_noise_is_the_half_split_of_the_levels_own_requests(tmp_path):
    runs = tmp_path / "old" / "runs"
    steady = [{"scenario": "burst", "concurrency": None, "request_rate": 2.0, "probe": False, "ttft_ms": 5.0}] * 8
    spread = [{"scenario": "burst", "concurrency": None, "request_rate": 4.0, "probe": False, "ttft_ms": t}
              for t in (1.0, 2.0, 9.0, 10.0) * 2]
    original = write_run(runs, "a-1", ORIGINAL, steady + spread)
    again = write_run(tmp_path / "new" / "runs", "a-1", reproduction())
    ttft = {r.level: r for r in compare_runs(original, again)["rows"] if r.label == "TTFT p50 ms"}
    calm, wild = ttft[("burst", "request_rate", 2.0, False)], ttft[("burst", "request_rate", 4.0, False)]
    assert calm.noise_source == wild.noise_source == "half-split of the original's requests"
    assert calm.noise == 0.02 and wild.noise > 0.1
    assert ttft[("chat", "concurrency", 8, False)].noise_source == "assumed"   # no requests of its own


def test_the_noise_comes_from_the_repeats_of_the_runs_own_sweep_only(tmp_path):
    """A colleague's folder of runs gathered from several sweeps: a run of the same configuration name
    from another sweep is no repeat of this one, and its spread is not this run's noise."""
    runs = tmp_path / "gathered"
    original = write_run(runs, "a-1", ORIGINAL)
    elsewhere = write_run(runs, "a-1-other-sweep", [dict(lv, ttft_ms={"p50": 2 * lv["ttft_ms"]["p50"]})
                                                    for lv in ORIGINAL])
    for run, sweep in ((original, "s-20260101-000000"), (elsewhere, "s-20260202-000000")):
        manifest = json.loads((run / "manifest.json").read_text())
        (run / "manifest.json").write_text(json.dumps(manifest | {"sweep_id": sweep}))
    again = write_run(tmp_path / "new" / "runs", "a-1", reproduction())
    ttft = [r for r in compare_runs(original, again)["rows"] if r.label == "TTFT p50 ms"]
    assert ttft and all(r.noise_source != "spread of 2 repeats" for r in ttft)
    assert all(r.noise < 0.5 for r in ttft)


def test_a_fact_of_several_fields_is_shown_whole_not_as_a_cut_python_repr():
    from harness.report.reproduce_view import _fmt
    commit = "0123456789abcdef0123456789abcdef01234567"
    assert _fmt({"commit": commit, "dirty": True}) == f"commit {commit}, dirty True"
    assert _fmt("x" * 300) == "x" * 197 + "..."
