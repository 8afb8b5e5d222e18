"""Sweep scaling: 8 configurations of the simulated engine on 4 hosts at once against on 1 host.

The hosts are 4 network namespaces of this machine (tests/netns.py), each with its own address and
sshd, reached over SSH like GPU hosts; their engines are the simulator, through a "remote" venv
(tests/remote_venv.py). Each run's benchmark is about 8 s of simulated decoding: the servers sleep
through most of it (a long ITL at time scale 0.25, concurrency at most 4), so 4 servers and their
benchmark clients fit on a machine with 2 cores. No profiling: the measure is the harness's own cost.

The real command line runs both sweeps (`python -m harness sweep PLAYBOOK -i INV -o OUT`, placement
pool; `--jobs 4` on the 4 hosts, `--limit host0 --jobs 1` on one). Prints the wall time of each, the
speedup (the goal is 3.6x), and the sweep's overhead per run (the goal is at most 1.0 s on one host):

    (sweep wall time - sum over its runs of manifest phases health + bench) / runs

that is, what the harness adds to each run beyond the server's own startup and the benchmark:
connecting, preflight, uploads, launch, collection, teardown, and the wait between runs. On 4 hosts
4 runs share the wall time, so there the figure counts host time: (4 x wall - sum) / runs, which
includes a host's idle wait for the sweep's last run.

With `--rounds N` the pair of sweeps runs N times on the same hosts (the 1-host sweep, then the
4-host one, each round), and the summary gives the median of the rounds' own speedups, with each:
a 4-host sweep's wall time scatters by several percent on a shared 2-core machine, more than the
gap between 3.5x and 3.6x. The first round meets hosts the harness never used (its tools uploaded and
unpacked there); the later ones meet them as a sweep after another does.

Needs root (network namespaces). Run as:  .venv/bin/python benchmarks/sweep_scaling.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.netns import netns_hosts  # noqa: E402
from tests.remote_venv import make_remote_venv  # noqa: E402

HOSTS = 4
CONFIGS = 8
PORT = 30600


def playbook(path: Path) -> Path:
    """8 configurations of simulated SGLang that cost the same (the static memory fraction does not
    change the simulator's latency), so the speedup measures the harness and not an uneven playbook;
    at time scale 0.25 each benchmark decodes for about 8 s."""
    pb = {
        "name": "scaling",
        "hosts": "gpu",
        "engine": "sglang",
        "model": {"path": "/models/GLM-5-NVFP4", "served_name": "glm-5"},
        "server": {"port": PORT, "args": {"tp-size": 8, "kv-cache-dtype": "fp8_e4m3"},
                   "env": {"HARNESS_SIM_TIME_SCALE": "0.25", "HARNESS_SIM_STARTUP_S": "1"},
                   "startup_timeout_s": 120},
        "configs": [{"name": f"mem{80 + i}", "args": {"mem-fraction-static": (80 + i) / 100}}
                    for i in range(CONFIGS)],
        "benchmark": {"prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": 48,
                      "concurrency": [1, 4], "requests": 4, "warmup": 1, "timeout_s": 300},
        "profile": {"mode": "none"},
        "placement": "pool",
    }
    path.write_text(yaml.safe_dump(pb, sort_keys=False))
    return path


def inventory(path: Path, hosts, venv: Path) -> Path:
    inv = {"all": {"children": {"gpu": {
        "vars": {"venv": str(venv)},
        "hosts": {h.name: {"address": h.address, "port": h.sshd.port, "user": h.sshd.user,
                           "identity_file": str(h.sshd.client_key), "known_hosts": str(h.sshd.known_hosts),
                           "workdir": str(h.workdir)} for h in hosts}}}}}
    path.write_text(yaml.safe_dump(inv, sort_keys=False))
    return path


def sweep(pb: Path, inv: Path, out: Path, *extra: str) -> tuple[float, list[dict]]:
    """Run the sweep with the real command line; its wall time and its runs' manifests (each given
    `_since_start`: its start and end, in seconds after the command started)."""
    started, started_at = time.monotonic(), time.time()
    done = subprocess.run([sys.executable, "-m", "harness", "sweep", str(pb), "-i", str(inv), "-o", str(out),
                           *extra], cwd=REPO, capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    wall = time.monotonic() - started
    if done.returncode != 0:
        failed = [(p.parent.name, json.loads(p.read_text()).get("error")) for p in out.glob("*/runs/*/manifest.json")]
        raise SystemExit(f"sweep {' '.join(extra)} failed ({done.returncode}): {failed}\n{done.stderr[-3000:]}")
    manifests = [json.loads(p.read_text()) for p in out.glob("*/runs/*/manifest.json")]
    for m in manifests:
        m["_since_start"] = (m["started"] - started_at, m["finished"] - started_at)
    failed = [(m["run_id"], m.get("error")) for m in manifests if m["status"] != "ok"]
    if len(manifests) != CONFIGS or failed:
        raise SystemExit(f"expected {CONFIGS} ok runs, got {len(manifests)} (failed: {failed})")
    return wall, manifests


def report(label: str, wall: float, manifests: list[dict], *, slots: int) -> float:
    """Print the sweep's figures; return its overhead per run, counting `slots` hosts' time."""
    phase = {name: sum(m["phases"][name]["seconds"] for m in manifests) for name in manifests[0]["phases"]}
    server = phase["health"] + phase["bench"]
    overhead = (wall * slots - server) / len(manifests)
    phases = ", ".join(f"{name} {seconds / len(manifests):.2f}" for name, seconds in phase.items())
    first = min(m["_since_start"][0] for m in manifests)
    last = max(m["_since_start"][1] for m in manifests)
    print(f"{label:8} wall {wall:6.1f} s  health+bench {server:6.1f} s  overhead/run {overhead:5.2f} s"
          f"  (mean phases, s: {phases}; first run began {first:.2f} s in, the last ended "
          f"{wall - last:.2f} s before the end)")
    return overhead


def timeline(label: str, manifests: list[dict]) -> None:
    """Each run's host, start and end (seconds after the command started), in start order."""
    for m in sorted(manifests, key=lambda m: m["_since_start"][0]):
        start, end = m["_since_start"]
        print(f"  {label} {m['run_id']:>12} on {m['host']['name']}: {start:6.2f} -> {end:6.2f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timeline", action="store_true", help="also print each run's host, start and end")
    parser.add_argument("--rounds", type=int, default=1, help="pairs of sweeps; the summary is their median")
    args = parser.parse_args()
    pairs = []
    with tempfile.TemporaryDirectory(prefix="sweep-scaling-") as tmp_name:
        tmp = Path(tmp_name)
        venv = make_remote_venv(tmp / "venv", engines=("sglang",))
        with netns_hosts(HOSTS, tmp / "hosts") as hosts:
            pb = playbook(tmp / "playbook.yaml")
            inv = inventory(tmp / "inventory.yaml", hosts, venv)
            for n in range(args.rounds):
                one = sweep(pb, inv, tmp / f"one-{n}", "--limit", hosts[0].name, "--jobs", "1")
                four = sweep(pb, inv, tmp / f"four-{n}", "--jobs", str(HOSTS))
                pairs.append((one, four))
    print(f"{CONFIGS} configurations of the simulated engine (time scale 0.25, ~8 s of decoding each), "
          f"{os.cpu_count()} CPU cores")
    speedups, overheads, host_overheads = [], [], []
    for n, ((one_wall, one), (four_wall, four)) in enumerate(pairs):
        if args.rounds > 1:
            print(f"round {n + 1}:")
        overheads.append(report("1 host", one_wall, one, slots=1))
        host_overheads.append(report(f"{HOSTS} hosts", four_wall, four, slots=HOSTS))
        speedups.append(one_wall / four_wall)
        if args.timeline:
            timeline("1 host ", one)
            timeline(f"{HOSTS} hosts", four)
    listed = ", ".join(f"{x:.2f}x" for x in speedups)
    each = f" (median of {len(speedups)} rounds: {listed})" if len(speedups) > 1 else ""
    print(f"summary: speedup {statistics.median(speedups):.2f}x on {HOSTS} hosts{each} (goal 3.6x); "
          f"overhead per run {statistics.median(overheads):.2f} s on 1 host (goal <= 1.0 s), "
          f"{statistics.median(host_overheads):.2f} s of host time on {HOSTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
