"""Requests that fail before they are sent (a connection refused) start nothing: a level's duration, rates,
goodput and decode window come from the requests actually sent, against real sockets."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from harness.remote.bench import run_benchmark
from harness.remote.exchange import Outcome
from harness.remote.levels import decode_window, summarize_level


def answer(tokens: int) -> bytes:
    """A streamed completion of `tokens` tokens with its usage, as a whole HTTP response."""
    usage = {"prompt_tokens": 5, "completion_tokens": tokens, "total_tokens": 5 + tokens}
    events = [{"choices": [{"index": 0, "text": " a", "finish_reason": None}]}] * tokens
    events.append({"choices": [], "usage": usage})
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    return (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


class DyingServer:
    """A completions server that answers `serve` requests one at a time and then stops listening, as
    an engine that went away mid-level: every later connection is refused. It closes its listening
    socket before it sends its last answer, so the client's next connect finds nothing there."""

    def __init__(self, serve: int, tokens: int = 4):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.serve, self.tokens = serve, tokens
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with self.listener:
            for i in range(self.serve):
                conn, _ = self.listener.accept()
                with conn:
                    self._read_request(conn)
                    if i == self.serve - 1:
                        self.listener.close()
                    conn.sendall(answer(self.tokens))

    @staticmethod
    def _read_request(conn: socket.socket) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        while len(body) < length:
            body += conn.recv(65536)



def test_a_level_whose_later_requests_were_refused_lasts_from_its_first_send():
    server = DyingServer(serve=2)
    result = run_benchmark(server.url, "m", concurrency=[1], requests=6, warmup=0, max_tokens=4,
                           slo={"ttft_ms_p99": 600_000})
    server.thread.join(5)
    (level,) = result["levels"]
    reqs = result["requests"]
    assert level["completed"] == 2 and level["failed"] == 4
    refused = [r for r in reqs if r["error"]]
    assert all(r["error"].startswith("cannot connect") and r["start_ns"] == 0 for r in refused)
    sent = [r for r in reqs if r["start_ns"]]
    first_send, last_end = min(r["start_ns"] for r in sent), max(r["end_ns"] for r in reqs)
    assert level["started_ns"] == first_send and level["ended_ns"] == last_end
    assert level["duration_s"] == pytest.approx((last_end - first_send) / 1e9)
    assert 0 < level["duration_s"] < 30      # not the host's uptime (the monotonic clock's zero)
    assert level["output_tok_s"] == pytest.approx(8 / level["duration_s"])
    assert level["requests_per_s"] == pytest.approx(2 / level["duration_s"])
    assert level["goodput_req_s"] == pytest.approx(2 / level["duration_s"])


def test_a_level_that_sent_nothing_has_no_duration_and_no_rates():
    with socket.create_server(("127.0.0.1", 0)) as s:   # a port nobody listens on once closed
        port = s.getsockname()[1]
    result = run_benchmark(f"http://127.0.0.1:{port}", "m", concurrency=[2], requests=4, warmup=0,
                           slo={"ttft_ms_p99": 600_000})
    (level,) = result["levels"]
    assert level["failed"] == 4 and all(r["start_ns"] == 0 for r in result["requests"])
    assert level["started_ns"] is None and level["duration_s"] == 0.0
    assert level["output_tok_s"] is None and level["requests_per_s"] is None and level["goodput_req_s"] is None


def test_the_first_wave_is_of_requests_sent():
    """A request refused before it was sent takes no place in the decode window's first wave."""
    ms = 1_000_000
    refused = Outcome(0, 1 * ms, [], None, None, None, "cannot connect: [Errno 111] Connection refused")
    a = Outcome(10 * ms, 100 * ms, [20 * ms + i * 10 * ms for i in range(9)], 9, 5, 200, None)
    b = Outcome(11 * ms, 100 * ms, [30 * ms + i * 10 * ms for i in range(8)], 8, 5, 200, None)
    window = decode_window([refused, a, b], 2)
    assert window is not None and window["streams"] == 2
    assert window["window_s"] == pytest.approx((min(a.times[-1], b.times[-1]) - 30 * ms) / 1e9)
    level, _ = summarize_level(2, [refused, a, b])
    assert level["decode"] == window and level["started_ns"] == 10 * ms



# ---- no file descriptor left -------------------------------------------------------------------

class Completions(BaseHTTPRequestHandler):
    """Every request answered with four tokens, after a pause that keeps its connection open a while."""

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        time.sleep(0.05)
        self.wfile.write(answer(4))


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256   # every stream's connect at once, none of their SYNs dropped


@pytest.fixture
def completions():
    server = Server(("127.0.0.1", 0), Completions)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def bench_with_files(tmp_path: Path, url: str, soft: int, hard: int, streams: int) -> tuple[int, str, dict | None]:
    """`bench.py` in a process whose file descriptors are limited to `soft` (may go up to `hard`):
    its exit code, its stderr and its bench.json (None: it wrote none)."""
    out = tmp_path / "bench.json"
    code = (f"import resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard}))\n"
            "from harness.remote.bench import main\n"
            f"sys.exit(main(['--url', {url!r}, '--model', 'm', '--concurrency', '{streams}', '--requests', "
            f"'{2 * streams}', '--warmup', '0', '--max-tokens', '4', '--out', {str(out)!r}]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    return done.returncode, done.stderr, json.loads(out.read_text()) if out.exists() else None


def test_a_request_that_finds_no_file_descriptor_fails_alone_and_the_level_is_kept(tmp_path, completions):
    """Out of file descriptors (EMFILE), and no higher limit to take: the requests without a socket
    fail as refused connections do, the others complete, and bench.json is written."""
    code, err, result = bench_with_files(tmp_path, completions, 40, 40, streams=64)
    assert "Traceback" not in err and result is not None, err
    assert code == 4          # failed requests, not a crash
    (level,) = result["levels"]
    assert level["completed"] > 0 and level["failed"] > 0 and level["requests"] == 128
    assert any("Too many open files" in e["error"] for e in level["errors"])
    assert level["duration_s"] < 60


def test_the_benchmark_takes_the_hard_limit_of_file_descriptors(tmp_path, completions):
    """A soft limit below the streams' needs is raised to the hard limit at the start."""
    code, err, result = bench_with_files(tmp_path, completions, 40, 512, streams=64)
    assert code == 0, err
    assert result is not None and result["levels"][0]["completed"] == 128
