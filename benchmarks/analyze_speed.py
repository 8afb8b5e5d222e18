"""`harness analyze` against HolisticTraceAnalysis on the same traces, in the same run.

    python benchmarks/analyze_speed.py --hta-python HTA_VENV/bin/python [--mb 250] [--layout torch --layout compact]

For each layout (see tracegen.py) and each form (plain .json and .json.gz of the same text) it writes a
trace with known figures, then runs `harness analyze --format json` and HTA's
`get_gpu_kernel_breakdown` on it, each as its own process, one after the other. It measures each one's
wall time and peak memory (the resident memory of its whole process tree, workers included, sampled
every 20 ms), and checks that the two breakdowns agree with each other and
with the generator's truth: kernel totals by name within 0.1%. HTA 0.5.0 needs pandas<3, so it lives in
its own environment: pass its interpreter. HTA rounds timestamps to whole microseconds unless told
not to (pytorch/pytorch#122425); HTA_DISABLE_NS_ROUNDING=1 keeps them exact, as the trace has them.

Two rates are printed for the harness, in MB/s (10^6 bytes) of JSON text (a .gz case counts the text
it holds): the command's (the JSON over the wall time of `harness analyze`, its start-up included:
about half a second of Python and the command-line parser) and the analysis's own (the JSON over the
time `harness.analysis.analyze_path` takes, timed inside a process that imported it beforehand: a
parse rate, as trace processors publish theirs). The last line is the verdict: the worst analysis
rate and the worst memory ratio over the cases, against the goals (at least 177 MB/s, the parse rate
Perfetto's trace processor publishes, with at most 1/16 of HTA's peak memory). Every process runs
under --timeout, and the run stops starting cases once --budget seconds have passed.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tracegen  # noqa: E402

RATE_GOAL, MEMORY_GOAL = 177e6, 16.0
TOLERANCE = 0.001
HTA_SCRIPT = """
import json, sys
from hta.trace_analysis import TraceAnalysis
analysis = TraceAnalysis(trace_dir=sys.argv[1])
_, kernels = analysis.get_gpu_kernel_breakdown(visualize=False, num_kernels=10**9, duration_ratio=1.0,
                                               include_memory_kernels=True)
print(json.dumps({row["name"]: row["sum (us)"] for row in kernels.to_dict("records")}))
"""
ANALYSIS_SCRIPT = """
import sys, time
from pathlib import Path
from harness.analysis import analyze_path
start = time.perf_counter()
analyze_path(Path(sys.argv[1]), top=10**6)
print(time.perf_counter() - start)
"""


def measure(argv: list[str], timeout: float, env: dict | None = None) -> dict:
    """Run one command; its wall time, peak memory and stdout."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    peak = [0]
    sampler = threading.Thread(target=_sample_tree, args=(proc, peak), daemon=True)
    sampler.start()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise RuntimeError(f"{argv[0]} ran past {timeout} s") from None
    wall = time.perf_counter() - start
    sampler.join()
    if proc.returncode:
        raise RuntimeError(f"{' '.join(argv[:4])} failed: {err.decode()[-2000:]}")
    return {"seconds": wall, "tree_mb": peak[0] / 2**20, "stdout": out}


def _sample_tree(proc: subprocess.Popen, peak: list) -> None:
    """Peak of the summed resident memory of the process and its descendants (Linux /proc)."""
    while proc.poll() is None:
        peak[0] = max(peak[0], sum(_rss(pid) for pid in _tree(proc.pid)))
        time.sleep(0.02)


def _tree(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split()]
        except OSError:
            pass
    return pids


