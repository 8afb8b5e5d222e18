"""Every file a sweep writes, as a pydantic model: the one writer builds it, every reader reads it.

    sweep.json      SweepRecord    "harness.sweep/1"
    journal.jsonl   JournalEvent   (one per line; no schema field: the sweep's says which)
    manifest.json   RunManifest    "harness.run/1"
    bench.json      BenchFile      "harness.bench/1" (written on the host by the benchmark client)
    analysis.json   AnalysisFile   "harness.analysis/1"

Each file's `schema` names its version (docs/formats.md). A reader takes every version it knows and
keeps the fields it does not name (`extra="allow"`), so a file written by a newer harness still reads
and a file written by an older one still reads where its fields were optional. Nothing here reads or
writes a file: `harness.results.store` does, through `read_model` and `write_model`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from harness.errors import Kind


class Record(BaseModel):
    """A part of a results file: fields this version does not name are kept, not refused."""
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class Versioned(Record):
    schema_: str = Field(alias="schema")

    def dump(self) -> dict[str, Any]:
        """The file's content as JSON data, in the field order written since the first version."""
        return self.model_dump(mode="json", by_alias=True)


# --- manifest.json ---------------------------------------------------------------------------------

RunStatus = Literal["ok", "failed", "skipped"]


class ErrorRecord(Record):
    kind: str                                   # a Kind's value; older files may carry one this version lacks
    message: str = ""
    detail: str | None = None
    log_tail: str | None = None

    @property
    def as_kind(self) -> Kind:
        return Kind.of(self.kind)

    def line(self) -> str:
        return f"{self.kind}: {self.message}".strip()


class ConfigRecord(Record):
    name: str
    description: str | None = None
    args: dict[str, Any] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)


class HostRecord(Record):
    """The host as the inventory described it (secrets masked): the rest of its fields are kept."""
    name: str | None = None
    gpu: str | None = None
    gpu_bandwidth_gbs: float | None = None


class Placement(Record):
    """Where a scheduler put a run: the allocation (job), the step that launched its server, its nodes."""
    scheduler: str
    job_id: str
    step_id: str | None = None                   # JOB.STEP; None when the run failed before its launch
    nodes: list[str] = Field(default_factory=list)


class ModelRecord(Record):
    path: str | None = None
    served_name: str | None = None
    active_params_b: float | None = None
    bytes_per_weight: float | None = None
    kv_bytes_per_token: float | None = None


class Phase(Record):
    seconds: float


class Collected(Record):
    files: int = 0
    bytes: int = 0
    sha256: dict[str, str] = Field(default_factory=dict)
    skipped: list[str] = Field(default_factory=list)


class AnalysisRef(Record):
    """What the manifest says of its analysis.json (or why there is none)."""
    file: str | None = None
    total_gpu_ms: float | None = None
    steps: int | None = None
    steps_source: str | None = None
    per_step_ms: float | None = None
    error: str | None = None


class ProfileRecord(Record):
    status: str                                  # ok | partial | failed | pending (nsys, until collected)
    mode: str | None = None
    files: list[dict[str, Any]] = Field(default_factory=list)
    missing_ranks: int | None = None
    ranks_found: int | None = None
    expected_ranks: int | None = None
    num_steps: int | None = None
    dir: str | None = None
    bytes: int | None = None
    error: str | None = None
    hint: str | None = None
    answers: list[dict[str, Any]] = Field(default_factory=list)
    seconds: float | None = None
    analysis: AnalysisRef | None = None


class RunManifest(Versioned):
    """One run: what ran, where, how it ended, what each stage found. A run that never started
    (skipped, or no host could take it) has the first block only."""
    schema_: str = Field("harness.run/1", alias="schema")
    run_id: str
    sweep_id: str = ""
    config: ConfigRecord
    repeat: int | None = None
    host: HostRecord = Field(default_factory=HostRecord)
    placement: Placement | None = None           # a node of a Slurm allocation: job, step, nodes
    engine: str | None = None
    protocol: str | None = None
    model: ModelRecord | None = None
    gpus_used: int | None = None
    port: int | None = None
    template: dict[str, Any] | None = None
    playbook: dict[str, Any] | None = None
    benchmark: dict[str, Any] | None = None
    profile_settings: dict[str, Any] | None = None
    status: RunStatus
    error: ErrorRecord | None = None
    skipped: str | None = None                   # why a run never started
    attempts: int = 1
    phases: dict[str, Phase] = Field(default_factory=dict)
    collected: Collected = Field(default_factory=Collected)
    profile: ProfileRecord | None = None
    facts: dict[str, Any] | None = None
    probe: dict[str, Any] | None = None
    teardown: dict[str, Any] | None = None
    warnings: list[str] = Field(default_factory=list)
    started: float | None = None
    finished: float | None = None
    harness_version: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def seconds(self, phase: str) -> float | None:
        return self.phases[phase].seconds if phase in self.phases else None


