"""Cut a Kineto trace down to a test fixture: its first steps, byte for byte as torch wrote them.

    python benchmarks/trim_trace.py IN.pt.trace.json.gz OUT.pt.trace.json.gz [--steps 30] [--prefix execute_context_]

The window runs from the start of the first CPU step span (a `user_annotation` named `--prefix...`;
vLLM's is the default, SGLang's is `step[`) to the end of the `--steps`th, stretched until no step is
cut: to the end of every GPU step span that began inside it, and then over every CPU step that began
while the GPU caught up. Kept: every top-level key, every metadata event ("ph": "M") and every other
event that starts inside the window, except `python_function` (the Python stack samples of
`with_stack`, most of such a trace's bytes, which the analysis never reads).

Each kept event keeps its text, so the fixture has Kineto's own layout (libkineto output_json.cpp: one
event over several lines, `\\n  },\\n  {` between events); the output is checked to decode. Standard
library only; the whole trace is held in memory (fixtures come from traces of tens of MB).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

_SEPARATOR = "\n  },\n  {"
"""Between two events in Kineto's layout: a JSON string holds no raw newline, so this never splits one."""


def trim(text: str, *, steps: int, prefix: str) -> tuple[str, dict]:
    """The trimmed document, and what was kept."""
    begin = text.index("{", text.index('"traceEvents": [')) + 1
    end = text.rindex("\n  }")
    pieces = text[begin:end].split(_SEPARATOR)
    events = [json.loads("{" + piece + "\n  }") for piece in pieces]
    if len(events) != len(json.loads(text)["traceEvents"]):
        raise ValueError("not Kineto's layout: the events do not split on their separators")
    t0, t1 = _window(events, steps, prefix)
    kept = [piece for piece, ev in zip(pieces, events, strict=True)
            if ev.get("ph") == "M" or (ev.get("cat") != "python_function" and t0 <= ev.get("ts", -1) <= t1)]
    out = text[:begin] + _SEPARATOR.join(kept) + text[end:]
    spans = [ev for ev in events if t0 <= ev.get("ts", -1) <= t1 and ev.get("name", "").startswith(prefix)]
    summary = {"events": len(kept), "of": len(events), "window_us": round(t1 - t0, 3),
               "cpu_steps": sum(ev.get("cat") == "user_annotation" for ev in spans),
               "gpu_steps": sum(ev.get("cat") == "gpu_user_annotation" for ev in spans)}
    if len(json.loads(out)["traceEvents"]) != len(kept):
        raise ValueError("the trimmed trace does not decode to the events kept")
    return out, summary


def _window(events: list[dict], steps: int, prefix: str) -> tuple[float, float]:
    """From the first CPU step's start to the end of the `steps`th, stretched until it cuts no step."""
    def spans(cat: str) -> list[tuple[float, float]]:
        return sorted((ev["ts"], ev["ts"] + ev["dur"]) for ev in events
                      if ev.get("cat") == cat and ev.get("name", "").startswith(prefix))
    cpu, gpu = spans("user_annotation"), spans("gpu_user_annotation")
    if not cpu:
        raise ValueError(f"no CPU step spans named {prefix}...")
    t0, t1 = cpu[0][0], max(end for _, end in cpu[:steps])
    while True:
        stretched = max([t1] + [end for start, end in gpu + cpu if start <= t1])
        if stretched == t1:
            return t0, t1
        t1 = stretched


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path, help="a Kineto trace, .json or .json.gz")
    parser.add_argument("out", type=Path, help="the fixture to write (gzip'd)")
    parser.add_argument("--steps", type=int, default=30, help="CPU step spans the window starts with")
    parser.add_argument("--prefix", default="execute_context_", help="how the engine's step spans begin")
    args = parser.parse_args(argv)
    opener = gzip.open if args.trace.read_bytes()[:2] == b"\x1f\x8b" else open
    with opener(args.trace, "rb") as f:
        text = f.read().decode("utf-8", "surrogateescape")
    out, summary = trim(text, steps=args.steps, prefix=args.prefix)
    with open(args.out, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:
        f.write(out.encode("utf-8", "surrogateescape"))
    print(json.dumps({"file": args.out.name, "bytes": args.out.stat().st_size, **summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
