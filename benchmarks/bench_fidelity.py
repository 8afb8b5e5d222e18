"""How faithfully the benchmark client measures: side by side with SGLang's bench_serving, against a
reference server that knows its true emission times (benchmarks/reference_server.py).

For each concurrency level and repeat, both clients stream the same load (`--max-tokens` tokens, one
decode step every `--itl-ms` for the whole batch) from one reference server; the server's record of the
measured requests (warm-up excluded) is the truth. Per run:
    ITL p99 error     = measured ITL p99 - true ITL p99, each pooled over the same requests' gaps
    TTFT p50 overhead = measured TTFT p50 - true TTFT p50 (first chunk written - request read)
    CPU per chunk     = the client process's user+system time (start-up and parsing included) / chunks;
                        for ours also its CPU while streaming alone (bench.json client_cpu_us_per_chunk)
A last row streams 4 tokens a chunk, where TPOT must still be per token (tokens from usage).
Each figure is the median of `--repeats` runs, with its spread [min, max]. The goals (the issue's):
|ITL p99 error| <= 0.5 ms at 64 streams and <= 1.0 ms at 256, at most a quarter of bench_serving's at
256; TTFT p50 overhead <= 10 ms at 256. Everything runs on 127.0.0.1 and the whole run is bounded by
`--time-limit`. Not a test: run it by hand on an otherwise quiet machine (the load average is printed).

    python benchmarks/bench_fidelity.py --bench-serving-python /tmp/sgl-venv/bin/python
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVER = Path(__file__).resolve().parent / "reference_server.py"
sys.path.insert(0, str(ROOT))
from harness.remote import ZIPAPP, zipapp  # noqa: E402  the client as it ships to a host
from harness.remote.stats import percentile  # noqa: E402  the client's own percentile, so both sides agree

# A word-level tokenizer for bench_serving's random-ids dataset, built with `tokenizers` in its venv.
MAKE_TOKENIZER = """
import json, sys
from tokenizers import Tokenizer, models, pre_tokenizers, decoders
words = ["tok", "<unk>"] + ["w%d" % i for i in range(998)]
t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
t.pre_tokenizer, t.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece()
t.save(sys.argv[1] + "/tokenizer.json")
json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>"},
          open(sys.argv[1] + "/tokenizer_config.json", "w"))
