"""`search.optuna.space`: the flags a search may set, each a list of choices or a range.

    search:
      optuna:
        space:
          args.tp-size: [1, 2, 4, 8]                      # choices (any scalars, null removes the flag)
          args.max-num-seqs: {low: 16, high: 512, step: 16}   # integers from low to high
          args.mem-fraction-static: {low: 0.7, high: 0.95}    # a float (to 4 significant digits)
          env.NCCL_ALGO: [Ring, Tree]
          benchmark.concurrency: [8, 32]

Paths are the matrix's (`args.FLAG`, `env.NAME`, `benchmark.FIELD`: harness.config.matrix). A trial's
values become a configuration named by them, as a matrix point is (`tp-size-4_max-num-seqs-128`),
over the playbook's one configuration when it has one. This module is pure and imports no sampler, so
`harness plan` can show a search without loading Optuna; harness.search turns an entry into Optuna's
distribution.
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from harness.config import matrix
from harness.errors import InputError

if TYPE_CHECKING:
    from harness.plan import Sweep

Scalar = bool | int | float | str | None
FLOAT_DIGITS = 4
"""Significant digits kept of a float drawn from a range without a step: what the run uses and its
name says (0.8312, not 0.83119472...)."""


class Range(BaseModel):
    """Numbers from low to high (both included): integers when low, high and step are all integers,
    else floats; `step` spaces them, `log` draws them evenly on a log scale."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    low: int | float
    high: int | float
    step: int | float | None = None
    log: bool = False

    @model_validator(mode="before")
    @classmethod
    def _numbers(cls, v: Any) -> Any:
        if isinstance(v, dict):
            for key in ("low", "high", "step"):
                if isinstance(v.get(key), (bool, str)):
                    raise ValueError(f"{key} is a number, not {v[key]!r}")
        return v

    @model_validator(mode="after")
    def _sane(self) -> Range:
        if not self.low < self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        if self.step is not None and self.step <= 0:
            raise ValueError(f"step must be positive, not {self.step}")
        if self.log and self.low <= 0:
            raise ValueError("a log range needs low above 0")
        if self.log and self.step is not None:
            raise ValueError("a range takes step or log, not both")
        if self.step is not None:
            count = (self.high - self.low) / self.step
            if abs(count - round(count)) > 1e-9:
                raise ValueError(f"high - low ({self.high - self.low:g}) is not a multiple of step ({self.step})")
        return self

    @property
    def integers(self) -> bool:
        return all(isinstance(x, int) for x in (self.low, self.high, self.step if self.step is not None else 1))

    @property
    def size(self) -> int | None:
        """How many values it holds; None for a float range without a step."""
        if self.integers:
            return (int(self.high) - int(self.low)) // int(self.step or 1) + 1
        return round((self.high - self.low) / self.step) + 1 if self.step else None

    def value(self, raw: float) -> int | float:
        """The value a run uses for a number the sampler drew, never outside low..high: rounding
        0.99996 to 4 digits made 1.0 of a range that ends at 0.99999."""
        if self.integers:
            return int(raw)
        if self.step:
            return round(self.low + round((raw - self.low) / self.step) * self.step, 12)
        return min(max(float(f"{raw:.{self.digits}g}"), self.low), self.high)

    @property
    def digits(self) -> int:
        """Significant digits of a value drawn without a step: FLOAT_DIGITS, or more for a range so
        narrow that they would not keep ten values of it apart ({low: 1000.1, high: 1000.4} was one
        run, 1000.0, outside it)."""
        widest = max(abs(self.low), abs(self.high))
        return max(FLOAT_DIGITS, math.ceil(math.log10(widest / (self.high - self.low))) + 1)

    def first(self) -> int | float:
        return self.low

    def describe(self) -> str:
        how = f", step {self.step}" if self.step else ", log scale" if self.log else ""
        kind = "integers" if self.integers else "floats"
        return f"{kind} {self.low} to {self.high}{how}"


Entry = list[Scalar] | Range


