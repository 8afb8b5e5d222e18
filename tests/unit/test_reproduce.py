"""What `harness reproduce` puts side by side: each level of the original beside the level of the same key in
the reproduction (scenario, load kind, load, probe or not), with the noise of that level alone."""

from __future__ import annotations

import datetime as dt
import json
import os
import time
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from harness import reproduce
from harness.errors import InputError
from harness.report.reproduce_view import render_comparison
from harness.reproduce import compare_runs, prepare


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


# ---- every node's launch script, and the model's path moved on purpose -----------------------------------

def launched(run: Path, lines: list[str], *, rank: int = 0, workdir: str = "/w", model: str = "/m") -> None:
    """A launch script as the harness writes one for node `rank` of run `run`, in `workdir` on its host."""
    manifest = json.loads((run / "manifest.json").read_text())
    folder = f"{workdir}/{manifest['sweep_id']}/{manifest['run_id']}"
    where = run if rank == 0 else run / "nodes" / f"node{rank}"
    where.mkdir(parents=True, exist_ok=True)
    (where / "launch.sh").write_text("\n".join(["#!/usr/bin/env bash", "# rendered by harness", f"cd {folder}",
                                                *lines, f"exec python -m sglang.launch_server --model-path {model} "
                                                f"--node-rank {rank}"]) + "\n")


def two_nodes(run: Path, *, sweep: str, hosts: tuple[str, str], model: str = "/m") -> Path:
    manifest = json.loads((run / "manifest.json").read_text())
    manifest |= {"sweep_id": sweep, "model": {"path": model},
                 "nodes": [{"rank": 0, "host": hosts[0]}, {"rank": 1, "host": hosts[1], "dir": "nodes/node1"}]}
    (run / "manifest.json").write_text(json.dumps(manifest))
    return run


def test_every_nodes_launch_script_is_compared_and_a_difference_is_named_with_its_node(tmp_path):
    """A server on two hosts: node 1's script differs (its new host's inventory adds env), node 0's
    does not; each node's folder on its host (another workdir, another sweep) is no difference."""
    original = two_nodes(write_run(tmp_path / "old" / "runs", "a-1", ORIGINAL), sweep="s-1", hosts=("g1", "g2"))
    again = two_nodes(write_run(tmp_path / "new" / "runs", "a-1", reproduction()), sweep="s-2", hosts=("g1", "g3"))
    for run, workdir in ((original, "/home/ann"), (again, "/home/bob")):
        launched(run, ["export A=1"], workdir=workdir)
    launched(original, ["export A=1"], rank=1, workdir="/home/ann")
    launched(again, ["export A=1", "export NCCL_DEBUG=INFO"], rank=1, workdir="/scratch/bob")
    facts = compare_runs(original, again)["facts"]
    assert facts == [{"fact": "node 1 launch.sh", "before": None, "after": "export NCCL_DEBUG=INFO"}]


def test_a_node_that_launched_in_one_run_only_is_said(tmp_path):
    original = two_nodes(write_run(tmp_path / "old" / "runs", "a-1", ORIGINAL), sweep="s-1", hosts=("g1", "g2"))
    again = two_nodes(write_run(tmp_path / "new" / "runs", "a-1", reproduction()), sweep="s-2", hosts=("g1", "g3"))
    launched(original, [])
    launched(again, [])
    launched(again, [], rank=1)   # the copy of the original lost nodes/node1/
    facts = compare_runs(original, again)["facts"]
    assert facts == [{"fact": "node 1 launch.sh", "before": "(no launch.sh)", "after": "(launched)"}]


