"""Run a Python server under a torch.profiler window that the harness opens and closes from outside.

    python harness.pyz torchprof --dir PROFILE_DIR -- COMMAND [ARGS...]

COMMAND is a console script on PATH (`transformers serve ...`) or `-m MODULE ...`; it runs in this
process (runpy), so the profiler sees its work, whatever the engine. The window:

    the harness creates PROFILE_DIR/.start  ->  the profiler starts, PROFILE_DIR/.started appears
    the harness sends traffic for N decode steps
    the harness creates PROFILE_DIR/.stop   ->  the profiler stops and writes
        torch-<pid>.pt.trace.json.gz      the Kineto trace (what `harness analyze` reads)
        torch-<pid>.key_averages.json     torch's own key_averages() table, to check the analysis by
    and PROFILE_DIR/.done (or .failed with the reason).

The profiler runs in a thread of its own, told to record every thread (`profile_all_threads`): CUDA
kernels are recorded process-wide (CUPTI) in any case, and they are what the analysis ranks.
Standard library at import; torch is imported only when the window opens (the server imports it anyway).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import runpy
import shutil
import sys
import threading
import time
import traceback


def wait_for(path: str, poll: float = 0.05) -> None:
    while not os.path.exists(path):
        time.sleep(poll)


def window(directory: str) -> None:
    def mark(name: str, text: str = "") -> None:
        with open(os.path.join(directory, name), "w") as f:
            f.write(text)

    try:
        wait_for(os.path.join(directory, ".start"))
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        prof = profile(activities=activities, experimental_config=_all_threads())
        prof.__enter__()
        mark(".started")
        wait_for(os.path.join(directory, ".stop"))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        base = os.path.join(directory, f"torch-{os.getpid()}")
        prof.export_chrome_trace(base + ".pt.trace.json")
        with open(base + ".pt.trace.json", "rb") as src, gzip.open(base + ".pt.trace.json.gz", "wb", 6) as dst:
            shutil.copyfileobj(src, dst)
        os.unlink(base + ".pt.trace.json")
        table = [{"name": e.key, "count": e.count, "device_time_total_us": e.device_time_total,
                  "self_device_time_total_us": e.self_device_time_total, "cpu_time_total_us": e.cpu_time_total,
                  "self_cpu_time_total_us": e.self_cpu_time_total} for e in prof.key_averages()]
        with open(base + ".key_averages.json", "w") as f:
            json.dump({"torch": torch.__version__, "key_averages": table}, f)
        mark(".done")
    except Exception:  # the server goes on; the harness reads why the window failed
        mark(".failed", traceback.format_exc())


def _all_threads():
    """Record the operators of every thread (the server's, not only ours), where this torch can."""
    from torch._C._profiler import _ExperimentalConfig
    try:
        return _ExperimentalConfig(profile_all_threads=True)
    except TypeError:  # older torch: kernels are still recorded process-wide, CPU ops of this thread only
        return None


def main() -> None:
    p = argparse.ArgumentParser(prog="torchprof", usage="harness.pyz torchprof --dir DIR -- COMMAND [ARGS...]")
    p.add_argument("--dir", required=True)
    p.add_argument("command", nargs=argparse.REMAINDER)
    a = p.parse_args()
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        p.error("no command to run")
    os.makedirs(a.dir, exist_ok=True)
    threading.Thread(target=window, args=(a.dir,), name="torchprof", daemon=True).start()
    if command[0] == "-m":
        sys.argv = command[1:]
        runpy.run_module(command[1], run_name="__main__", alter_sys=True)
    else:
        script = shutil.which(command[0]) or command[0]
        sys.argv = [script, *command[1:]]
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