# --- sweep.json and the journal --------------------------------------------------------------------

class SweepRun(Record):
    run_id: str
    config: str = ""
    hosts: list[str] = Field(default_factory=list)
    inputs: dict[str, Any] | None = None         # what the run measures, for --resume to compare
    fingerprint: str | None = None


class SweepRecord(Versioned):
    schema_: str = Field("harness.sweep/1", alias="schema")
    sweep_id: str = ""
    harness_version: str | None = None
    playbook_path: str | None = None
    playbook: dict[str, Any] = Field(default_factory=dict)
    inventory_path: str | None = None
    hosts: list[dict[str, Any]] = Field(default_factory=list)
    runs: list[SweepRun] = Field(default_factory=list)
    argv: list[str] = Field(default_factory=list)
    started: float | None = None
    finished: float | None = None

    @property
    def playbook_name(self) -> str | None:
        return self.playbook.get("name")


RunState = Literal["pending", "running", "retry", "ok", "failed", "skipped", "interrupted"]


class JournalEvent(Record):
    t: float
    run_id: str
    state: RunState
    host: str | None = None
    config: str | None = None
    attempt: int | None = None
    attempts: int | None = None
    error_kind: str | None = None
    reason: str | None = None

    def line(self) -> str:
        return self.model_dump_json(exclude_none=True)


# --- bench.json --------------------------------------------------------------------------------------

class Distribution(Record):
    mean: float | None = None
    std: float | None = None
    min: float | None = None
    p50: float | None = None
    p90: float | None = None
    p95: float | None = None
    p99: float | None = None
    max: float | None = None


DISTRIBUTIONS = ("ttft_ms", "itl_ms", "itl_token_ms", "tpot_ms", "e2e_ms")
"""The latency distributions of a level (bench.json), each with Distribution's statistics."""


class BenchLevel(Record):
    concurrency: int
    requests: int | None = None
    completed: int = 0
    failed: int = 0
    duration_s: float | None = None
    output_tokens: int | None = None
    output_tok_s: float | None = None
    requests_per_s: float | None = None
    errors: list[Any] = Field(default_factory=list)
    ttft_ms: Distribution | None = None
    itl_ms: Distribution | None = None
    itl_token_ms: Distribution | None = None
    tpot_ms: Distribution | None = None
    e2e_ms: Distribution | None = None
    tokens_per_chunk: float | None = None
    decode: dict[str, Any] | None = None

    def stat(self, metric: str, q: str) -> float | None:
        """`stat("itl_ms", "p50")`: one statistic of one distribution, None when not measured."""
        dist = getattr(self, metric)
        return getattr(dist, q) if dist is not None else None


class BenchFile(Versioned):
    schema_: str = Field("harness.bench/1", alias="schema")
    url: str | None = None
    model: str | None = None
    max_tokens: int | None = None
    prompt_tokens: int | None = None
    levels: list[BenchLevel] = Field(default_factory=list)


# --- analysis.json -----------------------------------------------------------------------------------

class Kernel(Record):
    name: str
    category: str | None = None
    total_ms: float | None = None
    share: float = 0.0
    count: int | None = None


class Scope(Record):
    """The kernels of a trace, or of one stage of it (the decode steps)."""
    steps: int | None = None
    per_step_ms: float | None = None             # GPU kernel time a step
    step_ms: float | None = None                 # wall time a step (a stage of marked steps)
    total_gpu_ms: float | None = None
    top: list[Kernel] = Field(default_factory=list)
    categories: dict[str, float] = Field(default_factory=dict)   # shares of the kernel time
    category_ms: dict[str, float] = Field(default_factory=dict)  # kernel ms a step


class AnalysisFile(Versioned, Scope):
    schema_: str = Field("harness.analysis/1", alias="schema")
    files: list[dict[str, Any]] = Field(default_factory=list)
    steps_source: str | None = None
    gpu_idle_ms: float | None = None
    gpu_idle_share: float | None = None
    stages: dict[str, Scope] = Field(default_factory=dict)
    ranks: list[dict[str, Any]] = Field(default_factory=list)
    rank_spread: dict[str, Any] | None = None

    def idle_ms_per_step(self, scope: Scope) -> float | None:
        """GPU time a step with no kernel running: a marked stage's wall time less its kernel time, else
        the whole trace's idle time over its steps."""
        if scope is not self:
            return max(0.0, scope.step_ms - scope.per_step_ms) if scope.step_ms and scope.per_step_ms else None
        return self.gpu_idle_ms / self.steps if self.gpu_idle_ms is not None and self.steps else None

    def decode_scope(self) -> tuple[Scope, str]:
        """The decode stage's figures and "decode" when the trace marks decode steps that ran kernels,
        else the whole trace's and ""."""
        decode = self.stages.get("decode")
        return (decode, "decode") if decode is not None and decode.top else (self, "")
