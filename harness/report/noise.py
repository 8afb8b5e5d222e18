"""Is a difference real? Medians with bootstrap confidence intervals, and the verdict they allow.

A configuration is called better (or worse) than the baseline only when the two intervals do not
overlap; otherwise the difference is within the noise the measurements show. Intervals come from the
repeats of a configuration (each run one value), or, for a configuration measured once, from its
requests (each request's inter-token gaps resampled whole). The resampling starts from a fixed random state, so the same
results folder always gives the same intervals.
"""

from __future__ import annotations

import random
import statistics
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Sequence
from itertools import chain

RESAMPLES = 2000
LEVEL = 0.95
POOL_DIRECTLY = 4096
"""A resample of at most this many values is pooled and sorted: faster than bisection, as exact."""


def bootstrap_ci(values: Sequence[float], *, stat: Callable[[Sequence[float]], float] = statistics.median,
                 resamples: int = RESAMPLES, level: float = LEVEL, random_state: int = 0) -> tuple[float, float] | None:
    """The `level` percentile interval of `stat` over resamples of `values`; None for fewer than two."""
    if len(values) < 2:
        return None
    rng = random.Random(random_state)
    stats = sorted(stat(rng.choices(values, k=len(values))) for _ in range(resamples))
    cut = (1 - level) / 2
    return stats[int(cut * (resamples - 1))], stats[int((1 - cut) * (resamples - 1))]


def grouped_ci(groups: Sequence[Sequence[float]], *, resamples: int = RESAMPLES, level: float = LEVEL,
               random_state: int = 0) -> tuple[float, float] | None:
    """The interval of the median of pooled values when whole groups are resampled (a request's gaps
    stay together: they are not independent of each other)."""
    sorted_groups = [sorted(g) for g in groups if g]
    if len(sorted_groups) < 2:
        return None
    rng = random.Random(random_state)
    pooled = sorted(chain.from_iterable(sorted_groups))
    picks = range(len(sorted_groups))
    stats = sorted(_pooled_median(pooled, sorted_groups, Counter(rng.choices(picks, k=len(picks))))
                   for _ in range(resamples))
    cut = (1 - level) / 2
    return stats[int(cut * (resamples - 1))], stats[int((1 - cut) * (resamples - 1))]


def _pooled_median(pooled: list[float], groups: list[list[float]], times: Counter[int]) -> float:
    """statistics.median of the groups taken `times[g]` times each, pooled, without pooling them: a
    run's 32,000 gaps, resampled 2,000 times, would be 64 million values to copy and sort. The value of
    a rank is found by bisection over every value (`pooled`, sorted), counting with each group's own
    bisection what lies at or below it."""
    chosen = [(groups[g], n) for g, n in times.items()]
    total = sum(len(values) * n for values, n in chosen)
    if total <= POOL_DIRECTLY:
        return statistics.median(sorted(chain.from_iterable(values * n for values, n in chosen)))

    def at_or_below(x: float) -> int:
        return sum(bisect_right(values, x) * n for values, n in chosen)

    def of_rank(rank: int) -> float:
        """The value with `rank` values of the pool below it (0-based)."""
        lo, hi = 0, len(pooled) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if at_or_below(pooled[mid]) > rank:
                hi = mid
            else:
                lo = mid + 1
        return pooled[lo]

    mid = total // 2
    if total % 2:
        return of_rank(mid)
    below = of_rank(mid - 1)
    if at_or_below(below) > mid:
        return below   # the two middle values are the same value
    above = min(values[i] for values, _ in chosen if (i := bisect_right(values, below)) < len(values))
    return (below + above) / 2


def verdict(ci: tuple[float, float] | None, ref: tuple[float, float] | None, *,
            higher_is_better: bool) -> str | None:
    """"better", "worse" or "within noise" against the reference's interval; None without both."""
    if ci is None or ref is None:
        return None
    if ci[0] > ref[1]:
        return "better" if higher_is_better else "worse"
    if ci[1] < ref[0]:
        return "worse" if higher_is_better else "better"
    return "within noise"