def test_a_moved_model_path_is_a_fact_and_no_difference_of_the_launch(tmp_path):
    """`--model-path`: the one substitution asked for is said once, as model.path, and every line it
    changed reads as the original's; a line that still names the recorded path is no change either."""
    original = write_run(tmp_path / "old" / "runs", "a-1", ORIGINAL)
    again = write_run(tmp_path / "new" / "runs", "a-1", reproduction())
    for run, model in ((original, "/models/tiny"), (again, "/data/my models/tiny")):
        manifest = json.loads((run / "manifest.json").read_text())
        (run / "manifest.json").write_text(json.dumps(manifest | {"sweep_id": "s", "model": {"path": model}}))
    launched(original, ["export T=/models/tiny/tokenizer"], model="/models/tiny")
    launched(again, ["export T=/models/tiny/tokenizer"], model="'/data/my models/tiny'")
    result = compare_runs(original, again)
    assert result["facts"] == [{"fact": "model.path (--model-path)", "before": "/models/tiny",
                                "after": "/data/my models/tiny"}]
    # any other change still shows
    launched(again, ["export T=/data/my-models/tokenizer"], model="'/data/my models/tiny'")
    changed = {"fact": "launch.sh", "before": "export T=/models/tiny/tokenizer",
               "after": "export T=/data/my-models/tokenizer"}
    assert compare_runs(original, again)["facts"][1:] == [changed]


def test_an_original_without_figures_is_said_not_shown_as_an_empty_table(tmp_path):
    original = write_run(tmp_path / "old" / "runs", "a-1", ORIGINAL)
    (original / "bench.json").write_text("{")
    again = write_run(tmp_path / "new" / "runs", "a-1", reproduction())
    result = compare_runs(original, again)
    assert result["rows"] and all(r.before is None for r in result["rows"])   # the reproduction's levels still show
    shown = Console(record=True, width=200)
    shown.print(render_comparison(result, before="original", after="now"))
    text = shown.export_text()
    assert f"note: original: no benchmark figures: {original / 'bench.json'} cannot be read" in text, text


# ---- prepare: the working folder is whole or absent ------------------------------------------------------

TEMPLATES = Path(__file__).resolve().parents[2] / "harness" / "templates"


def recorded_run(tmp_path: Path, **playbook) -> tuple[Path, Path]:
    """A run folder whose manifest records a playbook of one run on `localhost`, and an inventory."""
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(json.dumps({"all": {"hosts": {"localhost": {"transport": "local", "venv": "/venv"}}}}))
    run = write_run(tmp_path / "theirs" / "runs", "a-1", ORIGINAL)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest |= {"sweep_id": "s-20260101-000000", "playbook": {
        "name": "s", "hosts": "localhost", "engine": "sglang", "model": {"path": "/models/tiny"},
        "server": {"port": 30000, "env": {}, "args": {}}, "configs": [{"name": "a", "args": {"tp-size": 2}}],
        "benchmark": {"concurrency": [1]}, "profile": {"mode": "none"}, **playbook},
        "template": {"name": "sglang.sh.j2", "files": {p.name: p.read_text() for p in TEMPLATES.glob("*.j2")}}}
    (run / "manifest.json").write_text(json.dumps(manifest))
    return run, inventory


