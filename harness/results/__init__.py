"""The results of sweeps: where each file lives (`layout`), what it holds (`models`), and the one
writer and the readers (`store`). docs/formats.md describes every file."""

from harness.results.layout import HostRunLayout, RunFiles, RunLayout, SweepFiles, SweepLayout
from harness.results.models import (
                                    AnalysisFile,
                                    BenchFile,
                                    BenchLevel,
                                    ErrorRecord,
                                    JournalEvent,
                                    RunManifest,
                                    SearchFile,
                                    SearchTrial,
                                    SweepRecord,
                                    SweepRun,
)
from harness.results.store import (
                                    RunResult,
                                    Unreadable,
                                    atomic_write,
                                    find_sweeps,
                                    latest_sweep,
                                    load_run,
                                    load_runs,
                                    maybe_read,
                                    read_json,
                                    read_model,
                                    read_requests,
                                    read_search,
                                    read_sweep,
                                    samples,
                                    summary_rows,
                                    write_json,
                                    write_model,
                                    write_summary,
)

__all__ = ["AnalysisFile", "BenchFile", "BenchLevel", "ErrorRecord", "HostRunLayout", "JournalEvent", "RunFiles",
           "RunLayout", "RunManifest", "RunResult", "SearchFile", "SearchTrial", "SweepFiles", "SweepLayout",
           "SweepRecord", "SweepRun", "Unreadable", "atomic_write", "find_sweeps", "latest_sweep", "load_run",
           "load_runs", "maybe_read", "read_json", "read_model", "read_requests", "read_search", "read_sweep",
           "samples", "summary_rows", "write_json", "write_model", "write_summary"]
