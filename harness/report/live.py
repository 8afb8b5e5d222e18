"""What a sweep shows while it runs: a live table of hosts on a terminal, plain log lines elsewhere.

On a terminal (rich Live): every host with its current run, phase and time in phase, and a footer with
progress, failures and an ETA from the mean duration of finished runs. Without one (CI, `nohup`, a
pipe): one line per event, so a log file reads as a story.
"""

from __future__ import annotations

import re
import threading
import time

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.text import Text

from harness.report.escape import printable
from harness.report.plain import PlainTable
from harness.results import RunManifest


def profile_warning(manifest: RunManifest) -> str | None:
    """What to tell about a profile that is not `ok` (its benchmark stands): the engine's answer."""
    profile = manifest.profile
    if profile is None or profile.status == "ok":
        return None
    why = profile.error or "no trace came back"
    hint = f" ({profile.hint})" if profile.hint else ""
    return f"profile {profile.status}: {why}{hint}"


class Display:
    """The sweep's events on a terminal (a live table of hosts) or as plain lines (a log, a pipe)."""

    def __init__(self, console: Console | None):
        self.console = console
        self.live_mode = bool(console and console.is_terminal)
        self.lock = threading.Lock()
        self.hosts: dict[str, tuple[str, str, float]] = {}     # host -> (run, phase, since)
        self.total = self.done_count = self.failed = 0
        self.durations: list[float] = []
        self.started = time.monotonic()
        self._live: Live | None = None
        self._last_progress: dict[str, tuple] = {}

    def start(self, *, total: int, done: int, hosts: list[str]) -> None:
        self.total, self.done_count = total, done
        now = time.monotonic()
        self.hosts = {h: ("", "idle", now) for h in hosts}
        if self.live_mode:
            self._live = Live(get_renderable=self._render, console=self.console, refresh_per_second=4,
                              transient=False)
            self._live.start()

    def stop(self) -> None:
        if self._live:
            self._live.stop()
            self._live = None

    def log(self, message: str) -> None:
        if self.console is None:
            return
        try:
            # soft_wrap: a message is one line to copy (a keyscan command, a fingerprint), however narrow
            self.console.print(printable(message), markup=False, emoji=False, highlight=False, soft_wrap=True)
        except OSError:  # the reader went away (a closed pipe): the sweep goes on, silently
            self.console = None

    def host(self, host: str, status: str) -> None:
        with self.lock:
            self.hosts[host] = ("", status, time.monotonic())
        if not self.live_mode and status != "idle":
            self.log(f"[{host}] {status}")

    def phase(self, host: str, run_id: str, phase: str) -> None:
        with self.lock:
            self.hosts[host] = (run_id, phase, time.monotonic())
        if not self.live_mode:
            self.log(f"[{host}] {run_id}: {phase}")

    def progress(self, host: str, run_id: str, tick: dict) -> None:
        """How far a phase has got (a benchmark level's requests): the phase's clock keeps running; a
        plain log gets a line only when the level or its tens of percent change."""
        text = describe_tick(tick)
        with self.lock:
            _, _, since = self.hosts.get(host, (run_id, text, time.monotonic()))
            self.hosts[host] = (run_id, text, since)
            key = (run_id, text.split(":")[0], _tenths(text))
            changed, self._last_progress[host] = self._last_progress.get(host) != key, key
        if not self.live_mode and changed:
            self.log(f"[{host}] {run_id}: {text}")

    def done(self, manifest: RunManifest) -> None:
        host = manifest.host.name or "?"
        seconds = sum(p.seconds for name, p in manifest.phases.items() if name != "finish")   # the host's
        with self.lock:
            self.done_count += 1
            self.failed += manifest.status == "failed"
            if seconds:
                self.durations.append(seconds)
            if self.hosts.get(host, ("",))[0] == manifest.run_id:   # not on its next run, set aside...
                self.hosts[host] = ("", "idle", time.monotonic())
        self.log(f"[{host}] {manifest.run_id}: {manifest.status} in {seconds:.0f} s"
                 + (f" ({manifest.error.line()})" if manifest.error else ""))
        warning = profile_warning(manifest)
        if warning:
            self.log(f"[{host}] {manifest.run_id}: warning: {warning}")

    def eta_s(self) -> float | None:
        left = self.total - self.done_count
        if not self.durations or left <= 0:
            return None
        busy = max(1, sum(1 for run, *_ in self.hosts.values() if run) or len(self.hosts))
        return sum(self.durations) / len(self.durations) * left / busy

    def _render(self):
        table = PlainTable(box=None, header_style="bold", pad_edge=False)
        for col in ("host", "run", "phase", "for"):
            table.add_column(col)
        now = time.monotonic()
        with self.lock:
            for host, (run, phase, since) in self.hosts.items():
                table.add_row(host, run or "-", phase, f"{now - since:.0f} s" if run else "")
            eta = self.eta_s()
            footer = (f"{self.done_count}/{self.total} runs done, {self.failed} failed, "
                      f"{now - self.started:.0f} s elapsed"
                      + (f", about {how_long(eta)} left" if eta is not None else ""))
        return Group(table, Text(footer, style="bold"))