"""


class OutOfTime(Exception):
    pass


@dataclass
class Measured:
    """What one client reported for one run, in ms, and what the run cost it."""

    ttft: list[float]
    itl: list[float]
    tpot: list[float]
    cpu_s: float
    failed: int = 0
    hot_us: float | None = None   # the client's own CPU per chunk while streaming (bench.json)


@dataclass
class Row:
    level: str
    client: str
    itl_err: list[float] = field(default_factory=list)
    ttft_over: list[float] = field(default_factory=list)
    tpot_err: list[float] = field(default_factory=list)
    cpu_us: list[float] = field(default_factory=list)
    hot_us: list[float] = field(default_factory=list)
    true_itl_p99: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class Fidelity:
    def __init__(self, args: argparse.Namespace, work: Path):
        self.args, self.work = args, work
        self.pyz = work / ZIPAPP
        self.pyz.write_bytes(zipapp())
        self.deadline = time.monotonic() + args.time_limit
        self.tokenizer: Path | None = None

    def left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 1:
            raise OutOfTime()
        return left

    # ------------------------------------------------------------------ the server

    def start_server(self, tokens_per_chunk: int) -> subprocess.Popen:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        proc = subprocess.Popen([sys.executable, str(SERVER), "--port", str(self.port), "--itl-ms",
                                 str(self.args.itl_ms), "--tokens-per-chunk", str(tokens_per_chunk)],
                                stdout=subprocess.DEVNULL)
        for _ in range(100):
            try:
                self.get("/health")
                return proc
            except OSError:
                time.sleep(0.05)
        proc.kill()
        raise RuntimeError("the reference server did not start")

    def get(self, path: str):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as r:
            return json.load(r)

    # ------------------------------------------------------------------ the clients

    def ours(self, concurrency: int) -> Measured:
        out = self.work / "bench.json"
        cpu = self.cpu_of([sys.executable, str(self.pyz), "bench", "--url", f"http://127.0.0.1:{self.port}", "--model",
                           "ref", "--concurrency", str(concurrency), "--requests", str(concurrency),
                           "--max-tokens", str(self.args.max_tokens), "--warmup", "1", "--out", str(out)])
        records = [json.loads(line) for line in (self.work / "requests.jsonl").read_text().splitlines()]
        ok = [r for r in records if r["error"] is None]
        level = json.loads(out.read_text())["levels"][0]
        return Measured([r["ttft_ms"] for r in ok], [x for r in ok for x in r["itl_ms"]],
                        [r["tpot_ms"] for r in ok], cpu, len(records) - len(ok), level["client_cpu_us_per_chunk"])

    def bench_serving(self, concurrency: int) -> Measured:
        out = self.work / "bench_serving.jsonl"
        out.unlink(missing_ok=True)
        tok = str(self.tokenizer)
        cpu = self.cpu_of([self.args.bench_serving_python, "-m", "sglang.benchmark.serving", "--backend", "vllm",
                           "--base-url", f"http://127.0.0.1:{self.port}", "--model", tok, "--tokenizer", tok,
                           "--dataset-name", "random-ids", "--random-input-len", "16", "--random-output-len",
                           str(self.args.max_tokens), "--random-range-ratio", "1.0",
                           "--num-prompts", str(concurrency), "--max-concurrency", str(concurrency),
                           "--request-rate", "inf", "--warmup-requests", "1", "--disable-tqdm",
                           "--output-details", "--output-file", str(out)])
        result = json.loads(out.read_text().splitlines()[-1])
        ok = [i for i, e in enumerate(result["errors"]) if not e]
        ttft = [result["ttfts"][i] * 1e3 for i in ok]
        itl = [x * 1e3 for i in ok for x in result["itls"][i]]
        # bench_serving's TPOT: (latency - ttft) / (output_len - 1); its per-request latencies are not
        # dumped, so TPOT comes from its summary
        return Measured(ttft, itl, [result["median_tpot_ms"]], cpu, len(result["errors"]) - len(ok))

    def cpu_of(self, command: list[str]) -> float:
        before = os.times()
        self.run_plain(command)
        after = os.times()
        return (after.children_user - before.children_user) + (after.children_system - before.children_system)

    def run_plain(self, command: list[str]) -> None:
        try:
            proc = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=self.work,
                                  timeout=self.left(),
                                  env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
        except subprocess.TimeoutExpired:
            raise OutOfTime() from None
        if proc.returncode:
            raise RuntimeError(f"{Path(command[1]).name} exited {proc.returncode}: "
                               f"{proc.stderr.decode()[-2000:]}")

    # ------------------------------------------------------------------ one measurement

    def measure(self, row: Row, client: str, concurrency: int) -> None:
        since = time.monotonic_ns()
        m = self.ours(concurrency) if client == "harness" else self.bench_serving(concurrency)
        run = sorted((e for e in self.get("/emissions") if e["recv_ns"] >= since), key=lambda e: e["recv_ns"])
        # the warm-up request: ours is the first one in (same length); bench_serving's is 32 tokens long
        true = run[1:] if client == "harness" else [e for e in run if e["max_tokens"] == self.args.max_tokens]
        true_itl = [(b - a) / 1e6 for e in true for a, b in itertools.pairwise(e["chunk_ns"])]
        true_ttft = [(e["chunk_ns"][0] - e["recv_ns"]) / 1e6 for e in true]
        true_tpot = [(e["chunk_ns"][-1] - e["chunk_ns"][0]) / 1e6 / (e["tokens"] - 1) for e in true]
        if m.failed or len(true) != concurrency or len(m.itl) != len(true_itl):
            row.notes.append(f"{m.failed} failed, {len(true)} true requests, {len(m.itl)} measured gaps "
                             f"vs {len(true_itl)} true")
        if not m.itl or not true_itl:
            return
        row.itl_err.append(percentile(sorted(m.itl), 99) - percentile(sorted(true_itl), 99))
        row.ttft_over.append(percentile(sorted(m.ttft), 50) - percentile(sorted(true_ttft), 50))
        row.tpot_err.append(percentile(sorted(m.tpot), 50) - percentile(sorted(true_tpot), 50))
        row.cpu_us.append(m.cpu_s * 1e6 / sum(len(e["chunk_ns"]) for e in run))
        row.true_itl_p99.append(percentile(sorted(true_itl), 99))
        if m.hot_us is not None:
            row.hot_us.append(m.hot_us)
        if sum(e["stalled"] for e in true):
            row.notes.append("the server could not write every chunk at once")


# ---------------------------------------------------------------------- the report

def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    if not values:
        return "-"
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}, {fmt.format(max(values))}]"


def med(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def table(rows: list[Row]) -> str:
    head = ("streams", "client", "ITL p99 err ms", "TTFT p50 over ms", "TPOT p50 err ms", "CPU us/chunk",
            "streaming us/chunk", "true ITL p99 ms")
    lines = [[r.level, r.client, spread(r.itl_err), spread(r.ttft_over), spread(r.tpot_err, "{:.3f}"),
              spread(r.cpu_us, "{:.1f}"), spread(r.hot_us, "{:.1f}"), spread(r.true_itl_p99)] for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines, strict=True)]
    out = ["  ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True)) for line in [head, *lines]]
    for r in rows:
        out += [f"  note ({r.level}, {r.client}): {n}" for n in sorted(set(r.notes))]
    return "\n".join(out)


def verdict(rows: dict[tuple, Row], have_bs: bool) -> str:
    def err(level: str, client: str) -> float | None:
        r = rows.get((level, client))
        return None if r is None or not r.itl_err else statistics.median(abs(x) for x in r.itl_err)

    checks, parts = [], []
    for level, goal in (("64", 0.5), ("256", 1.0)):
        e = err(level, "harness")
        checks.append(e is not None and e <= goal)
        parts.append(f"ITL p99 |err| @{level} {e if e is None else round(e, 2)} ms (<= {goal})")
    e, b = err("256", "harness"), err("256", "bench_serving")
    if have_bs:
        checks.append(None not in (e, b) and e <= b / 4)
        parts.append(f"bench_serving's @256 {b if b is None else round(b, 2)} ms (ratio "
                     f"{'-' if None in (e, b) or not b else round(e / b, 2)}, <= 0.25)")
    else:
        parts.append("bench_serving not run")
    r256 = rows.get(("256", "harness"))
    over = med(r256.ttft_over) if r256 else None
    checks.append(over is not None and over <= 10)
    parts.append(f"TTFT p50 over @256 {over if over is None else round(over, 2)} ms (<= 10)")
    r4 = rows.get(("64 x4tok", "harness"))
    tpot = med([abs(x) for x in r4.tpot_err]) if r4 else None
    parts.append(f"TPOT p50 |err| @4 tok/chunk {tpot if tpot is None else round(tpot, 3)} ms")
    r = rows.get(("256", "harness"))
    cpu, hot = (med(r.cpu_us), med(r.hot_us)) if r else (None, None)
    parts.append(f"client CPU @256 {cpu if cpu is None else round(cpu, 1)} us/chunk in all, "
                 f"{hot if hot is None else round(hot, 1)} while streaming")
    return ("PASS" if all(checks) else "FAIL") + ": " + "; ".join(parts)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bench-serving-python", help="a python whose environment has sglang (bench_serving) and "
                   "tokenizers; without it the bench_serving column is skipped")
    p.add_argument("--concurrency", default="64,256")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--itl-ms", type=float, default=10.0)
    p.add_argument("--max-tokens", type=int, default=100)
    p.add_argument("--time-limit", type=float, default=900.0, help="seconds for the whole run (default 900)")
    args = p.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]

    have_bs = bool(args.bench_serving_python) and Path(args.bench_serving_python).exists()
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; true ITL {args.itl_ms} ms, "
          f"{args.max_tokens} tokens, {args.repeats} repeats", flush=True)
    if not have_bs:
        print("note: bench_serving skipped (pass --bench-serving-python PY, a venv with sglang and tokenizers)")
    rows: dict[tuple, Row] = {}
    clients = ["harness"] + (["bench_serving"] if have_bs else [])
    with tempfile.TemporaryDirectory(prefix="bench-fidelity-") as tmp:
        fid = Fidelity(args, Path(tmp))
        try:
            if have_bs:
                fid.tokenizer = Path(tmp) / "tokenizer"
                fid.tokenizer.mkdir()
                fid.run_plain([args.bench_serving_python, "-c", MAKE_TOKENIZER, str(fid.tokenizer)])
            for tokens_per_chunk, plan in ((1, [(str(c), c) for c in levels]), (4, [(f"{levels[0]} x4tok",
                                                                                       levels[0])])):
                server = fid.start_server(tokens_per_chunk)
                try:
                    for _ in range(args.repeats):  # interleaved, so a noisy minute hits both clients
                        for name, c in plan:
                            for client in clients:
                                row = rows.setdefault((name, client), Row(name, client))
                                fid.measure(row, client, c)
                                print(f"  {name:>9} {client:<13} ITL p99 err {row.itl_err[-1]:+.2f} ms, "
                                      f"TTFT p50 over {row.ttft_over[-1]:+.2f} ms", flush=True)
                finally:
                    server.terminate()
                    server.wait()
        except OutOfTime:
            print(f"note: stopped at the time limit ({args.time_limit:.0f} s); the table has what was measured")
    print()
    print(table(list(rows.values())))
    print(verdict(rows, have_bs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
