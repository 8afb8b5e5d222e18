"""The peak memory of this process as the kernel keeps it for its address space: /proc/self/status's
VmHWM, which `reset_peak` sets back to what is resident now.

Not getrusage's ru_maxrss: a process started by fork and exec keeps its parent's peak there (a test
run's pytest at 800 MB), so growth below that would never show.
"""

from __future__ import annotations

from pathlib import Path


def peak_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")
