"""Telemetry against the real engines: what vLLM 0.32.0 and SGLang 0.5.23 write on /metrics (families,
kinds, labels, when a series appears), read by the sampler, the parser and the per-level view as the
report shows it; and a /metrics behind the server's API key.

Fixtures: tests/fixtures/metrics/vllm-0.32.0-cpu-level-{before,busy,after}.txt are three answers of the
real vLLM 0.32.0 CPU build (tiny Llama, `--api-key` set: /metrics answered 200 without it) around 160
requests of 300 prompt and 190 output tokens, cut to the families the engine's record keeps (and two
look-alikes, left out by name). The SGLang scrapes are written here with the labels and values its
0.5.23 sources give (`srt/observability/metrics_collector.py`, `managers/scheduler_components/`).
Every server here listens on 127.0.0.1.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from harness.engines import get_engine
from harness.lifecycle.measure import telemetry_shell
from harness.remote import exposition as ex
from harness.remote import telemetry as tm
from harness.remote import zipapp
from harness.report.compare import telemetry_table
from harness.report.telemetry_view import level_summary, pooled, value_of
from harness.results.models import TelemetryFile, TelemetryLine, TelemetryMetric
from harness.results.store import read_telemetry

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "metrics"
LEVEL = [(FIXTURES / f"vllm-0.32.0-cpu-level-{n}.txt").read_text() for n in ("before", "busy", "after")]
KEY = "sk-test-3f9c1e"          # a made-up key: it must never reach a note, a file or a command line
ENV = "HARNESS_ARG_API_KEY"


class Metrics:
    """A /metrics on 127.0.0.1 that answers `bodies` in turn (the last one again after them), asking for
    `Bearer KEY` when `key` is set: a 401 without credentials, a 403 with a wrong key."""

    def __init__(self, bodies: list[str], key: str | None = None):
        self.bodies, self.key, self.seen, self.asked = bodies, key, [], 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                sent = self.headers.get("Authorization")
                owner.seen.append(sent)
                status = 200
                if owner.key is not None and sent != f"Bearer {owner.key}":
                    status = 403 if sent else 401
                body = (owner.bodies[min(owner.asked, len(owner.bodies) - 1)] if status == 200
                        else '{"error": "Unauthorized"}').encode()
                owner.asked += status == 200
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.url = self.base + "/metrics"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serve():
    made: list[Metrics] = []

    def make(bodies: list[str], key: str | None = None) -> Metrics:
        made.append(Metrics(bodies, key))
        return made[-1]
    yield make
    for m in made:
        m.close()


def spec(engine: str) -> list[TelemetryMetric]:
    return [TelemetryMetric(**m.as_dict()) for m in get_engine(engine).metrics]


def rendered(group) -> str:
    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(group)
    return console.file.getvalue()  # type: ignore[attr-defined]


def run_sampler(out: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness.remote", "telemetry", "--out", str(out), "--no-gpu",
                           "--duration", "0", *args], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, **(env or {})})


# ---- vLLM 0.32.0, as its CPU build answered ----------------------------------------------------------

def test_the_real_vllm_answers_around_a_level_read_as_the_report_shows_them(serve):
    server = serve(LEVEL)
    families = [m.family for m in get_engine("vllm").metrics]
    sampler = tm.Sampler(server.url, families, smi=None)
    for _ in LEVEL:                      # before the level, inside it, after it
        sampler.sample()
    lines = [TelemetryLine(**x) for x in sampler.take()]
    scrapes = [x for x in lines if x.source == "metrics"]
    assert len(scrapes) == 3 and not [x for x in lines if x.source == "note" and x.values["error"]]
    # counters by their _total, `_created` and the look-alike families left out
    assert sorted(k.partition("{")[0] for k in scrapes[1].values) == sorted(
        f + ("_total" if m.kind == "counter" else "") for m in get_engine("vllm").metrics for f in [m.family]
        if not f.startswith("vllm:spec_decode"))       # no --speculative-config: no spec families at all
    t = TelemetryFile(metrics=spec("vllm"), lines=lines)
    s = level_summary(t, scrapes[0].t_end_ns or scrapes[0].t_ns, scrapes[2].t_ns)
    assert s is not None and s["bracketed"] and s["sampled_within"]
    assert s["running_mean"] == s["running_max"] == 67.0 and s["waiting_max"] == 0.0
    assert s["kv_cache_usage_max"] == pytest.approx(0.4442270058708415)      # a fraction: 44 %
    assert s["prefix_cache_queries"] == 53076 - 276 and s["prefix_cache_hits"] == 3840   # tokens
    assert s["generation_tokens"] == 38480 - 5040 and s["preemptions"] == 0
    assert s["spec_acceptance"] is None and s["spec_accept_length"] is None
    table = rendered(telemetry_table([{"config": "vllm-cpu", "concurrency": 160, "telemetry": pooled([s]),
                                       "telemetry_notes": []}]))
    row = next(line for line in table.splitlines() if line.strip().startswith("vllm-cpu"))
    assert row.split() == ["vllm-cpu", "160", "67.0", "0", "44%", "7%"]    # 3840 / 52800 hits


def test_vllm_data_parallel_engines_each_write_their_series_summed_or_averaged():
    """vLLM 0.32.0 `v1/metrics/loggers.py` PrometheusStatLogger: labelnames model_name and engine, one
    label set per engine index: requests and counters add up over the engines, KV use is their mean."""
    two = LEVEL[1] + LEVEL[1].replace('engine="0"', 'engine="1"').replace(" 67.0", " 33.0").replace(
        "0.4442270058708415", "0.2")
    values, bad = ex.parse_exposition(two, [m.family for m in get_engine("vllm").metrics])
    assert bad == 0
    by_key = {m.key: m for m in spec("vllm")}
    assert value_of(values, by_key["running"]) == 100.0
    assert value_of(values, by_key["kv_cache_usage"]) == pytest.approx((0.4442270058708415 + 0.2) / 2)
    assert value_of(values, by_key["prefix_cache_queries"]) == 2 * 52176


# ---- SGLang 0.5.23, from its sources --------------------------------------------------------------

SCHED = 'engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="{pp}",tp_rank="0"'
TOK = 'engine_type="unified",model_name="m"'


def sglang_scrape(t_ns: int, *, prompt: float, cached: float | None = None, rate: float = 0.0,
                  length: float = 0.0, waiting: float = 0.0, stages: int = 1) -> TelemetryLine:
    values = {f'sglang:prompt_tokens_total{{{TOK},is_streaming="true"}}': prompt}
    if cached is not None:
        values[f'sglang:cached_tokens_total{{cache_source="device",{TOK}}}'] = cached
    for pp in range(stages):
        labels = SCHED.format(pp=pp)
        values |= {f"sglang:num_queue_reqs{{{labels}}}": waiting, f"sglang:num_running_reqs{{{labels}}}": 4.0,
                   f"sglang:spec_accept_rate{{{labels}}}": rate, f"sglang:spec_accept_length{{{labels}}}": length}
    return TelemetryLine(t_ns=t_ns, t_end_ns=t_ns + 1, source="metrics", values=values)


def test_an_sglang_counter_made_at_its_first_increment_counts_from_zero():
    """0.5.23 observe_one_finished_request: `cached_tokens_total.labels(cache_source=...)` is made at the
    first request with a prefix hit, so the scrape before it has no such series at all."""
    t = TelemetryFile(metrics=spec("sglang"), lines=[sglang_scrape(0, prompt=100), sglang_scrape(10, prompt=1100,
                                                                                                cached=250)])
    s = level_summary(t, 2, 8)
    assert s is not None and s["prefix_cache_queries"] == 1000 and s["prefix_cache_hits"] == 250
    assert s["prefix_cache_hit_rate"] == 0.25
    never = TelemetryFile(metrics=spec("sglang"), lines=[sglang_scrape(0, prompt=100), sglang_scrape(10, prompt=900)])
    assert level_summary(never, 2, 8)["prefix_cache_hits"] is None    # type: ignore[index]  # never seen: unknown


def test_sglang_without_speculative_decoding_shows_no_acceptance():
    """0.5.23 metrics_reporter.report_decode_stats: spec_accept_rate and spec_accept_length are 0 when
    spec_algorithm.is_none(); a verify step yields at least its bonus token, so a length of 0 is no
    speculation, and a speculating server's scrapes before its first decode report are left out too."""
    plain = TelemetryFile(metrics=spec("sglang"), lines=[sglang_scrape(i * 10, prompt=i) for i in range(4)])
    s = level_summary(plain, 5, 25)
    assert s is not None and s["spec_acceptance"] is None and s["spec_accept_length"] is None
    assert rendered(telemetry_table([{"config": "c", "concurrency": 4, "telemetry": pooled([s])}])).count("%") == 0
    spec_lines = [sglang_scrape(0, prompt=0), sglang_scrape(10, prompt=1),
                  sglang_scrape(20, prompt=2, rate=0.6, length=2.8), sglang_scrape(30, prompt=3, rate=0.8, length=3.4),
                  sglang_scrape(40, prompt=4, rate=0.8, length=3.4)]
    s = level_summary(TelemetryFile(metrics=spec("sglang"), lines=spec_lines), 5, 35)
    assert s is not None and s["spec_acceptance"] == pytest.approx(0.7)
    assert s["spec_accept_length"] == pytest.approx(3.1)


