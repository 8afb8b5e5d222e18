"""Optuna's TPE against the grid, on the simulated engine's latency model (in-process, no server).

The space is seven SGLang flags the simulator's latency model reads (harness/sim/model.py): tp-size
and ep-size 1/2/4/8, dp-size 1/2, the KV-cache dtype (fp8_e4m3 or bf16), MSCCLPP, CUDA graphs off,
torch.compile; 4 x 4 x 2 x 2 x 2 x 2 x 2 = 512 points as a grid. A point's objective is its output
tokens a second at concurrency 64 from the model's decode step: 64 x 1000 / ITL ms (prefill left
out), each point's flags parsed by the simulator's own parser (harness.sim.flags) as its server
would parse them.

The grid runs all 512 points: that is what it takes to know its best. The search is the harness's
own: the space parsed by harness.config.space, Optuna's distributions from harness.search, TPE with
the harness's defaults (10 random trials first, constant liar), asked and told one trial at a time
(one host), a point proposed again costing no run (as harness.search does). Random search over the
same space (Optuna's RandomSampler, same rule for repeats) is the second baseline. For each of
`--states` random states it reports:

- runs until the search's best equals the grid's best (capped at `--cap`, by default the grid's 512;
  a search that has not reached it by then counts as the cap),
- the best after a budget of 20 runs, as a share of the grid's best.

Each figure is the median over the random states with [min, max].

    .venv/bin/python benchmarks/optuna_vs_grid.py [--states 10] [--cap 512]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import optuna  # noqa: E402

from harness.config import space  # noqa: E402
from harness.search import distribution  # noqa: E402
from harness.sim.flags import parse, sim_config  # noqa: E402
from harness.sim.model import LatencyModel  # noqa: E402

CONCURRENCY = 64
SPACE = {
    "args.tp-size": [1, 2, 4, 8],
    "args.ep-size": [1, 2, 4, 8],
    "args.dp-size": [1, 2],
    "args.kv-cache-dtype": ["fp8_e4m3", "bf16"],
    "args.enable-mscclpp": [True, False],
    "args.disable-cuda-graph": [True, False],
    "args.enable-torch-compile": [True, False],
}


def tok_s(point: dict[str, Any]) -> float:
    """Output tokens a second at CONCURRENCY of one point, from the simulator's latency model."""
    argv = ["--model-path", "/models/GLM-5-NVFP4"]
    for path, value in point.items():
        flag = "--" + path.split(".", 1)[1]
        if value is True:
            argv.append(flag)
        elif value is not False:
            argv += [flag, str(value)]
    model = LatencyModel(sim_config("sglang", parse("sglang", argv)))
    return CONCURRENCY * 1000 / model.itl_ms(CONCURRENCY)


def search(sampler: optuna.samplers.BaseSampler, entries: dict[str, space.Entry], best: float, cap: int,
           cache: dict[str, float]) -> tuple[int, float]:
    """Runs until the grid's best is reached (cap if never) and the best value within 20 runs."""
    study = optuna.create_study(direction="maximize", sampler=sampler)
    dists = {p: distribution(e) for p, e in entries.items()}
    ran: dict[tuple, float] = {}
    reached, best_at_20, repeats = cap, 0.0, 0
    while len(ran) < cap and repeats < 1000:
        trial = study.ask(dists)
        key = tuple(trial.params[p] for p in entries)
        if key in ran:   # proposed again: told the earlier value, no run
            study.tell(trial, ran[key])
            repeats += 1
            continue
        repeats = 0
        name = repr(key)
        value = cache[name] if name in cache else cache.setdefault(name, tok_s(dict(trial.params)))
        ran[key] = value
        study.tell(trial, value)
        if len(ran) <= 20:
            best_at_20 = max(best_at_20, value)
        if value >= best * (1 - 1e-9):
            reached = len(ran)
            break
    if len(ran) < 20:   # stopped at the best before 20 runs: that best stands for the budget too
        best_at_20 = max(ran.values())
    return reached, best_at_20


def spread(values: list[float], fmt: str) -> str:
    return f"{format(statistics.median(values), fmt)} [{format(min(values), fmt)}, {format(max(values), fmt)}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--states", type=int, default=10, help="random states (0, 1, ...)")
    parser.add_argument("--cap", type=int, default=None, help="runs at most per search (default: the grid's)")
    args = parser.parse_args()
    optuna.logging.set_verbosity(logging.WARNING)
    entries = {p: space.entry(v) for p, v in SPACE.items()}
    t0 = time.monotonic()
    grid = space.grid(entries)
    values = [tok_s(p) for p in grid]
    best = max(values)
    first = values.index(best) + 1
    winner = grid[values.index(best)]
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    print(f"grid: {len(grid)} points; best {best:,.0f} tok/s at concurrency {CONCURRENCY}: "
          + " ".join(f"{p.split('.', 1)[1]}={v}" for p, v in winner.items()))
    print(f"grid: {len(grid)} runs to know its best (in axis order the best is run {first}); "
          f"median point {statistics.median(values):,.0f} tok/s ({statistics.median(values) / best:.0%} of the best)")
    cap = args.cap or len(grid)
    cache: dict[str, float] = {}
    rows = {}
    for label, make in (("tpe", lambda s: optuna.samplers.TPESampler(seed=s, n_startup_trials=10)),
                        ("random", lambda s: optuna.samplers.RandomSampler(seed=s))):
        reached, at20 = [], []
        for state in range(args.states):
            r, b = search(make(state), entries, best, cap, cache)
            reached.append(r)
            at20.append(b / best)
        rows[label] = (reached, at20)
    print(f"\n{args.states} random states; runs capped at {cap}")
    print(f"{'':8} {'runs to the grid best':28} {'vs grid':10} {'best in 20 runs / grid best':28}")
    for label, (reached, at20) in rows.items():
        ratio = len(grid) / statistics.median(reached)
        print(f"{label:8} {spread(reached, '.0f'):28} {ratio:<10.1f} {spread(at20, '.1%'):28}")
    print(f"\n('vs grid': the grid's {len(grid)} runs over the median runs; {time.monotonic() - t0:.0f} s; "
          f"load average at the end: {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
