"""The results files as models: one writer, typed readers, older and newer files still read, a broken
file named rather than a traceback, and every path spelled by the layout."""

from __future__ import annotations

import json

import pytest

from harness.journal import Journal, read_journal
from harness.results import (
    AnalysisFile,
    BenchFile,
    HostRunLayout,
    JournalEvent,
    RunManifest,
    SweepLayout,
    SweepRecord,
    Unreadable,
    load_runs,
    read_model,
    write_model,
    write_summary,
)


def manifest(run_id: str = "tp8-1", **fields) -> dict:
    return {"schema": "harness.run/1", "run_id": run_id, "sweep_id": "demo-1", "config": {"name": "tp8"},
            "host": {"name": "gpu-01"}, "status": "ok", "attempts": 1, "phases": {"bench": {"seconds": 2.5}},
            **fields}


def level(concurrency: int, itl_p50: float) -> dict:
    dist = {"mean": itl_p50, "p50": itl_p50, "p99": itl_p50 * 2}
    return {"concurrency": concurrency, "requests": 8, "completed": 8, "failed": 0, "output_tok_s": 100.0,
            "ttft_ms": dist, "itl_ms": dist, "tpot_ms": dist, "e2e_ms": dist}


def test_a_manifest_round_trips_and_keeps_fields_this_version_does_not_name(tmp_path):
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(manifest(future_field={"a": 1})))
    m = read_model(path, RunManifest)
    assert (m.run_id, m.ok, m.seconds("bench"), m.host.name) == ("tp8-1", True, 2.5, "gpu-01")
    write_model(path, m)
    again = json.loads(path.read_text())
    assert again["schema"] == "harness.run/1" and again["future_field"] == {"a": 1}
    assert list(again)[:3] == ["schema", "run_id", "sweep_id"]


def test_the_manifest_of_a_run_that_never_started_reads_with_what_it_has():
    """What a sweep writes for a skipped run: no host facts, no phases, no profile."""
    m = RunManifest.model_validate({"schema": "harness.run/1", "run_id": "a-1", "sweep_id": "s",
                                    "config": {"name": "a"}, "status": "skipped", "skipped": "the deadline passed"})
    assert m.profile is None and m.phases == {} and m.collected.bytes == 0 and not m.ok


@pytest.mark.parametrize("content, key", [
    ("{not json", None),
    (json.dumps(manifest(status="fine")), "status"),
    (json.dumps({k: v for k, v in manifest().items() if k != "config"}), "config"),
    (json.dumps(manifest(phases={"bench": {"seconds": "soon"}})), "phases.bench.seconds"),
])
def test_a_broken_manifest_is_named_with_its_file_and_key(tmp_path, content, key):
    path = tmp_path / "manifest.json"
    path.write_text(content)
    with pytest.raises(Unreadable) as e:
        read_model(path, RunManifest)
    assert e.value.file == str(path)
    if key:
        assert e.value.key == key


def test_a_sweep_reads_its_runs_in_playbook_order_and_skips_a_run_being_written(tmp_path):
    sweep = SweepLayout.of(tmp_path, "demo-1")
    write_model(sweep.record, SweepRecord.model_validate(
        {"sweep_id": "demo-1", "runs": [{"run_id": "zz-1", "config": "zz"}, {"run_id": "aa-1", "config": "aa"}]}))
    for run_id, itl in (("zz-1", 2.0), ("aa-1", 3.0)):
        run = sweep.run(run_id)
        run.dir.mkdir(parents=True)
        run.manifest.write_text(json.dumps(manifest(run_id)))
        run.bench.write_text(json.dumps({"schema": "harness.bench/1", "prompt_tokens": 16,
                                         "levels": [level(1, itl), level(8, itl * 2)]}))
    half = sweep.run("mm-1")
    half.dir.mkdir()
    half.manifest.write_text('{"schema": "harness.run/1", "run_')
    runs = load_runs(sweep.dir)
    assert [r.manifest.run_id for r in runs] == ["zz-1", "aa-1"]
    assert runs[0].levels[1].stat("itl_ms", "p50") == 4.0 and runs[0].bench.prompt_tokens == 16
    rows = write_summary(sweep.dir)
    assert [(r["run_id"], r["concurrency"], r["itl_p50_ms"]) for r in rows] == [
        ("zz-1", 1, 2.0), ("zz-1", 8, 4.0), ("aa-1", 1, 3.0), ("aa-1", 8, 6.0)]
    assert sweep.summary_csv.read_text().splitlines()[0].startswith("run_id,config,host,status")


