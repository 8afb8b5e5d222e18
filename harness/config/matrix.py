"""`matrix:`: configurations written as a product of named axes instead of one by one.

    matrix:
      axes:                                   # each axis: a path and its values
        args.tensor-parallel-size: [1, 2]
        args.max-num-seqs: [64, 256]
        env.NCCL_ALGO: [Ring, Tree]
        benchmark.concurrency: [8, 64]
      exclude: [{args.tensor-parallel-size: 1, env.NCCL_ALGO: Tree}]   # points left out
      include: [{args.tensor-parallel-size: 8, args.max-num-seqs: 512}] # points added as written
      link: {args.max-num-seqs: benchmark.concurrency}                  # this follows that

A path is `args.FLAG`, `env.NAME` or `benchmark.FIELD` (a run's own benchmark setting: a run of
concurrency 64 measures concurrency 64 only). Each point of the product, less those an `exclude`
entry matches (all its keys equal), plus each `include`, becomes a configuration whose name says its
values (`tensor-parallel-size-2_max-num-seqs-64`). `link` copies the value of one path into another
in every point, as vLLM's `--link-vars` does: the batch size follows the benchmark's concurrency.
With `configs:` as well, every configuration is crossed with every point.
"""

from __future__ import annotations

import itertools
import re
from typing import Any

AXIS = re.compile(r"^(args|env|benchmark)\.(.+)$")
NAME_CHARS = re.compile(r"[^A-Za-z0-9_.\-]+")

Point = dict[str, Any]


def split(path: str) -> tuple[str, str]:
    """`args.max-num-seqs` -> ("args", "max-num-seqs")."""
    m = AXIS.match(path)
    if not m:
        raise ValueError(f"{path!r}: an axis is args.FLAG, env.NAME or benchmark.FIELD")
    return m.group(1), m.group(2)


def point_name(point: Point) -> str:
    """A configuration name that says the point's values: `max-num-seqs-64_enforce-eager`."""
    parts = []
    for path, value in point.items():
        leaf = split(path)[1].lstrip("-")
        if value is True:
            parts.append(leaf)
        elif value is False or value is None:
            parts.append(f"no-{leaf}")
        else:
            shown = "-".join(map(str, value)) if isinstance(value, list) else str(value)
            parts.append(f"{leaf}-{NAME_CHARS.sub('-', shown).strip('-')}")
    return NAME_CHARS.sub("-", "_".join(parts)).strip("-_.") or "point"


def points(axes: dict[str, list[Any]], *, exclude: list[Point], include: list[Point],
           link: dict[str, str]) -> list[Point]:
    """Every point of the product in axis order, less the excluded, plus the included; links applied."""
    product = [dict(zip(axes, values, strict=True)) for values in itertools.product(*axes.values())]
    kept = [p for p in product if not any(all(p.get(k) == v for k, v in ex.items()) for ex in exclude)]
    out: list[Point] = []
    for point in kept + [dict(p) for p in include]:
        for target, source in link.items():
            if source in point:
                point[target] = point[source]
        if point not in out:
            out.append(point)
    return out