def _rss(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def disagreements(ours: dict, theirs: dict, label: str) -> list[str]:
    """Kernel names whose totals (us) differ by more than the tolerance, or that one side lacks."""
    problems = [f"{label}: {name[:60]!r} missing" for name in set(ours) ^ set(theirs)]
    for name in set(ours) & set(theirs):
        a, b = ours[name], theirs[name]
        if abs(a - b) > TOLERANCE * max(abs(a), abs(b)):
            problems.append(f"{label}: {name[:60]!r} {a:.3f} vs {b:.3f} us")
    return problems


def run_case(trace: Path, truth: dict | None, args: argparse.Namespace) -> dict:
    harness = measure([sys.executable, "-m", "harness", "analyze", str(trace), "--format", "json",
                       "--top", "1000000"], args.timeout)
    analysis = json.loads(harness["stdout"])
    inside = measure([sys.executable, "-c", ANALYSIS_SCRIPT, str(trace)], args.timeout)
    harness["analysis_seconds"] = float(inside["stdout"].decode().split()[-1])
    ours = {k["name"]: k["total_ms"] * 1000 for k in analysis["top"]}
    hta_dir = trace.parent / f"hta-{trace.name}"
    hta_dir.mkdir(exist_ok=True)
    link = hta_dir / trace.name
    if not link.exists():
        link.symlink_to(trace)
    env = {**os.environ, "HTA_DISABLE_NS_ROUNDING": "1"}
    hta = measure([args.hta_python, "-c", HTA_SCRIPT, str(hta_dir)], args.timeout, env=env)
    theirs = json.loads(hta["stdout"].decode().strip().splitlines()[-1])
    problems = disagreements(ours, theirs, "harness vs HTA")
    if truth:
        problems += disagreements(ours, {n: k["total_us"] for n, k in truth["kernels"].items()}, "harness vs truth")
    return {"trace": trace.name, "mb": trace.stat().st_size / 2**20, "json_bytes": _json_bytes(trace),
            "harness": harness, "hta": hta, "kernels": len(ours), "problems": problems}


def _json_bytes(trace: Path) -> int:
    """The JSON text a trace holds: its size, or what its gzip stream inflates to."""
    if trace.suffix != ".gz":
        return trace.stat().st_size
    total = 0
    with gzip.open(trace, "rb") as f:
        while chunk := f.read(4 << 20):
            total += len(chunk)
    return total


def _rate(r: dict, seconds: str) -> float:
    return r["json_bytes"] / r["harness"][seconds]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hta-python", required=True, help="python of an environment with HolisticTraceAnalysis")
    parser.add_argument("--mb", type=float, default=250.0, help="JSON size of each generated trace")
    parser.add_argument("--layout", action="append", choices=tracegen.LAYOUTS,
                        help="layouts to generate (repeatable; default torch and compact)")
    parser.add_argument("--form", action="append", choices=("json", "gz"), help="default: both")
    parser.add_argument("--trace", type=Path, action="append", help="measure these traces instead")
    parser.add_argument("--workdir", type=Path, help="where traces go (default: a temporary directory)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds allowed to each process")
    parser.add_argument("--budget", type=float, default=1500.0, help="no case starts after this many seconds")
    args = parser.parse_args(argv)
    began = time.monotonic()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="analyze-speed-"))
    workdir.mkdir(parents=True, exist_ok=True)
    cases = [(t, None) for t in args.trace or []]
    if not cases:
        for layout in args.layout or ["torch", "compact"]:
            plain = workdir / f"{layout}.trace.json"
            truth = tracegen.generate(plain, mb=args.mb, layout=layout)
            for form in args.form or ["json", "gz"]:
                if form == "gz":
                    with open(plain, "rb") as src, gzip.open(plain.with_name(plain.name + ".gz"), "wb", 3) as dst:
                        shutil.copyfileobj(src, dst, 4 << 20)
                cases.append((plain if form == "json" else plain.with_name(plain.name + ".gz"), truth))
    results = []
    for trace, truth in cases:
        if time.monotonic() - began > args.budget:
            print(f"budget spent: {trace.name} not measured", file=sys.stderr)
            continue
        results.append(run_case(trace, truth, args))
        r = results[-1]
        print(f"{r['trace']}: harness {r['harness']['seconds']:.2f} s, HTA {r['hta']['seconds']:.2f} s",
              file=sys.stderr)
    if not results:
        return 1
    print(_table(results))
    problems = [p for r in results for p in r["problems"]]
    for p in problems[:20]:
        print("DISAGREE", p)
    speed = min(r["hta"]["seconds"] / r["harness"]["seconds"] for r in results)
    rate = min(_rate(r, "analysis_seconds") for r in results)
    command = min(_rate(r, "seconds") for r in results)
    memory = min(r["hta"]["tree_mb"] / r["harness"]["tree_mb"] for r in results)
    met = rate >= RATE_GOAL and memory >= MEMORY_GOAL and not problems
    print(f"SUMMARY cases={len(results)} analysis_rate_min={rate / 1e6:.0f} MB/s (goal {RATE_GOAL / 1e6:.0f}) "
          f"command_rate_min={command / 1e6:.0f} MB/s memory_ratio_min={memory:.1f}x (goal {MEMORY_GOAL:.0f}x) "
          f"speed_vs_hta_min={speed:.1f}x breakdowns_agree={not problems} goals_met={met}")
    return 0 if met else 1


def _table(results: list[dict]) -> str:
    head = ("trace", "MiB", "kernels", "harness s", "MB/s", "analysis s", "MB/s", "harness MB", "HTA s", "HTA MB",
            "speed", "memory", "agree")
    rows = [head] + [(r["trace"], f"{r['mb']:.0f}", str(r["kernels"]), f"{r['harness']['seconds']:.2f}",
                      f"{_rate(r, 'seconds') / 1e6:.0f}", f"{r['harness']['analysis_seconds']:.2f}",
                      f"{_rate(r, 'analysis_seconds') / 1e6:.0f}", f"{r['harness']['tree_mb']:.0f}",
                      f"{r['hta']['seconds']:.2f}", f"{r['hta']['tree_mb']:.0f}",
                      f"{r['hta']['seconds'] / r['harness']['seconds']:.1f}x",
                      f"{r['hta']['tree_mb'] / r['harness']['tree_mb']:.1f}x", "yes" if not r["problems"] else "NO")
                     for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(cell.rjust(w) if i else cell.ljust(w)
                               for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
                     for row in rows)


if __name__ == "__main__":
    sys.exit(main())
