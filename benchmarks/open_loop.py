"""How faithfully the open loop keeps its schedule: achieved against asked rate and the schedule lag,
at 10, 50, 100, 200 and 500 requests a second, against benchmarks/reference_server.py.

Per rate, one level of Poisson arrivals (`--seconds` of them, fixed random_state) from the benchmark
client as it ships (harness/remote/bench.py, in this process) to a reference server that records when
each request's last byte arrived (`GET /emissions`, the same monotonic clock). Printed per rate:
    schedule/asked   the drawn schedule's own rate (requests - 1 over its span) / the asked rate: the
                     arrival process's sampling noise, which no client can do better than
    sent/schedule    the client's achieved rate (its sends) / the schedule's own rate: its own error
    lag p50, p99     sent - scheduled, ms (bench.json schedule_lag_ms)
    arrival p50, p99 the server's receipt of the request - scheduled, ms (the truth, connect included)
    client CPU       the client's CPU while the level ran, as a share of one core
Not a test: run it by hand; the load average is printed.

    python benchmarks/open_loop.py
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVER = Path(__file__).resolve().parent / "reference_server.py"
sys.path.insert(0, str(ROOT))
from harness.remote.bench import run_benchmark  # noqa: E402
from harness.remote.stats import percentile  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="10,50,100,200,500")
    p.add_argument("--seconds", type=float, default=6.0, help="of arrivals per rate (default 6)")
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--itl-ms", type=float, default=5.0)
    args = p.parse_args()
    port = free_port()
    server = subprocess.Popen([sys.executable, str(SERVER), "--port", str(port), "--itl-ms", str(args.itl_ms),
                               "--ttft-ms", "5"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(url + "/health", timeout=1).read()
                break
            except OSError:
                time.sleep(0.05)
        print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; Poisson arrivals, {args.seconds:g} s a rate, "
              f"{args.output_tokens} tokens a request, true ITL {args.itl_ms:g} ms")
        print(f"{'rate':>6} {'requests':>8} {'schedule/asked':>14} {'sent/schedule':>13} {'lag p50':>8} "
              f"{'lag p99':>8} {'arrival p50':>11} {'arrival p99':>11} {'client CPU':>10}")
        for i, rate in enumerate(float(r) for r in args.rates.split(",")):
            n = max(20, round(rate * args.seconds))
            scenario = {"name": f"r{rate:g}", "input_tokens": 16, "output_tokens": args.output_tokens,
                        "request_rate": [rate], "requests": n}
            urllib.request.urlopen(url + "/emissions", timeout=5).read()    # forget the calibration probes
            cpu = time.process_time()
            result = run_benchmark(url, "ref", scenarios=[scenario], warmup=0, random_state=100 + i, timeout=60)
            cpu = time.process_time() - cpu
            (level,) = result["levels"]
            truth = sorted(json.loads(urllib.request.urlopen(url + "/emissions", timeout=5).read()),
                           key=lambda e: e["recv_ns"])[-n:]
            reqs = sorted(result["requests"], key=lambda r: r["scheduled_ns"])
            sched = [r["scheduled_ns"] for r in reqs]
            own_rate = (n - 1) / ((sched[-1] - sched[0]) / 1e9)
            arrival = sorted((t["recv_ns"] - s) / 1e6 for t, s in zip(truth, sched, strict=True))
            lag = level["schedule_lag_ms"]
            print(f"{rate:>6g} {n:>8} {own_rate / rate:>14.3f} {level['achieved_rate_req_s'] / own_rate:>13.4f} "
                  f"{lag['p50']:>8.3f} {lag['p99']:>8.3f} {percentile(arrival, 50):>11.3f} "
                  f"{percentile(arrival, 99):>11.3f} {cpu / level['duration_s']:>9.0%}"
                  + ("" if level["failed"] == 0 else f"  ({level['failed']} failed)"))
    finally:
        server.terminate()
        server.wait(timeout=10)


if __name__ == "__main__":
    main()
