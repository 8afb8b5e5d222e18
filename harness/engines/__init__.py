"""Engine adapters: what differs between SGLang, vLLM and the simulator, and nothing else.

An adapter knows its launcher, default port, health path, how to list its flags (for the preflight
flag check), how many trace files a configuration writes, and which profiler protocol it speaks. The
protocol itself runs on the host (`harness/remote/agent.py`), so adapters never touch SSH.
Register new engines with `@register`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from harness.errors import InputError

_ENGINES: dict[str, "Engine"] = {}


@dataclass(frozen=True)
class Engine:
    name: str
    launcher: str            # the command the template runs, inside the venv
    module: str              # must import in the venv (preflight; "" : nothing to check)
    default_port: int
    protocol: str            # health and profiler protocol: "sglang", "vllm" or "openai" (no profiler)
    help_command: str        # prints every accepted flag ("" : no flag check)
    version_command: str
    health_path: str = "/health"

    def ranks(self, args: dict) -> int:
        """How many trace files one profile writes (one per GPU worker)."""
        def num(*names: str) -> int:
            for n in names:
                v = args.get(n, args.get("--" + n))
                if v not in (None, False):
                    return int(v)
            return 1
        if self.protocol == "vllm":
            return num("tensor-parallel-size", "-tp") * num("pipeline-parallel-size", "-pp") * \
                num("data-parallel-size", "-dp")
        return num("tp-size", "tensor-parallel-size", "tp") * num("pp-size", "pipeline-parallel-size")

    def unknown_flags(self, help_text: str, flags: list[str]) -> list[str]:
        """Flags the installed engine's --help does not list (`--a.b` is checked as `--a`)."""
        known = set(re.findall(r"(?<![\w-])(--?[A-Za-z0-9][\w.-]*)", help_text))
        return [f for f in flags if f not in known and f.split(".")[0] not in known
                and f.split("=")[0] not in known]


def register(engine: Engine) -> Engine:
    _ENGINES[engine.name] = engine
    return engine


def get_engine(name: str, flavor: str = "sglang") -> Engine:
    """The adapter for a playbook's `engine` (for `sim`, the imitated engine's protocol)."""
    if name == "sim":
        real = _ENGINES[flavor]
        return replace(real, name="sim", launcher=f"python -m harness.sim {flavor}", module="harness.sim",
                       help_command=f"python -m harness.sim {flavor} --help",
                       version_command="python -c 'import harness; print(harness.__version__)'")
    if name not in _ENGINES:
        raise InputError(f"unknown engine {name!r} (known: {', '.join([*_ENGINES, 'sim'])})", key="engine")
    return _ENGINES[name]


def engine_for(playbook) -> Engine:
    """The adapter with the playbook's own settings applied (`server.module`, `server.help_command`)."""
    engine = get_engine(playbook.engine, playbook.flavor)
    server = playbook.server
    module = server.module if server.module is not None else engine.module
    return replace(engine, module=module,
                   help_command=server.help_command if server.help_command is not None else engine.help_command,
                   version_command=(f"python -c 'import {module}; print({module}.__version__)'"
                                    if module and engine.name == "openai" else engine.version_command))


register(Engine(
    name="sglang", launcher="python -m sglang.launch_server", module="sglang", default_port=30000,
    protocol="sglang", help_command="python -m sglang.launch_server --help",
    version_command="python -c 'import sglang; print(sglang.__version__)'"))

register(Engine(
    name="vllm", launcher="vllm serve", module="vllm", default_port=8000, protocol="vllm",
    # plain --help lists only the argument groups since vLLM 0.11; --help=all lists every flag
    help_command="vllm serve --help=all",
    version_command="python -c 'import vllm; print(vllm.__version__)'"))

# Any OpenAI-compatible server, launched by the playbook's own template (e.g. `transformers serve`):
# health on server.health_path, the benchmark over the OpenAI API, profiles by the torch wrapper.
register(Engine(
    name="openai", launcher="", module="", default_port=8000, protocol="openai", help_command="",
    version_command="true"))
