"""Where everything of a sweep lives: every path of a sweep and a run is built here, from the names of
`SweepFiles` (below) and `RunFiles` (harness/remote/names.py, which the tools on the host use too).

    RESULTS/<sweep_id>/            SweepLayout   sweep.json, journal.jsonl, sweep.lock, summary.json|csv,
                                                 a search's search.json and study.db
        runs/<run_id>/             RunLayout     manifest.json, launch.sh, server.log, bench.json, ...
    WORKDIR/<sweep_id>/<run_id>/   HostRunLayout the same run folder on its host, pulled whole
    WORKDIR/<sweep_id>/.host/<host>/
                                   HostCache     what the sweep's runs on a host find once: the engine
                                                 imported, its flag listing, the host's facts

A run folder has the same names on the host and, once collected, here (what the host wrote is what
the pull brings back), so both layouts take their names from `RunFiles`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from harness.remote.names import RunFiles

__all__ = ["HostCache", "HostRunLayout", "RunFiles", "RunLayout", "SweepFiles", "SweepLayout", "node_name"]

P = TypeVar("P", Path, str)


def node_name(rank: int) -> str:
    """The folder of node `rank` (>= 1) of a multi-node run, under nodes/ and under profile/."""
    return f"node{rank}"


class SweepFiles:
    SWEEP = "sweep.json"
    JOURNAL = "journal.jsonl"
    LOCK = "sweep.lock"
    SUMMARY_JSON = "summary.json"
    SUMMARY_CSV = "summary.csv"
    SEARCH = "search.json"            # a search's trials and its best, for compare and the report
    STUDY = "study.db"                # the Optuna study (SQLite) that --resume continues
    RUNS = "runs"


class HostFiles:
    CACHE = ".host"                   # beside the sweep's run folders on a host
    IMPORTED = "module.ok"            # the engine imported once: later probes ask for no import
    HELP = "help.txt"                 # the engine's flag listing
    FACTS = "facts"                   # the host's facts, one file each


class _Named(Generic[P]):
    """A file (or folder) of a layout by its name: `layout.bench` is the layout's folder joined with
    `RunFiles.BENCH`, a Path here and a text path on the host."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, layout: _Folder[P], owner: type | None = None) -> P:
        return layout.at(self.name)


class _Folder(Generic[P]):
    def at(self, name: str) -> P:
        raise NotImplementedError


@dataclass(frozen=True)
class _Here(_Folder[Path]):
    dir: Path

    def at(self, name: str) -> Path:
        return self.dir / name


@dataclass(frozen=True)
class RunLayout(_Here):
    """A run's folder in the results."""

    @property
    def run_id(self) -> str:
        return self.dir.name

    manifest = _Named[Path](RunFiles.MANIFEST)
    launch = _Named[Path](RunFiles.LAUNCH)
    server_log = _Named[Path](RunFiles.SERVER_LOG)
    bench = _Named[Path](RunFiles.BENCH)
    requests = _Named[Path](RunFiles.REQUESTS)
    telemetry = _Named[Path](RunFiles.TELEMETRY)
    analysis = _Named[Path](RunFiles.ANALYSIS)
    profile = _Named[Path](RunFiles.PROFILE)
    facts = _Named[Path](RunFiles.FACTS)
    harness_error = _Named[Path](RunFiles.HARNESS_ERROR)

    def node(self, rank: int) -> RunLayout:
        """Node `rank`'s (>= 1) run folder, pulled back beside node 0's: nodes/node<rank>/."""
        return RunLayout(self.dir / RunFiles.NODES / node_name(rank))

    def node_profile(self, rank: int) -> Path:
        """Where node `rank`'s (>= 1) traces land: profile/node<rank>/, so every name stays unique."""
        return self.profile / node_name(rank)


@dataclass(frozen=True)
class SweepLayout(_Here):
    """A sweep's folder in the results."""

    @classmethod
    def of(cls, results: Path, sweep_id: str) -> SweepLayout:
        return cls(Path(results) / sweep_id)

    @property
    def sweep_id(self) -> str:
        return self.dir.name

    record = _Named[Path](SweepFiles.SWEEP)
    journal = _Named[Path](SweepFiles.JOURNAL)
    lock = _Named[Path](SweepFiles.LOCK)
    summary_json = _Named[Path](SweepFiles.SUMMARY_JSON)
    summary_csv = _Named[Path](SweepFiles.SUMMARY_CSV)
    search = _Named[Path](SweepFiles.SEARCH)
    study = _Named[Path](SweepFiles.STUDY)
    runs = _Named[Path](SweepFiles.RUNS)

    def run(self, run_id: str) -> RunLayout:
        return RunLayout(self.runs / run_id)

    def run_layouts(self) -> list[RunLayout]:
        """Every run folder that has a manifest."""
        return [RunLayout(p.parent) for p in self.runs.glob(f"*/{RunFiles.MANIFEST}")]

    def is_sweep(self) -> bool:
        return self.record.exists() or self.runs.is_dir()


@dataclass(frozen=True)
class _There(_Folder[str]):
    """A folder on a host: its paths are text, for the host's shell."""
    root: str

    def at(self, name: str) -> str:
        return f"{self.root}/{name}"


@dataclass(frozen=True)
class HostRunLayout(_There):
    """Where a run lives on its host: WORKDIR/<sweep_id>/<run_id>, and for node k >= 1 of a server on
    several hosts WORKDIR/<sweep_id>/<run_id>.node<k>: hosts may share a workdir (a home directory on
    NFS), and two nodes in one folder would write each other's launch script, pid file and traces."""

    @classmethod
    def of(cls, workdir: str, sweep_id: str, run_id: str, node_rank: int = 0) -> HostRunLayout:
        folder = run_id if node_rank == 0 else f"{run_id}.node{node_rank}"
        return cls(f"{workdir.rstrip('/')}/{sweep_id}/{folder}")

    launch = _Named[str](RunFiles.LAUNCH)
    log = _Named[str](RunFiles.SERVER_LOG)
    pid_file = _Named[str](RunFiles.PID)
    exit_file = _Named[str](RunFiles.EXIT)
    lease = _Named[str](RunFiles.LEASE)
    secrets_file = _Named[str](RunFiles.SECRETS)
    profile_dir = _Named[str](RunFiles.PROFILE)
    facts_dir = _Named[str](RunFiles.FACTS)
    bench_json = _Named[str](RunFiles.BENCH)
    bench_progress = _Named[str](RunFiles.BENCH_PROGRESS)
    telemetry = _Named[str](RunFiles.TELEMETRY)
    prompt = _Named[str](RunFiles.PROMPT)


@dataclass(frozen=True)
class HostCache(_There):
    """What the runs of one sweep on one host find once and share: WORKDIR/<sweep_id>/.host/<host>,
    named by the inventory's host, since hosts may share a workdir (a home directory on NFS): each
    keeps its own facts and its own venv's flag listing."""

    @classmethod
    def of(cls, workdir: str, sweep_id: str, host: str) -> HostCache:
        return cls(f"{workdir.rstrip('/')}/{sweep_id}/{HostFiles.CACHE}/{host}")

    imported = _Named[str](HostFiles.IMPORTED)
    help = _Named[str](HostFiles.HELP)
    facts = _Named[str](HostFiles.FACTS)
