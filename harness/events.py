"""What a sweep tells whoever watches it: the seam between the executor and the live display.

The executor calls these and knows nothing of terminals; `harness.report.live.Display` draws them,
and a test can record them. Every call comes from the executor's threads, so an implementation
guards its own state.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from harness.results import RunManifest

TICK_KEYS = frozenset({"level", "levels", "concurrency", "done"})
"""What a benchmark progress tick (bench.progress.json, written by the client on the host) must hold."""


class Events(Protocol):
    def start(self, *, total: int, done: int, hosts: list[str]) -> None: ...
    def stop(self) -> None: ...
    def log(self, message: str) -> None: ...
    def host(self, host: str, status: str) -> None: ...
    def phase(self, host: str, run_id: str, phase: str) -> None: ...
    def progress(self, host: str, run_id: str, tick: dict[str, Any]) -> None: ...
    def done(self, manifest: RunManifest) -> None: ...


class Quiet:
    """Events nobody watches."""

    def start(self, *, total: int, done: int, hosts: list[str]) -> None:
        pass

    def stop(self) -> None:
        pass

    def log(self, message: str) -> None:
        pass

    def host(self, host: str, status: str) -> None:
        pass

    def phase(self, host: str, run_id: str, phase: str) -> None:
        pass

    def progress(self, host: str, run_id: str, tick: dict[str, Any]) -> None:
        pass

    def done(self, manifest: RunManifest) -> None:
        pass


def parse_tick(line: str) -> dict[str, Any] | None:
    """A progress tick as the host sent it, or None (none yet, half written, or not ours)."""
    try:
        tick = json.loads(line) if line.strip() else None
    except ValueError:
        return None
    return tick if isinstance(tick, dict) and set(tick) >= TICK_KEYS else None
