"""`harness check`: preflight every host without launching anything.

For each host, in parallel: connect (reachability, host key, auth), then the agent's probe inside the
venv: Python, the engine import, the port, GPUs and their processes, free disk. With no engine named
(no playbook, no `--engine`) the venv passes when it imports any engine the harness knows (SGLang,
vLLM), and the port is checked only when one is given.
"""

from __future__ import annotations

import shlex
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from rich.table import Table
from rich.text import Text

from harness.config.inventory import Host, load_inventory
from harness.engines import Engine, get_engine, real_engines
from harness.errors import HarnessError
from harness.remote import install, tool_command
from harness.report.plain import PlainTable
from harness.results.answers import AnswerError, Gpus, Probe, read_answer
from harness.transport import connect


@dataclass
class HostCheck:
    host: str
    ok: bool
    problems: list[str] = field(default_factory=list)
    probe: Probe | None = None


def check_host(host: Host, engine: str | Engine | None, port: int | None) -> HostCheck:
    """`engine` None: any engine the harness knows will do, and `port` None is not checked."""
    eng = get_engine(engine) if isinstance(engine, str) else engine
    modules = eng.module if eng else ",".join(e.module for e in real_engines() if e.module)
    port = port or (eng.default_port if eng else 0)
    if host.slurm is not None:   # no node to reach before an allocation names one
        return HostCheck(host.name, False, [f"a node slot of Slurm group {host.cluster!r}: its node is known once "
                                            "`harness sweep` has an allocation, and checked then (preflight)"])
    venv = host.with_default_venv().venv
    if not venv:
        return HostCheck(host.name, False, ["no venv set for this host in the inventory"])
    try:
        t = connect(host.spec())
    except HarnessError as e:
        return HostCheck(host.name, False, [f"{e.kind}: {e}"])
    try:
        installed = install(t, host.workdir, host=host.name)
        venv = installed.resolve(venv)
        python = f"{venv}/bin/python"
        probe_command = tool_command(python, installed.tools, "agent", "probe", "--module", modules,
                                     "--port", port, "--dir", installed.workdir)
        res = t.run(f"test -x {shlex.quote(python)} && {probe_command}", timeout=600, check=False)
        if res.exit_code != 0 and not res.stdout.strip():
            return HostCheck(host.name, False, [f"venv {venv}: no runnable {python}"])
        probe = read_answer(Probe, res.stdout)
    except HarnessError as e:
        return HostCheck(host.name, False, [f"{e.kind}: {e}"])
    except AnswerError as e:
        return HostCheck(host.name, False, [f"the agent's probe answered what this harness cannot read: {e}"])
    finally:
        t.close()
    problems = []
    if not probe.module_ok:
        wanted = eng.module if eng else "any engine (" + modules.replace(",", ", ") + ")"
        problems.append(f"venv {venv} cannot import {wanted}: {probe.module_error}")
    if not probe.port_free:
        holders = "; ".join(f"pid {h.pid} {h.command}" for h in probe.port_holders)
        problems.append(f"port {port} in use by {holders}")
    if busy := probe.gpus.processes:
        problems.append("GPUs busy: " + "; ".join(f"pid {p.pid} {p.name}" for p in busy))
    problems += gpu_mismatch(host, probe.gpus)
    if probe.disk_free_gb is not None and probe.disk_free_gb < 10:
        problems.append(f"only {probe.disk_free_gb} GB free in {host.workdir}")
    return HostCheck(host.name, not problems, problems, probe)


def gpu_mismatch(host: Host, found: Gpus) -> list[str]:
    """Where the inventory's `gpus` / `gpu` disagree with what nvidia-smi reports: a sweep planned for
    eight GPUs on a host that shows four, or an H100 declared as an H200 (the roofline would be off)."""
    if host.gpus is None and host.gpu is None:
        return []
    if not found.available:
        return [f"the inventory declares {host.gpus or ''} {host.gpu or 'GPU'}s but nvidia-smi is not on this host"]
    devices = found.devices
    problems = []
    if host.gpus is not None and host.gpus != len(devices):
        problems.append(f"the inventory declares gpus: {host.gpus}, nvidia-smi shows {len(devices)}")
    names = sorted({d.name for d in devices})
    if host.gpu and devices and not all(host.gpu.lower() in n.lower() for n in names):
        problems.append(f"the inventory declares gpu: {host.gpu}, nvidia-smi shows {', '.join(names)}")
    return problems


def check_hosts(inventory: Path, *, limit: str | None, engine: str | None, port: int | None) -> list[HostCheck]:
    return check_these(load_inventory(inventory).select(limit), engine, port)


def check_these(hosts: list[Host], engine: str | Engine | None, port: int | None) -> list[HostCheck]:
    """Every host checked at once, each over its own connection."""
    with ThreadPoolExecutor(max_workers=min(16, len(hosts))) as pool:
        return list(pool.map(lambda h: check_host(h, engine, port), hosts))


def render(results: list[HostCheck]) -> Table:
    """One row per host; its problems are `problem_lines`, printed whole under the table (a keyscan
    command or a fingerprint cut or broken in a cell cannot be copied)."""
    t = PlainTable(title="host check", header_style="bold")
    for col in ("host", "status", "python", "engine", "GPUs", "disk free"):
        t.add_column(col)
    t.add_column("problems", justify="right")
    for r in results:
        devices = r.probe.gpus.devices if r.probe else []
        gpu_text = f"{len(devices)} x {devices[0].name}" if devices else ("none" if r.probe else "-")
        disk = r.probe.disk_free_gb if r.probe else None
        status = Text("ok", style="green") if r.ok else Text("problem", style="red")
        t.add_row(r.host, status, r.probe.python if r.probe else "-", (r.probe.module or "-") if r.probe else "-",
                  gpu_text, f"{disk} GB" if disk is not None else "-", str(len(r.problems)) if r.problems else "-")
    return t


def problem_lines(results: list[HostCheck]) -> list[tuple[str, str]]:
    """(host, problem) for every problem found."""
    return [(r.host, problem) for r in results for problem in r.problems]