def test_sglangs_waiting_queue_is_counted_once_over_its_pipeline_stages():
    """0.5.23: every pipeline stage's scheduler holds the same waiting queue (request_receiver.py relays
    each request to the next stage) and writes num_queue_reqs with its own pp_rank; running requests are
    each stage's own micro-batch."""
    lines = [sglang_scrape(i * 10, prompt=i, waiting=5.0, stages=2) for i in range(3)]
    s = level_summary(TelemetryFile(metrics=spec("sglang"), lines=lines), 5, 15)
    assert s is not None and s["waiting_max"] == 5.0 and s["running_max"] == 8.0


def sglang_all_schedulers(running: list[float], waiting: list[float]) -> str:
    """A /metrics answer of SGLang 0.5.23 under --enable-metrics-for-all-schedulers: every rank writes the
    scheduler gauges with its own tp_rank (metrics_collector.py SchedulerMetricsCollector.init_new; the
    scheduler's `metrics_enabled`), the values of rank r those of its attention group, given by rank."""
    lines = ["# TYPE sglang:num_running_reqs gauge", "# TYPE sglang:num_queue_reqs gauge",
             "# TYPE sglang:token_usage gauge"]
    for rank, (run, wait) in enumerate(zip(running, waiting, strict=True)):
        labels = f'engine_type="unified",model_name="m",moe_ep_rank="{rank}",pp_rank="0",tp_rank="{rank}"'
        lines += [f"sglang:num_running_reqs{{{labels}}} {run}", f"sglang:num_queue_reqs{{{labels}}} {wait}",
                  f"sglang:token_usage{{{labels}}} 0.25"]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(("args", "kept", "running", "waiting"), [
    # TP 4: one attention group, every rank a copy of rank 0's
    ({"tp-size": 4}, ["0"], [6, 6, 6, 6], [2, 2, 2, 2]),
    # attention DP 2 inside TP 4 (the deprecated spelling too): ranks 0 and 2 lead a group each
    ({"tp-size": 4, "attn-dp-size": 2}, ["0", "2"], [6, 6, 3, 3], [2, 2, 1, 1]),
    ({"tp-size": 4, "dp-size": 2, "--enable-dp-attention": True}, ["0", "2"], [6, 6, 3, 3], [2, 2, 1, 1]),
])
def test_sglang_with_metrics_for_all_schedulers_counts_each_attention_group_once(tmp_path, serve, args, kept,
                                                                                running, waiting):
    """Without the flag only the first rank of each attention group writes the scheduler gauges, and
    the sum over label sets is the server's; with it every rank writes its group's copy, and the sum
    counted each request once a rank (TP 4: four times). The sampler is started as a run starts it
    (measure.telemetry_shell), the kept ranks in its file, and the level reads one copy a group."""
    engine = get_engine("sglang")
    plain = {m.key: m for m in engine.metrics_for(args)}
    assert all(not m.only for m in plain.values())
    flagged = {m.key: m for m in engine.metrics_for(args | {"--enable-metrics-for-all-schedulers": True})}
    for key in ("running", "waiting", "kv_cache_usage", "spec_accept_rate", "spec_accept_length"):
        assert flagged[key].only == (("tp_rank", tuple(kept)),), key
    for key in ("prefix_cache_queries", "prefix_cache_hits", "generation_tokens"):   # the tokenizer's: one process
        assert not flagged[key].only, key

    server = serve([sglang_all_schedulers(running, waiting)])
    (tmp_path / "harness.pyz").write_bytes(zipapp())
    ctx = SimpleNamespace(
        sweep=SimpleNamespace(playbook=SimpleNamespace(telemetry=SimpleNamespace(enabled=True, interval_s=0.05)),
                              engine=engine),
        paths=SimpleNamespace(telemetry=str(tmp_path / "telemetry.jsonl"), secrets_file=str(tmp_path / "none")),
        rendered=SimpleNamespace(args=args | {"enable-metrics-for-all-schedulers": True}, secret_env={}),
        python=sys.executable, tools_dir=str(tmp_path), base_url=server.base)
    start, stop = telemetry_shell(ctx, 60)   # type: ignore[arg-type]
    done = subprocess.run(["bash", "-c", f"{start}sleep 0.3; {stop}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    t = read_telemetry(tmp_path / "telemetry.jsonl")
    assert t is not None and t.notes(errors_only=True) == []
    assert {m.key: m.only for m in t.metrics}["running"] == {"tp_rank": kept}
    scrapes = t.samples("metrics")
    assert len(scrapes) >= 2
    s = level_summary(t, scrapes[0].t_ns, scrapes[-1].t_end_ns or scrapes[-1].t_ns)
    assert s is not None
    assert s["running_max"] == sum(running[int(r)] for r in kept)    # 6 for TP 4, 9 for two groups: not 24 or 18
    assert s["waiting_max"] == sum(waiting[int(r)] for r in kept)
    assert s["kv_cache_usage_max"] == 0.25


# ---- a /metrics behind the server's API key ----------------------------------------------------------

def test_a_guarded_metrics_is_a_clear_note_in_the_file_and_in_the_report(tmp_path, serve):
    server = serve(LEVEL, key=KEY)
    metrics = json.dumps([m.as_dict() for m in get_engine("vllm").metrics])
    done = run_sampler(tmp_path / "none.jsonl", "--url", server.url, "--metrics", metrics)
    assert done.returncode == 0, done.stderr
    t = read_telemetry(tmp_path / "none.jsonl")
    assert t is not None and not t.samples("metrics")
    assert t.notes(errors_only=True) == [
        f"{server.url}: GET /metrics answered HTTP 401: the server asks for credentials on /metrics and none "
        "were sent (the sampler sends the server's API key when the run gives the server one); no server "
        "metrics while it does"]
    text = rendered(telemetry_table([{"config": "c", "concurrency": 1, "telemetry": None,
                                      "telemetry_notes": t.notes()}]))
    assert "HTTP 401" in " ".join(text.split()) and "none were sent" in " ".join(text.split())

    wrong = run_sampler(tmp_path / "wrong.jsonl", "--url", server.url, "--metrics", metrics, "--api-key-env", ENV,
                        env={ENV: "not-the-key"})
    assert wrong.returncode == 0, wrong.stderr
    t = read_telemetry(tmp_path / "wrong.jsonl")
    assert t is not None and t.notes(errors_only=True) == [
        f"{server.url}: GET /metrics answered HTTP 403: the server refused the API key sent (from ${ENV}); "
        "no server metrics while it does"]
    assert "not-the-key" not in (tmp_path / "wrong.jsonl").read_text()


def test_the_sampler_sends_the_key_from_its_variable_and_a_variable_not_set_is_a_note(tmp_path, serve):
    server = serve(LEVEL, key=KEY)
    done = run_sampler(tmp_path / "t.jsonl", "--url", server.url, "--api-key-env", ENV, env={ENV: KEY})
    assert done.returncode == 0, done.stderr
    t = read_telemetry(tmp_path / "t.jsonl")
    assert t is not None and len(t.samples("metrics")) == 2 and t.notes(errors_only=True) == []
    assert set(server.seen) == {f"Bearer {KEY}"} and KEY not in (tmp_path / "t.jsonl").read_text()
    # a variable not set: said in the file, and the scrapes go on without a key (an exit left no file)
    env = {k: v for k, v in os.environ.items() if k != ENV}
    unset = subprocess.run([sys.executable, "-m", "harness.remote", "telemetry", "--out", str(tmp_path / "u.jsonl"),
                            "--no-gpu", "--duration", "0", "--url", server.url, "--api-key-env", ENV],
                           capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert unset.returncode == 0, unset.stderr
    t = read_telemetry(tmp_path / "u.jsonl")
    assert t is not None and t.notes(errors_only=True)[0] == (
        f"--api-key-env: {ENV} is not set here: /metrics asked without the API key")
    assert any("HTTP 401" in n for n in t.notes(errors_only=True))


def test_the_benchmarks_shell_starts_the_sampler_with_the_servers_key_on_no_command_line(tmp_path, serve):
    """measure.telemetry_shell, run by bash here as on a host: the run's secrets file sourced into the
    sampler's own environment, `--api-key-env` naming the variable, `$tpid` the sampler itself."""
    server = serve(LEVEL, key=KEY)
    (tmp_path / "harness.pyz").write_bytes(zipapp())
    secrets = tmp_path / "secrets.env"
    secrets.write_text(f"{ENV}={KEY}\n")
    secrets.chmod(0o600)
    ctx = SimpleNamespace(
        sweep=SimpleNamespace(playbook=SimpleNamespace(telemetry=SimpleNamespace(enabled=True, interval_s=0.05)),
                              engine=get_engine("vllm")),
        paths=SimpleNamespace(telemetry=str(tmp_path / "telemetry.jsonl"), secrets_file=str(secrets)),
        rendered=SimpleNamespace(args={"api-key": f"${ENV}"}, secret_env={ENV: KEY}),
        python=sys.executable, tools_dir=str(tmp_path), base_url=server.base)
    start, stop = telemetry_shell(ctx, 60)   # type: ignore[arg-type]
    assert KEY not in start + stop
    shell = subprocess.Popen(["bash", "-c", f"{start}echo sampler $tpid; {stop}"], stdout=subprocess.PIPE,
                             text=True, start_new_session=True, env={k: v for k, v in os.environ.items() if k != ENV})
    try:
        out, _ = shell.communicate(timeout=120)
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGKILL)
    assert shell.returncode == 0 and out.startswith("sampler ")
    t = read_telemetry(tmp_path / "telemetry.jsonl")
    assert t is not None and t.lines[-1].source == "stop" and t.lines[-1].values["why"] == "signal SIGTERM"
    assert len(t.samples("metrics")) >= 2 and t.notes(errors_only=True) == []
    assert t.samples("metrics")[0].values['vllm:num_requests_running{engine="0",model_name="tiny"}'] == 0.0
    assert set(server.seen) == {f"Bearer {KEY}"} and f"--api-key-env {ENV}" in start
