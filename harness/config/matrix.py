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

import hashlib
import itertools
import json
import re
from typing import Any

from harness.secrets import is_secret

AXIS = re.compile(r"^(args|env|benchmark)\.(.+)$")
NAME_CHARS = re.compile(r"[^A-Za-z0-9_.\-]+")
POINT_NAME_MAX = 160
"""The longest name a point is given: a configuration's name (at most 200 characters, it names a
folder) is its base configuration's, `_` and this, cut the same way where the two are longer
(`config_name`). A longer one (flags
whose values are paths or JSON: vLLM's --speculative-config) keeps its first characters and ends in
a hash of the whole, so that two points still have two names; the run's values are in its manifest.
Names within it are as they always were, so a sweep begun before resumes with the same run ids."""

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
    return _cut(NAME_CHARS.sub("-", "_".join(parts)).strip("-_.") or "point", POINT_NAME_MAX)


def config_name(base: str, point: Point, limit: int) -> str:
    """The name of `point` over the configuration `base` (`tp8_max-num-seqs-64`; the point's alone when
    the playbook has no configs), at most `limit` characters."""
    return _cut("_".join(n for n in (base, point_name(point)) if n), limit)


def _cut(name: str, limit: int) -> str:
    """`name` if it fits in `limit`, else its start and a hash of the whole: two long names that share
    a start stay two names."""
    if len(name) <= limit:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[:limit - len(digest) - 1].rstrip('-_.')}-{digest}"


def _key(point: Point) -> str:
    """A point as its run sees it: YAML's true is not 1, nor 1.0 (a bare flag, `--x 1`, `--x 1.0`),
    though Python finds them equal."""
    return json.dumps(point, sort_keys=True, default=repr)


def points(axes: dict[str, list[Any]], *, exclude: list[Point], include: list[Point],
           link: dict[str, str]) -> list[Point]:
    """Every point of the product in axis order, less the excluded, plus the included; links applied.
    A matrix that leaves no point is refused: a sweep of nothing would end `ok` having run nothing."""
    for i, ex in enumerate(exclude):
        if not ex:
            raise ValueError(f"matrix.exclude[{i}] is empty: it matches every point and leaves none to run")
    for i, entry in enumerate(include):   # a secret axis is refused where the playbook is loaded; an include too
        for path in entry:
            if path not in link and split(path)[0] != "benchmark" and is_secret(split(path)[1]):
                raise ValueError(f"matrix.include[{i}]: {path} is a secret, and its value would name the run "
                                 "(run ids, folders, the report): give it in server.env or a configuration's env")
    product = [dict(zip(axes, values, strict=True)) for values in itertools.product(*axes.values())]
    kept = [p for p in product if not any(all(_key({k: p.get(k)}) == _key({k: v}) for k, v in ex.items())
                                          for ex in exclude)]
    if not kept and not include:
        raise ValueError(f"matrix.exclude leaves out every point of the matrix ({len(product)}): nothing would run")
    out: list[Point] = []
    seen: set[str] = set()
    for point in kept + [dict(p) for p in include]:
        for target, source in link.items():
            if source in point:
                point[target] = point[source]
        if _key(point) not in seen:
            seen.add(_key(point))
            out.append(point)
    return out
