"""The simulated engine as a real process on a real port: readiness, the stream, the profiler, faults."""

from __future__ import annotations

import gzip
import http.client
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

MODEL = "/models/GLM-5-NVFP4"
DEADLINE_S = 30.0
"""Upper bound for anything the sim should do in well under a second: a safety net, not a timing test."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Sim:
    """One `python -m harness.sim` process, its port and its log."""

    def __init__(self, tmp_path: Path, engine: str, *args: str, env: dict[str, str] | None = None):
        self.port = free_port()
        self.log_path = tmp_path / f"server-{self.port}.log"
        port_flag = ["--port", str(self.port), "--host", "127.0.0.1"]
        argv = [engine, "--model-path", MODEL, *port_flag] if engine == "sglang" \
            else [engine, "serve", MODEL, *port_flag]
        full_env = {**os.environ, "HARNESS_SIM_TIME_SCALE": "0.01", "HARNESS_SIM_STARTUP_S": "0", **(env or {})}
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "harness.sim", *argv, *args], stdout=log,
                                         stderr=subprocess.STDOUT, env=full_env)

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_log(self, text: str) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while text not in self.log():
            assert self.proc.poll() is None or text in self.log(), f"sim exited; log:\n{self.log()}"
            assert time.monotonic() < deadline, f"{text!r} never logged:\n{self.log()}"
            time.sleep(0.02)

    def request(self, method: str, path: str, body: dict | None = None, timeout: float = DEADLINE_S,
                headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = json.dumps(body).encode() if body is not None else None
            conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def health_statuses(self) -> list[int]:
        """Poll /health until it says 200, recording every answer (0 = connection refused)."""
        seen: list[int] = []
        deadline = time.monotonic() + DEADLINE_S
        while not seen or seen[-1] != 200:
            assert time.monotonic() < deadline, f"never healthy; saw {sorted(set(seen))}\n{self.log()}"
            try:
                seen.append(self.request("GET", "/health")[0])
            except ConnectionRefusedError:
                seen.append(0)
                time.sleep(0.01)
        return seen

    def wait_ready(self) -> Sim:
        self.health_statuses()
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=DEADLINE_S)


@pytest.fixture
def sim(tmp_path):
    started: list[Sim] = []

    def start(engine: str, *args: str, env: dict[str, str] | None = None, ready: bool = True) -> Sim:
        s = Sim(tmp_path, engine, *args, env=env)
        started.append(s)
        return s.wait_ready() if ready else s

    yield start
    for s in started:
        s.stop()


def sse_events(raw: bytes) -> list[object]:
    """The `data:` payloads of an event stream, decoded ([DONE] stays a string)."""
    events = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: "):
            payload = block[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def text_chunks(events: list[object]) -> list[str]:
    out = []
    for e in events:
        if isinstance(e, dict) and e["choices"]:
            c = e["choices"][0]
            text = c["text"] if "text" in c else c["delta"].get("content", "")
            if text:
                out.append(text)
    return out


def complete(s: Sim, max_tokens: int = 5, **extra) -> list[object]:
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, **extra}
    status, raw = s.request("POST", "/v1/completions", body)
    assert status == 200, raw
    return sse_events(raw)


# ---- readiness -----------------------------------------------------------------------------

def test_sglang_refuses_connections_while_loading_then_answers_503_then_200(sim):
    s = sim("sglang", env={"HARNESS_SIM_STARTUP_S": "1"}, ready=False)
    s.wait_log("Load weight begin")
    with pytest.raises(ConnectionRefusedError):
        s.request("GET", "/health")
    seen = s.health_statuses()
    assert 503 in seen and seen.index(503) < len(seen) - 1 and seen[-1] == 200
    assert "The server is fired up and ready to roll!" in s.log()


def test_vllm_is_healthy_once_listening_and_answers_ping_and_version(sim):
    s = sim("vllm")
    assert s.request("GET", "/ping")[0] == 200
    status, body = s.request("GET", "/version")
    assert status == 200 and json.loads(body) == {"version": "0.32.0"}   # the release seen (docs/engines.md)
    assert s.request("GET", "/health_generate")[0] == 404


def test_server_info_echoes_the_server_args_and_version(sim):
    s = sim("sglang", "--tp-size", "2", "--kv-cache-dtype", "fp8_e4m3")
    for path in ("/server_info", "/get_server_info"):
        info = json.loads(s.request("GET", path)[1])
        assert info["version"] == "0.5.23" and info["tp_size"] == 2 and info["kv_cache_dtype"] == "fp8_e4m3"
    models = json.loads(s.request("GET", "/v1/models")[1])
    assert models["data"][0]["id"] == MODEL


def test_sglang_metrics_exist_only_with_enable_metrics(sim):
    assert sim("sglang").request("GET", "/metrics")[0] == 404
    status, body = sim("sglang", "--enable-metrics").request("GET", "/metrics")
    assert status == 200 and b"sglang:num_running_reqs" in body


# ---- the stream ----------------------------------------------------------------------------

def test_completion_stream_carries_every_token_then_a_usage_chunk_then_done(sim):
    events = complete(sim("sglang"), max_tokens=5)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 5
    assert usage_chunk["usage"]["prompt_tokens"] == 4
    assert len(text_chunks(events)) == 5
    assert all(e["object"] == "text_completion" for e in events[:-1])


def test_stream_interval_packs_several_tokens_into_one_chunk(sim):
    events = complete(sim("vllm", "--stream-interval", "3"), max_tokens=7)
    chunks = text_chunks(events)
    assert len(chunks) == 3  # the first token at once, then every third
    assert events[-2]["usage"]["completion_tokens"] == 7
    assert events[-3]["choices"][0]["finish_reason"] == "length"


def test_chat_stream_opens_with_a_role_only_chunk(sim):
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3, "stream": True}
    for engine in ("sglang", "vllm"):
        status, raw = sim(engine).request("POST", "/v1/chat/completions", body)
        events = sse_events(raw)
        assert status == 200 and events[0]["object"] == "chat.completion.chunk"
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert len(text_chunks(events)) == 3 and events[-1] == "[DONE]"


def test_without_ignore_eos_the_model_stops_by_itself(sim):
    s = sim("sglang")
    body = {"prompt": "Tell me a story", "max_tokens": 5000}
    reply = json.loads(s.request("POST", "/v1/completions", body)[1])
    assert reply["choices"][0]["finish_reason"] == "stop" and reply["usage"]["completion_tokens"] < 5000
    body["ignore_eos"], body["max_tokens"] = True, 300
    reply = json.loads(s.request("POST", "/v1/completions", body)[1])
    assert reply["choices"][0]["finish_reason"] == "length" and reply["usage"]["completion_tokens"] == 300


def test_vllm_refuses_an_unknown_model_name(sim):
    s = sim("vllm", "--served-model-name", "glm-5")
    assert s.request("POST", "/v1/completions", {"model": "other", "prompt": "x"})[0] == 404
    assert s.request("POST", "/v1/completions", {"model": "glm-5", "prompt": "x", "max_tokens": 2})[0] == 200


def test_emit_log_records_every_token_and_sigterm_flushes_it(sim, tmp_path):
    emit = tmp_path / "emit.jsonl"
    s = sim("sglang", env={"HARNESS_SIM_EMIT_LOG": str(emit)})
    events = complete(s, max_tokens=6)
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(timeout=DEADLINE_S) == 0
    rows = [json.loads(line) for line in emit.read_text().splitlines()]
    assert [r["token"] for r in rows] == list(range(6))
    assert {r["request"] for r in rows} == {events[0]["id"]}
    assert all(a["t_ns"] <= b["t_ns"] for a, b in itertools.pairwise(rows))


# ---- API keys --------------------------------------------------------------------------------

KEY = "sk-test-4e1f"
BEARER = {"Authorization": f"Bearer {KEY}"}
PROMPT = {"prompt": "x", "max_tokens": 2}


@pytest.mark.parametrize("engine,open_paths,guarded_paths", [
    # vLLM 0.26 guards /v1, /v2 and /inference only; SGLang 0.5.23 everything but /health*, /ready*, /metrics*
    ("vllm", ["/health", "/ping", "/version"], ["/v1/models"]),
    ("sglang", ["/health", "/health_generate"], ["/v1/models", "/server_info", "/model_info"]),
])
def test_with_an_api_key_guarded_paths_answer_401_without_the_bearer_and_health_stays_open(
        sim, engine, open_paths, guarded_paths):
    s = sim(engine, "--api-key", KEY)
    for path in open_paths:
        assert s.request("GET", path)[0] == 200, path
    for path in guarded_paths:
        status, body = s.request("GET", path)
        assert (status, json.loads(body)) == (401, {"error": "Unauthorized"}), path
        assert s.request("GET", path, headers={"Authorization": "Bearer wrong"})[0] == 401, path
        assert s.request("GET", path, headers={"Authorization": KEY})[0] == 401, path   # no scheme
        assert s.request("GET", path, headers=BEARER)[0] == 200, path
    assert s.request("POST", "/v1/completions", PROMPT)[0] == 401
    assert s.request("POST", "/v1/completions", PROMPT, headers={"Authorization": f"bearer {KEY}"})[0] == 200


def test_sglang_guards_its_profiler_and_vllm_does_not(sim, tmp_path):
    s = sim("sglang", "--api-key", KEY)
    assert s.request("POST", "/start_profile", {"output_dir": str(tmp_path / "a"), "num_steps": 1})[0] == 401
    assert s.request("POST", "/start_profile", {"output_dir": str(tmp_path / "a"), "num_steps": 1},
                     headers=BEARER)[0] == 200
    v = sim("vllm", "--api-key", KEY, *VLLM_PROFILER, "--profiler-config.torch_profiler_dir", str(tmp_path / "v"))
    assert v.request("POST", "/start_profile")[0] == 200


def test_vllm_takes_several_keys_or_its_environment_variable(sim):
    s = sim("vllm", "--api-key", "first-key", "second-key")
    for key in ("first-key", "second-key"):
        assert s.request("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})[0] == 200
    e = sim("vllm", env={"VLLM_API_KEY": KEY})
    assert e.request("GET", "/v1/models")[0] == 401 and e.request("GET", "/v1/models", headers=BEARER)[0] == 200
    assert sim("sglang", env={"VLLM_API_KEY": KEY}).request("GET", "/v1/models")[0] == 200


# ---- flags -----------------------------------------------------------------------------------

@pytest.mark.parametrize("engine,args,message", [
    ("sglang", ["--model-path", "m", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ("sglang", ["--model-path", "m", "--enable-piecewise-cuda-graph"], "unrecognized arguments"),
    ("sglang", ["--model-path", "m", "--cuda-graph-max-bs", "8"], "ambiguous option: --cuda-graph-max-bs"),
    ("vllm", ["serve", "m", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_a_flag_the_real_launcher_lacks_fails_with_exit_2(engine, args, message):
    done = subprocess.run([sys.executable, "-m", "harness.sim", engine, *args], capture_output=True, text=True,
                          timeout=DEADLINE_S)
    assert done.returncode == 2 and message in done.stderr


# ---- profiler ------------------------------------------------------------------------------

def trace_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("*.trace.json*")) if directory.exists() else []


def test_sglang_num_steps_session_stops_itself_with_traffic_and_writes_one_file_per_rank(sim, tmp_path):
    s = sim("sglang", "--tp-size", "2", "--ep-size", "2")
    out = tmp_path / "prof"
    assert s.request("POST", "/start_profile", {"output_dir": str(out), "num_steps": 3})[0] == 200
    complete(s, max_tokens=8)  # 8 forward steps (a prefill, 7 decodes); the session closes at the third
    names = trace_files(out)
    assert len(names) == 2
    assert all(re.fullmatch(r"\d+\.\d+-TP-(\d)-EP-\1\.trace\.json\.gz", n) for n in names), names
    status, body = s.request("POST", "/stop_profile")
    assert status == 500 and b"Profiling is not in progress" in body


def test_sglang_num_steps_session_without_traffic_stays_open_and_stop_writes_to_its_old_dir(sim, tmp_path):
    s = sim("sglang", "--tp-size", "2")
    old, new = tmp_path / "old", tmp_path / "new"
    assert s.request("GET", "/start_profile", {"output_dir": str(old), "num_steps": 5})[0] == 200
    status, body = s.request("POST", "/start_profile", {"output_dir": str(new), "num_steps": 5})
    assert status == 500 and b"Profiling is already in progress" in body
    assert trace_files(old) == []
    assert s.request("POST", "/stop_profile")[0] == 200
    assert len(trace_files(old)) == 2 and trace_files(new) == []


def test_sglang_profile_prefix_and_stages_shape_the_file_names(sim, tmp_path):
    s = sim("sglang")
    body = {"output_dir": str(tmp_path), "num_steps": 4, "profile_prefix": "tp1", "profile_by_stage": True}
    assert s.request("POST", "/start_profile", body)[0] == 200
    complete(s, max_tokens=6)
    names = trace_files(tmp_path)
    assert [re.sub(r"\d+\.\d+", "ID", n) for n in names] == ["tp1-ID-TP-0-DECODE.trace.json.gz",
                                                             "tp1-ID-TP-0-EXTEND.trace.json.gz"]


def test_sglang_output_dir_defaults_to_the_env_var(sim, tmp_path):
    s = sim("sglang", env={"SGLANG_TORCH_PROFILER_DIR": str(tmp_path / "env")})
    assert s.request("POST", "/start_profile")[0] == 200
    complete(s, max_tokens=2)
    assert s.request("POST", "/stop_profile")[0] == 200
    assert len(trace_files(tmp_path / "env")) == 1


def test_vllm_profiler_is_404_unless_configured(sim):
    s = sim("vllm")
    assert s.request("POST", "/start_profile")[0] == 404
    assert s.request("POST", "/stop_profile")[0] == 404


def wait_files(directory: Path, count: int) -> list[str]:
    deadline = time.monotonic() + DEADLINE_S
    while len(trace_files(directory)) < count:
        assert time.monotonic() < deadline, f"{trace_files(directory)} after {DEADLINE_S} s"
        time.sleep(0.02)
    return trace_files(directory)


def step_spans(path: Path) -> tuple[list[str], list[str]]:
    """The CPU and GPU step-span names of a trace, in order."""
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    return ([e["name"] for e in events if e.get("cat") == "user_annotation"],
            [e["name"] for e in events if e.get("cat") == "gpu_user_annotation"])


VLLM_PROFILER = ("--profiler-config.profiler", "torch", "--profiler-config.torch_profiler_with_stack", "false")
CONFLICT = {"error": {"message": "A profiling session is already active. Call /stop_profile before starting "
                                 "another session.", "type": "Conflict", "param": None, "code": 409}}


def test_vllm_capture_the_way_the_host_agent_drives_it(sim, tmp_path):
    """Launch with max_iterations, start with it in the body, traffic until every rank's file, stop."""
    out = tmp_path / "prof"
    s = sim("vllm", "-tp", "2", *VLLM_PROFILER, "--profiler-config.torch_profiler_dir", str(out),
            "--profiler-config.ignore_frontend", "true", "--profiler-config.max_iterations", "3")
    assert s.request("GET", "/start_profile")[0] == 405
    assert s.request("POST", "/start_profile", {"max_iterations": 3}) == (200, b"")
    complete(s, max_tokens=8)
    names = wait_files(out, 2)
    assert [re.sub(r"\.\d{16,}\.", ".NS.", n) for n in names] == ["rank0.NS.pt.trace.json.gz",
                                                                    "rank1.NS.pt.trace.json.gz"]
    assert sorted(p.name for p in out.glob("*.txt")) == ["rank0.profiler_out.txt", "rank1.profiler_out.txt"]
    assert step_spans(out / names[0]) == (["execute_context_1(4)_generation_0(0)"]
                                          + ["execute_context_0(0)_generation_1(1)"] * 2,) * 2
    status, body = s.request("POST", "/start_profile", {"max_iterations": 3})
    assert status == 409 and json.loads(body) == CONFLICT
    assert s.request("POST", "/stop_profile")[0] == 200
    assert trace_files(out) == names  # the workers wrote when they stopped themselves: nothing more
    assert s.request("POST", "/stop_profile")[0] == 200
    assert s.request("POST", "/start_profile", {"max_iterations": 3})[0] == 200


