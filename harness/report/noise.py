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
from collections.abc import Callable, Sequence

RESAMPLES = 2000
LEVEL = 0.95


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
    groups = [g for g in groups if g]
    if len(groups) < 2:
        return None
    rng = random.Random(random_state)
    stats = sorted(statistics.median([x for g in rng.choices(groups, k=len(groups)) for x in g])
                   for _ in range(resamples))
    cut = (1 - level) / 2
    return stats[int(cut * (resamples - 1))], stats[int((1 - cut) * (resamples - 1))]


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
