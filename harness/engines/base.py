"""What an engine is to the harness: a record of facts, and the registry that holds one per engine.

An `Engine` names its launcher, its launch template (shipped with the package), how to list its flags
and its version, its health path, how its profiler is driven (`capture`: plain data that the host
agent follows without knowing the engine), how its trace files are named (`TraceNaming`), how it
marks its steps inside a trace (`StepSpans`), and how many ranks a configuration has. Nothing outside
`harness/engines/` knows any of this: lifecycle, analysis, config and the host agent read it here.

`metrics` lists the families of its Prometheus `/metrics` that the telemetry sampler keeps, each with
the engine-neutral meaning compare summarizes it under (`Metric`).

A new engine is a module that calls `register(Engine(...))` (or a subclass overriding `ranks` and
`capture`) and a template beside the others in `templates/`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.errors import InputError


@dataclass(frozen=True)
class TraceNaming:
    """How an engine's profiler names its trace files.

    `rank` is a regular expression whose groups, together, identify one rank across the whole
    run (the GLOBAL rank, not a rank inside one parallel group): two files with the same groups are
    the same rank. `not_ranks` matches trace files that are no rank at all (an API front end's
    trace); `prefer`, when some files match it, keeps only those (files split by stage repeat what
    the per-rank files hold).
    """

    glob: str
    rank: str
    not_ranks: str = ""
    prefer: str = ""

    def rank_key(self, name: str) -> tuple[str, ...] | None:
        """The rank a file belongs to (its groups), or None when it is not a rank's trace."""
        if self.not_ranks and re.search(self.not_ranks, name):
            return None
        m = re.search(self.rank, name)
        return m.groups() if m else None

    def rank_number(self, name: str) -> int | None:
        """The rank as a number, when the name holds exactly one (`-TP-3` does, `-TP-3-PP-1` not)."""
        numbers = [g for g in self.rank_key(name) or () if g]
        return int(numbers[0]) if len(numbers) == 1 and numbers[0].isdigit() else None

    def per_rank(self, names: Sequence[str]) -> list[str]:
        """The names that hold one rank each: no front end, no duplicates of a preferred split."""
        ranks = [n for n in names if self.rank_key(n) is not None]
        if self.prefer:
            ranks = [n for n in ranks if re.search(self.prefer, n)] or ranks
        return ranks


@dataclass(frozen=True)
class StepSpans:
    """How an engine marks each forward step in its traces: a `record_function` range per step whose
    name starts with `prefix`; `stages` maps a name to its stage by the first regular expression that
    matches (stage "" : not a step worth counting, e.g. an idle step with no requests)."""

    prefix: str
    stages: tuple[tuple[str, str], ...]

    def stage(self, name: str) -> str | None:
        """The stage of a step span's name; None when the name is no step span of this engine."""
        if not name.startswith(self.prefix):
            return None
        for pattern, stage in self.stages:
            if re.search(pattern, name):
                return stage
        return None


@dataclass(frozen=True)
class Metric:
    """One family of the engine's Prometheus /metrics that the harness keeps, and what it is to the
    harness: `key` names it the same for every engine (running, waiting, kv_cache_usage,
    prefix_cache_queries, prefix_cache_hits, spec_draft_tokens, spec_accepted_tokens, spec_accept_rate,
    ...), `kind` says how a level reads it (a gauge: its mean and maximum over the level; a counter:
    its increase), `across` how the samples of several label sets combine (engines of a data-parallel
    server, ranks: "sum" or "mean"), and a label named in `breakdown` with a non-empty value marks a
    sample that splits a total already counted (SGLang's per-priority queue counts), left out. `only`
    names labels whose samples count only at the values listed: where several ranks each write a copy
    of one figure, the rank that stands for the others (`Engine.metrics_for`)."""

    key: str
    family: str
    kind: str = "gauge"                 # gauge | counter
    across: str = "sum"                 # sum | mean
    breakdown: tuple[str, ...] = ()
    only: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def as_dict(self) -> dict[str, Any]:
        only = {"only": {label: list(values) for label, values in self.only}} if self.only else {}
        return {"key": self.key, "family": self.family, "kind": self.kind, "across": self.across,
                "breakdown": list(self.breakdown), **only}


@dataclass(frozen=True)
class CaptureSettings:
    """What the playbook asks of one profile capture."""

    directory: str
    num_steps: int
    start_step: int | None = None
    nsys: bool = False
    nodes: int = 1                 # hosts the server spans: each writes its own ranks' traces


@dataclass(frozen=True)
class NodeInfo:
    """Where one node of a server that spans several hosts stands: its rank, how many nodes there are,
    and where node 0 listens for the others (the rendezvous)."""

    rank: int
    count: int
    head_address: str
    rendezvous_port: int

    @property
    def head_endpoint(self) -> str:
        """`HOST:PORT` of the rendezvous, an IPv6 address in brackets."""
        host = f"[{self.head_address}]" if ":" in self.head_address else self.head_address
        return f"{host}:{self.rendezvous_port}"