def _tenths(text: str) -> int | None:
    """Tens of percent done in a progress line `... N/M requests ...`."""
    m = re.search(r"(\d+)/(\d+) requests", text)
    return int(m.group(1)) * 10 // int(m.group(2)) if m and int(m.group(2)) else None


def how_long(seconds: float) -> str:
    """A time left as a person says it: seconds under two minutes, minutes under two hours, else hours."""
    if seconds < 120:
        return f"{max(0, round(seconds))} s"
    if seconds < 7200:
        return f"{round(seconds / 60)} min"
    return f"{seconds / 3600:.1f} h"


def describe_tick(state: dict) -> str:
    """A benchmark level in progress, in one short line (the sweep's display and `harness bench`)."""
    of = f"/{state['of']}" if state.get("of") else ""
    eta = f", ~{state['eta_s']:.0f} s left" if state.get("eta_s") is not None else ""
    failed = f", {state['failed']} failed" if state.get("failed") else ""
    rate = f", ~{state['tok_s_estimate']:,.0f} tok/s" if state.get("tok_s_estimate") else ""
    load = state.get("load") or f"concurrency {state['concurrency']}"   # a scenario's: its name and load
    return (f"bench level {state['level']}/{state['levels']} ({load}): "
            f"{state['done']}{of} requests{failed}{rate}{eta}")


class BenchProgress:
    """`harness bench`'s progress: a bar per level on a terminal, a line a level otherwise."""

    def __init__(self, console: Console):
        self.console = console
        self.progress: Progress | None = None
        self.task: TaskID | None = None
        self.level: int | None = None

    def __enter__(self) -> BenchProgress:
        if self.console.is_terminal:
            self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), TextColumn("{task.fields[note]}"),
                                     console=self.console, transient=True)
            self.progress.start()
        return self

    def update(self, state: dict) -> None:
        if self.progress is None:
            return
        if self.level != state["level"]:
            self.level = state["level"]
            self.task = self.progress.add_task(f"concurrency {state['concurrency']}", total=state.get("of"),
                                               note="")
        assert self.task is not None
        note = ", ".join(x for x in (f"{state['failed']} failed" if state["failed"] else "",
                                     f"~{state['tok_s_estimate']:,.0f} tok/s" if state["tok_s_estimate"] else "",
                                     f"~{state['eta_s']:.0f} s left" if state["eta_s"] is not None else "") if x)
        self.progress.update(self.task, completed=state["done"], note=note)

    def level_done(self, level: dict) -> None:
        line = (f"concurrency {level['concurrency']}: {level['completed']}/{level['requests']} done, "
                f"{level['output_tok_s'] or 0:,.1f} tok/s")
        if self.progress is not None:
            self.progress.console.print(line, markup=False, highlight=False)
        else:
            self.console.print(line, markup=False, highlight=False)

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.stop()