def test_vllm_records_until_stop_without_a_bound_with_idle_steps_as_cpu_spans(sim, tmp_path):
    s = sim("vllm", *VLLM_PROFILER, "--profiler-config.torch_profiler_dir", str(tmp_path),
            "--profiler-config.ignore_frontend", "true")
    assert s.request("POST", "/start_profile")[0] == 200
    complete(s, max_tokens=3)
    complete(s, max_tokens=3)
    assert trace_files(tmp_path) == []
    assert s.request("POST", "/stop_profile")[0] == 200
    (name,) = trace_files(tmp_path)
    cpu, gpu = step_spans(tmp_path / name)
    one = ["execute_context_1(4)_generation_0(0)"] + ["execute_context_0(0)_generation_1(1)"] * 2
    assert cpu[:7] == one + ["execute_context_0(0)_generation_0(0)"] + one and gpu == one + one


@pytest.mark.parametrize("ignore_frontend,front_end_files", [(None, 2), ("false", 2), ("true", 0)])
def test_vllm_front_end_writes_its_own_files_at_stop_unless_ignored(sim, tmp_path, ignore_frontend,
                                                                    front_end_files):
    extra = ("--profiler-config.ignore_frontend", ignore_frontend) if ignore_frontend else ()
    s = sim("vllm", *VLLM_PROFILER, "--profiler-config.torch_profiler_dir", str(tmp_path), *extra)
    assert s.request("POST", "/start_profile", {"max_iterations": 2})[0] == 200
    complete(s, max_tokens=4)
    assert not list(tmp_path.glob("*async_llm*"))
    assert s.request("POST", "/stop_profile")[0] == 200
    front = sorted(p.name for p in tmp_path.glob("*.async_llm.*"))
    assert len(front) == front_end_files
    if front:
        assert re.fullmatch(rf"{re.escape(socket.gethostname())}_{s.proc.pid}\.async_llm\.\d+\.pt\.trace\.json\.gz",
                            front[0])
        assert front[1] == f"{socket.gethostname()}_{s.proc.pid}.async_llm.profiler_out.txt"


