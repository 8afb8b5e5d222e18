"""How much a night of crashes costs: a sweep killed N times at random instants and resumed, against
the same sweep run cleanly (docs/reliability.md case 12; goal: the same result set within 1.5x the clean time).

    .venv/bin/python benchmarks/kill_resume.py [--configs 6] [--kills 3] [--random-state 1]

The hosts are this machine (local transport) and the engine is the simulator. Each kill is a SIGKILL of
the orchestrator at a random moment of the clean sweep's duration; `--resume` then picks up, stopping the
servers that were in flight. It prints both wall times, the ratio and whether the result sets match.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def playbook(path: Path, configs: int) -> Path:
    path.write_text(yaml.safe_dump({
        "name": "killres", "hosts": "localhost", "engine": "sim", "model": {"path": "/m", "served_name": "m"},
        "server": {"port": 30611, "env": {"HARNESS_SIM_TIME_SCALE": "0.1", "HARNESS_SIM_STARTUP_S": "0.5"},
                   "startup_timeout_s": 60},
        "configs": [{"name": f"c{i}", "args": {"mem-fraction-static": 0.8 + i / 100}} for i in range(configs)],
        "benchmark": {"prompt": "hi", "max_tokens": 32, "concurrency": [1, 4], "requests": 4}}))
    return path


def sweep(pb: Path, inv: Path, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "harness", "sweep", str(pb), "-i", str(inv), "-o", str(out),
                             "--lease", "5", *extra], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def results(out: Path) -> dict[str, str]:
    return {p.parent.name: json.loads(p.read_text())["status"] for p in out.glob("*/runs/*/manifest.json")}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--configs", type=int, default=6)
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--random-state", type=int, default=1)
    a = p.parse_args()
    rng = random.Random(a.random_state)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        inv = tmp / "inventory.yaml"
        inv.write_text(yaml.safe_dump({"all": {"vars": {"workdir": str(tmp / "work")},
                                               "hosts": {"localhost": {"transport": "local"}}}}))
        pb = playbook(tmp / "pb.yaml", a.configs)
        start = time.monotonic()
        sweep(pb, inv, tmp / "clean").wait(timeout=900)
        clean = time.monotonic() - start
        start = time.monotonic()
        for k in range(a.kills):
            proc = sweep(pb, inv, tmp / "killed", *(["--resume"] if k else []))
            time.sleep(rng.uniform(0.1, 1.0) * clean / a.kills)
            proc.kill()
            proc.wait()
        resumes = 0
        while sweep(pb, inv, tmp / "killed", "--resume").wait(timeout=900) != 0 and resumes < 10:
            resumes += 1
        killed = time.monotonic() - start
        same = results(tmp / "clean") == results(tmp / "killed")
        done = [json.loads(line) for line in next((tmp / "killed").glob("*/journal.jsonl")).read_text().splitlines()]
        finished = [e["run_id"] for e in done if e["state"] == "ok"]
        print(f"{a.configs} configurations, {a.kills} SIGKILLs at random instants, then --resume")
        print(f"clean {clean:6.1f} s   killed and resumed {killed:6.1f} s   ratio {killed / clean:.2f}x (goal <= 1.5x)")
        print(f"summary: ratio {killed / clean:.2f}x; same result set {same}; "
              f"each run finished once {len(finished) == len(set(finished)) == a.configs}")


if __name__ == "__main__":
    main()