def test_a_bench_file_from_a_host_that_does_not_match_counts_as_no_benchmark(tmp_path):
    sweep = SweepLayout.of(tmp_path, "s")
    run = sweep.run("a-1")
    run.dir.mkdir(parents=True)
    run.manifest.write_text(json.dumps(manifest("a-1")))
    run.bench.write_text(json.dumps({"schema": "harness.bench/1", "levels": [{"concurrency": "many"}]}))
    (only,) = load_runs(sweep.dir)
    assert only.bench is None and only.levels == []


def test_analysis_decode_scope_is_the_decode_stage_when_it_ran_kernels():
    kernel = {"name": "k", "share": 1.0}
    whole = AnalysisFile.model_validate({"schema": "harness.analysis/1", "top": [kernel], "stages": {
        "decode": {"top": [kernel], "categories": {"gemm": 1.0}}, "prefill": {"top": []}}})
    scope, stage = whole.decode_scope()
    assert stage == "decode" and scope.categories == {"gemm": 1.0}
    no_decode = AnalysisFile.model_validate({"schema": "harness.analysis/1", "top": [kernel],
                                             "stages": {"decode": {"top": []}}})
    assert no_decode.decode_scope() == (no_decode, "")


def test_the_journal_writes_typed_events_and_skips_lines_that_are_not_events(tmp_path):
    journal = Journal(tmp_path / "journal.jsonl")
    journal.append("a-1", "running", host="gpu-01", attempt=1)
    with pytest.raises(ValueError):
        journal.append("a-1", "finished-ish")
    with open(journal.path, "a") as f:
        f.write('{"t": 1, "run_id": "a-1", "state": "exploded"}\n')
    journal.append("a-1", "ok", host="gpu-01", attempts=1)
    events = read_journal(journal.path)
    assert [(e.run_id, e.state, e.host) for e in events] == [("a-1", "running", "gpu-01"), ("a-1", "ok", "gpu-01")]
    assert all(isinstance(e, JournalEvent) for e in events)


def test_the_host_layout_and_the_local_layout_name_the_same_files(tmp_path):
    host = HostRunLayout.of("/home/u/.cache/harness/", "demo-1", "tp8-1")
    local = SweepLayout.of(tmp_path, "demo-1").run("tp8-1")
    assert host.root == "/home/u/.cache/harness/demo-1/tp8-1"
    assert host.bench_json.rsplit("/", 1)[1] == local.bench.name == "bench.json"
    assert host.log.rsplit("/", 1)[1] == local.server_log.name


def test_the_bench_client_and_the_analyzer_write_the_schemas_the_models_read():
    from harness.analysis import SCHEMA as ANALYSIS
    from harness.remote.bench import SCHEMA as BENCH
    assert BenchFile.model_fields["schema_"].default == BENCH
    assert AnalysisFile.model_fields["schema_"].default == ANALYSIS


def test_a_runs_requests_are_read_line_by_line_and_only_numbers_are_samples(tmp_path):
    from harness.results import RunLayout, read_requests, samples
    layout = RunLayout(tmp_path)
    assert read_requests(layout) == []   # no file
    layout.requests.write_bytes(b'{"itl_ms": [1, 2.5], "ttft_ms": 40}\n{"ttft_ms": "\xff"}\n[1]\nnot json\n'
                                b'{"itl_ms": [1, NaN], "ttft_ms": true}\n{"itl_ms": [1, "2"], "ttft_ms": null}\n{"itl')
    records = read_requests(layout)
    assert len(records) == 4   # the list, the line that is not JSON and the torn last line are left out
    assert [samples(r, "itl_ms") for r in records] == [[1.0, 2.5], None, None, None]
    assert [samples(r, "ttft_ms") for r in records] == [[40.0], None, None, None]


