"""The benchmark client end to end: the zipapp's `bench` as a real process against a real streaming HTTP
server."""

from __future__ import annotations

import contextlib
import json
import socket
import socketserver
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from harness.remote import ZIPAPP, zipapp
from harness.remote.bench import run_benchmark, write_results


class StreamServer(socketserver.ThreadingTCPServer):
    """An OpenAI-compatible streaming server on 127.0.0.1 that plays one scripted behaviour per request,
    in arrival order (then `tokens4` for every request after the script)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, script: list[str]):
        super().__init__(("127.0.0.1", 0), Handler)
        self.script, self.bodies, self.headers = list(script), [], []
        self.lock, self.release = threading.Lock(), threading.Event()
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    def next(self, body: dict) -> str:
        with self.lock:
            self.bodies.append(body)
            return self.script.pop(0) if self.script else "tokens4"


class Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        stream = self.request.makefile("rb")
        request_line = stream.readline().decode()
        headers = {}
        for line in iter(stream.readline, b"\r\n"):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        self.path = request_line.split()[1]
        self.server.headers.append(headers)
        body = json.loads(stream.read(int(headers["content-length"])))
        getattr(self, self.server.next(body))()

    def event(self, text: str | None = None, finish: str | None = None, usage: dict | None = None,
              error: dict | None = None) -> bytes:
        if error:
            return b"data: " + json.dumps(error).encode() + b"\n\n"
        if text is None:
            choices = []
        elif self.path.endswith("/chat/completions"):
            choices = [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]
        else:
            choices = [{"index": 0, "text": text, "finish_reason": finish}]
        chunk = {"object": "chunk", "choices": choices, "usage": usage}
        return b"data: " + json.dumps(chunk).encode() + b"\n\n"

    def head(self, extra: str) -> None:
        self.request.sendall(f"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n{extra}\r\n".encode())

    def chunk(self, data: bytes) -> None:
        self.request.sendall(b"%x\r\n%s\r\n" % (len(data), data))

    def chunked_stream(self, texts: list[str], finish: str, tokens: int) -> None:
        """A text event each, a last event with `finish`, usage of `tokens` in its own, [DONE]; chunked."""
        self.head("Transfer-Encoding: chunked\r\n")
        for text in texts:
            self.chunk(self.event(text))
        self.chunk(self.event("", finish=finish))
        self.chunk(self.event(usage={"prompt_tokens": 5, "completion_tokens": tokens, "total_tokens": 5 + tokens}))
        self.chunk(b"data: [DONE]\n\n")
        self.request.sendall(b"0\r\n\r\n")

    def tokens4(self) -> None:
        """12 tokens, 4 to a chunk, usage in its own chunk, chunked encoding."""
        self.chunked_stream([f" w{i} x{i} y{i} z{i}" for i in range(3)], "length", 12)

    def keepalive(self) -> None:
        """A complete chunked response on a connection the server then keeps open."""
        self.tokens4()
        self.server.release.wait()

    def midstream_error(self) -> None:
        self.head("Connection: close\r\n")
        self.request.sendall(self.event(" The") + self.event(error={
            "object": "error", "message": "The server is overloaded", "type": "ServiceUnavailableError",
            "code": 503}) + b"data: [DONE]\n\n")

    def reset(self) -> None:
        self.head("Transfer-Encoding: chunked\r\n")
        self.chunk(self.event(" The"))
        self.request.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.request.close()  # linger 0: the peer gets a RST

    def status500(self) -> None:
        body = b'{"object":"error","message":"Internal error: out of KV cache","code":500}'
        self.request.sendall(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))

    def no_done(self) -> None:
        """Usage on the last content chunk, no [DONE], the end marked by closing the connection."""
        self.head("Connection: close\r\n")
        self.request.sendall(self.event(" a b c d e f") + self.event(" g h i j k l", finish="length", usage={
            "prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}))

    def aborted(self) -> None:
        """vLLM's engine-initiated abort (a shutdown, a pause): three tokens, then a last event with
        finish_reason "abort", usage and [DONE], all on an ordinary 200 stream."""
        self.chunked_stream([f" w{i}" for i in range(3)], "abort", 3)

    def short(self) -> None:
        """An answer that stops by itself after 4 tokens (finish_reason stop) though asked to ignore EOS."""
        self.head("Transfer-Encoding: chunked\r\n")
        self.chunk(self.event(" w x y z", finish="stop"))
        self.chunk(self.event(usage={"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}))
        self.chunk(b"data: [DONE]\n\n")
        self.request.sendall(b"0\r\n\r\n")

    def head_then_hang(self) -> None:
        self.head("Transfer-Encoding: chunked\r\n")
        self.server.release.wait()

    def hang(self) -> None:
        self.server.release.wait()

    def endless(self) -> None:
        """A chunked answer that never ends, as fast as the client takes it."""
        self.head("Transfer-Encoding: chunked\r\n")
        piece = b"%x\r\n%s\r\n" % (1 << 16, b"x" * (1 << 16))
        with contextlib.suppress(OSError):
            while not self.server.release.is_set():
                self.request.sendall(piece)

    def headless(self) -> None:
        """Header lines that never end in the blank line."""
        self.request.sendall(b"HTTP/1.1 200 OK\r\n")
        with contextlib.suppress(OSError):
            while not self.server.release.is_set():
                self.request.sendall(b"X-Padding: " + b"y" * 1000 + b"\r\n")


@pytest.fixture
def serve():
    servers = []

    def start(*script: str) -> StreamServer:
        server = StreamServer(list(script))
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.release.set()
        server.shutdown()
        server.server_close()


def bench(tmp_path: Path, url: str, *args: str) -> tuple[subprocess.CompletedProcess, dict, list[dict]]:
    out = tmp_path / "out" / "bench.json"
    pyz = tmp_path / ZIPAPP
    pyz.write_bytes(zipapp())
    proc = subprocess.run([sys.executable, str(pyz), "bench", "--url", url, "--model", "glm-5", "--out", str(out),
                           "--max-tokens", "12", *args], capture_output=True, text=True, timeout=60)
    if not out.exists():
        return proc, {}, []
    lines = (out.parent / "requests.jsonl").read_text().splitlines()
    return proc, json.loads(out.read_text()), [json.loads(line) for line in lines]


def test_every_kind_of_response_is_counted_and_described_and_failed_requests_fail_the_run(serve, tmp_path):
    server = serve("tokens4", "midstream_error", "reset", "keepalive", "status500", "no_done")
    proc, result, requests = bench(tmp_path, server.url, "--concurrency", "1", "--requests", "6",
                                   "--warmup", "0", "--timeout", "30")
    assert proc.returncode == 4, proc.stderr
    assert "concurrency 1: 3 of 6 requests failed (1 x " in proc.stderr
    assert [r["index"] for r in requests] == list(range(6))
    four, error, reset, keepalive, status500, no_done = requests

    assert (four["error"], four["output_tokens"], four["chunks"], len(four["itl_ms"])) == (None, 12, 3, 2)
    assert four["tpot_ms"] == pytest.approx((four["e2e_ms"] - four["ttft_ms"]) / 11)
    assert error["error"] == "The server is overloaded"
    assert "reset" in reset["error"].lower()
    assert (keepalive["error"], keepalive["output_tokens"]) == (None, 12)
    assert status500["error"].startswith("HTTP 500: ") and "out of KV cache" in status500["error"]
    assert (no_done["error"], no_done["output_tokens"], no_done["chunks"]) == (None, 12, 2)

    level, = result["levels"]
    assert (level["requests"], level["completed"], level["failed"]) == (6, 3, 3)
    assert level["output_tokens"] == 36
    assert level["token_count_mismatches"] == 3
    assert sorted(e["count"] for e in level["errors"]) == [1, 1, 1]
    assert (result["schema"], result["model"], result["prompt_tokens"]) == ("harness.bench/1", "glm-5", 5)
    assert level["client_cpu_s"] > 0 and level["client_cpu_us_per_chunk"] > 0
    assert "1 failed: The server is overloaded" in proc.stderr


def test_a_share_of_failed_requests_the_playbook_allows_still_passes(serve, tmp_path):
    server = serve("tokens4", "midstream_error", "keepalive", "no_done")
    proc, result, _ = bench(tmp_path, server.url, "--requests", "4", "--warmup", "0", "--max-failed-share", "0.25")
    assert proc.returncode == 0, proc.stderr
    assert (result["levels"][0]["completed"], result["levels"][0]["failed"]) == (3, 1)


def test_requests_are_greedy_streams_that_ask_for_usage_and_ignore_eos(serve, tmp_path):
    server = serve()
    proc, _, _ = bench(tmp_path, server.url, "--requests", "1", "--warmup", "0", "--prompt-tokens", "7")
    assert proc.returncode == 0, proc.stderr
    body, = server.bodies
    assert body["stream"] is True and body["temperature"] == 0 and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert (body["model"], body["max_tokens"], len(body["prompt"].split())) == ("glm-5", 12, 7)


def test_a_request_that_hangs_times_out_and_a_run_where_nothing_completed_exits_3(serve, tmp_path):
    server = serve("hang")
    proc, result, requests = bench(tmp_path, server.url, "--requests", "1", "--warmup", "0",
                                   "--timeout", "0.2")
    assert proc.returncode == 3
    assert "no request completed" in proc.stderr and "timeout" in proc.stderr
    assert [r["error"] for r in requests] == ["timeout"]
    assert result["levels"][0]["failed"] == 1


def test_a_server_that_is_not_there_is_a_failed_run_not_a_crash(tmp_path):
    with socket.socket() as held:  # bound, never listening: connections are refused
        held.bind(("127.0.0.1", 0))
        proc, _, requests = bench(tmp_path, f"http://127.0.0.1:{held.getsockname()[1]}",
                                  "--requests", "2", "--warmup", "0")
    assert proc.returncode == 3
    assert all(r["error"].startswith("cannot connect") for r in requests)


def test_a_level_bound_by_time_pauses_while_the_server_refuses_rather_than_spinning(tmp_path):
    """Before, 2 s against a closed port recorded about 80,000 refused requests (and kept each for
    requests.jsonl); now each round of refusals waits longer, from 10 ms to 1 s."""
    with socket.socket() as held:  # bound, never listening: connections are refused
        held.bind(("127.0.0.1", 0))
        proc, result, requests = bench(tmp_path, f"http://127.0.0.1:{held.getsockname()[1]}",
                                       "--concurrency", "4", "--duration", "2", "--warmup", "0")
    assert proc.returncode == 3
    assert 4 <= len(requests) <= 64, len(requests)   # 4 a round, and at most 9 pauses fit in 2 s
    assert all(r["error"].startswith("cannot connect") for r in requests)


def test_a_server_that_comes_back_within_a_level_bound_by_time_is_used_again(tmp_path):
    """The server listens only 0.3 s into a 5 s level: the pauses (1 s at most) keep trying it."""
    server = StreamServer([])
    port = server.server_address[1]
    server.socket.close()   # refused until it listens again, on the same port
    later = socket.socket()
    later.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    later.bind(("127.0.0.1", port))
    server.socket = later

    def listen_later() -> None:
        time.sleep(0.3)
        later.listen(16)
        server.serve_forever(0.05)

    threading.Thread(target=listen_later, daemon=True).start()
    try:
        result = run_benchmark(server.url, "glm-5", concurrency=[2], duration=5, warmup=0, max_tokens=12)
    finally:
        server.release.set()
        server.shutdown()
        server.server_close()
    level, = result["levels"]
    assert level["completed"] >= 1 and level["failed"] >= 2
    assert {e["error"].split(":")[0] for e in level["errors"]} == {"cannot connect"}


@pytest.mark.parametrize("behaviour, error", [("endless", "response larger than 64 MB"),
                                              ("headless", "response head longer than 64 kB")])
def test_an_answer_that_never_ends_fails_its_request_at_a_bound(serve, tmp_path, behaviour, error):
    server = serve(behaviour)
    proc, _, requests = bench(tmp_path, server.url, "--requests", "1", "--warmup", "0", "--timeout", "50")
    assert proc.returncode == 3, proc.stderr
    assert [r["error"] for r in requests] == [error]


def test_chunked_bodies_come_apart_whatever_the_reads_split(tmp_path):
    from harness.remote.exchange import _dechunk
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (b"ab", b"c" * 300, b"\r\n0\r\n", b"d")) + b"0\r\n\r\n"
    for size in (1, 2, 3, 7, 64, len(body)):
        reads = [(i, body[o:o + size]) for i, o in enumerate(range(0, len(body), size))]
        assert b"".join(d for _, d in _dechunk(reads)) == b"ab" + b"c" * 300 + b"\r\n0\r\nd", size
    with pytest.raises(ValueError, match="bad chunk size"):
        list(_dechunk([(0, b"f" * 5000)]))   # a size line that never ends


def test_bad_arguments_exit_2_with_a_message(tmp_path):
    assert bench(tmp_path, "ftp://x", "--requests", "1")[0].returncode == 2
    assert bench(tmp_path, "http://127.0.0.1:1", "--concurrency", "0")[0].returncode == 2
    proc = bench(tmp_path, "127.0.0.1:30000")[0]
    assert proc.returncode == 2 and "url must look like http://HOST:PORT" in proc.stderr


@pytest.mark.parametrize("tool", ["bench", "agent"])
def test_an_api_key_variable_that_is_not_set_is_an_error_naming_it(tool, tmp_path, monkeypatch):
    """The benchmark and the health wait send the server's API key from a variable the harness names;
    one that is not set on the host stops the tool before any request, naming the variable. (The
    telemetry sampler notes it in its file and samples on without a key: test_telemetry_engines.)"""
    monkeypatch.delenv("HARNESS_TEST_UNSET_KEY", raising=False)
    args = {"bench": ["--url", "http://127.0.0.1:1", "--model", "m", "--out", str(tmp_path / "b.json")],
            "agent": ["wait", "--url", "http://127.0.0.1:1", "--pid-file", str(tmp_path / "pid"),
                      "--timeout", "1"]}[tool]
    proc = subprocess.run([sys.executable, "-m", "harness.remote", tool, *args,
                           "--api-key-env", "HARNESS_TEST_UNSET_KEY"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "--api-key-env: HARNESS_TEST_UNSET_KEY is not set in the environment" in proc.stderr


def test_an_api_key_goes_in_the_authorization_header_and_nowhere_else(monkeypatch):
    from harness.remote.exchange import auth_headers
    monkeypatch.setenv("HARNESS_TEST_KEY", "s3cret")
    assert auth_headers("HARNESS_TEST_KEY") == {"Authorization": "Bearer s3cret"}
    assert auth_headers(None) == auth_headers("") == {}


def test_worker_processes_share_a_level_and_their_requests_are_merged(serve, tmp_path):
    server = serve()
    proc, result, requests = bench(tmp_path, server.url, "--concurrency", "1,4", "--requests", "8",
                                   "--warmup", "2", "--workers", "2")
    assert proc.returncode == 0, proc.stderr
    assert [(lv["concurrency"], lv["completed"], lv["output_tokens"]) for lv in result["levels"]] == \
        [(1, 8, 96), (4, 8, 96)]
    assert [r["index"] for r in requests if r["concurrency"] == 4] == list(range(8))
    assert len(server.bodies) == 2 * (8 + 2)


def test_the_chat_api_in_process(serve, tmp_path):
    server = serve("tokens4", "tokens4")
    result = run_benchmark(server.url + "/v1", "glm-5", requests=2, warmup=0, api="chat",
                           prompt="Hello there", max_tokens=12)
    write_results(result, tmp_path / "bench.json")
    assert server.bodies[0]["messages"] == [{"role": "user", "content": "Hello there"}]
    assert result["levels"][0]["completed"] == 2
    assert "requests" not in json.loads((tmp_path / "bench.json").read_text())
    assert len((tmp_path / "requests.jsonl").read_text().splitlines()) == 2


def test_a_level_bound_by_duration_sends_whole_requests_up_to_the_requests_cap(serve):
    server = serve()
    result = run_benchmark(server.url, "glm-5", concurrency=[2], requests=3, duration=0.05, warmup=0, max_tokens=12)
    level, = result["levels"]
    assert 1 <= level["requests"] <= 3
    assert level["failed"] == 0


def test_headers_and_an_api_key_go_with_every_request_and_bad_ones_are_refused(serve):
    from harness.remote.bench import run_benchmark
    server = serve()
    run_benchmark(server.url, "glm-5", requests=2, warmup=0, max_tokens=4,
                  headers={"Authorization": "Bearer sk-1", "X-Team": "perf"})
    assert [(h["authorization"], h["x-team"]) for h in server.headers] == [("Bearer sk-1", "perf")] * 2
    with pytest.raises(ValueError, match="one line"):
        run_benchmark(server.url, "glm-5", requests=1, headers={"X-Evil": "a\r\nHost: elsewhere"})


def test_a_stream_the_server_aborted_or_cut_short_is_a_failed_request_and_the_level_misses_its_slo(serve, tmp_path):
    """vLLM ends a request its engine aborted with HTTP 200, finish_reason "abort", usage and [DONE];
    a server may also stop an answer that was to ignore EOS before its max_tokens. Both were counted
    completed, so a level that lost them met its SLO and the run was ok."""
    server = serve("tokens4", "aborted", "short")
    proc, result, requests = bench(tmp_path, server.url, "--requests", "3", "--warmup", "0",
                                   "--plan", '{"slo": {"ttft_ms_p99": 60000}}')
    assert proc.returncode == 4, proc.stderr
    assert [r["error"] for r in requests] == [
        None, "server aborted the request (finish_reason abort) after 3 tokens",
        "short answer: 4 of the 12 tokens asked with ignore_eos"]
    level, = result["levels"]
    assert (level["completed"], level["failed"], level["output_tokens"]) == (1, 2, 12)
    assert (level["slo_met"], level["slo_met_requests"]) == (False, 1)
    assert "1 x server aborted the request" in proc.stderr and "1 x short answer: 4 of the 12" in proc.stderr


def test_an_answer_that_may_end_by_itself_is_held_to_no_length(serve):
    """Without ignore_eos, or where extra_body adds a stop or another limit, a short answer is an answer."""
    from harness.remote.bench import asked_exactly
    server = serve("short", "short")
    result = run_benchmark(server.url, "glm-5", requests=2, warmup=0, max_tokens=12, ignore_eos=False)
    assert (result["levels"][0]["completed"], result["levels"][0]["failed"]) == (2, 0)
    assert asked_exactly({"max_tokens": 12, "ignore_eos": True}) == 12
    assert asked_exactly({"max_tokens": 12, "ignore_eos": True, "stop": ["."]}) is None
    assert asked_exactly({"max_tokens": 12, "ignore_eos": True, "max_completion_tokens": 20}) is None
    assert asked_exactly({"max_tokens": 12}) is None


def test_a_timeout_after_the_response_head_is_reported_as_a_timeout(serve):
    """It read "not an event stream: (empty)", as if the server had answered something else."""
    server = serve("head_then_hang")
    result = run_benchmark(server.url, "glm-5", requests=1, warmup=0, max_tokens=12, timeout=0.2)
    assert result["requests"][0]["error"] == "timeout after the response head and 0 bytes of its body"


def test_a_search_the_bisection_cannot_run_is_refused_before_any_level(serve, tmp_path, capsys):
    """No whole number of streams lies between 1.5 and 1.7: the bisection said so only after every
    level had run, and the run ended with exit 2 and nothing written."""
    from harness.remote.bench import main
    server = serve()
    plan = {"scenarios": [{"name": "s", "input_tokens": 8, "output_tokens": 12, "concurrency": [1]}],
            "search": {"low": 1.5, "high": 1.7, "steps": 2, "slo": {"ttft_ms_p99": 1000}}}
    out = tmp_path / "bench.json"
    assert main(["--url", server.url, "--model", "glm-5", "--out", str(out), "--plan", json.dumps(plan)]) == 2
    assert "search: no whole number of streams lies between low 1.5 and high 1.7" in capsys.readouterr().err
    assert server.bodies == [] and not out.exists()


@pytest.mark.parametrize("plan", [
    {"scenarios": [{"name": "s", "input_tokens": 8, "output_tokens": 12, "concurrency": [1]}],
     "search": {"low": 1, "high": float("inf"), "steps": 2, "slo": {"ttft_ms_p99": 1000}}},
    {"scenarios": [{"name": "s", "input_tokens": 8, "output_tokens": 12, "request_rate": [1], "burstiness": [2]}]},
    {"scenarios": [{"name": "s", "input_tokens": 8, "output_tokens": 12, "concurrency": 4}]},
    {"scenarios": [{"name": "s", "input_tokens": 8, "output_tokens": 12, "concurrency": [1], "requests": "8"}]},
    {"scenarios": 3},
], ids=["infinite-high", "burstiness-a-list", "concurrency-a-number", "requests-a-string", "scenarios-a-number"])
def test_a_plan_of_the_wrong_types_is_refused_with_a_message(plan, tmp_path, capsys):
    from harness.remote.bench import main
    assert main(["--url", "http://127.0.0.1:9", "--model", "m", "--out", str(tmp_path / "b.json"),
                 "--plan", json.dumps(plan)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bench.py: error: ") and "Traceback" not in err


@pytest.mark.parametrize("option", ["--plan", "--extra-body"])
def test_json_nested_past_the_parser_s_stack_is_a_bad_argument(option, tmp_path, capsys):
    from harness.remote.bench import main
    with pytest.raises(SystemExit) as exited:
        main(["--url", "http://127.0.0.1:9", "--model", "m", "--out", str(tmp_path / "b.json"),
              option, "[" * 100_000])
    assert exited.value.code == 2 and f"argument {option}: not JSON" in capsys.readouterr().err


def test_the_benchmark_s_time_budget_counts_the_warm_up_as_waves_of_its_own():
    """The warm-up runs, and ends, before a level's measured requests: one request of warm-up and 16
    at 3 streams are 1 + 6 waves, each as long as a request's timeout at worst, not ceil(17 / 3) = 6."""
    from types import SimpleNamespace

    from harness.config.playbook import Benchmark, MaxLoad, Scenario, Search
    from harness.lifecycle.measure import PROMPT_S, _waves

    def waves(benchmark: Benchmark, search: Search | None = None) -> float:
        return _waves(SimpleNamespace(sweep=SimpleNamespace(playbook=SimpleNamespace(search=search)),
                                      run=SimpleNamespace(benchmark=benchmark)))

    assert waves(Benchmark(concurrency=[3], warmup=1)) == 1 + 6
    assert waves(Benchmark(concurrency=[4], warmup=1, requests=5)) == 1 + 2
    chat = Scenario(name="chat", input_tokens=8, output_tokens=8, concurrency=[4], requests=5)
    prompts = (5 + 1) * PROMPT_S / 600
    assert waves(Benchmark(scenarios=[chat], warmup=1)) == pytest.approx(1 + 2 + prompts)
    # a probe sends two requests a stream at least: 8 at 4 streams, whatever the scenario's 5
    probe = Search(max_load=MaxLoad(low=4, high=8, steps=1))
    assert waves(Benchmark(scenarios=[chat], warmup=1), probe) == pytest.approx(2 * (1 + 2) + prompts
                                                                                + (8 + 1) * PROMPT_S / 600)
