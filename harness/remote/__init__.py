"""Code that runs ON the GPU host, standard library only: the agent (`agent.py`), the benchmark
client (`bench.py`) and the torch.profiler wrapper (`torchprof.py`). They are uploaded once per connection into a directory named by their content,
read once per process, so every run of a sweep uses exactly the same bytes."""

from __future__ import annotations

import hashlib
import shlex
from functools import cache
from pathlib import Path

import harness

FILES = ("agent.py", "bench.py", "torchprof.py")


@cache
def payload() -> dict[str, bytes]:
    here = Path(__file__).resolve().parent
    return {name: (here / name).read_bytes() for name in FILES}


def remote_dir(workdir: str) -> str:
    digest = hashlib.sha256(b"".join(payload().values())).hexdigest()[:12]
    return f"{workdir.rstrip('/')}/.harness/{harness.__version__}-{digest}"


def install(transport, workdir: str) -> str:
    """Upload the agent and the client under `workdir`; return where they are."""
    where = remote_dir(workdir)
    transport.run(f"mkdir -p {shlex.quote(where)}", timeout=60)
    for name, data in payload().items():
        transport.put(data, f"{where}/{name}")
    return where
