"""The agent's own HTTP requests (health, the profiler's calls, the traffic beside a capture), against
real servers on loopback: a well-behaved one (the standard library's), and raw sockets that answer
the way engines and broken proxies do."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from harness.remote import agent


class _Handler(BaseHTTPRequestHandler):
    seen: list[dict] = []

    def log_message(self, *args) -> None:
        pass

    def _reply(self, code: int, body: bytes, chunked: bool = False) -> None:
        self.send_response(code)
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(0, len(body), 1000):
                part = body[i:i + 1000]
                self.wfile.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
        else:
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    def do_GET(self) -> None:
        self.seen.append({"method": "GET", "path": self.path, "auth": self.headers.get("Authorization")})
        if self.path == "/health":
            self._reply(200, b"")
        elif self.path == "/chunked":
            self._reply(200, b"x" * 2500 + b"end", chunked=True)
        elif self.path == "/big":
            self._reply(200, b"y" * 100_000)
        else:
            self._reply(503, b"loading the weights")

    def do_POST(self) -> None:
        data = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.seen.append({"method": "POST", "path": self.path, "type": self.headers.get("Content-Type"),
                          "body": json.loads(data) if data else None})
        if self.path == "/start_profile":
            self._reply(500, b'{"detail": "profiler is already running"}')
        else:
            self._reply(200, b'{"ok": true}')


@pytest.fixture
def server():
    _Handler.seen = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_status_and_body_of_plain_and_chunked_answers(server):
    assert agent.http("GET", server + "/health") == (200, "")
    assert agent.http("GET", server + "/other") == (503, "loading the weights")
    status, text = agent.http("GET", server + "/chunked")
    assert status == 200 and text == "x" * 2500 + "end"


def test_a_large_body_is_cut_to_what_the_agent_keeps(server):
    status, text = agent.http("GET", server + "/big")
    assert status == 200 and text == "y" * agent.HTTP_BODY_MOST


def test_a_post_sends_its_json_and_the_api_key(server, monkeypatch):
    monkeypatch.setattr(agent, "HEADERS", {"Authorization": "Bearer sk-test"})
    assert agent.http("POST", server + "/start_profile", {"num_steps": 3}) == (
        500, '{"detail": "profiler is already running"}')
    assert agent.http("GET", server + "/health")[0] == 200
    assert _Handler.seen[0] == {"method": "POST", "path": "/start_profile", "type": "application/json",
                                "body": {"num_steps": 3}}
    assert _Handler.seen[1]["auth"] == "Bearer sk-test"


@contextlib.contextmanager
def _raw_server(answer: bytes | None, *, close: bool = True) -> Iterator[str]:
    """The URL of a listening socket that answers each connection with `answer` (None: says nothing),
    after reading the request; it closes the connection after when `close`, else when the test ends."""
    lsock = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = lsock.accept()
            except OSError:
                return
            try:
                conn.recv(65536)
                if answer is not None:
                    conn.sendall(answer)
            except OSError:   # the agent stopped reading and went: its side of the test is over
                pass
            if close:
                conn.close()
            else:
                held.append(conn)

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{lsock.getsockname()[1]}"
    finally:
        lsock.close()
        for conn in held:
            conn.close()


def test_a_refused_connection_is_status_0_with_the_reason():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]   # bound, never listening: refused
        status, reason = agent.http("GET", f"http://127.0.0.1:{port}/health", timeout=2)
    assert status == 0 and "refused" in reason.lower()


@pytest.mark.parametrize("answer, expected", [
    (b"SSH-2.0-OpenSSH_9.2\r\n", "not an HTTP answer: 'SSH-2.0-OpenSSH_9.2'"),
    (b"", "no answer"),
    (b"HTTP/1.1 200\r\n", "not an HTTP answer: 'HTTP/1.1 200'"),   # the head never ends
])
def test_what_is_not_an_http_answer_is_status_0_named(answer, expected):
    with _raw_server(answer) as url:
        assert agent.http("GET", url + "/health", timeout=5) == (0, expected)


def test_an_answer_whose_body_never_ends_is_taken_as_it_stands_at_the_timeout():
    # the head promises 100 bytes, 5 come, and the connection stays open
    with _raw_server(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 100\r\n\r\nstart", close=False) as url:
        assert agent.http("GET", url + "/health", timeout=0.5) == (503, "start")


def test_a_server_that_never_answers_times_out_as_status_0():
    with _raw_server(None, close=False) as url:
        status, reason = agent.http("GET", url + "/health", timeout=0.3)
    assert status == 0 and "timed out" in reason


def test_a_head_without_end_is_bounded():
    with _raw_server(b"HTTP/1.1 200 OK\r\nX-Junk: " + b"z" * 200_000, close=False) as url:
        status, reason = agent.http("GET", url + "/health", timeout=5)
    assert status == 0 and reason.startswith("not an HTTP answer: 'HTTP/1.1 200 OK'")
