"""The telemetry sampler's parsers against what real engines and real nvidia-smi print, its bounds, and
the per-level summary compare shows.

Fixtures: tests/fixtures/metrics/vllm-0.32.0-cpu-ngram-busy.txt is the /metrics answer of the real vLLM
0.32.0 CPU build (tiny Llama, ngram speculative decoding, four requests running); the nvidia-smi
tables are what nvidia-smi 580.159.04 printed on an NVIDIA H200 (docs/transformers_gpu/ and
tests/fixtures/metrics/nvidia-smi-580.159.04-h200-telemetry.csv, the sampler's own query).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from harness.config.playbook import load_playbook
from harness.engines import get_engine
from harness.errors import InputError
from harness.remote import exposition as ex
from harness.remote import telemetry as tm
from harness.remote import zipapp
from harness.report.telemetry_view import bracket, level_summary, pooled, value_of
from harness.results.models import TelemetryFile, TelemetryLine, TelemetryMetric
from harness.results.store import read_telemetry
from tests.unit.test_sim import sim  # noqa: F401  (the fixture)

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "metrics"
VLLM_CPU = (FIXTURES / "vllm-0.32.0-cpu-ngram-busy.txt").read_text()
SMI_H200 = (FIXTURES / "nvidia-smi-580.159.04-h200-telemetry.csv").read_text()
LABELS = '{engine="0",model_name="tiny"}'


# ---- the exposition format -------------------------------------------------------------------

def test_the_real_vllm_answer_parses_whole_with_no_line_left_out():
    values, bad = ex.parse_exposition(VLLM_CPU)
    samples = [ln for ln in VLLM_CPU.splitlines() if ln and not ln.startswith("#")]
    assert bad == 0 and len(values) == len(samples) == 430
    assert values['vllm:request_prompt_tokens_bucket{engine="0",le="+Inf",model_name="tiny"}'] == 4.0


def test_only_the_families_of_the_engines_record_are_kept_counters_by_their_total():
    families = [m.family for m in get_engine("vllm").metrics]
    values, bad = ex.parse_exposition(VLLM_CPU, families)
    assert bad == 0
    assert values == {
        f"vllm:num_requests_running{LABELS}": 4.0, f"vllm:num_requests_waiting{LABELS}": 0.0,
        f"vllm:kv_cache_usage_perc{LABELS}": 0.015655577299412915,
        f"vllm:prefix_cache_queries_total{LABELS}": 316.0, f"vllm:prefix_cache_hits_total{LABELS}": 0.0,
        f"vllm:spec_decode_num_drafts_total{LABELS}": 281.0, f"vllm:spec_decode_num_draft_tokens_total{LABELS}": 534.0,
        f"vllm:spec_decode_num_accepted_tokens_total{LABELS}": 490.0, f"vllm:num_preemptions_total{LABELS}": 0.0,
        f"vllm:generation_tokens_total{LABELS}": 807.0}


def test_every_family_the_engines_list_is_one_their_sources_define():
    """vLLM's names are checked against its real /metrics answer; both engines' against their spelling."""
    real = {k.partition("{")[0] for k in ex.parse_exposition(VLLM_CPU)[0]}
    for m in get_engine("vllm").metrics:
        assert {m.family, m.family + "_total"} & real, m.family
    for engine in ("vllm", "sglang"):
        for m in get_engine(engine).metrics:
            assert m.family.startswith(f"{engine}:") and not m.family.endswith("_total"), m.family
            assert m.kind in ("gauge", "counter") and m.across in ("sum", "mean")


def test_the_parser_takes_what_the_format_allows():
    text = ("# HELP x_total A counter with a \\\\ and \\n in its help\n# TYPE x_total counter\n# any comment\n"
            'x_total{path="/a\\"b\\\\c\\nd",code="200",} 3 1700000000000\n'
            "gauge_nan NaN\ngauge_inf +Inf\ngauge_ninf -Inf\ngauge_exp 1.5e-3\n"
            '   spaced{ a = "1" }   2   \nno_newline 7')
    values, bad = ex.parse_exposition(text)
    assert bad == 0
    assert values['x_total{code="200",path="/a\\"b\\\\c\\nd"}'] == 3.0
    assert ex.parse_labels('{path="/a\\"b\\\\c\\nd"}') == {"path": '/a"b\\c\nd'}
    assert values["gauge_inf"] == float("inf") and values["gauge_ninf"] == float("-inf")
    assert values["gauge_nan"] != values["gauge_nan"] and values["gauge_exp"] == 0.0015
    assert values['spaced{a="1"}'] == 2.0 and values["no_newline"] == 7.0
    assert [ex.json_value(values[k]) for k in ("gauge_nan", "gauge_inf", "gauge_ninf")] == ["NaN", "+Inf", "-Inf"]


@pytest.mark.parametrize("line", ["x 1_000", "x infinity", "x", 'x{a=1} 2', 'x{a="1" b="2"} 3', '{a="1"} 1',
                                  "x 1 2 3", 'x{a="unterminated} 1', "9x 1", "x 0x10"])
def test_a_line_that_is_not_a_sample_gives_no_value_and_is_counted(line):
    values, bad = ex.parse_exposition(f"good 1\n{line}\n")
    assert values == {"good": 1.0} and bad == 1


# ---- nvidia-smi ----------------------------------------------------------------------------------

def test_nvidia_smi_csv_as_the_h200_printed_it():
    before = (REPO / "docs" / "transformers_gpu" / "nvidia_smi_before.csv").read_text()
    assert ex.parse_gpu_csv(before) == [{"name": "NVIDIA H200", "memory_used_mib": 0.0,
                                        "memory_total_mib": 143771.0, "driver_version": "580.159.04"}]
    assert SMI_H200.splitlines()[0].split(", ")[1] == "clocks.current.sm [MHz]"   # asked as clocks.sm
    assert ex.parse_gpu_csv(SMI_H200) == [{"gpu": 0, "sm_clock_mhz": 345.0, "memory_used_mib": 0.0,
                                          "power_w": 90.68, "utilization_pct": 0.0}]


def test_nvidia_smi_fields_it_cannot_read_are_none_and_a_table_of_another_shape_is_refused():
    head = SMI_H200.splitlines()[0]
    assert ex.parse_gpu_csv(f"{head}\n1, [N/A], 10 MiB, [Not Supported], 5 %\n")[0] == {
        "gpu": 1, "sm_clock_mhz": None, "memory_used_mib": 10.0, "power_w": None, "utilization_pct": 5.0}
    for bad in ("", f"{head}\n0, 345 MHz\n", f"{head}\nzero, 1 MHz, 0 MiB, 1 W, 0 %\n",
                "No devices were found\n0", f"{head}\n0, fast, 0 MiB, 1 W, 0 %\n"):
        with pytest.raises(ValueError):
            ex.parse_gpu_csv(bad)


def test_a_command_is_cut_off_at_its_timeout_and_its_output_bound():
    with pytest.raises(tm.Hung, match="no answer within"):
        tm.run_bounded(["sleep", "600"], timeout=0.2, max_bytes=100)
    with pytest.raises(ValueError, match="printed over 1,000 bytes"):
        tm.run_bounded(["yes"], timeout=60, max_bytes=1000)
    with pytest.raises(ValueError, match="exited 3"):
        tm.run_bounded(["sh", "-c", "exit 3"], timeout=60, max_bytes=1000)
    assert tm.run_bounded(["echo", "ok"], timeout=60, max_bytes=100) == "ok\n"


# ---- /metrics over real HTTP -----------------------------------------------------------------

class _Server:
    """A loopback HTTP server answering /metrics with what the test sets."""

    def __init__(self):
        self.body, self.status, self.length = VLLM_CPU.encode(), 200, True
        self.drip = 0.0   # seconds before each byte of the body: the head at once, then a byte at a time
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def do_GET(self):
                self.send_response(owner.status)
                if owner.length:
                    self.send_header("Content-Length", str(len(owner.body)))
                self.end_headers()
                if not owner.drip:
                    self.wfile.write(owner.body)
                    return
                self.wfile.flush()
                for byte in owner.body:
                    time.sleep(owner.drip)
                    try:
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                    except OSError:
                        return

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/metrics"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = _Server()
    yield s
    s.close()


def test_an_answer_over_the_limit_is_refused_with_or_without_its_length(server):
    assert tm.fetch_metrics(server.url) == VLLM_CPU
    with pytest.raises(ValueError, match="refused unread"):
        tm.fetch_metrics(server.url, max_bytes=1000)
    server.length = False       # no Content-Length: read to the limit and no further
    with pytest.raises(ValueError, match="over the 1,000 byte limit"):
        tm.fetch_metrics(server.url, max_bytes=1000)
    server.status = 404
    with pytest.raises(ValueError, match="HTTP 404"):
        tm.fetch_metrics(server.url)
    server.status, server.body = 200, b"\xff\xfe not text"
    with pytest.raises(ValueError, match="not UTF-8"):
        tm.fetch_metrics(server.url)


def run_sampler(tmp_path: Path, *args: str, zipped: bool = False) -> tuple[subprocess.CompletedProcess, list[dict]]:
    out = tmp_path / "telemetry.jsonl"
    if zipped:
        (tmp_path / "harness.pyz").write_bytes(zipapp())
        command = [sys.executable, str(tmp_path / "harness.pyz"), "telemetry"]
    else:
        command = [sys.executable, "-m", "harness.remote", "telemetry"]
    done = subprocess.run([*command, "--out", str(out), *args], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    lines = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
    return done, lines


def test_the_sampler_alone_samples_at_start_every_interval_and_at_stop(tmp_path, server):
    spec = json.dumps([m.as_dict() for m in get_engine("vllm").metrics])
    done, lines = run_sampler(tmp_path, "--url", server.url, "--interval", "0.05", "--duration", "0.3",
                              "--metrics", spec, "--nvidia-smi", "no-such-nvidia-smi", zipped=True)
    assert done.returncode == 0, done.stderr
    assert lines[0]["source"] == "start" and lines[0]["values"]["schema"] == tm.SCHEMA
    assert lines[-1] == {"t_ns": lines[-1]["t_ns"], "source": "stop",
                         "values": {"why": "duration", "metrics": lines[-1]["values"]["metrics"], "gpu": 0,
                                    "errors": 0}}
    metrics = [x for x in lines if x["source"] == "metrics"]
    assert len(metrics) >= 2 and all(x["t_ns"] <= x["t_end_ns"] for x in metrics)
    assert metrics[0]["values"][f"vllm:num_requests_running{LABELS}"] == 4.0
    notes = [x["values"] for x in lines if x["source"] == "note"]
    assert notes == [{"about": "gpu", "error": False, "message": "no-such-nvidia-smi is not on PATH here: no GPU "
                                                                 "samples"}]
    read = read_telemetry(tmp_path / "telemetry.jsonl")
    assert read is not None and read.interval_s == 0.05 and [m.key for m in read.metrics][:2] == ["running", "waiting"]


def test_a_refused_or_broken_answer_is_a_note_once_and_never_stops_the_sampler(tmp_path, server):
    # a line of a kept family that is not a sample; one of a family not kept is not even read
    server.body = VLLM_CPU.encode() + b'vllm:num_requests_running{engine="0" 1\nnot a sample line\n'
    done, lines = run_sampler(tmp_path, "--url", server.url, "--interval", "0.05", "--duration", "0.2",
                              "--families", "vllm:num_requests_running", "--no-gpu")
    assert done.returncode == 0, done.stderr
    notes = [x["values"]["message"] for x in lines if x["source"] == "note" and x["values"]["error"]]
    assert notes == [f"{server.url}: 1 malformed lines left out"]
    (tmp_path / "small").mkdir()
    done, lines = run_sampler(tmp_path / "small", "--url", server.url, "--interval", "0.05", "--duration", "0.2",
                              "--max-bytes", "100", "--no-gpu")
    assert done.returncode == 0, done.stderr
    assert not [x for x in lines if x["source"] == "metrics"]
    refused = [x["values"]["message"] for x in lines if x["source"] == "note" and x["values"]["error"]]
    assert len(refused) == 1 and "over the 100 byte limit" in refused[0]
    assert lines[-1]["source"] == "stop" and lines[-1]["values"]["errors"] >= 2


def test_an_engine_without_metrics_families_gets_gpu_samples_only(tmp_path):
    done, lines = run_sampler(tmp_path, "--url", "http://127.0.0.1:9/metrics", "--interval", "0.05", "--duration",
                              "0.1", "--no-metrics", "--nvidia-smi", "no-such-nvidia-smi")
    assert done.returncode == 0, done.stderr
    assert [x["source"] for x in lines] == ["start", "note", "stop"]     # nothing asked of port 9: no error
    assert lines[-1]["values"]["errors"] == 0


@pytest.mark.parametrize("args", [["--interval", "0"], ["--families", "bad name"], ["--metrics", "[1]"],
                                  ["--metrics", "not json"], ["--max-bytes", "0"]])
def test_bad_arguments_exit_2_before_anything_is_written(tmp_path, args):
    done, lines = run_sampler(tmp_path, "--url", "http://127.0.0.1:9/metrics", *args)
    assert done.returncode == 2 and lines == [] and "telemetry" in done.stderr


# ---- the simulator's /metrics --------------------------------------------------------------------

@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_simulator_serves_its_engines_families_in_the_real_format(sim, engine):  # noqa: F811
    s = sim(engine, *(["--enable-metrics"] if engine == "sglang" else []))
    status, body = s.request("GET", "/metrics")
    assert status == 200
    values, bad = ex.parse_exposition(body.decode())
    assert bad == 0
    names = {k.partition("{")[0] for k in values}
    families = {m.family: m.kind for m in get_engine(engine).metrics if not m.key.startswith("spec_")}
    served = {f + "_total" if kind == "counter" else f for f, kind in families.items()}
    assert served <= names                       # speculative decoding is not simulated: the rest all there
    others = names - served - {f + "_created" for f in families}
    assert others == ({"sglang:cache_hit_rate", "sglang:num_requests_total", "sglang:num_requests_created"}
                      if engine == "sglang" else {"vllm:prompt_tokens_total", "vllm:prompt_tokens_created"})


# ---- a level's summary -------------------------------------------------------------------------

METRICS = [TelemetryMetric(**m.as_dict()) for m in get_engine("vllm").metrics]


def scrape(t_ns: int, running: float, queries: float, hits: float, *, engines: int = 1) -> TelemetryLine:
    values = {}
    for e in range(engines):
        label = f'{{engine="{e}",model_name="m"}}'
        values |= {f"vllm:num_requests_running{label}": running, f"vllm:kv_cache_usage_perc{label}": 0.5 + e / 10,
                   f"vllm:prefix_cache_queries_total{label}": queries, f"vllm:prefix_cache_hits_total{label}": hits,
                   f"vllm:prefix_cache_hits_created{label}": 1.7e9}
    return TelemetryLine(t_ns=t_ns, t_end_ns=t_ns + 5, source="metrics", values=values)


def gpu(t_ns: int, index: int, power: float | None, memory: float) -> TelemetryLine:
    return TelemetryLine(t_ns=t_ns, t_end_ns=t_ns + 5, source="gpu", values={
        "gpu": index, "sm_clock_mhz": 1980.0, "memory_used_mib": memory, "power_w": power, "utilization_pct": 90.0})


def test_a_level_reads_its_gauges_within_it_and_its_counters_between_the_brackets():
    t = TelemetryFile(metrics=METRICS, lines=[
        scrape(0, 0, 100, 0), scrape(100, 4, 200, 50, engines=2), scrape(160, 8, 300, 100, engines=2),
        scrape(200, 6, 400, 150, engines=2), scrape(300, 9, 500, 175, engines=2), scrape(400, 0, 600, 200, engines=2),
        gpu(0, 0, 100.0, 1000.0), gpu(0, 1, 90.0, 900.0), gpu(170, 0, 300.0, 5000.0), gpu(170, 1, 70.0, 5500.0),
        gpu(210, 0, 400.0, 5000.0), gpu(210, 1, None, 6000.0), gpu(400, 0, 120.0, 5000.0), gpu(400, 1, 80.0, 9000.0)])
    s = level_summary(t, 150, 250)       # brackets: the scrapes at 100 and 300; within: those at 160 and 200
    assert s is not None and s["bracketed"] and s["samples"] == 4
    assert s["running_mean"] == (16 + 12) / 2 and s["running_max"] == 16      # two engines: summed
    assert s["kv_cache_usage_max"] == pytest.approx(0.55)                     # two engines: their mean
    assert s["prefix_cache_queries"] == 600 and s["prefix_cache_hits"] == 250   # from 100 to 300
    assert s["prefix_cache_hit_rate"] == pytest.approx(250 / 600)
    assert s["spec_acceptance"] is None and s["spec_accept_length"] is None   # no speculative decoding here
    # GPUs: the samples taken within the level (170 and 210); [N/A] power is no figure
    assert [g["gpu"] for g in s["gpus"]] == [0, 1]
    assert s["gpus"][0]["power_w"] == 350.0 and s["gpus"][1]["power_w"] == 70.0
    assert s["gpu_power_w"] == 420.0 and s["gpu_memory_used_mib"] == 6000.0 and s["gpu_sm_clock_mhz"] == 1980.0
    short = level_summary(t, 110, 120)   # no sample within: the two brackets stand in for the gauges
    assert short is not None and short["running_max"] == 16 and short["prefix_cache_hits"] == 100


def test_a_level_without_a_sample_after_it_gets_no_counters_and_a_restart_no_negative_count():
    t = TelemetryFile(metrics=METRICS, lines=[scrape(0, 1, 100, 10), scrape(100, 2, 150, 20)])
    s = level_summary(t, 50, 500)
    assert s is not None and not s["bracketed"] and s["prefix_cache_queries"] is None and s["running_max"] == 2
    restarted = TelemetryFile(metrics=METRICS, lines=[scrape(0, 1, 900, 90), scrape(100, 2, 5, 0)])
    assert level_summary(restarted, 10, 90)["prefix_cache_queries"] is None   # type: ignore[index]
    assert level_summary(t, None, 10) is None and level_summary(TelemetryFile(metrics=METRICS), 1, 2) is None


def test_the_sampler_answered_partly_inside_a_level_is_no_bracket():
    samples = [scrape(0, 0, 0, 0), scrape(95, 0, 0, 0), scrape(300, 0, 0, 0)]
    window, bracketed = bracket(samples, 98, 200)      # the one asked at 95 was answered at 100: after 98
    assert [s.t_ns for s in window] == [0, 95, 300] and bracketed


def test_speculative_decoding_acceptance_from_vllms_counters_and_sglangs_gauges():
    v = {f"vllm:spec_decode_num_{k}_total{LABELS}": n for k, n in
         (("drafts", 0), ("draft_tokens", 0), ("accepted_tokens", 0))}
    w = {f"vllm:spec_decode_num_{k}_total{LABELS}": n for k, n in
         (("drafts", 281), ("draft_tokens", 534), ("accepted_tokens", 490))}
    t = TelemetryFile(metrics=METRICS, lines=[TelemetryLine(t_ns=0, source="metrics", values=v),
                                              TelemetryLine(t_ns=10, source="metrics", values=w)])
    s = level_summary(t, 1, 9)
    assert s is not None and s["spec_acceptance"] == pytest.approx(490 / 534)
    assert s["spec_accept_length"] == pytest.approx(1 + 490 / 281)
    sg = [TelemetryMetric(**m.as_dict()) for m in get_engine("sglang").metrics]
    labels = '{engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"}'
    lines = [TelemetryLine(t_ns=i * 10, source="metrics", values={
        f"sglang:spec_accept_rate{labels}": rate, f"sglang:spec_accept_length{labels}": 1 + 3 * rate,
        f"sglang:num_running_reqs{labels}": 4.0,
        'sglang:num_running_reqs{engine_type="unified",model_name="m",priority="1"}': 3.0})
        for i, rate in enumerate((0.5, 0.7, 0.9))]
    s = level_summary(TelemetryFile(metrics=sg, lines=lines), 5, 15)
    assert s is not None and s["spec_acceptance"] == pytest.approx(0.7)
    assert s["spec_accept_length"] == pytest.approx(3.1)
    assert s["running_max"] == 4.0      # the per-priority sample splits the total: left out
    assert value_of({"sglang:num_running_reqs": "NaN"}, sg[0]) is None


def test_repeats_pool_by_their_median():
    got = pooled([{"bracketed": True, "running_mean": 1.0}, None, {"bracketed": True, "running_mean": 3.0},
                  {"bracketed": False, "running_mean": 8.0, "gpus": [{"gpu": 0}]}])
    assert got is not None and got["runs"] == 3 and got["running_mean"] == 3.0 and not got["bracketed"]
    assert got["gpus"] == [{"gpu": 0}] and pooled([None]) is None


def test_a_torn_last_line_or_a_foreign_line_is_left_out_and_a_file_without_its_start_is_none(tmp_path):
    path = tmp_path / "telemetry.jsonl"
    head = {"t_ns": 0, "source": "start", "values": {"schema": tm.SCHEMA, "interval_s": 1.0, "metrics": []}}
    path.write_text("\n".join([json.dumps(head), '{"t_ns": 1, "source": "metrics", "values": {}}', "[1, 2]",
                               '{"source": "metrics"}', '{"t_ns": 2, "sour']) + "\n")
    read = read_telemetry(path)
    assert read is not None and [x.t_ns for x in read.lines] == [0, 1]
    path.write_text('{"t_ns": 1, "source": "metrics", "values": {}}\n')
    assert read_telemetry(path) is None and read_telemetry(tmp_path / "missing") is None


# ---- the playbook's key ----------------------------------------------------------------------------

@pytest.mark.parametrize("telemetry, key", [({"interval_s": 0}, "telemetry.interval_s"),
                                            ({"interval_s": "fast"}, "telemetry.interval_s"),
                                            ({"every": 1}, "telemetry.every")])
def test_a_bad_telemetry_setting_names_the_file_and_key(tmp_path, telemetry, key):
    pb = {"name": "p", "hosts": "localhost", "engine": "sim", "model": {"path": "/m"}, "configs": [{"name": "a"}],
          "telemetry": telemetry}
    (tmp_path / "playbook.yaml").write_text(yaml.safe_dump(pb))
    with pytest.raises(InputError) as e:
        load_playbook(tmp_path / "playbook.yaml")
    assert "playbook.yaml" in str(e.value) and key in str(e.value)
    pb["telemetry"] = {"interval_s": 0.25, "enabled": False}
    (tmp_path / "playbook.yaml").write_text(yaml.safe_dump(pb))
    assert load_playbook(tmp_path / "playbook.yaml")[0].telemetry.interval_s == 0.25