@dataclass(frozen=True)
class Engine:
    name: str
    launcher: str                  # the command the template runs, inside the venv
    module: str                    # must import in the venv (preflight; "": nothing to check)
    default_port: int
    template: str                  # the built-in launch template's file name (templates/)
    help_command: str = ""         # prints every accepted flag ("": no flag check)
    distribution: str = ""         # the installed distribution that gives its version ("": the module's)
    health_path: str = "/health"
    traces: TraceNaming | None = None
    steps: StepSpans | None = None
    profile_modes: tuple[str, ...] = ("torch", "none")
    env_prefixes: tuple[str, ...] = ()   # the engine's own environment variables, recorded as facts
    oom_hint: str = "lower the engine's memory fraction or use more GPUs"
    oom_log: str = ""              # a regular expression for the engine's own "no memory left" messages
    protocol: str = ""             # the engine whose HTTP and profiler protocol it speaks ("": its own)
    metrics_path: str = "/metrics"
    metrics: tuple[Metric, ...] = ()     # the /metrics families telemetry keeps (none: it samples GPUs only)
    metrics_hint: str = ""               # what to do when /metrics is not there (a 404)
    rendezvous_port: int = 29500   # where node 0 waits for the other nodes of a multi-node server
    node_flags: tuple[str, ...] = ()   # the flags `node_args` writes (and their aliases): the playbook's go

    @property
    def speaks(self) -> str:
        return self.protocol or self.name

    def ranks(self, args: Mapping[str, Any]) -> int:
        """How many GPU workers (trace files) a configuration with these args has."""
        return 1

    def nodes(self, args: Mapping[str, Any]) -> int:
        """How many hosts the engine's own flags say one server spans (`--nnodes`): 1 unless they say."""
        return 1

    def metrics_for(self, args: Mapping[str, Any]) -> tuple[Metric, ...]:
        """The /metrics families telemetry keeps for a configuration with these args: `metrics`,
        unless the args make several ranks write copies of one figure."""
        return self.metrics

    def node_args(self, node: NodeInfo) -> dict[str, Any]:
        """The flags that make one node of a multi-node server (rank, count, node 0's address), merged
        over the configuration's args; {} for a server on one host."""
        return {}

    def capture(self, how: CaptureSettings) -> dict[str, Any] | None:
        """The profiler protocol as data for the host agent (`agent.py profile`), None when the engine
        has no profiler of its own. Keys: `start` {path, body}, `stop` {path} or None, `traffic`
        ("flow": requests keep coming until every rank's file is in; or {"max_tokens": N}: one request),
        `await` ("files"; "exit": the files appear when the server exits), `hints` {status: text}."""
        return None

    def known_flags(self, help_text: str) -> list[str]:
        """Every flag the engine's --help lists."""
        return sorted(set(re.findall(r"(?<![\w-])(--?[A-Za-z0-9][\w.-]*)", help_text)))

    def unknown_flags(self, help_text: str, flags: Iterable[str]) -> list[str]:
        """Flags the installed engine's --help does not list (`--a.b` is checked as `--a`)."""
        known = set(self.known_flags(help_text))
        return [f for f in flags if f not in known and f.split(".")[0] not in known
                and f.split("=")[0] not in known]


def arg(args: Mapping[str, Any], *names: str, default: int = 1) -> int:
    """An integer flag given under any of its names (`tp-size`, `--tp-size`, `-tp`), else `default`."""
    for name in names:
        bare = name.lstrip("-")
        for key in (bare, "-" + bare, "--" + bare):
            value = args.get(key)
            if value not in (None, False):
                try:
                    return int(value)
                except (TypeError, ValueError):
                    raise InputError(f"{key} must be a whole number, not {value!r}", key=f"args.{key}") from None
    return default


def flag(args: Mapping[str, Any], *names: str) -> bool:
    """Whether a flag is given, under any of its names and spellings, with a value other than false."""
    return any(args.get(key) not in (None, False) for name in names
               for key in (name.lstrip("-"), "-" + name.lstrip("-"), "--" + name.lstrip("-")))


Entry = Engine | Callable[[str | None], Engine]
_REGISTRY: dict[str, Entry] = {}


def register(entry: Entry, name: str | None = None) -> Entry:
    """Add an engine by name; an entry may also be a function of the imitated engine's name (the
    simulator is one engine for every engine it imitates)."""
    _REGISTRY[name or entry.name] = entry  # type: ignore[union-attr]
    return entry


def names() -> list[str]:
    return sorted(_REGISTRY)


def real_engines() -> list[Engine]:
    """Every registered engine that is a record of its own (not derived from another)."""
    return [e for e in _REGISTRY.values() if isinstance(e, Engine)]


def imitable() -> list[str]:
    """Engines with a profiler protocol of their own, which a derived engine can imitate."""
    return sorted(e.name for e in real_engines() if e.traces is not None)


def get_engine(name: str, imitates: str | None = None) -> Engine:
    entry = _REGISTRY.get(name)
    if entry is None:
        raise InputError(f"unknown engine {name!r} (known: {', '.join(names())})", key="engine")
    if isinstance(entry, Engine):
        return entry
    return entry(imitates)


def step_span_rules() -> list[StepSpans]:
    """The step spans of every engine: a trace is read without knowing which engine wrote it."""
    return [e.steps for e in real_engines() if e.steps is not None]


def naming_for(files: Sequence[Path]) -> TraceNaming | None:
    """The naming that recognises the most of these trace files as ranks (None: no engine's)."""
    best, hits = None, 0
    for engine in real_engines():
        if engine.traces is None:
            continue
        found = len(engine.traces.per_rank([f.name for f in files]))
        if found > hits:
            best, hits = engine.traces, found
    return best


def env_prefixes() -> list[str]:
    return sorted({p for e in real_engines() for p in e.env_prefixes})
