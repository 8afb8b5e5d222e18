"""harness bench against `vllm bench serve` on one real vLLM server, interleaved, same workload.

    python benchmarks/peer_vllm.py --url http://127.0.0.1:8000 --model tiny --tokenizer /models/tiny \
        --vllm .venv-vllm/bin/vllm --concurrency 1,16 --rounds 3

Each round runs, for every concurrency level, the harness's client (`bench` of the zipapp that ships to
hosts, run by this Python: standard library only; a prompt of --input-tokens tokens by the server's /tokenize) and
`vllm bench serve` (random prompts of --input-tokens tokens,
--max-tokens output tokens with ignore_eos, --max-concurrency c) one after the other, the order
alternating between rounds so that a drift of the machine does not favour either. Printed per level:
the median over rounds of each client's output tok/s and their ratio (harness / vllm), TPOT p50 of
each and the difference in percent, ITL p50 of vllm bench against the harness's ITL per token and
per chunk. vllm bench counts every event with a choice as a token, the harness only chunks that carry
text; `itl_token_ms` is the figure that means the same as vllm's ITL.

Goal on an H200 (a 0.7B-parameter Llama): throughput ratio >= 0.98 and TPOT within 3% at 1 and 16.
Writes every raw result under --out (default peer-vllm/).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from harness.remote import ZIPAPP, zipapp  # noqa: E402  the client as it ships to a host


def prompt_of(a) -> str:
    """A prompt of exactly --input-tokens tokens by the server's own count (vLLM's /tokenize, which
    adds the BOS token as a completion request does), so both clients send prompts of one length."""
    words = "the of and to in is was for on that with as by at from his it an were are which this".split()
    text = ""
    for i in range(4 * a.input_tokens):
        candidate = (text + " " + words[i % len(words)]).strip()
        request = urllib.request.Request(a.url + "/tokenize", json.dumps({"model": a.model, "prompt": candidate})
                                         .encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as reply:
            count = json.loads(reply.read())["count"]
        if count > a.input_tokens:
            break
        text = candidate
    return text


def run_harness(a, c: int, out: Path) -> dict:
    path = out / f"harness-c{c}.json"
    pyz = out / ZIPAPP
    pyz.write_bytes(zipapp())
    subprocess.run([sys.executable, str(pyz), "bench", "--url", a.url, "--model", a.model, "--concurrency", str(c),
                    "--requests", str(a.requests(c)), "--max-tokens", str(a.max_tokens), "--warmup", "1",
                    "--prompt", a.prompt, "--out", str(path)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    level = json.loads(path.read_text())["levels"][0]
    return {"tok_s": level["output_tok_s"], "tpot": level["tpot_ms"]["p50"], "itl_chunk": level["itl_ms"]["p50"],
            "itl_token": level["itl_token_ms"]["p50"], "tokens_per_chunk": level["tokens_per_chunk"]}


def run_vllm(a, c: int, out: Path) -> dict:
    name = f"vllm-c{c}.json"
    subprocess.run([a.vllm, "bench", "serve", "--backend", "vllm", "--base-url", a.url, "--model", a.model,
                    "--tokenizer", a.tokenizer, "--dataset-name", "random", "--random-input-len",
                    str(a.input_tokens), "--random-output-len", str(a.max_tokens), "--ignore-eos",
                    "--num-prompts", str(a.requests(c)), "--max-concurrency", str(c), "--num-warmups", "1",
                    "--save-result", "--result-dir", str(out), "--result-filename", name],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "HF_HUB_OFFLINE": "1"})
    r = json.loads((out / name).read_text())
    return {"tok_s": r["output_throughput"], "tpot": r["median_tpot_ms"], "itl": r["median_itl_ms"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--tokenizer", required=True, help="the model's folder, for vllm bench's random prompts")
    p.add_argument("--vllm", default="vllm", help="the vllm command (of the venv that has vllm bench)")
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--per-level", type=int, default=4, help="requests per level = this x concurrency, at least 16")
    p.add_argument("--input-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=Path("peer-vllm"))
    a = p.parse_args(argv)
    a.requests = lambda c: max(16, a.per_level * c)
    a.prompt = prompt_of(a)
    levels = [int(c) for c in a.concurrency.split(",")]
    results: dict[int, dict[str, list]] = {c: {"harness": [], "vllm": []} for c in levels}
    for r in range(a.rounds):
        out = a.out / f"round{r}"
        out.mkdir(parents=True, exist_ok=True)
        for c in levels:
            pair = [("harness", run_harness), ("vllm", run_vllm)]
            for name, fn in pair if r % 2 == 0 else pair[::-1]:
                results[c][name].append(fn(a, c, out))
                print(f"round {r} c={c} {name}: {results[c][name][-1]}", file=sys.stderr, flush=True)
    print(f"{'conc':>4}  {'harness tok/s':>13}  {'vllm tok/s':>10}  {'ratio':>6}  {'TPOT h':>7}  {'TPOT v':>7}"
          f"  {'TPOT diff':>9}  {'ITL v':>6}  {'ITL/tok h':>9}  {'ITL/chunk h':>11}  {'tok/chunk':>9}")
    for c in levels:
        h, v = results[c]["harness"], results[c]["vllm"]
        med = lambda rows, k: statistics.median(x[k] for x in rows)  # noqa: E731
        ratio = statistics.median(x["tok_s"] / y["tok_s"] for x, y in zip(h, v, strict=True))
        tpot_diff = (med(h, "tpot") - med(v, "tpot")) / med(v, "tpot") * 100
        print(f"{c:>4}  {med(h, 'tok_s'):>13.1f}  {med(v, 'tok_s'):>10.1f}  {ratio:>6.3f}  {med(h, 'tpot'):>7.3f}"
              f"  {med(v, 'tpot'):>7.3f}  {tpot_diff:>8.2f}%  {med(v, 'itl'):>6.3f}  {med(h, 'itl_token'):>9.3f}"
              f"  {med(h, 'itl_chunk'):>11.3f}  {med(h, 'tokens_per_chunk'):>9.2f}")
    (a.out / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
