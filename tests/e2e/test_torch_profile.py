"""profile.mode torch: any Python server, run under torchprof.py, profiled for a window the harness
opens, drives with N decode steps, and closes. The server here is a small OpenAI-style stand-in whose
every token does real torch work on the CPU; the wrapper and the window protocol are the real ones."""

from __future__ import annotations

import json

import pytest

from tests.conftest import harness
from tests.e2e.test_sweep import manifests, playbook, sweep_dir

torch = pytest.importorskip("torch", reason="profile.mode torch needs torch in the host's venv (make test installs it)")

SERVER = '''
import json, sys, torch
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

w = torch.randn(256, 256)

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers(); self.wfile.write(b"ok")
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = int(body.get("max_tokens", 8))
        x = torch.randn(1, 256)
        for _ in range(n):          # one "decode step" per token
            x = torch.tanh(x @ w)
        if body.get("stream"):
            self.send_response(200); self.send_header("Content-Type", "text/event-stream"); self.end_headers()
            for i in range(n):
                chunk = {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
                self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\\n\\n")
            usage = {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": n, "total_tokens": n + 2}}
            self.wfile.write(b"data: " + json.dumps(usage).encode() + b"\\n\\ndata: [DONE]\\n\\n")
        else:
            out = json.dumps({"choices": [{"text": "x" * n}], "usage": {"completion_tokens": n}}).encode()
            self.send_response(200); self.send_header("Content-Length", str(len(out))); self.end_headers()
            self.wfile.write(out)

ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
'''

TEMPLATE = '''{% include "_common.sh.j2" %}
{% set command = "-m tinyserve " ~ server.port %}
{% if profile.mode == "torch" %}
exec python {{ tools.torchprof | shquote }} --dir {{ run.profile_dir | shquote }} -- {{ command }}
{% else %}
exec python {{ command }}
{% endif %}
'''


def test_a_torch_window_around_any_server_brings_back_its_trace_and_torchs_own_table(tmp_path, ssh_inventory):
    import sys

    from tests.remote_venv import make_remote_venv
    venv = make_remote_venv(tmp_path / "venv")
    site = next((venv / "lib").glob("python3*/site-packages"))
    # the host's venv sees torch (from the test environment) and the stand-in server module
    torch_site = next(p for p in sys.path if (__import__("pathlib").Path(p) / "torch").is_dir())
    (site / "torch-from-tests.pth").write_text(torch_site + "\n")
    (site / "tinyserve.py").write_text(SERVER)
    templates = tmp_path / "templates"
    templates.mkdir()
    from tests.remote_venv import REPO
    (templates / "_common.sh.j2").write_text((REPO / "templates" / "_common.sh.j2").read_text())
    (templates / "tiny.sh.j2").write_text(TEMPLATE)
    pb = playbook(tmp_path, engine="openai", configs=[{"name": "tiny"}], profile="torch",
                  template=str(templates / "tiny.sh.j2"))
    run = harness("sweep", pb, "-i", ssh_inventory(venv=str(venv)), "-o", tmp_path / "r")
    assert run.returncode == 0, run.stdout + run.stderr
    m = manifests(tmp_path / "r")["tiny-1"]
    assert m["profile"]["status"] == "ok", m["profile"]
    d = sweep_dir(tmp_path / "r") / "runs" / "tiny-1" / "profile"
    (trace,) = d.glob("torch-*.pt.trace.json.gz")
    table = json.loads(next(d.glob("torch-*.key_averages.json")).read_text())
    assert any(row["name"] == "aten::tanh" for row in table["key_averages"])
    analyzed = harness("analyze", trace, "--format", "json")
    assert analyzed.returncode == 0 and json.loads(analyzed.stdout)["schema"] == "harness.analysis/1"