def test_sglang_capture_the_way_the_host_agent_drives_it(sim, tmp_path):
    """start_profile with output_dir, num_steps and activities, traffic until the files, never a stop."""
    s = sim("sglang", "--tp-size", "2")
    body = {"output_dir": str(tmp_path), "num_steps": 3, "activities": ["CPU", "GPU"]}
    assert s.request("POST", "/start_profile", body)[0] == 200
    complete(s, max_tokens=8)
    names = wait_files(tmp_path, 2)
    for name in names:
        assert step_spans(tmp_path / name) == (["step[EXTEND bs=1 toks=4]", "step[DECODE bs=1]",
                                                "step[DECODE bs=1]"],) * 2


# ---- the stream: tokens without text --------------------------------------------------------

@pytest.mark.parametrize("engine,every,tokens,with_text", [
    ("vllm", None, 64, 64),
    ("vllm", "2", 64, 32),   # the CPU build's random-weight byte-level BPE model: 64 tokens, 32 text events
    ("vllm", "3", 9, 6),
    ("sglang", "2", 8, 4),
])
def test_empty_text_every_n_tokens(sim, engine, every, tokens, with_text):
    env = {"HARNESS_SIM_EMPTY_TEXT_EVERY": every} if every else {}
    events = complete(sim(engine, env=env), max_tokens=tokens)
    token_events = [e for e in events if isinstance(e, dict) and e["choices"]]
    if engine == "sglang":
        token_events = token_events[:-1]  # its closing chunk, empty, with the finish reason
    assert len(token_events) == tokens  # one event per token, the empty ones included
    assert len(text_chunks(events)) == with_text
    assert sum(e["choices"][0]["text"] == "" for e in token_events) == tokens - with_text
    assert events[-2]["usage"]["completion_tokens"] == tokens and events[-1] == "[DONE]"


