"""Engines: everything the harness knows about SGLang, vLLM, the simulator and any OpenAI-compatible
server lives here, one module per engine (see `base` for what a record holds). Importing this package
registers them all.

    get_engine("vllm")                  the record
    engine_for(playbook)                the record with the playbook's own settings applied
    names(), imitable()                 what a playbook's `engine` and `flavor` may be
    step_span_rules(), naming_for(...)  what a trace reader needs without knowing the engine
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from harness.engines import openai, sglang, sim, vllm  # noqa: F401  (each registers itself)
from harness.engines.base import (
    CaptureSettings,
    Engine,
    NodeInfo,
    StepSpans,
    TraceNaming,
    env_prefixes,
    get_engine,
    imitable,
    names,
    naming_for,
    real_engines,
    register,
    step_span_rules,
)

__all__ = ["CaptureSettings", "Engine", "NodeInfo", "StepSpans", "TraceNaming", "engine_for", "env_prefixes",
           "get_engine", "imitable", "naming_for", "names", "real_engines", "register", "step_span_rules"]


def engine_for(playbook: Any) -> Engine:
    """The engine with the playbook's own settings applied (`server.module`, `server.help_command`)."""
    engine = get_engine(playbook.engine, playbook.flavor)
    server = playbook.server
    module = server.module if server.module is not None else engine.module
    return replace(engine, module=module,
                   help_command=server.help_command if server.help_command is not None else engine.help_command)