def test_a_write_the_disk_has_no_room_for_names_its_file_and_leaves_nothing(tmp_path):
    """On a full file system (a 64 kB tmpfs, filled), the write to the file's descriptor fails with an
    OSError naming no file; the one a results file raises names it (the CLI's one-line error shows
    that name), and no temporary file is left beside it."""
    import subprocess

    from harness.results.store import atomic_write
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)], check=True)
    try:
        (small / "runs").mkdir()
        with open(small / "fill", "wb", buffering=0) as f, pytest.raises(OSError):
            while True:
                f.write(b"\0" * 4096)
        with pytest.raises(OSError) as refused:
            atomic_write(small / "runs" / "manifest.json", json.dumps({"x": "y" * 100_000}))
        assert refused.value.filename == str(small / "runs" / "manifest.json")
        assert refused.value.strerror == "No space left on device"
        assert [p.name for p in small.rglob("*") if p.is_file()] == ["fill"]
    finally:
        subprocess.run(["umount", str(small)], check=True)


@pytest.mark.parametrize("fixture", ["real_trace", "transformers_trace", "vllm_h200/graphs", "vllm_cpu"])
def test_the_analysis_of_every_real_trace_reads_back_as_written(tmp_path, fixture):
    """A trace that marks no engine steps (torch.profiler's own, transformers, vLLM's CPU build) is
    analysed with null step figures; its analysis.json, written as a run writes it, read as a file that
    could not be read, and compare and the report showed no kernels for that run."""
    from pathlib import Path

    from harness.analysis import analyze_path
    from harness.results import AnalysisFile, read_model
    from harness.results.store import write_json
    analysis = analyze_path(Path(__file__).parents[1] / "fixtures" / fixture)
    write_json(tmp_path / "analysis.json", analysis)
    read = read_model(tmp_path / "analysis.json", AnalysisFile)
    assert [k.name for k in read.top] == [k["name"] for k in analysis["top"]]
    assert read.categories == (analysis["categories"] or {})


def test_finishing_a_run_hashes_its_files_as_they_lie_and_names_those_that_are_gone(tmp_path):
    """The hashes come once the host is free (`finish`): of each file as it lies in the run folder, a
    file gone by then named in a warning rather than hashed as nothing, and a name that would lead out
    of the folder (a damaged manifest's) never read."""
    import hashlib

    from harness.lifecycle.run import finish, unfinished
    from harness.results import RunLayout

    layout = RunLayout(tmp_path / "run")
    (layout.dir / "profile").mkdir(parents=True)
    (layout.dir / "server.log").write_text("masked ***\n")
    (layout.dir / "profile" / "0.trace.json.gz").write_bytes(b"\x1f\x8b" + bytes(1000))
    (tmp_path / "outside").write_text("not the run's")
    names = ["profile/0.trace.json.gz", "server.log", "bench.json", "../outside"]
    record = RunManifest.model_validate(manifest(collected={"files": 4, "bytes": 1013, "unhashed": names}))
    assert unfinished(record)
    done = finish(layout, record)
    assert done.collected.sha256 == {name: hashlib.sha256((layout.dir / name).read_bytes()).hexdigest()
                                     for name in ("profile/0.trace.json.gz", "server.log")}
    assert not done.collected.unhashed and not unfinished(done)
    assert [w.split(":")[0] for w in done.warnings] == ["bench.json", "../outside"]
    assert "finish" in done.phases and read_model(layout.manifest, RunManifest) == done


def test_an_analysis_that_breaks_keeps_the_hashes_and_says_so(tmp_path, monkeypatch):
    """A bug of ours in the trace analysis (or a full disk under analysis.json): the files are hashed
    all the same, and the analysis records its error, which `harness analyze` can take up again."""
    import harness.analysis
    from harness.lifecycle.run import finish
    from harness.results import RunLayout

    def broken(*args, **kwargs):
        raise ValueError("a parser bug")
    monkeypatch.setattr(harness.analysis, "analyze_path", broken)
    layout = RunLayout(tmp_path / "run")
    (layout.dir / "profile").mkdir(parents=True)
    (layout.dir / "profile" / "0.trace.json").write_text("{}")
    record = RunManifest.model_validate(manifest(
        collected={"files": 1, "bytes": 2, "unhashed": ["profile/0.trace.json"]},
        profile={"mode": "engine", "status": "ok", "files": [{"name": "0.trace.json", "bytes": 2}], "num_steps": 3}))
    done = finish(layout, record)
    assert list(done.collected.sha256) == ["profile/0.trace.json"] and not done.collected.unhashed
    assert done.profile is not None and done.profile.analysis is not None
    assert "a parser bug" in (done.profile.analysis.error or "")