# ---- faults --------------------------------------------------------------------------------

def test_oom_at_start_logs_the_cuda_oom_and_exits_1(sim):
    s = sim("sglang", env={"HARNESS_SIM_FAULT": "oom_at_start"}, ready=False)
    assert s.proc.wait(timeout=DEADLINE_S) == 1
    assert "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate" in s.log()


def test_crash_after_n_requests_kills_the_process(sim):
    s = sim("vllm", env={"HARNESS_SIM_FAULT": "crash_after=2"})
    complete(s)
    assert s.proc.poll() is None
    complete(s)
    assert s.proc.wait(timeout=DEADLINE_S) == 1


def test_never_healthy_keeps_answering_503(sim):
    s = sim("sglang", env={"HARNESS_SIM_FAULT": "never_healthy"}, ready=False)
    s.wait_log("Uvicorn running")
    assert {s.request("GET", "/health")[0] for _ in range(5)} == {503}
    assert "fired up" not in s.log()


def test_hang_after_n_requests_accepts_connections_but_never_answers(sim):
    s = sim("sglang", env={"HARNESS_SIM_FAULT": "hang_after=1"})
    complete(s)
    with pytest.raises(socket.timeout):
        s.request("GET", "/health", timeout=0.5)


def test_profile_500_refuses_both_endpoints_and_writes_nothing(sim, tmp_path):
    s = sim("sglang", env={"HARNESS_SIM_FAULT": "profile_500"})
    assert s.request("POST", "/start_profile", {"output_dir": str(tmp_path / "p"), "num_steps": 1})[0] == 500
    complete(s)
    assert s.request("POST", "/stop_profile")[0] == 500
    assert trace_files(tmp_path / "p") == []


