"""Every file a sweep writes, as a pydantic model: the one writer builds it, every reader reads it.

    sweep.json      SweepRecord    "harness.sweep/1"
    journal.jsonl   JournalEvent   (one per line; no schema field: the sweep's says which)
    manifest.json   RunManifest    "harness.run/1"
    bench.json      BenchFile      "harness.bench/1" (written on the host by the benchmark client)
    analysis.json   AnalysisFile   "harness.analysis/1"
    search.json     SearchFile     "harness.search/1"
    telemetry.jsonl TelemetryFile  "harness.telemetry/1" (its start line's; written on the host by the sampler)

Each file's `schema` names its version (docs/formats.md). A reader takes every version it knows and
keeps the fields it does not name (`extra="allow"`), so a file written by a newer harness still reads
and a file written by an older one still reads where its fields were optional. Nothing here reads or
writes a file: `harness.results.store` does, through `read_model` and `write_model`.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
)

from harness.errors import Kind


class Record(BaseModel):
    """A part of a results file: fields this version does not name are kept, not refused."""
    model_config = ConfigDict(extra="allow", populate_by_name=True)


SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
"""A name that is one folder's: a run's (`runs/<run_id>`, made of a configuration's name), never a path."""
MAX_COUNT = 10**12
"""More requests or tokens than this in one level is no benchmark (and would overflow a float division)."""
NS_MAX = 2**63
"""time.monotonic_ns() fits in 64 bits."""

Tokens = Annotated[int, Field(ge=0, le=MAX_COUNT)]
"""A count of tokens a benchmark asked for."""
Concurrency = Annotated[int, Field(ge=1, le=MAX_COUNT)]
"""Streams in flight: a closed loop's load (the playbook's concurrency is at least 1)."""
Load = Annotated[float, Field(gt=0, le=MAX_COUNT, allow_inf_nan=False)]
"""A level's load (its concurrency or request rate): above 0, finite, within what a benchmark can ask."""
Clock = Annotated[int, Field(ge=0, lt=NS_MAX)]
"""An instant of time.monotonic_ns() on the host."""


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
    unset: list[str] = Field(default_factory=list)   # env names the launch script unsets (env: null)


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
    """The files brought back from the host(s). `sha256` is each one's as it lies in the run folder
    (text files after their secrets were masked), computed once the host is free; until then the
    names wait in `unhashed` (a manifest written by an orchestrator stopped in between)."""
    files: int = 0
    bytes: int = 0
    sha256: dict[str, str] = Field(default_factory=dict)
    unhashed: list[str] = Field(default_factory=list)
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


class NodeRecord(Record):
    """One host of a server that spans several: where its files came back to, what its teardown said."""
    rank: int
    host: str
    address: str | None = None                   # where the other nodes reached node 0 (node 0 only)
    dir: str = "."                               # its run folder, relative to the run's
    profile_dir: str | None = None               # where its traces landed, relative to the run's
    teardown: dict[str, Any] | None = None


class GpuFact(Record):
    """A GPU as nvidia-smi named it (harness.facts): its figures as the text nvidia-smi wrote."""
    name: str | None = None
    memory_total_mib: str | int | float | None = None
    driver: str | None = None
    cuda_capability: str | None = None


class GitFact(Record):
    commit: str | None = None
    dirty: bool | None = None


class HostFacts(Record):
    """A manifest's `facts` (what harness.facts parsed on the host), read for showing: a fact of another
    shape than the parser writes (a manifest edited by hand, or another harness's) is None, a GPU
    that is no record is left out, and every other fact stands."""
    gpus: list[GpuFact] | None = None
    cuda: str | None = None
    python: str | None = None
    engine_version: str | None = None
    engine_git: GitFact | None = None
    pip_freeze: str | int | None = None
    env: dict[str, str] | None = None
    kernel: str | None = None

    @field_validator("gpus", mode="before")
    @classmethod
    def _records_only(cls, value: Any) -> Any:
        return [g for g in value if isinstance(g, dict)] if isinstance(value, list) else value

    @field_validator("*", mode="wrap")
    @classmethod
    def _or_none(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            return None


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
    nodes: list[NodeRecord] = Field(default_factory=list)   # a server on several hosts: every one, node 0 first
    warnings: list[str] = Field(default_factory=list)
    started: float | None = None
    finished: float | None = None
    harness_version: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def host_facts(self) -> HostFacts:
        """`facts` as HostFacts: each one well-formed, or None."""
        return HostFacts.model_validate(self.facts or {})

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
    t: Annotated[float, Field(ge=0, le=1e11, allow_inf_nan=False)]   # time.time(): a line with no such time is no event
    run_id: str
    state: RunState
    host: str | None = None
    config: str | None = None
    attempt: int | None = None
    attempts: int | None = None
    error_kind: str | None = None
    reason: str | None = None
    nodes: list[str] | None = None               # a run on several hosts: every node's host, node 0 first

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


class Workload(Record):
    """What a scenario's level asked: prompts of `input_tokens`, `output_tokens` out (the level's own
    `output_tokens` is what its completed requests produced, summed), at `load` of `kind`."""
    scenario: str
    input_tokens: Tokens
    output_tokens: Tokens
    kind: Literal["concurrency", "request_rate"]
    load: Load


class BenchLevel(Record):
    """One level of bench.json. Its load (concurrency, request_rate) is what tells it apart and what every
    chart is drawn along: one that is no load (0, negative, beyond any benchmark) makes the file
    unreadable, named with its key; its figures are checked apart (`check_level`)."""
    concurrency: Concurrency | None = None       # closed loop's streams; None in an open loop (request_rate)
    requests: int | None = None
    completed: int = 0
    failed: int = 0
    duration_s: float | None = None
    output_tokens: int | None = None
    started_ns: int | None = None                # the level's first send and last end, time.monotonic_ns()
    ended_ns: int | None = None                  # on the host: the clock of telemetry.jsonl
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
    # a scenario's level (benchmark.scenarios): its workload, load and, with an SLO, its goodput
    scenario: str | None = None
    workload: Workload | None = None
    request_rate: Load | None = None
    arrival: str | None = None
    burstiness: float | None = None
    random_state: int | None = None
    probe: bool = False                          # a probe of search.max_load
    prompt_source: str | None = None             # tokenize | usage-calibrated | words
    prompt_tokens_reported: dict[str, int] = Field(default_factory=dict)
    prompt_tokens_mismatches: int = 0
    latency_origin: Literal["sent", "scheduled"] | None = None
    achieved_rate_req_s: float | None = None
    schedule_lag_ms: Distribution | None = None
    slo: dict[str, float] | None = None
    slo_met_requests: int | None = None
    slo_met: bool | None = None
    goodput_req_s: float | None = None

    _not_measured: dict[str, str] = PrivateAttr(default_factory=dict)

    @property
    def not_measured(self) -> dict[str, str]:
        """The fields the reader refused as inconsistent (`check_level`), each with why; the key
        `level` when the whole level was refused. Empty for a file read as written."""
        return self._not_measured

    @property
    def trusted(self) -> bool:
        """Whether the level's figures stand: False when the reader refused the level as a whole."""
        return WHOLE_LEVEL not in self._not_measured

    @property
    def label(self) -> str:
        """The level as a person names it: `concurrency 8`, `chat rate 2.5/s`, with `probe` for a probe."""
        head = f"{self.scenario} " if self.scenario else ""
        load = f"rate {self.request_rate:g}/s" if self.request_rate is not None else f"concurrency {self.concurrency}"
        return head + load + (" probe" if self.probe else "")

    @property
    def load(self) -> float | None:
        """The level's load: its request rate in an open loop, else its concurrency."""
        return self.request_rate if self.request_rate is not None else self.concurrency

    @property
    def key(self) -> tuple[str | None, str, float | None]:
        """What tells a level apart from the others of a run: scenario, load kind, load."""
        return (self.scenario, "request_rate" if self.request_rate is not None else "concurrency", self.load)

    def stat(self, metric: str, q: str) -> float | None:
        """`stat("itl_ms", "p50")`: one statistic of one distribution, None when not measured."""
        dist = getattr(self, metric)
        return getattr(dist, q) if dist is not None else None


class MaxLoadResult(Record):
    """search.max_load's answer for one run: the highest load of `scenario` that met `slo`, and each probe
    ({load, met, level: its index in levels}); value None and met False when even `low` missed."""
    scenario: str
    kind: Literal["concurrency", "request_rate"]
    value: Load | None = None
    met: bool = False
    low: Load | None = None
    high: Load | None = None
    steps: int | None = None
    slo: dict[str, float] = Field(default_factory=dict)
    probes: list[dict[str, Any]] = Field(default_factory=list)


class BenchFile(Versioned):
    schema_: str = Field("harness.bench/1", alias="schema")
    url: str | None = None
    model: str | None = None
    max_tokens: Tokens | None = None
    prompt_tokens: Tokens | None = None
    slo: dict[str, float] | None = None
    random_state: int | None = None
    levels: list[BenchLevel] = Field(default_factory=list)
    max_load: MaxLoadResult | None = None
    _not_measured: dict[str, str] = PrivateAttr(default_factory=dict)

    @property
    def not_measured(self) -> dict[str, str]:
        """What of the file beside its levels the reader refused (`max_load`), each with why."""
        return self._not_measured

    def checked(self, *, bench_s: float | None = None, max_tokens: int | None = None) -> BenchFile:
        """The file with every figure that `check_level` refuses set to None (not measured, as NaN is),
        each level's refusals in its `not_measured`; the file itself when nothing is refused, so a
        consistent file reads exactly as written. `bench_s`: the benchmark phase's wall time as the
        orchestrator measured it (the manifest's `phases.bench`); `max_tokens`: the output tokens a
        request asked for when the request body overrode the file's own (`extra_body`)."""
        found = [check_level(lv, bench_s=bench_s, max_tokens=max_tokens or (
            lv.workload.output_tokens if lv.workload is not None else self.max_tokens)) for lv in self.levels]
        levels = []
        for level, faults in zip(self.levels, found, strict=True):
            if faults:
                dropped = FIGURES if WHOLE_LEVEL in faults else [f for f in faults if f in FIGURES]
                level = level.model_copy(update=dict.fromkeys(dropped))
                level._not_measured = faults
            levels.append(level)
        search = _max_load_fault(self.max_load, levels) if self.max_load is not None else None
        if not any(found) and search is None:
            return self
        out = self.model_copy(update={"levels": levels} | ({"max_load": None} if search else {}))
        out._not_measured = {"max_load": search} if search else {}
        return out


# --- bench.json: what a level must be to be believed ---------------------------------------------------
# A bench.json is written on the host and read here: NaN, infinities and negative figures are shown as not
# measured (compare's `_figure`), and so is a level whose finite figures cannot all be true at once. bench.py
# writes every figure unrounded (json.dumps of the float it computed: a rate is one division of the
# numbers beside it), so the tolerances below are far wider than any rounding; a file of an older or
# another client that rounds still reads. The orchestrator rounds its phase times to the millisecond and
# its clock and the host's may drift apart by a fraction of a percent.

WHOLE_LEVEL = "level"
"""The key of `BenchLevel.not_measured` that refuses a level as a whole."""

FIGURES = ["output_tok_s", "requests_per_s", "goodput_req_s", "slo_met", "achieved_rate_req_s",
           "tokens_per_chunk", "decode", *DISTRIBUTIONS, "schedule_lag_ms"]
"""What a level refused as a whole loses (set to None): every figure compare, the report and the search read."""

REL_TOL = 0.01
"""How far a rate may stray from the division it is (1%): bench.py's own is exact."""
PHASE_SLACK_S = 1.0
"""Seconds a level may outlast the benchmark phase (beyond REL_TOL of it): the phase is rounded to the
millisecond, measured on another clock."""


def _number(value: Any) -> float | None:
    """A finite figure, else None (NaN and the infinities are already not measured; nothing to check)."""
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _near(value: float, expected: float) -> bool:
    return abs(value - expected) <= REL_TOL * abs(expected) + 1e-9


def _distribution_fault(dist: Distribution) -> str | None:
    """Why a distribution cannot be one (its order statistics out of order, the mean outside them, a
    negative spread), or None. Interpolated percentiles and an fsum mean may stray by an ulp: 1e-6 of
    the largest value is allowed."""
    values = {q: v for q in ("min", "p50", "p90", "p95", "p99", "max") if (v := _number(getattr(dist, q))) is not None}
    slack = 1e-6 * max([abs(v) for v in values.values()] + [1.0])
    ordered = list(values.items())
    for (qa, a), (qb, b) in zip(ordered, ordered[1:], strict=False):
        if a > b + slack:
            return f"{qa} {a:g} above {qb} {b:g}"
    mean, std = _number(dist.mean), _number(dist.std)
    low, high = values.get("min"), values.get("max")
    if mean is not None and low is not None and high is not None and not low - slack <= mean <= high + slack:
        return f"mean {mean:g} outside min..max"
    if std is not None and std < -slack:
        return f"std {std:g} below 0"
    if std is not None and low is not None and high is not None and std > high - low + slack:
        return f"std {std:g} wider than max - min"
    return None


def check_level(level: BenchLevel, *, max_tokens: int | None = None, bench_s: float | None = None) -> dict[str, str]:
    """What in one level of bench.json cannot be true, as {field: why}; WHOLE_LEVEL when what is wrong
    is what every figure rests on (its counts, its duration, its clock). `max_tokens`: what each request
    asked for (a request may produce one more, an engine's closing token, before it is called absurd).
    Only what the level gives is checked: a file without `duration_s` or `requests` (an older client's)
    is not at fault for it."""
    whole = _whole_level_fault(level, max_tokens, bench_s)
    if whole is not None:
        return {WHOLE_LEVEL: whole}
    out: dict[str, str] = {}
    duration = _number(level.duration_s)
    rates = [("output_tok_s", level.output_tokens, "output_tokens"), ("requests_per_s", level.completed, "completed"),
             ("goodput_req_s", level.slo_met_requests, "slo_met_requests")]
    for field, count, name in rates:
        rate = _number(getattr(level, field))
        if rate is None or count is None or duration is None:
            continue
        if duration == 0:
            out[field] = f"{rate:g} over a duration_s of 0"
        elif not _near(rate, count / duration):
            out[field] = (f"{rate:g} disagrees with {name} / duration_s "
                          f"({count} / {duration:g} s = {count / duration:g})")
    if level.slo_met_requests is not None and not 0 <= level.slo_met_requests <= level.completed:
        out["goodput_req_s"] = f"slo_met_requests {level.slo_met_requests} is not within 0..completed {level.completed}"
    if "goodput_req_s" in out:
        out["slo_met"] = "its goodput is not measured"
    for field in (*DISTRIBUTIONS, "schedule_lag_ms"):
        dist = getattr(level, field)
        if dist is not None and (why := _distribution_fault(dist)) is not None:
            out[field] = why
    if level.slo_met and "slo_met" not in out and (why := _slo_met_fault(level, out)) is not None:
        out["slo_met"] = why
    return out


def _slo_met_fault(level: BenchLevel, refused: dict[str, str]) -> str | None:
    """Why a level's `slo_met: true` cannot be (levels.level_meets: no request failed, something
    completed, each bound holds for the level's own statistic), or None."""
    if level.failed or not level.completed:
        return f"true with {level.failed} failed and {level.completed} completed requests"
    for metric, bound in (level.slo or {}).items():
        name, _, stat = metric.rpartition("_")
        if name in refused:
            return f"true where {name} is not measured"
        value = _number(level.stat(name, stat)) if name in DISTRIBUTIONS else None
        if value is not None and value > bound * (1 + 1e-9):
            return f"true where {metric} is {value:g}, above its bound {bound:g}"
    return None


def _max_load_fault(found: MaxLoadResult, levels: list[BenchLevel]) -> str | None:
    """Why a max_load answer is not what its probes found, or None: each probe must name a probe level
    of its load (`level`: an index into levels) that the reader kept and whose `slo_met` is the probe's
    `met`, and the answer must be the highest load a probe met (None when none met)."""
    met = []
    for probe in found.probes:
        index, load = probe.get("level"), probe.get("load")
        level = levels[index] if isinstance(index, int) and not isinstance(index, bool) \
            and 0 <= index < len(levels) else None
        if level is None or not level.probe or level.load != load:
            return f"its probe at {load} names no probe level of that load (level {index})"
        if not level.trusted or level.slo_met is None:
            return f"its probe at {load} is a level whose figures are not measured"
        if bool(probe.get("met")) != level.slo_met:
            return f"its probe at {load} says met {probe.get('met')} where its level says slo_met {level.slo_met}"
        if level.slo_met:
            met.append(level.load)
    best = max((x for x in met if x is not None), default=None)
    if found.value != best or found.met != (best is not None):
        return f"value {found.value} (met {found.met}) is not the highest load its probes met ({best})"
    return None


def _whole_level_fault(level: BenchLevel, max_tokens: int | None, bench_s: float | None) -> str | None:
    """Why none of a level's figures can be believed (its counts, duration or clock), or None."""
    counts = {"requests": level.requests, "completed": level.completed, "failed": level.failed,
              "output_tokens": level.output_tokens, "slo_met_requests": level.slo_met_requests}
    for name, value in counts.items():
        if value is not None and not 0 <= value <= MAX_COUNT:
            return f"{name} {value} is not a count"
    if level.requests is not None and level.completed + level.failed != level.requests:
        return (f"completed {level.completed} + failed {level.failed} is not requests {level.requests}"
                if level.completed <= level.requests else
                f"completed {level.completed} is more than requests {level.requests}")
    if level.output_tokens is not None and max_tokens is not None and max_tokens > 0 \
            and level.output_tokens > level.completed * (max_tokens + 1):
        return (f"output_tokens {level.output_tokens} is more than completed {level.completed} x "
                f"{max_tokens} tokens asked of each")
    duration = level.duration_s
    if duration is not None and not (math.isfinite(duration) and duration >= 0):
        return f"duration_s {duration:g} is not a duration"
    start, end = level.started_ns, level.ended_ns
    if start is not None and end is not None:
        if not 0 <= start <= end < NS_MAX:
            return f"started_ns {start} and ended_ns {end} are not a span of time.monotonic_ns()"
        if duration is not None and not _near(duration, (end - start) / 1e9) \
                and abs(duration - (end - start) / 1e9) > 1e-3:
            return f"duration_s {duration:g} disagrees with ended_ns - started_ns ({(end - start) / 1e9:g} s)"
    if duration is not None and bench_s is not None and duration > bench_s * (1 + REL_TOL) + PHASE_SLACK_S:
        return f"duration_s {duration:g} is longer than the whole benchmark phase ({bench_s:g} s, measured here)"
    return None


# --- telemetry.jsonl ---------------------------------------------------------------------------------

MAX_READING = 1e15
"""A sampled number beyond this (a thousand trillion tokens, watts or MiB) is no reading of a server or a GPU."""


def _reading(value: Any) -> bool:
    """Whether a sampled value can be read: anything not a number, or a number within MAX_READING (not
    NaN, not an infinity; `abs` first: an integer too large for a float is compared exactly)."""
    return isinstance(value, bool) or not isinstance(value, (int, float)) or abs(value) <= MAX_READING


class TelemetryLine(Record):
    """One line: `source` start | metrics | gpu | note | stop (a newer sampler may add others); a
    sample was asked for at `t_ns` and answered at `t_end_ns` (time.monotonic_ns() on the host). A
    line whose time is no instant of that clock is no line (the reader leaves it out)."""
    t_ns: Clock
    t_end_ns: Clock | None = None
    source: str
    values: dict[str, Any] = Field(default_factory=dict)

    @field_validator("values")
    @classmethod
    def _readings(cls, values: dict[str, Any]) -> dict[str, Any]:
        """A number that is no reading (NaN, an infinity, beyond MAX_READING) is left out, as a value
        not sampled: every sum, mean and chart of the readers stays finite."""
        return {key: value for key, value in values.items() if _reading(value)}


class TelemetryMetric(Record):
    """A /metrics family the sampler kept and what it means (harness.engines.base.Metric)."""
    key: str
    family: str
    kind: str = "gauge"
    across: str = "sum"
    breakdown: list[str] = Field(default_factory=list)
    only: dict[str, list[str]] = Field(default_factory=dict)   # label -> the values whose samples count


class TelemetryFile(Versioned):
    """telemetry.jsonl read whole: the settings of its start line and every line, in file order."""
    schema_: str = Field("harness.telemetry/1", alias="schema")
    url: str | None = None
    interval_s: float | None = None
    metrics: list[TelemetryMetric] = Field(default_factory=list)
    lines: list[TelemetryLine] = Field(default_factory=list)

    def samples(self, source: str) -> list[TelemetryLine]:
        """The lines of one source, by time."""
        return sorted((x for x in self.lines if x.source == source), key=lambda x: x.t_ns)

    def notes(self, *, errors_only: bool = False) -> list[str]:
        """What the sampler said went wrong or was missing, each message once."""
        return list(dict.fromkeys(str(x.values.get("message")) for x in self.lines if x.source == "note"
                                  and (x.values.get("error") or not errors_only)))


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

    @field_validator("top", "categories", "category_ms", mode="before")
    @classmethod
    def _null_is_none(cls, value: Any, info: ValidationInfo) -> Any:
        """The analyzer writes null where there is nothing to list (a trace that marks no steps has no
        ms a step): an empty list or mapping, not a file that cannot be read."""
        return ([] if info.field_name == "top" else {}) if value is None else value


class AnalysisFile(Versioned, Scope):
    schema_: str = Field("harness.analysis/1", alias="schema")
    files: list[dict[str, Any]] = Field(default_factory=list)
    steps_source: str | None = None
    gpu_idle_ms: float | None = None
    gpu_idle_share: float | None = None
    stages: dict[str, Scope] = Field(default_factory=dict)
    ranks: list[dict[str, Any]] = Field(default_factory=list)

    @field_validator("stages", "files", "ranks", mode="before")
    @classmethod
    def _null_is_empty(cls, value: Any, info: ValidationInfo) -> Any:
        return ({} if info.field_name == "stages" else []) if value is None else value
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


# --- search.json -------------------------------------------------------------------------------------

TrialState = Literal["complete", "failed", "running", "interrupted", "duplicate"]
"""`interrupted`: its run was in flight when the sweep was interrupted; `--resume` runs it again."""


class SearchTrial(Record):
    """One trial of a search: the run it made (a duplicate made none: its point had run already)."""
    number: int
    run_id: str | None = None
    config: str | None = None
    state: TrialState
    value: float | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    duplicate_of: int | None = None
    reason: str | None = None                    # why a failed trial has no value

    @field_validator("run_id")
    @classmethod
    def _a_run_folder(cls, value: str | None) -> str | None:
        """The name of the run's folder under runs/, which compare and the report read (its launch
        command): a plain name, never a path that leads elsewhere."""
        if value is not None and not SAFE_NAME.match(value):
            raise ValueError(f"{value!r} is not a run's name (a folder of runs/: letters, digits, '_', '.', '-')")
        return value


class SearchFile(Versioned):
    """A search's settings as it ran, every trial so far and the best one (rewritten as trials end)."""
    schema_: str = Field("harness.search/1", alias="schema")
    sampler: str = "tpe"
    objective: str
    direction: Literal["maximize", "minimize"]
    level: int | None = None
    budget: int
    patience: int | None = None
    random_state: int | None = None
    space: dict[str, Any] = Field(default_factory=dict)
    grid_size: int | None = None
    runs: int = 0
    trials: list[SearchTrial] = Field(default_factory=list)
    best: SearchTrial | None = None
    stopped: str | None = None                   # why it asked no more trials