def everything(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else []


def test_a_refusal_leaves_nothing_on_disk(tmp_path):
    """The recorded host is not in this inventory: refused, and no folder of the reproduction is left
    (neither its working folder nor the results folder made for it)."""
    run, inventory = recorded_run(tmp_path, hosts="gpu-01")
    results = tmp_path / "new" / "results"
    with pytest.raises(InputError, match="--host NAME"):
        prepare(run, inventory, host=None, results=results)
    assert not (tmp_path / "new").exists()
    kept = tmp_path / "kept"
    (kept / "earlier").mkdir(parents=True)
    with pytest.raises(InputError, match="'gpu-02' matches no host"):
        prepare(run, inventory, host="gpu-02", results=kept)
    assert everything(kept) == ["earlier"]


def test_a_refusal_names_the_record_not_the_copy_that_is_gone(tmp_path):
    run, inventory = recorded_run(tmp_path, configs=[])
    with pytest.raises(InputError) as refused:
        prepare(run, inventory, host=None, results=tmp_path / "r")
    assert refused.value.file == str(run / "manifest.json") and refused.value.key == "playbook"
    assert ".reproduce" not in str(refused.value)


def test_ctrl_c_while_preparing_leaves_no_half_folder(tmp_path, monkeypatch):
    run, inventory = recorded_run(tmp_path)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(reproduce, "load_sweep", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare(run, inventory, host=None, results=tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_two_reproductions_in_one_second_never_share_a_folder_or_a_sweep(tmp_path, monkeypatch):
    """The folder's name has the second in it: a second reproduction then (or one after a folder cut
    short) must not take the first's folder, nor its sweep, for its own."""
    run, inventory = recorded_run(tmp_path)

    class Frozen(dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2026, 1, 1, 12, 0, 0)
    monkeypatch.setattr(reproduce.dt, "datetime", Frozen)
    first = prepare(run, inventory, host=None, results=tmp_path / "r")
    (tmp_path / "r" / first.sweep_id).mkdir()   # the first one's sweep has begun
    second = prepare(run, inventory, host=None, results=tmp_path / "r")
    assert first.sweep_id != second.sweep_id
    assert first.doc.path.parent != second.doc.path.parent
    assert first.doc.path.is_file() and second.doc.path.is_file()
    assert not [p for p in (tmp_path / "r" / ".reproduce").iterdir() if p.name.endswith(".partial")]


def test_what_stops_a_reproduction_before_its_sweep_begins_leaves_nothing(tmp_path):
    """A Slurm allocation that does not come, Ctrl-C before the first run: the working folder goes;
    once the sweep's folder exists, both stay (its sweep.json names the working folder's playbook)."""
    run, inventory = recorded_run(tmp_path)
    with pytest.raises(KeyboardInterrupt), reproduce.reproduction(run, inventory, host=None, results=tmp_path / "r"):
        raise KeyboardInterrupt
    assert not (tmp_path / "r").exists()
    with pytest.raises(KeyboardInterrupt), \
            reproduce.reproduction(run, inventory, host=None, results=tmp_path / "r") as sweep:
        (tmp_path / "r" / sweep.sweep_id).mkdir()
        raise KeyboardInterrupt
    assert sweep.doc.path.is_file()


def test_the_model_path_given_replaces_the_recorded_one_and_nothing_else(tmp_path):
    run, inventory = recorded_run(tmp_path)
    sweep = prepare(run, inventory, host=None, results=tmp_path / "r", model_path="/data/my models/tiny")
    assert sweep.playbook.model.path == "/data/my models/tiny"
    written = yaml.safe_load(sweep.doc.path.read_text())
    assert written["model"] == {"path": "/data/my models/tiny"}   # the copy records what ran
    with pytest.raises(InputError, match="--model-path"):
        prepare(run, inventory, host=None, results=tmp_path / "r2", model_path="/a\n/b")
    assert not (tmp_path / "r2").exists()


def test_a_run_that_never_started_is_refused_for_what_it_is_not_as_an_older_harness(tmp_path):
    """A skipped run's manifest has its first block only: no playbook, which is not the mark of an
    older harness, and the refusal says why the run has nothing to run again."""
    run = write_run(tmp_path / "runs", "a-1", [])
    manifest = json.loads((run / "manifest.json").read_text())
    (run / "manifest.json").write_text(json.dumps(manifest | {"status": "skipped", "skipped": "the deadline passed"}))
    with pytest.raises(InputError) as refused:
        prepare(run, tmp_path / "inventory.yaml", host=None, results=tmp_path / "r")
    said = str(refused.value)
    assert "never started (skipped: the deadline passed)" in said and "older harness" not in said, said
    assert not (tmp_path / "r").exists()


def test_a_folder_left_half_written_by_a_killed_reproduction_goes_with_the_next_one(tmp_path):
    """kill -9 between the working folder's first file and its rename leaves `.<run>-*.partial`: the
    next reproduction removes it; a folder that another reproduction is writing right now stays."""
    run, inventory = recorded_run(tmp_path)
    workspace = tmp_path / "r" / ".reproduce"
    left = workspace / f".{run.name}-k9x2.partial"
    left.mkdir(parents=True)
    (left / "sglang.sh.j2").write_text("half")
    old = time.time() - reproduce.PARTIAL_STALE_S - 60
    os.utime(left, (old, old))
    writing = workspace / f".{run.name}-now1.partial"
    writing.mkdir()
    prepare(run, inventory, host=None, results=tmp_path / "r")
    assert not left.exists() and writing.is_dir()
