"""The playbook: which server configurations to sweep, where, and how to measure them.

Every key is declared once here, typed, with its description and default; unknown keys are errors.
`configs[*].args` / `.env` merge over `server.args` / `.env` (a config's value wins; `null` removes a
flag the server section set, and unsets a variable, whatever the host or the server section set).
"""

from __future__ import annotations

import re
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from harness import engines
from harness.config import matrix
from harness.config import space as spaces
from harness.config.yamlfile import load_yaml

ArgScalar = bool | int | float | str | None
ArgValue = ArgScalar | list[bool | int | float | str | list[bool | int | float | str]] | dict[str, Any]

FLAG_NAME = re.compile(r"^-{0,2}[A-Za-z0-9][A-Za-z0-9_.\-]*$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
CONFIG_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _check_args(args: dict) -> dict:
    for name in args:
        if not FLAG_NAME.match(str(name)):
            raise ValueError(f"{name!r} is not a valid flag name")
    return {str(k): v for k, v in args.items()}


def _check_env(env: dict) -> dict:
    out = {}
    for name, value in env.items():
        if not ENV_NAME.match(str(name)):
            raise ValueError(f"{name!r} is not a valid environment variable name")
        if isinstance(value, (dict, list)):
            raise ValueError(f"{name}: environment values are strings")
        # null: unset in the launch script (an empty value is not an absent one: CUDA_VISIBLE_DEVICES="")
        out[str(name)] = None if value is None else ("1" if value is True else "0" if value is False
                                                     else str(value))
    return out


Args = Annotated[dict[str, ArgValue], AfterValidator(_check_args)]
Env = Annotated[dict[str, Any], AfterValidator(_check_env)]


class ModelSpec(Strict):
    path: str = Field(description="model path on the host (or a hub name the engine resolves)")
    served_name: str | None = Field(None, description="name the server answers to; default: the path")
    active_params_b: float | None = Field(None, gt=0, description="active parameters per token, billions")
    bytes_per_weight: float | None = Field(None, gt=0, description="bytes per weight (FP4 = 0.5)")
    kv_bytes_per_token: float | None = Field(None, ge=0, description="KV-cache bytes per token, all layers")

    @property
    def name(self) -> str:
        return self.served_name or self.path


MAX_NAME = 200
"""The longest configuration name: its run folders (`NAME-REPEAT`) and their files fit a file name."""


class Server(Strict):
    port: int | None = Field(None, ge=1, le=65535, description="server port; default: the engine's")
    host: str = Field("127.0.0.1", description="address the server binds; the client runs on the same host",
                      pattern=r"^([A-Za-z0-9]([A-Za-z0-9.\-]*[A-Za-z0-9])?|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*)$")
    args: Args = Field(default_factory=dict, description="flags for every configuration")
    env: Env = Field(default_factory=dict, description="environment for every configuration")
    startup_timeout_s: float = Field(1800, gt=0, description="give up waiting for health after this")
    rendezvous_port: int | None = Field(None, ge=1, le=65535, description="a server on several hosts: the "
                                        "port node 0 waits for the others on; default: the engine's")
    health_path: str | None = Field(None, description="health endpoint, from its leading /; default: the "
                                    "engine's", pattern=r"^/[\x21-\x7e]*$")
    module: str | None = Field(None, description="Python module the engine needs (preflight checks it "
                               "imports); default: the engine's", pattern=r"^([A-Za-z_]\w*(\.[A-Za-z_]\w*)*)?$")
    help_command: str | None = Field(None, description="prints the engine's flags, for the preflight flag "
                                     "check; default: the engine's; \"\" turns the check off")


class Config(Strict):
    name: str = Field(description="configuration name; run ids begin with it")
    args: Args = Field(default_factory=dict, description="flags merged over server.args")
    env: Env = Field(default_factory=dict, description="environment merged over server.env")
    benchmark: dict[str, Any] = Field(default_factory=dict, description="benchmark settings of this "
                                      "configuration's runs, over the playbook's (a matrix's benchmark axes)")
    nodes: int = Field(1, ge=1, description="hosts one server spans (node 0 serves and benchmarks); "
                       "default: what the engine's own flags say (--nnodes), else 1")
    description: str | None = None
    _at: tuple[str | int, ...] = PrivateAttr(default=())   # where the playbook wrote it (for error lines)

    @property
    def at(self) -> tuple[str | int, ...]:
        return self._at

    def written_at(self, at: tuple[str | int, ...]) -> Config:
        config = self.model_copy()
        config._at = at
        return config

    @field_validator("benchmark")
    @classmethod
    def _benchmark_fields(cls, v: dict[str, Any]) -> dict[str, Any]:
        unknown = [k for k in v if k not in Benchmark.model_fields]
        if unknown:
            raise ValueError(f"the benchmark has no field {unknown[0]!r} (fields: {', '.join(Benchmark.model_fields)})")
        return v

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not CONFIG_NAME.match(v):
            raise ValueError("use letters, digits, '.', '_' and '-' (it names directories)")
        if len(v) > MAX_NAME:   # a run's folder is its name and repeat: a file name holds 255 bytes
            raise ValueError(f"a name of {len(v)} characters: at most {MAX_NAME} (it names directories; "
                             "a matrix's points can be named shorter with fewer or shorter axis values)")
        return v


class Scenario(Strict):
    """A workload: prompts of exactly `input_tokens`, `output_tokens` out, under closed-loop concurrency
    or an open-loop request rate."""
    name: str = Field(description="names the scenario's levels (letters, digits, '.', '_', '-')",
                      pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
    input_tokens: int = Field(ge=1, description="prompt length in the server's tokens")
    output_tokens: int = Field(ge=1, description="tokens asked of every request")
    concurrency: list[int] | None = Field(None, description="closed-loop levels (streams in flight)")
    request_rate: list[float] | None = Field(None, description="open-loop levels, requests a second")
    arrival: Literal["poisson", "gamma", "constant"] = Field("poisson", description="open loop: the gaps "
                                                             "between scheduled sends")
    burstiness: float = Field(1.0, gt=0, description="gamma's shape: 1 is Poisson, below 1 burstier")
    requests: int | None = Field(None, ge=1, description="requests a level; default: benchmark.requests, else "
                                 "max(16, 2 x concurrency) or max(16, 2 x request_rate)")

    @model_validator(mode="after")
    def _one_kind(self) -> Scenario:
        if (self.concurrency is None) == (self.request_rate is None):
            raise ValueError(f"scenario {self.name}: give concurrency (closed loop) or request_rate (open loop), "
                             "one of the two")
        if any(c < 1 for c in self.concurrency or ()) or any(r <= 0 for r in self.request_rate or ()):
            raise ValueError(f"scenario {self.name}: concurrency levels are >= 1 and request rates above 0")
        short = next((c for c in self.concurrency or () if self.requests is not None and self.requests < c), None)
        if short is not None:
            raise ValueError(f"scenario {self.name}: {self.requests} requests never keep {short} streams in flight: "
                             f"give requests of at least {short} (or leave it out: max(16, 2 x concurrency))")
        return self

    @property
    def kind(self) -> str:
        """"concurrency" (closed loop) or "request_rate" (open loop)."""
        return "concurrency" if self.concurrency is not None else "request_rate"

    @property
    def loads(self) -> list[float]:
        return list(self.concurrency if self.concurrency is not None else self.request_rate or [])


class Benchmark(Strict):
    prompt: str | None = Field(None, description="the prompt; default: a synthetic one of prompt_tokens words")
    prompt_tokens: int | None = Field(None, ge=1, description="length of the synthetic prompt")
    max_tokens: int = Field(50, ge=1, description="output tokens per request")
    concurrency: list[int] = Field(default_factory=lambda: [1], min_length=1, description="levels, in order")
    requests: int | None = Field(None, ge=1, description="requests per level; default: max(16, 2 x concurrency)")
    warmup: int = Field(1, ge=0, description="unmeasured requests before each level")
    api: Literal["completions", "chat"] = "completions"
    ignore_eos: bool = Field(True, description="ask for exactly max_tokens (false: send no ignore_eos field)")
    extra_body: dict[str, Any] = Field(default_factory=dict, description="fields added to every request, "
                                       "for engine-specific knobs (e.g. transformers' generation_config)")
    timeout_s: float = Field(600, gt=0, description="per request")
    max_failed_share: float = Field(0.0, ge=0, le=1, description="a run whose level lost more than this "
                                    "share of its requests fails (kind bench); 0: any failed request fails it")
    scenarios: list[Scenario] = Field(default_factory=list, description="workloads, each its own levels "
                                      "(instead of prompt, prompt_tokens, max_tokens, concurrency and ignore_eos)")
    random_state: int = Field(0, ge=0, description="fixes the open loop's arrivals and the scenarios' prompts "
                              "(level i draws from random_state + i)")

    @field_validator("scenarios")
    @classmethod
    def _unique_scenarios(cls, v: list[Scenario]) -> list[Scenario]:
        names = [sc.name for sc in v]
        if twice := next((n for n in names if names.count(n) > 1), None):
            raise ValueError(f"scenario name {twice!r} appears twice")
        return v

    @field_validator("concurrency", mode="before")
    @classmethod
    def _one_or_many(cls, v):
        return [v] if isinstance(v, int) else v

    @field_validator("concurrency")
    @classmethod
    def _positive(cls, v):
        if any(c < 1 for c in v):
            raise ValueError("concurrency levels must be >= 1")
        return v


SCENARIO_REPLACES = ("prompt", "prompt_tokens", "max_tokens", "concurrency", "ignore_eos")
"""The single workload's keys, which benchmark.scenarios replace (refused beside them)."""


class Profile(Strict):
    mode: Literal["engine", "nsys", "torch", "none"] = Field(
        "none", description="engine: the engine's profiler; nsys: Nsight Systems around the server; torch: "
                            "torch.profiler around the server process (any engine); none")
    num_steps: int = Field(10, ge=1, description="forward steps to capture")
    start_step: int | None = Field(None, ge=0)
    concurrency: int = Field(1, ge=1, description="streams kept flowing while the profiler records")
    timeout_s: float = Field(600, gt=0, description="how long to wait for every rank's trace")
    max_mb: float | None = Field(None, gt=0, description="refuse to pull a profile larger than this")


class Telemetry(Strict):
    """The server's Prometheus /metrics and the GPUs (nvidia-smi), sampled on the host around the benchmark."""
    enabled: bool = Field(True, description="false: no telemetry.jsonl")
    interval_s: float = Field(1.0, ge=0.05, le=60, description="seconds between samples (one more as the "
                              "benchmark starts and one as it ends)")


REFERENCE_METRIC = re.compile(r"^((ttft|itl|tpot|e2e)_ms_(mean|std|min|p50|p90|p95|p99|max)|output_tok_s|"
                              r"requests_per_s|efficiency)$")


class Reference(Strict):
    """An expected value and how far a result may stray from it, ReFrame's (ref, lower_thres, upper_thres):
    the result must lie in [value * (1 + lower), value * (1 + upper)]; null leaves that side open.
    Short form: [value, lower, upper]."""
    value: float
    lower: float | None = Field(None, ge=-1, le=0, description="relative lower bound, e.g. -0.1")
    upper: float | None = Field(None, ge=0, description="relative upper bound, e.g. 0.1")

    @model_validator(mode="before")
    @classmethod
    def _short_form(cls, v):
        if isinstance(v, (list, tuple)):
            if len(v) != 3:
                raise ValueError("the short form lists value, lower and upper, e.g. [97, -0.1, 0.1]")
            return dict(zip(("value", "lower", "upper"), v, strict=True))
        return v


def _check_references(refs: dict) -> dict:
    for metrics in refs.values():
        for metric in metrics:
            if not REFERENCE_METRIC.match(metric):
                raise ValueError(f"unknown metric {metric!r}: use e.g. itl_ms_p50, ttft_ms_p99, tpot_ms_p50, "
                                 "output_tok_s, requests_per_s or efficiency")
    return refs


References = Annotated[dict[str, dict[str, Reference | dict[int, Reference]]],
                       AfterValidator(_check_references)]


def _same(a: Any, b: Any) -> bool:
    """Equal and of one type: YAML's true is not 1, nor "true"."""
    return type(a) is type(b) and a == b


class Matrix(Strict):
    axes: dict[str, list[Any]] = Field(min_length=1, description="path (args.FLAG, env.NAME, benchmark.FIELD) "
                                       "-> its values; the configurations are their product")
    exclude: list[dict[str, Any]] = Field(default_factory=list, description="points left out: those where "
                                          "every key of an entry has its value")
    include: list[dict[str, Any]] = Field(default_factory=list, description="points added as written")
    link: dict[str, str] = Field(default_factory=dict, description="path -> the axis whose value it takes in "
                                 "every point (`args.max-num-seqs: benchmark.concurrency`)")

    @field_validator("axes")
    @classmethod
    def _axes(cls, axes: dict[str, list[Any]]) -> dict[str, list[Any]]:
        for path, values in axes.items():
            _check_path(path)
            if not values:
                raise ValueError(f"{path}: an axis needs at least one value")
            if any(values.count(v) > 1 for v in values):
                raise ValueError(f"{path}: a value appears twice")
        return axes

    @model_validator(mode="after")
    def _entries(self) -> Matrix:
        for what, entries in (("exclude", self.exclude), ("include", self.include)):
            for i, entry in enumerate(entries):
                for path in entry:
                    _check_path(path)
                    if what == "exclude" and path not in self.axes:
                        raise ValueError(f"exclude[{i}]: {path!r} is not an axis (axes: {', '.join(self.axes)})")
                    if what == "exclude" and not any(_same(entry[path], v) for v in self.axes[path]):
                        # a typo, or "true" for true, would leave every point in without a word
                        raise ValueError(f"exclude[{i}]: {path}: {entry[path]!r} is none of the axis's values "
                                         f"({', '.join(repr(v) for v in self.axes[path])})")
        for target, source in self.link.items():
            _check_path(target)
            if source not in self.axes and not any(source in e for e in self.include):
                raise ValueError(f"link {target}: {source!r} is not an axis (axes: {', '.join(self.axes)})")
            if target in self.axes:
                raise ValueError(f"link {target}: it is an axis itself; a linked path takes its values from "
                                 "the axis it follows")
        return self

    def configs(self, bases: list[Config]) -> list[Config]:
        """A configuration per point (crossed with each of `bases`, when the playbook has configs)."""
        out = []
        for base in bases or [Config.model_construct(name="")]:
            for point in matrix.points(self.axes, exclude=self.exclude, include=self.include, link=self.link):
                parts: dict[str, dict[str, Any]] = {"args": dict(base.args), "env": dict(base.env),
                                                    "benchmark": dict(base.benchmark)}
                for path, value in point.items():
                    section, name = matrix.split(path)
                    parts[section][name] = value
                named = {k: v for k, v in point.items() if k not in self.link}   # a linked value says nothing new
                name = matrix.config_name(base.name, named, MAX_NAME)
                nodes = {"nodes": base.nodes} if "nodes" in base.model_fields_set else {}
                out.append(Config.model_validate({"name": name, **parts, **nodes, "description": base.description})
                           .written_at(("matrix",)))
        return out


def _check_path(path: str) -> None:
    section, name = matrix.split(path)
    if section == "args" and not FLAG_NAME.match(name):
        raise ValueError(f"{path!r}: {name!r} is not a valid flag name")
    if section == "env" and not ENV_NAME.match(name):
        raise ValueError(f"{path!r}: {name!r} is not a valid environment variable name")
    if section == "benchmark" and name not in Benchmark.model_fields:
        raise ValueError(f"{path!r}: the benchmark has no field {name!r} (fields: "
                         f"{', '.join(Benchmark.model_fields)})")


SLO_METRIC = re.compile(r"^(ttft|itl|tpot|e2e)_ms_(mean|p50|p90|p95|p99|max)$")


def _check_slo(slo: dict[str, float]) -> dict[str, float]:
    for metric, bound in slo.items():
        if not SLO_METRIC.match(metric):
            raise ValueError(f"unknown SLO metric {metric!r}: use e.g. ttft_ms_p99, itl_ms_p99, tpot_ms_p50")
        if bound <= 0:
            raise ValueError(f"{metric}: a bound in ms is positive")
    return slo


Slo = Annotated[dict[str, float], AfterValidator(_check_slo)]


class MaxLoad(Strict):
    """Per configuration, the highest load that meets the SLO, by bounded bisection in one server's life."""
    scenario: str | None = Field(None, description="the scenario whose load is searched; default: the first")
    slo: Slo | None = Field(None, description="bounds; default: the playbook's slo")
    low: float = Field(gt=0, description="the lowest load tried (concurrency or request rate)")
    high: float = Field(gt=0, description="the highest load tried")
    steps: int = Field(6, ge=1, le=32, description="probes at most, the ends included")


OBJECTIVE = re.compile(r"^((ttft|itl|tpot|e2e)_ms_(mean|p50|p90|p95|p99|max)|output_tok_s|requests_per_s)$")


def _space_path(path: str) -> str:
    _check_path(path)
    return path


SpacePath = Annotated[str, AfterValidator(_space_path)]
SpaceEntry = Annotated[Any, AfterValidator(spaces.entry)]


class Optuna(Strict):
    """A search over declared flags with Optuna's TPE sampler; every trial is an ordinary run."""
    space: dict[SpacePath, SpaceEntry] = Field(min_length=1, description="path (args.X, env.X, benchmark.X) -> "
                                               "a list of choices or {low, high, step, log}")
    budget: int = Field(ge=1, description="runs at most (a point the sampler proposes again is not run again)")
    objective: str = Field("output_tok_s", description="the run's figure the search optimizes: output_tok_s, "
                           "requests_per_s or a latency statistic such as itl_ms_p50, ttft_ms_p99")
    direction: Literal["maximize", "minimize"] | None = Field(None, description="default: maximize a rate, "
                                                              "minimize a latency")
    level: int | None = Field(None, ge=1, description="the concurrency level the objective is read at; "
                              "default: the highest level the run measured")
    patience: int | None = Field(None, ge=1, description="stop after this many runs in a row that did not "
                                 "beat the best")
    random_state: int | None = Field(None, description="the sampler's random state, for a search that can "
                                     "be repeated")
    startup_trials: int = Field(10, ge=1, description="trials drawn at random before TPE models the results")

    @field_validator("space")
    @classmethod
    def _benchmark_values(cls, v: dict[str, spaces.Entry]) -> dict[str, spaces.Entry]:
        for path, entry in v.items():
            section, name = matrix.split(path)
            if section != "benchmark":
                continue
            for choice in entry if isinstance(entry, list) else [entry.low, entry.high]:
                try:
                    Benchmark.model_validate({name: choice})
                except ValidationError as e:
                    why = str(e.errors()[0]["msg"]).removeprefix("Value error, ")
                    raise ValueError(f"{path}: {choice!r}: {why}") from None
        return v

    @field_validator("objective")
    @classmethod
    def _objective(cls, v: str) -> str:
        if not OBJECTIVE.match(v):
            raise ValueError(f"unknown objective {v!r}: use output_tok_s, requests_per_s or a latency statistic "
                             "such as itl_ms_p50, ttft_ms_p99, tpot_ms_p50, e2e_ms_mean")
        return v

    def config(self, bases: list[Config], point: dict[str, Any]) -> Config:
        """A trial's configuration: its values over the playbook's configuration (when it has one),
        named by them as a matrix point is."""
        base = bases[0] if bases else Config.model_construct(name="")
        parts: dict[str, dict[str, Any]] = {"args": dict(base.args), "env": dict(base.env),
                                            "benchmark": dict(base.benchmark)}
        for path, value in point.items():
            section, name = matrix.split(path)
            parts[section][name] = value
        name = matrix.config_name(base.name, point, MAX_NAME)
        return Config.model_validate({"name": name, **parts, "description": base.description}).written_at(
            ("search", "optuna"))

    @property
    def maximize(self) -> bool:
        return self.direction == "maximize" if self.direction else not self.objective.endswith(
            tuple(f"_ms_{q}" for q in ("mean", "p50", "p90", "p95", "p99", "max")))


class Search(Strict):
    max_load: MaxLoad | None = None
    optuna: Optuna | None = None

    @model_validator(mode="after")
    def _one(self) -> Search:
        if (self.max_load is None) == (self.optuna is None):
            raise ValueError("search takes one of max_load or optuna")
        return self


class Playbook(Strict):
    name: str = Field(description="the sweep's name; sweep ids begin with it (letters, digits, '.', '_', '-')",
                      pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
    hosts: str = Field(description="group, host name or glob from the inventory")
    engine: str = Field(description="a registered engine: sglang, vllm, sim (the simulator) or openai (any "
                        "OpenAI-compatible server, by template)")
    flavor: str | None = Field(None, description="engine sim: the engine it imitates (default: the "
                               "simulator's default, SGLang)")
    template: str | None = Field(None, description="launch template; default: the engine's own, or "
                                 "templates/<engine>.sh.j2 beside the playbook")
    model: ModelSpec
    server: Server = Field(default_factory=Server)
    configs: list[Config] = Field(default_factory=list, description="named configurations (or `matrix:`, or both: "
                                  "every configuration crossed with every point)")
    matrix: Matrix | None = Field(None, description="configurations as a product of axes")
    benchmark: Benchmark = Field(default_factory=Benchmark)
    profile: Profile = Field(default_factory=Profile)
    telemetry: Telemetry = Field(default_factory=Telemetry)
    repeat: int = Field(1, ge=1)
    placement: Literal["pool", "each"] = "pool"
    secrets: list[str] = Field(default_factory=list, description="env names to treat as secrets")
    vars: dict[str, Any] = Field(default_factory=dict, description="free variables for the template")
    slo: Slo = Field(default_factory=dict, description="latency bounds in ms (ttft_ms_p99, itl_ms_p99, ...): "
                     "goodput counts the requests within every bound")
    search: Search | None = Field(None, description="max_load: the highest load within the SLO per "
                                  "configuration; optuna: a search over flags (default: the grid)")
    references: References = Field(default_factory=dict, description="expected results: config name or "
                                   "\"*\" -> metric -> reference, or -> {concurrency: reference}; a miss "
                                   "fails the sweep and compare")

    @field_validator("configs")
    @classmethod
    def _unique_names(cls, configs):
        names = [c.name for c in configs]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"configuration name {name!r} appears twice")
        return [c.written_at(("configs", i)) for i, c in enumerate(configs)]

    @field_validator("search")
    @classmethod
    def _one_search_base(cls, v: Search | None, info: ValidationInfo) -> Search | None:
        # a trial is one run of one configuration: the space's values over the playbook's one configuration
        if v is None or v.optuna is None:
            return v
        if info.data.get("matrix") is not None:
            raise ValueError("search.optuna searches its space instead of a matrix: write the matrix's axes "
                             "as the space (lists of choices)")
        if len(info.data.get("configs") or []) > 1:
            raise ValueError("search.optuna builds every trial on one configuration: keep one under configs "
                             "(or none), or put what differs between them in the space")
        if info.data.get("repeat", 1) != 1 or info.data.get("placement", "pool") != "pool":
            raise ValueError("search.optuna runs every trial once on whichever host is free: leave repeat at 1 "
                             "and placement at pool")
        return v

    @cached_property
    def all_configs(self) -> list[Config]:
        """What runs: the configurations as written, or the matrix's points (crossed with them)."""
        return self.matrix.configs(self.configs) if self.matrix else list(self.configs)

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, v: str) -> str:
        if v not in engines.names():
            raise ValueError(f"unknown engine {v!r}: use one of {', '.join(engines.names())}")
        return v

    @field_validator("flavor")
    @classmethod
    def _imitable(cls, v: str | None) -> str | None:
        if v is not None and v not in engines.imitable():
            raise ValueError(f"the simulator imitates {', '.join(engines.imitable())}, not {v!r}")
        return v

    @model_validator(mode="after")
    def _some_configs(self):
        if not self.configs and self.matrix is None and self.optuna is None:
            raise ValueError("a playbook needs `configs:` (a list of named configurations) or `matrix:`")
        try:
            names = [c.name for c in self.all_configs]
        except ValidationError as e:
            first = e.errors()[0]
            raise _at(("matrix",), f"a point makes a configuration that is not valid: "
                      f"{'.'.join(map(str, first['loc']))}: {first['msg']}", self.matrix) from None
        except ValueError as e:   # the matrix's own refusals (an exclude that leaves no point, ...)
            raise _at(("matrix",), str(e), self.matrix) from None
        twice = next((n for n in names if names.count(n) > 1), None)
        if twice:
            raise _at(("matrix",) if self.matrix is not None else ("configs",),
                      f"the matrix makes the configuration {twice!r} twice (an include repeats a point, or "
                      "values that differ only in characters a name cannot hold)", self.matrix)
        return self

    @property
    def optuna(self) -> Optuna | None:
        return self.search.optuna if self.search is not None else None

    def _scenarios_of(self, config: Config) -> list[Scenario] | None:
        """A configuration's scenarios (its own or the playbook's), None when one is not valid."""
        try:
            return [Scenario.model_validate(sc) if isinstance(sc, dict) else sc
                    for sc in config.benchmark.get("scenarios", self.benchmark.scenarios)]
        except ValidationError:
            return None

    @model_validator(mode="after")
    def _workloads(self):
        """Scenarios replace the single workload's keys (a playbook says one or the other, so no level
        runs a workload nobody wrote); max_load needs the scenario it searches and an SLO."""
        mine = set(self.benchmark.model_fields_set) & set(SCENARIO_REPLACES)
        for c in self.all_configs:
            scenarios = c.benchmark.get("scenarios", self.benchmark.scenarios)
            if not scenarios:
                continue
            mixed = sorted(mine | (set(c.benchmark) & set(SCENARIO_REPLACES)))
            if mixed:
                raise ValueError(f"configuration {c.name}: benchmark.scenarios replace benchmark."
                                 f"{', benchmark.'.join(mixed)}: give each scenario its input_tokens, output_tokens "
                                 "and concurrency or request_rate instead")
        ml = self.search.max_load if self.search is not None else None
        for c in self.all_configs:
            scenarios = self._scenarios_of(c)
            if scenarios is None:
                continue   # the plan names the configuration's bad scenario, with its line
            searched = (ml.scenario or scenarios[0].name) if ml is not None and scenarios else None
            empty = next((sc.name for sc in scenarios if not sc.loads and sc.name != searched), None)
            if empty:
                raise ValueError(f"scenario {empty}: no levels (its concurrency or request_rate list is empty; only "
                                 "the scenario search.max_load searches may leave it empty)")
        if ml is None:
            return self
        if not (ml.slo or self.slo):
            raise ValueError("search.max_load: an SLO to meet (search.max_load.slo or slo)")
        if ml.low > ml.high:
            raise ValueError(f"search.max_load: low {ml.low:g} is above high {ml.high:g}")
        for c in self.all_configs:
            scenarios = self._scenarios_of(c)
            if scenarios is None:
                continue   # the plan names the configuration's bad scenario, with its line
            names = [sc.name for sc in scenarios]
            if not names:
                raise ValueError(f"configuration {c.name}: search.max_load needs benchmark.scenarios (the "
                                 "scenario whose load it searches)")
            name = ml.scenario or names[0]
            if name not in names:
                raise ValueError(f"configuration {c.name}: search.max_load searches scenario {name!r}, which "
                                 f"benchmark.scenarios does not declare (have: {', '.join(names) or 'none'})")
            searched = next(sc for sc in scenarios if sc.name == name)
            if searched.kind == "concurrency" and (ml.low != int(ml.low) or ml.high != int(ml.high)):
                raise ValueError(f"search.max_load: scenario {name} is closed loop: low and high are concurrency "
                                 "levels, whole numbers")
        return self

    @model_validator(mode="after")
    def _engine_needs(self):
        engine = engines.get_engine(self.engine, self.flavor)
        if not engine.template and not self.template:
            raise ValueError(f"engine {self.engine} needs `template:` (the script that launches the server)")
        if self.profile.mode not in engine.profile_modes:
            raise ValueError(f"engine {self.engine} has no profile.mode {self.profile.mode}: use one of "
                             f"{', '.join(engine.profile_modes)}")
        return self


def _at(loc: tuple[str | int, ...], message: str, value: Any) -> ValidationError:
    """A check of the whole playbook that is about one key: raised as that key's error, so that the
    message names the key and its line, not the playbook's first line."""
    error = PydanticCustomError("value_error", "{message}", {"message": message})
    return ValidationError.from_exception_data("Playbook", [InitErrorDetails(type=error, loc=loc, input=value)])


def load_playbook(path: Path | str) -> tuple[Playbook, Any]:
    """The validated playbook and its YamlDoc (kept for line numbers of later errors)."""
    doc = load_yaml(path)
    if not isinstance(doc.data, dict):
        raise doc.error((), "a playbook is a mapping (name, hosts, engine, model, configs, ...)")
    return doc.validate(Playbook), doc
