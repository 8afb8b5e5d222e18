"""`python -m harness.sim sglang|vllm ARGS`: see harness.sim."""

from __future__ import annotations

import sys

from harness.sim import flags, knobs

USAGE = "usage: python -m harness.sim {sglang,vllm} ARGS...\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        import harness.sim
        sys.stdout.write(USAGE + "\n" + (harness.sim.__doc__ or "") + "\n" + (knobs.__doc__ or ""))
        return 0
    if not argv or argv[0] not in ("sglang", "vllm"):
        sys.stderr.write(USAGE + "error: the first argument names the engine: sglang or vllm\n")
        return 2
    engine = argv[0]
    ns = flags.parse(engine, argv[1:])
    try:
        settings = knobs.from_env()
    except knobs.KnobError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    # imported here: the flag listing (`--help`, above) needs no server (asyncio: 40 ms a start)
    from harness.sim.server import serve
    return serve(engine, ns, settings)


if __name__ == "__main__":
    sys.exit(main())
