"""Host facts: each a command plus a parser (the shape of pyinfra's facts).

The commands run on the host inside the venv, once per sweep and host: the first preflight there starts
them apart from itself, and they run while that run's server starts. The facts that the venv's Python
answers (its version, the packages, the engine's version and git commit) come from one start of the
host agent's `facts` rather than a Python each; the others are shell commands. Each run copies them
into its `facts/<name>.txt` before its benchmark (and again at teardown, for a run that failed before),
which is pulled back with everything else; the parsers turn those files into the manifest's `facts`.
The raw files stay, so nothing a parser missed is lost.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.engines import Engine, env_prefixes

ENV_PREFIXES = ["NCCL", "CUDA", "NVIDIA", "TORCH", "PYTORCH"]
"""The environment of the GPU stack recorded with every run, beside each engine's own prefixes."""


@dataclass(frozen=True)
class Fact:
    name: str
    command: str            # shell, run in the venv; "": written by the host agent's `facts`
    parse: Callable[[str], Any] = staticmethod(lambda text: text.strip() or None)


def _gpus(text: str) -> list[dict] | None:
    rows = [[c.strip() for c in line.split(",")] for line in text.splitlines() if line.count(",") >= 3]
    return [{"name": r[0], "memory_total_mib": r[1], "driver": r[2], "cuda_capability": r[3]}
            for r in rows] or None


