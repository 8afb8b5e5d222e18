"""The simulated engine's environment knobs, read once at start.

    HARNESS_SIM_TIME_SCALE  multiplies every simulated delay (decode steps, prefill, profiler flush);
                            default 1 (real GLM-5 speed); the demo uses ~0.05. The traces keep the
                            modelled GPU's times (a 97 ms step stays 97 ms), so what a client measures
                            is scaled and what the trace says is not: compare and the report label
                            both (`recorded_time_scale`)
    HARNESS_SIM_STARTUP_S   wall seconds the port stays closed while "loading"; default 2 x time scale.
                            SGLang then answers 503 ("Starting") for half as long again before 200
    HARNESS_SIM_TRACE_MB    size on disk of each rank's trace file; default: as many bytes as the
                            profiled steps need (~30 KB a step with CUDA graphs, ~110 KB without)
    HARNESS_SIM_EMPTY_TEXT_EVERY
                            N: every N-th token of a request decodes to no text, so its stream event
                            carries `"text": ""` (vLLM 0.26 / 0.32 completions: with a random-weight
                            byte-level-BPE model every other token of a greedy answer was empty, 64
                            tokens in 32 text events); chat deltas get `"content": ""`, and SGLang
                            streams the same way; default off
    HARNESS_SIM_EMIT_LOG    a JSONL file of {"request", "token", "t_ns"}: time.monotonic_ns() when each
                            token's bytes were handed to the socket; buffered, flushed every second and
                            at exit
    HARNESS_SIM_FAULT       a comma list of:
                              crash_after=N   exit abruptly (status 1) after N completed requests
                              hang_after=N    after N completed requests accept connections but never
                                              answer anything again, health included
                              never_healthy   the health endpoints answer 503 forever
                              oom_at_start    print a CUDA OOM traceback while loading and exit 1
                              no_kv_cache     load, then print the engine's own "no memory left for
                                              the KV cache" error and exit 1
                              profile_500     the profiler endpoints answer 500 and write nothing
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Faults:
    crash_after: int | None = None
    hang_after: int | None = None
    never_healthy: bool = False
    oom_at_start: bool = False
    no_kv_cache: bool = False
    profile_500: bool = False


@dataclass(frozen=True)
class Knobs:
    time_scale: float = 1.0
    startup_s: float = 2.0
    trace_mb: float | None = None
    emit_log: str | None = None
    empty_text_every: int | None = None
    faults: Faults = Faults()

    @property
    def starting_s(self) -> float:
        """How long SGLang answers 503 after the port opens (its warm-up generation)."""
        return self.startup_s / 2


class KnobError(ValueError):
    """A knob's value cannot be understood; the message names the variable."""


def parse_faults(text: str) -> Faults:
    values: dict = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, eq, value = item.partition("=")
        if name in ("crash_after", "hang_after") and eq:
            try:
                values[name] = int(value)
            except ValueError:
                raise KnobError(f"HARNESS_SIM_FAULT: {name} needs a whole number, got {value!r}") from None
        elif name in ("never_healthy", "oom_at_start", "no_kv_cache", "profile_500") and not eq:
            values[name] = True
        else:
            raise KnobError(f"HARNESS_SIM_FAULT: unknown fault {item!r} (known: crash_after=N, hang_after=N, "
                            "never_healthy, oom_at_start, no_kv_cache, profile_500)")
    return Faults(**values)


def _number(env: Mapping[str, str], name: str) -> float | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise KnobError(f"{name}: expected a number, got {raw!r}") from None
    if value < 0:
        raise KnobError(f"{name}: must not be negative, got {raw!r}")
    return value


def _every(env: Mapping[str, str], name: str) -> int | None:
    """A positive whole number, or None when unset (0 also means off)."""
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise KnobError(f"{name}: expected a whole number, got {raw!r}") from None
    if value < 0:
        raise KnobError(f"{name}: must not be negative, got {raw!r}")
    return value or None


def recorded_time_scale(env: Mapping[str, str]) -> float:
    """The time scale a run's recorded environment gave the simulator: 1 (real speed) when unset or
    unreadable (the simulator then refused to start, and the run has no timings to label)."""
    try:
        scale = _number(env, "HARNESS_SIM_TIME_SCALE")
    except KnobError:
        return 1.0
    return 1.0 if scale is None else scale


def from_env(env: Mapping[str, str] | None = None) -> Knobs:
    env = os.environ if env is None else env
    scale = _number(env, "HARNESS_SIM_TIME_SCALE")
    scale = 1.0 if scale is None else scale
    startup = _number(env, "HARNESS_SIM_STARTUP_S")
    return Knobs(time_scale=scale, startup_s=2.0 * scale if startup is None else startup,
                 trace_mb=_number(env, "HARNESS_SIM_TRACE_MB") or None,
                 emit_log=env.get("HARNESS_SIM_EMIT_LOG") or None,
                 empty_text_every=_every(env, "HARNESS_SIM_EMPTY_TEXT_EVERY"),
                 faults=parse_faults(env.get("HARNESS_SIM_FAULT", "")))
