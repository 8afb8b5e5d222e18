"""The host's entry point: `python harness.pyz TOOL ARGS...` runs one of the harness's tools on the host.

    agent SUB ...     the lifecycle steps (agent.py: probe, wait, profile, stop, watch, reap)
    bench ...         the decode benchmark client (bench.py)
    torchprof ...     a Python server under a torch.profiler window (torchprof.py)
    telemetry ...     the engine's /metrics and nvidia-smi, sampled into a JSON-lines file (telemetry.py)

From a checkout or an installed harness the same runs as `python -m harness.remote TOOL ARGS...`. A tool
is imported only when it is asked for (`agent probe` never loads the client). Standard library only,
Python >= 3.9, like every module the zipapp carries.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

TOOLS = ("agent", "bench", "torchprof", "telemetry")
USAGE = f"usage: python harness.pyz {{{','.join(TOOLS)}}} ARGS..."


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    tool, rest = (args[0], args[1:]) if args else ("", [])
    if tool == "agent":
        from . import agent
        return int(agent.main(rest))
    if tool == "bench":
        from . import bench
        return bench.main(rest)
    if tool == "telemetry":
        from . import telemetry
        return telemetry.main(rest)
    if tool == "torchprof":
        from . import torchprof
        sys.argv = [sys.argv[0], *rest]   # torchprof reads its arguments from sys.argv
        torchprof.main()
        return 0
    if tool in ("-h", "--help"):
        print(f"{USAGE}\n\n{__doc__}")
        return 0
    print(f"{USAGE}\nharness.pyz: error: " + (f"no tool named {tool!r}" if tool else "name a tool"),
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
