"""How many probes search.max_load spends against an exhaustive scan of the same range, and whether both
find the same highest load, on the simulator.

The simulated vLLM (`python -m harness.sim vllm`, `--max-num-seqs` small so requests beyond it queue
and their TTFT grows with the load) serves one closed-loop scenario. For each SLO: an exhaustive scan
runs every concurrency from `--low` to `--high` and takes the highest level that met the SLO (bench.json
`slo_met`); the search (harness/remote/maxload.py bisect_max_load, as a sweep runs it) probes the same
range in one run. Printed per SLO: both answers, whether they agree, the levels each ran, and whether
the scan's verdicts were monotone (bisection assumes they are: where they are not, the two can
legitimately differ). Not a test: run it by hand; the load average is printed.

    python benchmarks/max_load_probes.py
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from harness.remote.bench import run_benchmark  # noqa: E402

MODEL = "/models/tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--low", type=int, default=1)
    p.add_argument("--high", type=int, default=24)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--slos", default="ttft_ms_p99=300,ttft_ms_p99=600,e2e_ms_p99=1200",
                   help="comma-separated METRIC=BOUND, one search each")
    p.add_argument("--time-scale", default="0.05")
    args = p.parse_args()
    port = free_port()
    env = {**os.environ, "HARNESS_SIM_TIME_SCALE": args.time_scale, "HARNESS_SIM_STARTUP_S": "0",
           "PYTHONPATH": str(ROOT)}
    sim = subprocess.Popen([sys.executable, "-m", "harness.sim", "vllm", "serve", MODEL, "--port", str(port),
                            "--host", "127.0.0.1", "--max-num-seqs", str(args.max_num_seqs)], env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                urllib.request.urlopen(url + "/health", timeout=1).read()
                break
            except OSError:
                time.sleep(0.05)
        print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; simulated vLLM, max-num-seqs "
              f"{args.max_num_seqs}, time scale {args.time_scale}, concurrency {args.low}..{args.high}, "
              f"steps {args.steps}")
        scenario = {"name": "chat", "input_tokens": 256, "output_tokens": 32, "concurrency": [], "requests": None}
        loads = list(range(args.low, args.high + 1))
        slos = [dict([kv.split("=")]) for kv in args.slos.split(",")]
        print(f"{'SLO':<18} {'scan':>5} {'levels':>6} {'search':>6} {'probes':>6} {'same':>5} {'monotone':>8}  "
              "search's probes (load: met)")
        for i, raw in enumerate(slos):
            slo = {k: float(v) for k, v in raw.items()}
            scan = run_benchmark(url, MODEL, scenarios=[{**scenario, "concurrency": loads}], slo=slo, warmup=1,
                                 random_state=10 * i)
            verdicts = [lv["slo_met"] for lv in scan["levels"]]
            met = [c for c, ok in zip(loads, verdicts, strict=True) if ok]
            scan_answer = max(met) if met and verdicts[0] else None
            monotone = all(a or not b for a, b in zip(verdicts, verdicts[1:], strict=False))
            search = run_benchmark(url, MODEL, scenarios=[scenario], warmup=1, random_state=10 * i,
                                   search={"scenario": "chat", "slo": slo, "low": args.low, "high": args.high,
                                           "steps": args.steps})["max_load"]
            probes = " ".join(f"{p['load']}:{'y' if p['met'] else 'n'}" for p in search["probes"])
            bound = ", ".join(f"{k} {v:g}" for k, v in slo.items())
            print(f"{bound:<18} {scan_answer!s:>5} {len(loads):>6} {search['value']!s:>6} {len(search['probes']):>6} "
                  f"{'yes' if search['value'] == scan_answer else 'no':>5} {'yes' if monotone else 'no':>8}  {probes}")
    finally:
        sim.terminate()
        sim.wait(timeout=10)


if __name__ == "__main__":
    main()
