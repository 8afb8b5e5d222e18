"""What the host's agent answers (`harness/remote/agent.py`: one JSON object a command, its last line
of output), as pydantic models: the probe, the health wait, the profile and another node's traces, the stop.

A host is not trusted: its answer is checked here, on arrival, and one of another shape is an
`AnswerError` naming the field (`gpus.devices.0.memory_used_mib: Input should be a valid number`)
rather than a lookup that fails later as the harness's own bug. Fields this version does not name
are dropped; the manifest records the probe, the profile and the stop as read here (`record`).
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class Answer(BaseModel):
    # strict: the agent writes JSON's own types; "no" for a boolean or "3" for a count is not its answer
    model_config = ConfigDict(extra="ignore", strict=True)

    def record(self) -> dict[str, Any]:
        """As the manifest keeps it: the fields the agent sent, not the defaults filled in here."""
        return self.model_dump(mode="json", exclude_unset=True)


class PortHolder(Answer):
    pid: int | None                 # None: the socket's process is not visible to the SSH user
    command: str = ""


class GpuDevice(Answer):
    index: int
    name: str = ""
    memory_used_mib: float | None           # None: nvidia-smi could not read it ([N/A], ERR!)
    memory_total_mib: float | None = None


class GpuProcess(Answer):
    pid: str | int                  # nvidia-smi's words, as it prints them
    name: str = ""
    memory_mib: str | float = ""


class Gpus(Answer):
    available: bool = False         # nvidia-smi is on the host
    devices: list[GpuDevice] = Field(default_factory=list)
    processes: list[GpuProcess] = Field(default_factory=list)
    error: str | None = None


class Probe(Answer):
    """`agent probe`: can this host run a server of the engine, on this port, now?"""
    python: str = ""
    executable: str = ""
    module_ok: bool
    module: str | None = None       # the module that imported (of alternatives: the first)
    module_error: str | None = None
    port_free: bool
    port_holders: list[PortHolder] = Field(default_factory=list)
    disk_free_gb: float | None = None
    gpus: Gpus = Field(default_factory=Gpus)


class Wait(Answer):
    """`agent wait`: the server's health, or how it ended."""
    status: Literal["healthy", "died", "timeout"]
    seconds: float
    exit_code: int | None = None
    last_answer: str = ""
    log_tail: str = ""
    error_line: str = ""


class Stop(Answer):
    """`agent stop`: the server's process group stopped, its port closed, its GPUs' memory back."""
    pid: int | None = None
    was_running: bool = False
    signal: str | None = None
    group_alive: bool = False
    port_closed: bool = True
    port_holders: list[PortHolder] = Field(default_factory=list)
    gpu_released: bool | None = None
    gpu_memory_used_mib: list[float | None] = Field(default_factory=list)
    gpu_memory_before_mib: list[float | None] = Field(default_factory=list)
    escaped: int = 0         # processes that had left the server's session (setsid), found by its marker
    escaped_alive: int = 0   # of those, still running after the stop


class TraceFile(Answer):
    name: str
    bytes: int = 0
    rank: bool = False              # one rank's trace (not the engine's other output)


class Traces(Answer):
    """`agent traces`: another node's own ranks' traces, once they stopped growing."""
    dir: str = ""
    files: list[TraceFile] = Field(default_factory=list)
    ranks_found: int = 0
    missing_ranks: int = 0
    bytes: int = 0
    seconds: float | None = None


class Profiled(Traces):
    """`agent profile`: the capture through the engine's profiler (or the torch window), and its traces."""
    status: Literal["ok", "partial", "failed", "pending"]
    expected_ranks: int | None = None
    error: str | None = None
    hint: str | None = None
    note: str | None = None
    answers: list[dict[str, Any]] = Field(default_factory=list)   # each call to the engine and its answer


A = TypeVar("A", bound=Answer)


class AnswerError(ValueError):
    """No answer of the expected shape in what the agent printed."""


def read_answer(model: type[A], output: str) -> A:
    """The last line of `output` that is a JSON object, as `model`; AnswerError when no line is one,
    or when it is not of that shape (the first wrong field named)."""
    for line in reversed(output.strip().splitlines()):
        try:
            data = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(data, dict):
            continue
        try:
            return model.model_validate(data)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(map(str, first["loc"])) or "the answer"
            raise AnswerError(f"{where}: {first['msg']} ({e.error_count()} "
                              f"problem{'s' * (e.error_count() > 1)})") from None
    raise AnswerError("no answer")
