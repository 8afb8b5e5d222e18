"""What a round of the telemetry sampler costs the host it shares with the benchmark client.

Serves the real vLLM 0.32.0 /metrics answer (tests/fixtures/metrics, 52 KB, 430 samples) and the same
answer repeated as if by 8 and 32 data-parallel engines, over loopback HTTP from a server process of
its own, and measures the sampler's CPU per scrape (time.process_time, this process only) for the HTTP
GET alone (the baseline) and for the GET plus the strict parse that keeps the engine's families, as
harness/remote/telemetry.py does it. Prints ms of CPU a scrape, the ratio to the baseline, and the
share of one core at one scrape a second.

    python benchmarks/telemetry_cost.py [--rounds 200]
"""

from __future__ import annotations

import argparse
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness.engines import get_engine  # noqa: E402
from harness.remote.exposition import parse_exposition  # noqa: E402
from harness.remote.telemetry import fetch_metrics  # noqa: E402

FIXTURE = (REPO / "tests" / "fixtures" / "metrics" / "vllm-0.32.0-cpu-ngram-busy.txt").read_text()


def engines(n: int) -> str:
    """The answer as a server of `n` engines would write it: every vLLM sample once per engine."""
    lines = []
    for line in FIXTURE.splitlines():
        if line.startswith("vllm:") and 'engine="0"' in line:
            lines += [re.sub(r'engine="0"', f'engine="{e}"', line) for e in range(n)]
        else:
            lines.append(line)
    return "\n".join(lines) + "\n"


def serve(folder: Path) -> tuple[subprocess.Popen, str]:
    """`folder`'s files over HTTP from a process of its own, so its CPU is not counted here."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "-d", str(folder),
                               str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/metrics"
    for _ in range(100):
        try:
            fetch_metrics(url)
            break
        except OSError:
            time.sleep(0.1)
    return server, url


def cpu_ms(rounds: int, work) -> float:
    work()   # warm
    start = time.process_time()
    for _ in range(rounds):
        work()
    return (time.process_time() - start) * 1000 / rounds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=200)
    args = p.parse_args()
    families = [m.family for m in get_engine("vllm").metrics]
    print(f"{'engines':>7} {'answer KB':>9} {'samples':>7} {'GET ms':>7} {'GET+parse ms':>12} {'ratio':>6} "
          f"{'core at 1/s':>11}")
    for n in (1, 8, 32):
        text = engines(n)
        with tempfile.TemporaryDirectory() as folder:
            (Path(folder) / "metrics").write_text(text)
            server, url = serve(Path(folder))
            try:
                base = cpu_ms(args.rounds, lambda url=url: fetch_metrics(url))
                full = cpu_ms(args.rounds, lambda url=url: parse_exposition(fetch_metrics(url), families))
            finally:
                server.terminate()
                server.wait()
        samples = len(parse_exposition(text)[0])
        print(f"{n:>7} {len(text) / 1000:>9.0f} {samples:>7} {base:>7.2f} {full:>12.2f} {full / base:>6.1f} "
              f"{full / 10:>10.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
