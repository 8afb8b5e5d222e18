"""The benchmark's statistics: pure arithmetic on numbers and bench.json's dictionaries, no sockets, no HTTP.

The benchmark client (`bench.py`) summarizes its requests with these on the host; `harness reproduce` and
the reports use the same definitions on the orchestrator, so a percentile means one thing everywhere.
Standard library only and Python >= 3.9, like everything that ships to a host.

    percentiles: linear interpolation between closest ranks (numpy's default method "linear")
    std: the population standard deviation (numpy's default ddof=0)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

STATS = ("mean", "std", "min", "p50", "p90", "p95", "p99", "max")
"""The keys of every distribution in bench.json, in the order the tables show them."""


def percentile(ordered: Sequence[float], p: float) -> float:
    """The p-th percentile of sorted values by linear interpolation between closest ranks (numpy's
    default), so p99 of few samples lies between the two largest rather than on either."""
    rank = (len(ordered) - 1) * p / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def distribution(values: Iterable[float]) -> dict:
    """{mean, std, min, p50, p90, p95, p99, max}; every value null when there are none."""
    xs = sorted(values)
    if not xs:
        return dict.fromkeys(STATS)
    mean = math.fsum(xs) / len(xs)
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / len(xs))
    return {"mean": mean, "std": std, "min": xs[0], "p50": percentile(xs, 50), "p90": percentile(xs, 90),
            "p95": percentile(xs, 95), "p99": percentile(xs, 99), "max": xs[-1]}


def several_per_chunk(level: dict) -> bool:
    """Whether a bench.json level's chunks carried noticeably more than one token: then ITL per chunk
    and ITL per token differ, and both are worth showing."""
    return (level.get("tokens_per_chunk") or 1) > 1.05
