"""Interval speed: `noise.grouped_ci` against its definition, computed the plain way.

A configuration measured once gets its ITL interval from its requests: 2,000 resamples of whole
requests, the median of each resample's pooled inter-token gaps (harness/report/noise.py). The end
of every sweep and `harness compare` compute one such interval per load level, so its cost is paid
once per configuration and level. The baseline is the definition itself: pool each resample's
requests and take `statistics.median` (the oracle of tests/unit/test_noise.py). Both draw the same
resamples, and the script checks that they give the same interval.

Sizes: requests per level x gaps per request (max_tokens - 1), from a quick sweep's 4 x 47 to a
long run's 64 x 512. Gaps are log-normal around 10 ms, rounded to 10 us as a client measures them.

    .venv/bin/python benchmarks/interval_speed.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.report.noise import RESAMPLES, grouped_ci  # noqa: E402

SIZES = [(4, 47), (16, 127), (32, 255), (64, 255), (64, 511)]


def plain(groups: list[list[float]], *, resamples: int = RESAMPLES, random_state: int = 0) -> tuple[float, float]:
    """The definition: every resample pooled and its median taken."""
    rng = random.Random(random_state)
    stats = sorted(statistics.median([x for g in rng.choices(groups, k=len(groups)) for x in g])
                   for _ in range(resamples))
    return stats[int(0.025 * (resamples - 1))], stats[int(0.975 * (resamples - 1))]


def best_of(repeats: int, fn, *args) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = fn(*args)
        times.append(time.perf_counter() - started)
    return min(times), result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="each timing is the best of this many")
    args = parser.parse_args()
    rng = random.Random(1)
    ratios = []
    for requests, gaps in SIZES:
        groups = [[round(rng.lognormvariate(0, 0.3) * 10, 2) for _ in range(gaps)] for _ in range(requests)]
        ours, got = best_of(args.repeats, grouped_ci, groups)
        base, want = best_of(args.repeats, plain, groups)
        if got != want:
            raise SystemExit(f"{requests} x {gaps}: grouped_ci gave {got}, the definition {want}")
        ratios.append(base / ours)
        print(f"{requests:3} requests x {gaps:3} gaps: grouped_ci {ours * 1e3:7.1f} ms, "
              f"pooled and sorted {base * 1e3:8.1f} ms, {base / ours:5.1f}x")
    print(f"summary: grouped_ci {min(ratios):.1f}-{max(ratios):.1f}x faster than pooling every resample "
          f"({RESAMPLES} resamples, the same intervals)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
