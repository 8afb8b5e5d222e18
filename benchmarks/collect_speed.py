"""Collect speed in a real sweep: the manifests' collected bytes / collect seconds against `scp -r`.

A real sshd on a loopback port (tests/sshd.py) and a "remote" venv whose SGLang is the simulator
(tests/remote_venv.py): `python -m harness sweep` runs a playbook of one configuration at TP 4 with
the engine's profiler on, each rank's trace padded to `--trace-mb` MB on disk (HARNESS_SIM_TRACE_MB,
gzip'd JSON as SGLang writes it). The run's manifest says how many bytes the collect phase brought
back (`collected.bytes`) and how long the phase took (`phases.collect.seconds`: the room check and
the pull with its checks and fsyncs, the host held throughout). The redaction of text files follows
the phase, and the sha256 of every file comes once the host is free (`phases.finish`, printed
beside: the files read back from the page cache and hashed, with the traces' analysis).

A good run's folder is removed from the host once collected, so the same files (those the manifest
lists as collected, copied from the local run folder) are then laid out again on the same host
and pulled with `scp -r` (OpenSSH's default, the SFTP protocol) through the same sshd with the same
key, `--scp-repeats` times (3), each into a fresh folder. The first scp writes into memory the way
the collect did, after a pause; the later ones reuse what the scp before them freed, and on a
virtual machine that hands free memory back to its host that is up to twice as fast
(benchmarks/README.md). Each round is one sweep then its scps, so a busy moment of the machine
hurts both alike. Two ratios, each the median of the rounds' own: against the first scp and
against the fastest (the strictest baseline).

    .venv/bin/python benchmarks/collect_speed.py [--rounds 5] [--trace-mb 64] [--ranks 4] [--scp-repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.remote_venv import make_remote_venv  # noqa: E402
from tests.sshd import Sshd  # noqa: E402

MB = 1_000_000


def playbook(path: Path, *, port: int, ranks: int, trace_mb: float) -> Path:
    pb = {
        "name": "collect",
        "hosts": "node1",
        "engine": "sglang",
        "model": {"path": "/models/tiny", "served_name": "tiny"},
        "server": {"port": port, "args": {"tp-size": ranks},
                   "env": {"HARNESS_SIM_TIME_SCALE": "0.02", "HARNESS_SIM_STARTUP_S": "0.5",
                           "HARNESS_SIM_TRACE_MB": str(trace_mb / 1.048576)},  # the knob counts MiB
                   "startup_timeout_s": 60},
        "configs": [{"name": "c"}],
        "benchmark": {"prompt": "hello there", "max_tokens": 12, "concurrency": [1], "requests": 2,
                      "warmup": 0, "timeout_s": 60},
        "profile": {"mode": "engine", "num_steps": 3, "timeout_s": 600},
    }
    path.write_text(yaml.safe_dump(pb, sort_keys=False))
    return path


def inventory(path: Path, sshd: Sshd, venv: Path, workdir: Path) -> Path:
    node = {"address": sshd.address, "port": sshd.port, "user": sshd.user,
            "identity_file": str(sshd.client_key), "known_hosts": str(sshd.known_hosts),
            "venv": str(venv), "workdir": str(workdir)}
    path.write_text(yaml.safe_dump({"all": {"hosts": {"node1": node}}}))
    return path


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sweep_once(pb: Path, inv: Path, out: Path) -> tuple[dict, Path]:
    done = subprocess.run([sys.executable, "-m", "harness", "sweep", str(pb), "-i", str(inv), "-o", str(out)],
                          cwd=REPO, capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    found = list(out.glob("*/runs/*/manifest.json"))
    if done.returncode != 0 or len(found) != 1:
        raise SystemExit(f"the sweep failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    manifest = json.loads(found[0].read_text())
    if manifest["status"] != "ok" or manifest["profile"]["status"] != "ok":
        raise SystemExit(f"the run failed: {manifest['error']} {manifest['profile']}")
    return manifest, found[0].parent


def scp_seconds(sshd: Sshd, run_dir: Path, files: list[str], work: Path, repeats: int) -> tuple[list[float], int]:
    """Lay the files the collect phase pulled out again on the host, then time `scp -r` of that folder
    `repeats` times."""
    remote = work / "remote-copy"
    for rel in files:
        (remote / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(run_dir / rel, remote / rel)
    size = sum(p.stat().st_size for p in remote.rglob("*") if p.is_file())
    local = work / "scp-local"
    options = ["-i", str(sshd.client_key), "-o", f"UserKnownHostsFile={sshd.known_hosts}",
               "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-o", "LogLevel=ERROR"]
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run(["scp", "-q", "-r", "-P", str(sshd.port), *options, f"{sshd.user}@{sshd.address}:{remote}",
                        str(local)], check=True)
        seconds.append(time.perf_counter() - started)
        got = sum(p.stat().st_size for p in local.rglob("*") if p.is_file())
        assert got == size, f"scp brought {got} bytes of {size}"
        shutil.rmtree(local)
    shutil.rmtree(remote)
    return seconds, size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--trace-mb", type=float, default=64.0, help="each rank's trace on disk, MB (10^6)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--scp-repeats", type=int, default=3, help="scp runs a round; the fastest is its baseline")
    args = parser.parse_args()
    ours, theirs, ratios, firsts = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="collect-speed-") as tmp_name, Sshd(Path(tmp_name) / "sshd") as sshd:
        tmp = Path(tmp_name)
        venv = make_remote_venv(tmp / "venv", engines=("sglang",))
        inv = inventory(tmp / "inventory.yaml", sshd, venv, tmp / "remote-work")
        pb = playbook(tmp / "playbook.yaml", port=free_port(), ranks=args.ranks, trace_mb=args.trace_mb)
        for round_no in range(args.rounds):
            out = tmp / f"results-{round_no}"
            manifest, run_dir = sweep_once(pb, inv, out)
            collected, seconds = manifest["collected"]["bytes"], manifest["phases"]["collect"]["seconds"]
            after = manifest["phases"].get("finish", {}).get("seconds")
            scps, scp_bytes = scp_seconds(sshd, run_dir, list(manifest["collected"]["sha256"]), tmp,
                                          args.scp_repeats)
            ours.append(collected / MB / seconds)
            theirs.append(scp_bytes / MB / min(scps))
            ratios.append(ours[-1] / theirs[-1])
            firsts.append(ours[-1] / (scp_bytes / MB / scps[0]))
            print(f"round {round_no + 1}: collect {collected / MB:.1f} MB in {seconds:.2f} s = {ours[-1]:.1f} MB/s; "
                  f"scp -r {scp_bytes / MB:.1f} MB in {min(scps):.2f} s = {theirs[-1]:.1f} MB/s (fastest of "
                  f"{', '.join(f'{s:.2f}' for s in scps)} s); ratio {ratios[-1]:.2f}x, to the first scp "
                  f"{firsts[-1]:.2f}x" + (f"; then, the host free, hashes and analysis {after:.2f} s"
                                          if after is not None else ""), flush=True)
            shutil.rmtree(out)
    load = os.getloadavg()[0]
    print(f"summary: collect {statistics.median(ours):.1f} MB/s, scp -r {statistics.median(theirs):.1f} MB/s, "
          f"collect/scp {statistics.median(ratios):.2f}x (median of {args.rounds} rounds: "
          f"{', '.join(f'{r:.2f}' for r in ratios)}; goal 1.3x), to the first scp of each round "
          f"{statistics.median(firsts):.2f}x ({', '.join(f'{r:.2f}' for r in firsts)}); "
          f"{args.ranks} traces of {args.trace_mb:g} MB; scp the fastest of {args.scp_repeats} a round; "
          f"load average {load:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