# ---- the tokenizer endpoint ----------------------------------------------------------------

@pytest.mark.parametrize("engine, paths, keys", [
    # vLLM 0.32 entrypoints/serve/tokenize: POST /tokenize, TokenizeResponse's field order
    ("vllm", ["/tokenize"], ["count", "max_model_len", "tokens", "token_strs"]),
    # SGLang 0.5.23 entrypoints/http_server.py: /tokenize and /v1/tokenize, protocol.py TokenizeResponse
    ("sglang", ["/tokenize", "/v1/tokenize"], ["tokens", "count", "max_model_len"]),
])
def test_tokenize_answers_as_the_engine_does_and_counts_what_usage_reports(sim, engine, paths, keys):
    s = sim(engine)
    prompt = "The quick brown fox, it jumps over the lazy dog."
    for path in paths:
        status, raw = s.request("POST", path, {"model": MODEL, "prompt": prompt})
        assert status == 200, raw
        answer = json.loads(raw)
        assert list(answer) == keys
        assert answer["count"] == len(answer["tokens"]) == 12 and answer["max_model_len"] == 202752
    usage = complete(s, prompt=prompt)[-2]["usage"]
    assert usage["prompt_tokens"] == 12
    chat = {"model": MODEL, "messages": [{"role": "user", "content": prompt}]}
    status, raw = s.request("POST", "/tokenize", chat)
    body = {**chat, "max_tokens": 2, "stream": False}
    assert json.loads(raw)["count"] == json.loads(s.request("POST", "/v1/chat/completions", body)[1])["usage"][
        "prompt_tokens"]
    assert s.request("GET", "/tokenize")[0] == 405
    assert s.request("POST", "/tokenize", {"model": MODEL})[0] == 400


def test_vllm_tokenize_refuses_an_unknown_model_and_sglang_takes_any(sim):
    status, raw = sim("vllm").request("POST", "/tokenize", {"model": "other", "prompt": "hi"})
    assert status == 404 and json.loads(raw)["error"]["code"] == 404
    assert sim("sglang").request("POST", "/tokenize", {"model": "other", "prompt": "hi"})[0] == 200
