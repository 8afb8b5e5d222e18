"""Any OpenAI-compatible server, launched by the playbook's own template (e.g. `transformers serve`,
templates/transformers.sh.j2): health on `server.health_path`, the benchmark over the OpenAI API,
profiles by the harness's torch.profiler wrapper (`profile.mode torch`), no flag check."""

from __future__ import annotations

from harness.engines.base import Engine, register

ENGINE = register(Engine(name="openai", launcher="", module="", default_port=8000, template=""))