def entry(value: Any) -> Entry:
    """One space entry as written: a list of distinct scalar choices, or a range mapping."""
    if isinstance(value, list):
        if not value:
            raise ValueError("a list of choices needs at least one")
        for choice in value:
            if not (choice is None or isinstance(choice, (bool, int, float, str))):
                raise ValueError(f"a choice is a number, a string, true/false or null, not {choice!r}")
        if any(value.count(v) > 1 for v in value):
            if len({matrix.point_name({'args.x': v}) for v in value}) == len(value):   # true and 1, 1 and 1.0
                raise ValueError("two choices the sampler cannot tell apart (Python finds true equal to 1, and "
                                 "1 to 1.0): keep one of them")
            raise ValueError("a choice appears twice")
        if len({matrix.point_name({'args.x': v}) for v in value}) < len(value):
            raise ValueError("two choices make the same run name (they differ only in characters a name "
                             "cannot hold)")
        return list(value)
    if isinstance(value, dict):
        try:
            return Range.model_validate(value)
        except ValidationError as e:   # an unknown key first: a misspelt one also makes one missing
            first = sorted(e.errors(), key=lambda err: err["type"] != "extra_forbidden")[0]
            where = ".".join(map(str, first["loc"]))
            message = str(first["msg"]).removeprefix("Value error, ")
            if first["type"] == "extra_forbidden":
                message = "unknown key (a range takes low, high, step and log)"
            elif first["type"] == "missing":
                message = "required (a range takes low, high, step and log)"
            raise ValueError(f"{where}: {message}" if where else message) from None
    raise ValueError("an entry is a list of choices or a range {low, high, step, log}")


def size(space: dict[str, Entry]) -> int | None:
    """The points of the space (its grid), or None when a float range has no step."""
    total = 1
    for e in space.values():
        n = len(e) if isinstance(e, list) else e.size
        if n is None:
            return None
        total *= n
    return total


def first_point(space: dict[str, Entry]) -> dict[str, Any]:
    """The space's first point (first choices, lowest numbers): what `harness plan` renders."""
    return {path: e[0] if isinstance(e, list) else e.first() for path, e in space.items()}


def describe(space: dict[str, Entry]) -> list[str]:
    return [f"{path}: {', '.join(map(_shown, e)) if isinstance(e, list) else e.describe()}"
            for path, e in space.items()]


def _shown(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def grid(space: dict[str, Entry]) -> list[dict[str, Any]]:
    """Every point of a finite space, in axis order (what a grid over it would run)."""
    axes: dict[str, list[Any]] = {}
    for path, e in space.items():
        if isinstance(e, list):
            axes[path] = list(e)
        elif e.size is None:
            raise ValueError(f"{path}: a float range without a step has no grid")
        else:
            step = e.step or 1
            axes[path] = [e.value(e.low + i * step) for i in range(e.size)]
    return matrix.points(axes, exclude=[], include=[], link={})



SAMPLES = 64
"""Values of a range checked one by one before a search starts; a larger range is checked at its ends
and between them."""


def samples(e: Entry) -> list[Any]:
    """Values that stand for every value an entry may give a trial: every choice, every value of a
    small grid, else the ends and two values between (fractional ones, as a float range draws)."""
    if isinstance(e, list):
        return list(e)
    if e.size is not None and e.size <= SAMPLES:
        return [e.value(e.low + i * (e.step or 1)) for i in range(e.size)]
    return list(dict.fromkeys(e.value(e.low + (e.high - e.low) * f) for f in (0, 0.37, 0.71, 1)))


def check(sweep: Sweep) -> None:
    """Refuse, before any host, a search some of whose trials could never have a value: a benchmark
    value of the space that is not one (a float range over a field of whole numbers), or an objective
    read at a level its trials do not measure. Each trial would be run, take its GPUs for a server's
    life, and be told failed; a night of them ended with no best and the sweep said it went well."""
    from harness.plan import search_run  # plan imports this module

    settings = sweep.playbook.optuna
    assert settings is not None  # only a searching playbook is checked as a search
    doc = sweep.doc
    paths = [p for p in settings.space if matrix.split(p)[0] == "benchmark"]
    base = first_point(settings.space)
    for values in itertools.islice(itertools.product(*(samples(settings.space[p]) for p in paths)), 4096):
        varied = dict(zip(paths, values, strict=True))
        bench = search_run(sweep, base | varied).benchmark   # an InputError naming the point's bad value
        closed = ({c for sc in bench.scenarios for c in sc.concurrency or ()} if bench.scenarios
                  else set(bench.concurrency))
        which = f"the points with {', '.join(f'{p} {v}' for p, v in varied.items())}" if varied else "no trial"
        if not closed:
            where: tuple[str, ...] = ("search", "optuna", "objective")
            raise InputError(f"{settings.objective} is read at a concurrency, and {which} "
                             f"{'measure none' if varied else 'measures one'} (the scenarios are all open-loop, "
                             "request_rate): give a scenario a concurrency", file=str(doc.path),
                             key=".".join(where), line=doc.line(where))
        if settings.level is not None and settings.level not in closed:
            where = ("search", "optuna", "level")
            measured = ", ".join(map(str, sorted(closed)))
            raise InputError(f"concurrency {settings.level}: {which} {'do not measure' if varied else 'measures'} "
                             f"it (the benchmark's concurrency: {measured}), so each would be a failed trial; "
                             "give one of those, or leave level out (the highest)", file=str(doc.path),
                             key=".".join(where), line=doc.line(where))
