"""The simulated engine (`python -m harness.sim ENGINE`): the launch flags, HTTP protocol, profiler,
trace names and step spans of the engine it imitates (the playbook's `flavor`), so everything but the
launcher and the flag listing is that engine's own record."""

from __future__ import annotations

from dataclasses import replace
from functools import cache

from harness.engines.base import Engine, get_engine, register

DEFAULT = "sglang"   # the engine of the campaign the demo retells (GLM-5 on SGLang)


@cache
def imitating(flavor: str | None) -> Engine:
    flavor = flavor or DEFAULT
    real = get_engine(flavor)
    return replace(real, name="sim", protocol=real.name, launcher=f"python -m harness.sim {flavor}",
                   module="harness.sim", template="sim.sh.j2",
                   help_command=f"python -m harness.sim {flavor} --help",
                   distribution="harness")


register(imitating, name="sim")
