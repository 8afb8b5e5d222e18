"""Pull speed: the harness's SSHTransport.pull against `scp -r` and `ssh HOST tar c | tar x`.

Same bytes, same host, same key: a real sshd on a loopback port (tests/sshd.py) serves a run-like
directory, and each method pulls it into a fresh local directory, several times, in alternation (so
a busy moment of the machine hurts every method alike). Two directories:

  mixed         8 gzip'd trace files (60 MB, incompressible, as Kineto traces written with .gz are)
                plus ~20 MB of JSON traces and logs that compress well
  compressible  ~80 MB of uncompressed JSON traces and logs, as an engine writes them by default

MB/s counts the directory's bytes (10^6 per MB) over the wall time of the whole pull. Methods:

  harness       SSHTransport(host).pull(...), connecting first, as scp and ssh must (uncompressed:
                the host is this machine)
  harness-warm  the same pull over a connection already open: what a sweep pays, since each worker
                keeps one connection per host
  harness-zstd  a new connection and the zstd-compressed pull that a host across a link gets
  scp           scp -r (OpenSSH's default: the SFTP protocol), same key, same sshd
  ssh-tar       ssh HOST tar -cf - DIR | tar -xf -

Prints one line per method and case (the median of the repeats, then each repeat), the ratio
harness/scp as the median of each round's own ratio (a busy moment hurts both sides of a round
alike), and a summary line.

    .venv/bin/python benchmarks/pull_speed.py [--repeats 7] [--cases mixed,compressible]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.transport.ssh import SSHTransport  # noqa: E402
from tests.sshd import Sshd  # noqa: E402

MB = 1_000_000


def kineto_json(size: int, random_state: int) -> bytes:
    """A Kineto-shaped trace (traceEvents of kernels with names, timestamps, durations) of about `size` bytes."""
    rng = random.Random(random_state)
    kernels = [f"void at::native::elementwise_kernel<{i}, 4>(int, {rng.getrandbits(32):x})" for i in range(64)]
    events, total, ts = [], 0, 1_700_000_000_000
    while total < size:
        ts += rng.randint(1, 400)
        event = {"ph": "X", "cat": "kernel", "name": rng.choice(kernels), "pid": 0, "tid": 7,
                 "ts": ts, "dur": rng.randint(1, 900),
                 "args": {"stream": 7, "correlation": rng.getrandbits(24), "grid": [rng.randint(1, 512), 1, 1]}}
        line = json.dumps(event)
        events.append(line)
        total += len(line) + 2
    return ('{"schemaVersion": 1, "traceEvents": [\n' + ",\n".join(events) + "\n]}\n").encode()


def server_log(size: int, random_state: int) -> bytes:
    rng = random.Random(random_state)
    lines, total = [], 0
    while total < size:
        line = (f"[2026-11-30 17:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d} TP{rng.randint(0, 7)}] "
                f"Decode batch. #running-req: {rng.randint(1, 64)}, #token: {rng.randint(1000, 90000)}, "
                f"token usage: 0.{rng.randint(1, 99):02d}, gen throughput (token/s): {rng.uniform(10, 900):.2f}\n")
        lines.append(line)
        total += len(line)
    return "".join(lines).encode()


def make_run_dir(root: Path, case: str) -> int:
    """Write the case's files under `root`; return their total size in bytes."""
    profile = root / "profile"
    profile.mkdir(parents=True)
    if case == "mixed":
        for rank in range(8):
            # gzip of random bytes: as incompressible as a gzip'd trace, without minutes of compressing
            data = gzip.compress(os.urandom(60 * MB // 8), compresslevel=1)
            (profile / f"{rank}-TP-{rank}.trace.json.gz").write_bytes(data)
        (profile / "host-summary.trace.json").write_bytes(kineto_json(16 * MB, 1))
        (root / "server.log").write_bytes(server_log(4 * MB, 2))
    else:
        for rank in range(4):
            (profile / f"{rank}-TP-{rank}.trace.json").write_bytes(kineto_json(19 * MB, rank))
        (root / "server.log").write_bytes(server_log(4 * MB, 9))
    (root / "bench.json").write_text(json.dumps({"schema": "harness.bench/1", "levels": []}))
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def ssh_options(sshd: Sshd) -> list[str]:
    return ["-i", str(sshd.client_key), "-o", f"UserKnownHostsFile={sshd.known_hosts}",
            "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-o", "LogLevel=ERROR"]


class CompressingTransport(SSHTransport):
    """The pull that a host across a link gets (zstd when both ends have it), here on loopback."""

    compress_pulls = True


def methods(sshd: Sshd) -> dict[str, Callable[[Path, Path], None]]:
    target = f"{sshd.user}@{sshd.address}"

    def pull_with(kind: type[SSHTransport]) -> Callable[[Path, Path], None]:
        def pull(remote: Path, local: Path) -> None:
            transport = kind(sshd.host_spec("bench"))
            try:
                transport.pull(str(remote), local, timeout=600)
            finally:
                transport.close()
        return pull

    warm = SSHTransport(sshd.host_spec("bench-warm"))

    def pull_warm(remote: Path, local: Path) -> None:
        warm.pull(str(remote), local, timeout=600)

    def scp(remote: Path, local: Path) -> None:
        subprocess.run(["scp", "-q", "-r", "-P", str(sshd.port), *ssh_options(sshd),
                        f"{target}:{remote}", str(local)], check=True)

    def ssh_tar(remote: Path, local: Path) -> None:
        local.mkdir()
        ssh = subprocess.Popen(["ssh", "-p", str(sshd.port), *ssh_options(sshd), target,
                                f"tar -C {remote} -cf - ."], stdout=subprocess.PIPE)
        subprocess.run(["tar", "-C", str(local), "-xf", "-"], stdin=ssh.stdout, check=True)
        ssh.stdout.close()
        if ssh.wait() != 0:
            raise RuntimeError("ssh tar failed")

    return {"harness": pull_with(SSHTransport), "scp": scp, "harness-warm": pull_warm, "ssh-tar": ssh_tar,
            "harness-zstd": pull_with(CompressingTransport)}


def measure(case: str, repeats: int, sshd: Sshd, work: Path) -> dict[str, float]:
    """Median MB/s of each method over `repeats` alternating rounds, and the median ratio harness/scp."""
    remote = work / f"remote-{case}"
    size = make_run_dir(remote, case)
    pulls = methods(sshd)
    timings: dict[str, list[float]] = {name: [] for name in pulls}
    for _ in range(repeats):
        for name, pull in pulls.items():
            local = work / f"local-{name}"
            started = time.perf_counter()
            pull(remote, local)
            timings[name].append(time.perf_counter() - started)
            got = sum(p.stat().st_size for p in local.rglob("*") if p.is_file())
            assert got == size, f"{name} pulled {got} bytes of {size}"
            shutil.rmtree(local)
    shutil.rmtree(remote)
    rates = {name: size / MB / statistics.median(t) for name, t in timings.items()}
    for name, rate in rates.items():
        spread = ", ".join(f"{size / MB / t:.0f}" for t in timings[name])
        print(f"{case:13} {name:12} {rate:7.1f} MB/s  (median of {repeats}: {spread})  {size / MB:.1f} MB")
    for name in ("harness", "harness-warm"):
        rounds = [scp / ours for ours, scp in zip(timings[name], timings["scp"], strict=True)]
        rates[f"{name}/scp"] = statistics.median(rounds)
        print(f"{case:13} {name}/scp = {rates[f'{name}/scp']:.2f}x  (rounds: {', '.join(f'{r:.2f}' for r in rounds)})")
    return rates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--cases", default="mixed,compressible")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pull-speed-") as tmp, Sshd(Path(tmp) / "sshd") as sshd:
        results = {case: measure(case, args.repeats, sshd, Path(tmp)) for case in args.cases.split(",")}
    summary = ", ".join(f"{case} {r['harness']:.0f} vs scp {r['scp']:.0f} MB/s ({r['harness/scp']:.2f}x; "
                        f"on an open connection {r['harness-warm/scp']:.2f}x)" for case, r in results.items())
    print(f"summary: harness pull {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
