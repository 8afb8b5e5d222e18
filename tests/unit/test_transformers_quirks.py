"""The benchmark client against `transformers serve` (transformers 5.17) and its quirks.

Recorded from a real `transformers serve` (tests/fixtures/streams/transformers_*.txt, a random-weight
Llama built by scripts/make_tiny_llama.py): the final event carries finish_reason and usage together,
with empty text; `stream_options` is ignored; no `data: [DONE]` ends the stream; the response is
chunked and the server closes the connection. Any request field outside the OpenAI schema, such as
`ignore_eos`, is refused with 422. `/health` answers 200 while `/v1/models` answers 500 when the hub
cache directory does not exist.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.error import HTTPError
from urllib.request import urlopen

import pytest

from harness.remote import ZIPAPP, zipapp
from harness.remote.exchange import parse_exchange

STREAMS = Path(__file__).parents[1] / "fixtures" / "streams"
OPENAI_FIELDS = {"model", "prompt", "messages", "max_tokens", "temperature", "top_p", "stream", "stream_options",
                 "stop", "frequency_penalty", "generation_config"}


def events_of(name: str) -> list[bytes]:
    return [e + b"\n\n" for e in (STREAMS / name).read_bytes().split(b"\n\n") if e.strip()]


def chunked(events: list[bytes]) -> bytes:
    """Events as uvicorn frames them; like transformers serve, two queued events can share one chunk."""
    groups = [events[0], b"".join(events[1:3]), *events[3:]]
    return b"".join(b"%x\r\n%s\r\n" % (len(g), g) for g in groups) + b"0\r\n\r\n"


HEAD = (b"HTTP/1.1 200 OK\r\nserver: uvicorn\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
        b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")


@pytest.mark.parametrize("name, chunks, prompt_tokens", [
    ("transformers_completions.txt", 12, 16),
    ("transformers_chat.txt", 12, 19),
])
def test_a_recorded_stream_takes_its_token_counts_from_the_usage_on_the_finish_chunk(name, chunks,
                                                                                     prompt_tokens):
    events = events_of(name)
    last = json.loads(events[-1][len(b"data: "):])
    assert b"[DONE]" not in b"".join(events)
    assert last["choices"][0]["finish_reason"] == "length" and last["usage"]["completion_tokens"] == 12
    assert all(b'"usage"' not in e for e in events[:-1])
    raw = HEAD + chunked(events)
    for reads in ([(1, raw)], [(i, raw[i:i + 1]) for i in range(len(raw))]):
        outcome = parse_exchange(0, len(raw), reads)
        assert (outcome.error, outcome.status) == (None, 200)
        assert (len(outcome.times), outcome.tokens, outcome.prompt_tokens) == (chunks, 12, prompt_tokens)


def test_the_raw_recorded_response_parses_with_its_own_framing():
    raw = (STREAMS / "transformers_completions_http.txt").read_bytes()
    outcome = parse_exchange(0, 1, [(1, raw)])
    assert (outcome.error, len(outcome.times), outcome.tokens, outcome.prompt_tokens) == (None, 12, 12, 16)


class TransformersLike(BaseHTTPRequestHandler):
    """Answers as transformers serve 5.17 does: the routes, the 422 on unknown fields, the stream."""

    protocol_version = "HTTP/1.1"
    tolerated: set = set()          # fields the class lets through besides the OpenAI ones

    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send(200, b'{"status":"ok"}')
        elif self.path == "/v1/models":   # huggingface_hub CacheNotFound, unhandled
            self._send(500, b"Internal Server Error", "text/plain; charset=utf-8")
        else:
            self._send(404, b'{"detail":"Not Found"}')

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        unexpected = set(body) - OPENAI_FIELDS - self.tolerated
        if unexpected:
            return self._send(422, json.dumps({"detail": f"Unexpected fields in the request: {unexpected}"})
                              .encode())
        name = "transformers_chat.txt" if self.path == "/v1/chat/completions" else "transformers_completions.txt"
        self.wfile.write(HEAD + chunked(events_of(name)))
        self.close_connection = True


@pytest.fixture
def serve():
    servers = []

    def start(tolerated: set = frozenset()) -> str:
        handler = type("Handler", (TransformersLike,), {"tolerated": set(tolerated)})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def run_bench(url: str, tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    out, pyz = tmp_path / "bench.json", tmp_path / ZIPAPP
    pyz.write_bytes(zipapp())
    proc = subprocess.run([sys.executable, str(pyz), "bench", "--url", url, "--model", "tiny-llama",
                           "--concurrency", "1,4", "--requests", "4", "--max-tokens", "12", "--timeout", "60",
                           "--out", str(out), *extra], capture_output=True, text=True, timeout=120)
    return proc, json.loads(out.read_text())


def test_the_server_is_healthy_while_its_model_list_fails(serve):
    url = serve()
    assert urlopen(url + "/health").status == 200
    with pytest.raises(HTTPError) as e:
        urlopen(url + "/v1/models")
    assert e.value.code == 500


@pytest.mark.parametrize("api, prompt_tokens", [("completions", 16), ("chat", 19)])
def test_the_benchmark_completes_every_request_with_usage_counts_and_no_done(serve, tmp_path, api,
                                                                              prompt_tokens):
    proc, result = run_bench(serve(tolerated={"ignore_eos"}), tmp_path, "--api", api)
    assert proc.returncode == 0, proc.stderr
    for level in result["levels"]:
        assert (level["requests"], level["completed"], level["failed"]) == (4, 4, 0)
        assert (level["output_tokens"], level["usage_missing"], level["token_count_mismatches"]) == (48, 0, 0)
    assert result["prompt_tokens"] == prompt_tokens


def test_the_client_s_ignore_eos_field_is_refused_with_422_and_reported(serve, tmp_path):
    proc, result = run_bench(serve(), tmp_path)
    assert proc.returncode == 3
    assert all(level["completed"] == 0 for level in result["levels"])
    assert "HTTP 422" in proc.stderr and "ignore_eos" in proc.stderr


def test_without_ignore_eos_the_client_sends_nothing_transformers_refuses(serve, tmp_path):
    proc, result = run_bench(serve(), tmp_path, "--no-ignore-eos")
    assert proc.returncode == 0, proc.stderr
    assert [level["completed"] for level in result["levels"]] == [4, 4]
