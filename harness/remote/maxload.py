"""The max_load search: the highest load of a scenario that meets an SLO, by bisection (`bisect_max_load`).

A room of its own: it knows no level, socket or SLO, only `meets(load)`, which bench.py answers by
measuring an ordinary level marked `probe` and asking levels.level_meets; so the search is tested on
its own, with any verdicts.
"""

from __future__ import annotations

import math
from typing import Callable


def bisect_max_load(low: float, high: float, steps: int, integer: bool,
                    meets: Callable[[float], bool]) -> dict:
    """The highest load in [low, high] that `meets`, assuming fewer loads meet as the load grows, in at
    most `steps` probes: low first (if it misses, nothing meets), then high (if it meets, it is the
    answer), then the middle of the last load that met and the first that missed, until `steps`
    probes were made or (integers) no load lies between them. Returns {value, met, probes}:
    value None and met False when low already missed."""
    if integer:
        low, high = math.ceil(low), math.floor(high)
    if low > high or steps < 1:
        raise ValueError(f"max_load: low {low} is above high {high}, or steps below 1")
    probes: list[dict] = []

    def probe(load: float) -> bool:
        ok = bool(meets(load))
        probes.append({"load": load, "met": ok})
        return ok

    if not probe(low):
        return {"value": None, "met": False, "probes": probes}
    if steps == 1 or high == low:
        return {"value": low, "met": True, "probes": probes}
    if probe(high):
        return {"value": high, "met": True, "probes": probes}
    good, bad = low, high
    while len(probes) < steps:
        mid = (good + bad) // 2 if integer else (good + bad) / 2
        if integer and mid <= good:
            break
        if probe(mid):
            good = mid
        else:
            bad = mid
    return {"value": good, "met": True, "probes": probes}