def _env(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def _first_line(text: str) -> str | None:
    lines = text.strip().splitlines()
    return lines[-1].strip() if lines else None


def _version(text: str) -> str | None:
    """The engine's version; None where the agent could not tell (its `#` line says why)."""
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    return lines[-1] if lines else None


def _git(text: str) -> dict | None:
    lines = text.strip().splitlines()
    if not lines or not re.fullmatch(r"[0-9a-f]{40}", lines[0].strip()):
        return None
    return {"commit": lines[0].strip(), "dirty": len(lines) > 1}


def _cuda(text: str) -> str | None:
    m = re.search(r"CUDA Version:\s*([\d.]+)", text)
    return m.group(1) if m else None


def _requirements(text: str) -> int | None:
    """How many packages a pip_freeze lists (its comments left out)."""
    return sum(1 for line in text.splitlines() if line.strip() and not line.startswith("#")) or None


def facts_for(engine: Engine) -> list[Fact]:
    """The facts of a host running `engine`: the engine's own (its version and commit) only for an
    engine that has a module or a distribution to ask."""
    return [fact for fact in _facts() if (engine.module or fact.name != "engine_git")
            and (engine.module or engine.distribution or fact.name != "engine_version")]


def _facts() -> list[Fact]:
    return [
        Fact("gpus", "nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap "
                     "--format=csv,noheader,nounits", _gpus),
        Fact("cuda", "nvidia-smi", _cuda),
        # from the agent: `pip freeze` (or, in a venv without pip, the distributions Python finds, under
        # a comment that says so), and an editable install (a git checkout) known by its commit and
        # whether it has local changes
        Fact("python", "", _first_line),
        Fact("engine_version", "", _version),
        Fact("engine_git", "", _git),
        Fact("pip_freeze", "", _requirements),
        # names that look secret are left out at the source (see harness.secrets)
        Fact("env", f"env | grep -E '^({'|'.join(ENV_PREFIXES + [p.rstrip('_') for p in env_prefixes()])})_' "
                    "| grep -viE '^[^=]*(TOKEN|SECRET|PASSWORD|KEY)[^=]*=' | sort", _env),
        Fact("kernel", "uname -sr", _first_line),
    ]


def agent_words(engine: Engine, facts_dir: str) -> list[str]:
    """The arguments of the host agent's `facts`, which writes the facts without a command of their own
    (harness/remote/agent.py) into `facts_dir`, in one start of the venv's Python."""
    return ["facts", "--dir", facts_dir, "--module", engine.module, "--distribution", engine.distribution]


def collect_script(facts: list[Fact], facts_dir: str, agent: str = "") -> str:
    """One shell snippet that runs every fact command into facts/<name>.txt, failures included, and
    `agent` (the agent's `facts` command line), which writes the facts without a command of their own;
    what it says on failing lands in facts/agent_facts.txt. They run at once and the snippet waits for
    all: a first run on a host waits for the slowest (pip, or importing an engine without metadata for
    its version: seconds) rather than for their sum. One group, so that `source .../activate && SNIPPET`
    holds for every one of them."""
    d = shlex.quote(facts_dir)
    jobs = [f"( {f.command} ) > {d}/{f.name}.txt 2>&1 &" for f in facts if f.command]
    if agent and any(not f.command for f in facts):
        said = f"{d}/agent_facts.txt"
        jobs.append(f"{{ ( {agent} ) > {said} 2>&1; [ -s {said} ] || rm -f {said}; }} &")
    return "{ " + " ".join(jobs) + " wait; }"


FACTS_WAIT_S = 60
"""How long a run waits for its host's facts, once before its health check ends and once at teardown:
the first run on a host takes them while its server starts; one that is not done by then (a hung
nvidia-smi) is not waited for longer, and the run keeps what was written."""


_ALIVE = "kill -0 \"$fp\" && ! grep -q ') Z' /proc/\"$fp\"/stat"
"""Whether the collection whose pid is `$fp` runs: a zombie has ended (some inits never reap)."""


def background_script(collect: str, folder: str) -> str:
    """Shell that starts `collect` (which writes into FOLDER.tmp) apart from the command, at a low
    priority, and returns at once; FOLDER.tmp becomes FOLDER once it is done. Nothing is started where
    FOLDER is there already or a collection still runs (its pid in FOLDER.pid); one that died halfway
    (the host rebooted, the sweep was killed) is started again.

    A host's facts (pip, nvidia-smi, the engine's version) take a second or more of CPU at the first
    run of a sweep on each host: the server starts meanwhile instead of waiting for them. Its own
    session (setsid), so a command's end or timeout signals none of it; no output held open, so the
    command ends at once; started from a subshell, so a `wait` of the command's own shell does not
    wait for it either. (Under Slurm the step of the command that started it lasts until it is done.)"""
    f, tmp, pid = shlex.quote(folder), shlex.quote(folder + ".tmp"), shlex.quote(folder + ".pid")
    job = shlex.quote(f"( {collect} ) >/dev/null 2>&1; mv -T {tmp} {f} 2>/dev/null || rm -rf {tmp}")
    return (f"if [ ! -d {f} ] && ! {{ read -r fp < {pid} && {_ALIVE}; }} 2>/dev/null; then "
            f"rm -rf {tmp} && mkdir -p {tmp} && ( setsid nice -n 10 bash --norc -c {job} >/dev/null 2>&1 "
            f"</dev/null & echo $! > {pid} ); fi")


def await_script(folder: str, into: str, wait_s: float = FACTS_WAIT_S) -> str:
    """Shell that waits, at most `wait_s`, while the collection `background_script` started runs, then
    copies the facts into `into` (the run's facts folder): all of them when it ended, what it wrote
    so far when it did not end in time. Nothing to wait for (done, or never started): it copies at once.
    It prints nothing and always succeeds, so it can end any command."""
    f, tmp, pid, d = (shlex.quote(p) for p in (folder, folder + ".tmp", folder + ".pid", into))
    return (f"{{ fp=; read -r fp < {pid}; i=0; while [ ! -d {f} ] && [ -n \"$fp\" ] && {{ {_ALIVE}; }} && "
            f"[ $i -lt {round(wait_s * 20)} ]; do sleep 0.05; i=$((i+1)); done; if [ -d {f} ]; then cp -p {f}/* {d}/; "
            f"elif [ -d {tmp} ]; then cp -p {tmp}/* {d}/; fi; }} >/dev/null 2>&1; true")


def parse_facts(facts: list[Fact], local_dir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in facts:
        path = local_dir / f"{f.name}.txt"
        if path.exists():
            out[f.name] = f.parse(path.read_text(errors="replace"))
    if isinstance(out.get("pip_freeze"), int):
        out["pip_freeze"] = f"{out['pip_freeze']} packages (facts/pip_freeze.txt)"
    return out
