"""Is a difference real? Medians with bootstrap confidence intervals, and the verdict they allow.

A configuration is called better (or worse) than the baseline only when the two intervals do not
overlap; otherwise the difference is within the noise the measurements show. Intervals come from the
repeats of a configuration (each run one value), or, for a configuration measured once, from its
requests (each request's inter-token gaps resampled whole). The resampling starts from a fixed random state, so the same
results folder always gives the same intervals.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

RESAMPLES = 2000
LEVEL = 0.95


def bootstrap_ci(values: Sequence[float], *, stat: Callable[[Sequence[float]], float] = statistics.median,
                 resamples: int = RESAMPLES, level: float = LEVEL, random_state: int = 0) -> tuple[float, float] | None:
    """The `level` percentile interval of `stat` over resamples of `values`; None for fewer than two.
    A value that is no measurement (NaN, an infinity) is left out: sorted with the others it would put
    the interval anywhere."""
    values = [v for v in values if math.isfinite(v)]
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
    import numpy as np  # only here: the other commands start without it

    kept = [np.sort(np.asarray(g, dtype=float)) for g in groups if g and all(map(math.isfinite, g))]
    if len(kept) < 2:
        return None
    picks = random.Random(random_state).choices(range(len(kept)), k=len(kept) * resamples)
    # times[r, g]: how often resample r takes group g
    rows = np.repeat(np.arange(resamples) * len(kept), len(kept))
    times = np.bincount(rows + np.asarray(picks), minlength=resamples * len(kept)).reshape(resamples, len(kept))
    stats = np.sort(_pooled_medians(kept, times))
    cut = (1 - level) / 2
    return float(stats[int(cut * (resamples - 1))]), float(stats[int((1 - cut) * (resamples - 1))])


def _pooled_medians(groups: list[NDArray[np.float64]], times: NDArray[np.int64]) -> NDArray[np.float64]:
    """statistics.median of each resample's pool (row r of `times`: how often it takes each group),
    without pooling them: a run's 32,000 gaps, resampled 2,000 times, would be 64 million values to
    copy and sort. The value of a rank is found by bisection over every value (sorted), all resamples
    at once, counting with each group's own bisection what lies at or below it."""
    import numpy as np  # noqa: F811 - at run time, as in grouped_ci

    pooled = np.sort(np.concatenate(groups))
    total = times @ np.array([len(values) for values in groups])
    # the two middle ranks of each pool (the same one for an odd total), searched together
    rank = np.concatenate([(total - 1) // 2, total // 2])
    taken = np.concatenate([times, times])
    lo, hi = np.zeros(len(rank), dtype=np.int64), np.full(len(rank), len(pooled) - 1)
    while (lo < hi).any():   # a finished search stays put: at its rank's value, `over` holds
        mid = (lo + hi) // 2
        at_or_below = sum(taken[:, g] * np.searchsorted(values, pooled[mid], side="right")
                          for g, values in enumerate(groups))
        over = at_or_below > rank   # the value of `rank` is pooled[mid] or below it
        hi = np.where(over, mid, hi)
        lo = np.where(over, lo, mid + 1)
    lower, upper = np.split(pooled[lo], 2)
    return (lower + upper) / 2


def verdict(ci: tuple[float, float] | None, ref: tuple[float, float] | None, *,
            higher_is_better: bool) -> str | None:
    """"better", "worse" or "within noise" against the reference's interval; None without both, or
    when either is no interval (a bound NaN or infinite, or its low end above its high end): NaN compares
    false both ways, which read as "within noise", and an inverted interval as a verdict it cannot carry."""
    if ci is None or ref is None or not (_interval(ci) and _interval(ref)):
        return None
    if ci[0] > ref[1]:
        return "better" if higher_is_better else "worse"
    if ci[1] < ref[0]:
        return "worse" if higher_is_better else "better"
    return "within noise"


def _interval(ci: tuple[float, float]) -> bool:
    return len(ci) == 2 and all(map(math.isfinite, ci)) and ci[0] <= ci[1]
