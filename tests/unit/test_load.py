"""Workloads without a clock: the open loop's arrival schedules (statistics of a fixed random_state),
goodput and the SLO's verdict on a level, max_load's bisection, and the playbook's scenario keys."""

from __future__ import annotations

import json
import re
import statistics
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from itertools import pairwise

import pytest

from harness.errors import InputError
from harness.plan import load_sweep
from harness.remote.bench import run_benchmark
from harness.remote.exchange import Outcome
from harness.remote.levels import level_meets, request_meets, summarize_level
from harness.remote.maxload import bisect_max_load
from harness.remote.workload import arrival_offsets


def gaps(offsets: list[int]) -> list[float]:
    return [(b - a) / 1e9 for a, b in pairwise(offsets)]


# ---- arrival schedules ---------------------------------------------------------------------

@pytest.mark.parametrize("rate", [10.0, 200.0])
def test_poisson_gaps_have_the_rates_mean_and_a_coefficient_of_variation_of_one(rate):
    g = gaps(arrival_offsets(rate, 20001, "poisson", random_state=7))
    mean = statistics.fmean(g)
    assert mean == pytest.approx(1 / rate, rel=0.03)
    assert statistics.pstdev(g) / mean == pytest.approx(1.0, abs=0.03)
    # memoryless: the share of gaps above the mean is e^-1
    assert sum(x > 1 / rate for x in g) / len(g) == pytest.approx(0.3679, abs=0.015)


@pytest.mark.parametrize("shape", [0.25, 1.0, 4.0])
def test_gamma_gaps_keep_the_mean_and_burstiness_sets_their_spread(shape):
    g = gaps(arrival_offsets(50.0, 20001, "gamma", burstiness=shape, random_state=3))
    mean = statistics.fmean(g)
    assert mean == pytest.approx(1 / 50, rel=0.05)
    assert statistics.pstdev(g) / mean == pytest.approx(shape ** -0.5, rel=0.06)


def test_a_constant_arrival_is_exactly_one_over_the_rate_and_the_first_send_is_at_zero():
    offsets = arrival_offsets(40.0, 11, "constant")
    assert offsets[0] == 0
    assert offsets == [round(i * 25e6) for i in range(11)]


def test_the_same_random_state_draws_the_same_schedule_and_another_a_different_one():
    a = arrival_offsets(100.0, 50, "poisson", random_state=1)
    assert a == arrival_offsets(100.0, 50, "poisson", random_state=1)
    assert a != arrival_offsets(100.0, 50, "poisson", random_state=2)
    assert all(x < y for x, y in pairwise(a))


def test_a_bad_arrival_is_refused():
    with pytest.raises(ValueError):
        arrival_offsets(0.0, 5)
    with pytest.raises(ValueError):
        arrival_offsets(5.0, 5, "weibull")


# ---- goodput -------------------------------------------------------------------------------

def record(ttft: float | None, itl: list[float], e2e: float | None = None, error: str | None = None) -> dict:
    tpot = (sum(itl) / len(itl)) if itl else None
    return {"ttft_ms": ttft, "itl_ms": itl, "tpot_ms": tpot, "e2e_ms": e2e if e2e is not None else
            (ttft or 0) + sum(itl), "error": error}


def test_a_request_meets_the_slo_only_when_every_bound_holds_for_its_own_values():
    slo = {"ttft_ms_p99": 100, "itl_ms_p50": 20}
    assert request_meets(record(90, [10, 10, 50]), slo)            # its own ITL median is 10
    assert not request_meets(record(90, [10, 50, 50]), slo)        # ... here 50
    assert not request_meets(record(110, [10]), slo)               # TTFT over
    assert request_meets(record(110, [10]), {"itl_ms_max": 10})    # only the bounds given count
    assert not request_meets(record(110, [10]), {"itl_ms_max": 9.9})
    assert request_meets(record(50, []), {"itl_ms_p99": 1, "tpot_ms_p50": 1})  # one token: no gaps to bound
    assert not request_meets(record(50, [1], error="timeout"), {"ttft_ms_p99": 100})
    assert not request_meets(record(None, []) | {"e2e_ms": None}, {"e2e_ms_p99": 100})


def outcome(sent_ms: float, first_ms: float, gap_ms: float, tokens: int, scheduled_ms: float | None = None,
            error: str | None = None) -> Outcome:
    ns = 1_000_000
    times = [round((first_ms + i * gap_ms) * ns) for i in range(tokens)] if error is None else []
    end = times[-1] if times else round(first_ms * ns)
    return Outcome(round(sent_ms * ns), end, times, tokens if error is None else None, 8, 200, error,
                   scheduled_ns=None if scheduled_ms is None else round(scheduled_ms * ns))


def test_goodput_is_the_levels_requests_within_every_bound_over_its_duration():
    outcomes = [outcome(0, 50, 10, 5), outcome(0, 150, 10, 5), outcome(100, 180, 30, 5),
                outcome(200, 300, 10, 5, error="timeout")]
    level, _ = summarize_level(4, outcomes, {"ttft_ms_p99": 100, "itl_ms_p99": 20})
    # duration: first send (0) to last end (the third request's last token: 180 + 4 x 30 = 300 ms)
    assert level["duration_s"] == pytest.approx(0.3)
    assert level["slo_met_requests"] == 1            # the second's TTFT is 150, the third's ITL 30
    assert level["goodput_req_s"] == pytest.approx(1 / 0.3)
    assert level["slo_met"] is False                 # a request failed


def test_an_open_loop_request_counts_its_latency_from_its_scheduled_time():
    late = outcome(sent_ms=40, first_ms=90, gap_ms=10, tokens=3, scheduled_ms=0)
    level, records = summarize_level(None, [late], {"ttft_ms_p99": 60})
    assert records[0]["ttft_ms"] == pytest.approx(90)     # not 50: it waited 40 ms to be sent
    assert records[0]["e2e_ms"] == pytest.approx(110)
    assert records[0]["scheduled_ns"] == 0 and records[0]["start_ns"] == 40_000_000
    assert level["slo_met_requests"] == 0 and level["slo_met"] is False


def test_a_level_meets_the_slo_by_its_own_statistics():
    level = {"completed": 10, "failed": 0, "ttft_ms": {"p99": 90.0}, "itl_ms": {"p99": 25.0}, "tpot_ms": {"p50": None}}
    assert level_meets(level, {"ttft_ms_p99": 100, "tpot_ms_p50": 5})
    assert not level_meets(level, {"ttft_ms_p99": 100, "itl_ms_p99": 20})
    assert not level_meets(level | {"failed": 1}, {"ttft_ms_p99": 100})
    assert not level_meets(level | {"completed": 0}, {"ttft_ms_p99": 100})


# ---- bisection -----------------------------------------------------------------------------

def threshold(limit: float):
    tried: list[float] = []

    def meets(load: float) -> bool:
        tried.append(load)
        return load <= limit
    return meets, tried


@pytest.mark.parametrize("limit", [1, 2, 7, 33, 63, 64])
def test_integer_bisection_finds_the_exact_highest_load_in_log2_probes(limit):
    meets, tried = threshold(limit)
    found = bisect_max_load(1, 64, 10, True, meets)
    assert found["value"] == limit and found["met"]
    assert len(tried) <= 2 + 6                       # the ends, then log2(63) halvings
    assert [p["load"] for p in found["probes"]] == tried
    assert tried[:2] == [1, 64] or (limit == 64 and tried == [1, 64])


def test_bisection_stops_after_steps_probes_with_the_best_load_that_met():
    meets, tried = threshold(37)
    found = bisect_max_load(1, 64, 4, True, meets)
    assert len(tried) == 4 and tried == [1, 64, 32, 48]
    assert found["value"] == 32


def test_rates_bisect_in_halves_to_within_the_steps():
    meets, tried = threshold(13.3)
    found = bisect_max_load(1.0, 100.0, 12, False, meets)
    assert len(tried) == 12
    assert 13.3 - (99 / 2 ** 10) <= found["value"] <= 13.3


def test_when_the_low_probe_misses_nothing_met_and_nothing_else_is_tried():
    meets, tried = threshold(0.5)
    assert bisect_max_load(1, 64, 6, True, meets) == {"value": None, "met": False,
                                                      "probes": [{"load": 1, "met": False}]}
    assert tried == [1]


def test_one_step_or_equal_ends_probe_once():
    meets, tried = threshold(10)
    assert bisect_max_load(4, 64, 1, True, meets)["value"] == 4 and tried == [4]
    with pytest.raises(ValueError):
        bisect_max_load(8, 4, 3, True, meets)


# ---- the playbook's keys -------------------------------------------------------------------

INVENTORY = "all:\n  hosts:\n    localhost: {transport: local, venv: /opt/venv}\n"
BASE = """\
name: t
hosts: localhost
engine: sim
model: {path: /models/m}
configs: [{name: a}]
"""


def sweep(tmp_path, extra: str):
    (tmp_path / "inventory.yaml").write_text(INVENTORY)
    (tmp_path / "pb.yaml").write_text(BASE + extra)
    return load_sweep(tmp_path / "pb.yaml", tmp_path / "inventory.yaml")


SCENARIOS = """\
benchmark:
  scenarios:
    - {name: chat, input_tokens: 128, output_tokens: 32, concurrency: [1, 4]}
    - {name: rag, input_tokens: 2000, output_tokens: 16, request_rate: [2.5], arrival: gamma, burstiness: 0.5}
"""


def test_scenarios_load_with_their_kinds(tmp_path):
    s = sweep(tmp_path, SCENARIOS + "slo: {ttft_ms_p99: 500}\n")
    b = s.runs[0].benchmark
    assert [(sc.name, sc.kind, sc.loads) for sc in b.scenarios] == [("chat", "concurrency", [1, 4]),
                                                                    ("rag", "request_rate", [2.5])]


@pytest.mark.parametrize("extra, words", [
    ("  concurrency: [8]\n", "benchmark.concurrency"),
    ("  max_tokens: 64\n", "benchmark.max_tokens"),
    ("  prompt_tokens: 64\n", "benchmark.prompt_tokens"),
    ("  ignore_eos: false\n", "benchmark.ignore_eos"),
])
def test_scenarios_beside_the_single_workloads_keys_are_refused_naming_them(tmp_path, extra, words):
    with pytest.raises(InputError, match=words):
        sweep(tmp_path, SCENARIOS + extra)


@pytest.mark.parametrize("scenario, words", [
    ("{name: x, input_tokens: 8, output_tokens: 8}", "concurrency .closed loop. or request_rate"),
    ("{name: x, input_tokens: 8, output_tokens: 8, concurrency: [1], request_rate: [1]}", "one of the two"),
    ("{name: x, input_tokens: 8, output_tokens: 8, concurrency: []}", "no levels"),
    ("{name: x, input_tokens: 0, output_tokens: 8, concurrency: [1]}", "input_tokens"),
    ("{name: x, input_tokens: 8, output_tokens: 8, request_rate: [0]}", "request rates above 0"),
])
def test_a_bad_scenario_is_named(tmp_path, scenario, words):
    with pytest.raises(InputError, match=words):
        sweep(tmp_path, f"benchmark:\n  scenarios:\n    - {scenario}\n")


def test_max_load_needs_its_scenario_and_an_slo(tmp_path):
    search = "search: {max_load: {scenario: chat, low: 1, high: 16, steps: 5}}\n"
    with pytest.raises(InputError, match="an SLO"):
        sweep(tmp_path, SCENARIOS + search)
    with pytest.raises(InputError, match="scenario 'nope'"):
        sweep(tmp_path, SCENARIOS + search.replace("chat", "nope") + "slo: {ttft_ms_p99: 500}\n")
    with pytest.raises(InputError, match="whole numbers"):
        sweep(tmp_path, SCENARIOS + search.replace("high: 16", "high: 16.5") + "slo: {ttft_ms_p99: 500}\n")
    s = sweep(tmp_path, SCENARIOS + search + "slo: {ttft_ms_p99: 500}\n")
    assert s.playbook.search is not None and s.playbook.search.max_load is not None


# ---- prompts without a tokenizer endpoint ----------------------------------------------------

class CountingServer(ThreadingHTTPServer):
    """A completions server with no /tokenize whose usage counts a prompt's words plus one (a BOS),
    and the word "which" as two tokens: what it saw is kept."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), CountingHandler)
        self.prompts: list[tuple[bool, str]] = []
        self.hang = threading.Event()      # set: streamed requests get no answer (until released)
        self.release = threading.Event()
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


def count(prompt: str) -> int:
    return 1 + sum(2 if w == "which" else 1 for w in prompt.split())


class CountingHandler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if self.path != "/v1/completions":
            self.send_error(404)
            return
        prompt, stream = body["prompt"], bool(body.get("stream"))
        self.server.prompts.append((stream, prompt))
        if stream and self.server.hang.is_set():
            self.server.release.wait(30)
            return
        usage = {"prompt_tokens": count(prompt), "completion_tokens": body["max_tokens"],
                 "total_tokens": count(prompt) + body["max_tokens"]}
        if not stream:
            data = json.dumps({"choices": [{"index": 0, "text": " a", "finish_reason": "length"}],
                               "usage": usage}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        events = [{"choices": [{"index": 0, "text": " a", "finish_reason": None}]}
                  for _ in range(body["max_tokens"])] + [{"choices": [], "usage": usage}]
        data = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def counting():
    server = CountingServer()
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield server
    server.release.set()
    server.shutdown()
    server.server_close()


def test_without_a_tokenizer_the_prompt_length_is_calibrated_from_usage_and_mismatches_counted(counting):
    scenario = {"name": "s", "input_tokens": 30, "output_tokens": 3, "concurrency": [4], "requests": 40}
    result = run_benchmark(counting.url, "m", scenarios=[scenario], warmup=0, random_state=5)
    (level,) = result["levels"]
    assert level["prompt_source"] == "usage-calibrated"
    measured = [p for stream, p in counting.prompts if stream]
    probes = [p for stream, p in counting.prompts if not stream]
    assert len(measured) == 40 and probes
    # each request opens with its own words, none the probes' opening: nothing shares a cached prefix
    openings = [tuple(p.split()[:6]) for p in measured]
    assert len(set(openings)) == len(openings)
    assert not set(openings) & {tuple(p.split()[:6]) for p in probes}
    # the server's own count of each prompt, and those that are not 30 (an opening with "which") counted
    expected = Counter(count(p) for p in measured)
    assert level["prompt_tokens_reported"] == {str(k): v for k, v in sorted(expected.items())}
    assert level["prompt_tokens_mismatches"] == sum(v for k, v in expected.items() if k != 30)
    assert expected[30] > 0 and level["prompt_tokens_mismatches"] > 0


def test_the_same_random_state_builds_the_same_prompts(counting):
    scenario = {"name": "s", "input_tokens": 12, "output_tokens": 1, "concurrency": [2], "requests": 6}
    run_benchmark(counting.url, "m", scenarios=[scenario], warmup=1, random_state=9)
    first = [p for s, p in counting.prompts if s]
    counting.prompts.clear()
    run_benchmark(counting.url, "m", scenarios=[scenario], warmup=1, random_state=9)
    assert sorted(first) == sorted(p for s, p in counting.prompts if s) and len(first) == 7


def test_scenarios_refuse_the_single_workloads_arguments():
    scenario = {"name": "s", "input_tokens": 12, "output_tokens": 1, "concurrency": [2]}
    with pytest.raises(ValueError, match="no prompt nor prompt_tokens"):
        run_benchmark("http://127.0.0.1:9", "m", scenarios=[scenario], prompt="hi")
    with pytest.raises(ValueError, match="no scenario named 'x'"):
        run_benchmark("http://127.0.0.1:9", "m", scenarios=[scenario],
                      search={"scenario": "x", "slo": {"ttft_ms_p99": 1}, "low": 1, "high": 2, "steps": 2})


@pytest.mark.parametrize("plan, words", [
    ('{"scenarios": [{"name": "s", "input_tokens": 8, "output_tokens": 1}]}', "concurrency .closed loop. or"),
    ('{"scenarios": [{"name": "s", "input_tokens": 8, "output_tokens": 1, "concurrency": [1]}], '
     '"slo": {"ttft_p99": 5}}', "slo: metrics like ttft_ms_p99"),
    ('{"scenarios": [{"name": "s", "input_tokens": 8, "output_tokens": 1, "concurrency": [1]}], '
     '"search": {"low": "1", "high": 2, "steps": 2, "slo": {"ttft_ms_p99": 1}}}', "low and high numbers"),
    ('{"scenarios": [], "random_state": "x"}', "random_state must be an integer"),
    ('{"scenario": []}', "--plan is a JSON object of"),
    ('[1]', "--plan is a JSON object of"),
])
def test_a_bad_plan_exits_2_with_a_message_not_a_traceback(plan, words, capsys):
    from harness.remote.bench import main
    assert main(["--url", "http://127.0.0.1:9", "--model", "m", "--plan", plan]) == 2
    err = capsys.readouterr().err
    assert re.search(words, err) and "Traceback" not in err


def test_a_plan_with_scenarios_refuses_the_single_workloads_options(capsys):
    from harness.remote.bench import main
    plan = '{"scenarios": [{"name": "s", "input_tokens": 8, "output_tokens": 1, "concurrency": [1]}]}'
    assert main(["--url", "http://127.0.0.1:9", "--model", "m", "--plan", plan, "--concurrency", "4"]) == 2
    assert "replace --concurrency" in capsys.readouterr().err


def test_the_open_loop_sends_on_schedule_whatever_is_in_flight(counting):
    """No coordinated omission: with a server that answers nothing, every request of the level is still
    sent, each at its turn, before the first one times out (a closed loop of one stream would have
    sent one)."""
    counting.hang.set()
    scenario = {"name": "s", "input_tokens": 10, "output_tokens": 2, "request_rate": [200.0], "requests": 12,
                "arrival": "constant"}
    result = run_benchmark(counting.url, "m", scenarios=[scenario], warmup=0, timeout=3)
    reqs = result["requests"]
    assert len(reqs) == 12 and all(r["error"] == "timeout" for r in reqs)
    first_end = min(r["end_ns"] for r in reqs)
    assert all(r["scheduled_ns"] <= r["start_ns"] < first_end for r in reqs)
    assert [r["scheduled_ns"] - reqs[0]["scheduled_ns"] for r in reqs] == [i * 5_000_000 for i in range(12)]
    assert sum(stream for stream, _ in counting.prompts) == 12
    (level,) = result["levels"]
    assert level["completed"] == 0 and level["schedule_lag_ms"]["max"] is not None


def test_max_load_without_scenarios_says_it_needs_them(tmp_path):
    with pytest.raises(InputError, match="search.max_load needs benchmark.scenarios"):
        sweep(tmp_path, "slo: {ttft_ms_p99: 5}\nsearch: {max_load: {low: 1, high: 4}}\n")


def test_an_slo_without_scenarios_gives_the_single_workloads_levels_their_goodput(counting):
    result = run_benchmark(counting.url, "m", concurrency=[2], requests=4, max_tokens=3, warmup=0,
                           slo={"ttft_ms_p99": 600000, "tpot_ms_p50": 600000})
    (level,) = result["levels"]
    assert level["slo_met_requests"] == 4 and level["slo_met"] is True
    assert level["goodput_req_s"] == pytest.approx(4 / level["duration_s"])
    assert "scenario" not in level and result["slo"] == {"ttft_ms_p99": 600000, "tpot_ms_p50": 600000}


def test_a_probe_sends_at_least_two_requests_a_stream_whatever_the_scenarios_count(counting):
    """On an H200 (vLLM 0.26.0) a probe at 128 streams of a scenario written with `requests: 32` had at
    most 32 requests in flight: the search's load must be the load it runs."""
    scenario = {"name": "s", "input_tokens": 8, "output_tokens": 2, "concurrency": [2], "requests": 4}
    result = run_benchmark(counting.url, "m", scenarios=[scenario], warmup=0, random_state=1,
                           search={"scenario": "s", "slo": {"ttft_ms_p99": 600000}, "low": 1, "high": 12,
                                   "steps": 2})
    own, *probes = result["levels"]
    assert own["requests"] == 4 and not own.get("probe")
    assert [(p["concurrency"], p["requests"]) for p in probes] == [(1, 4), (12, 24)]


def test_a_scenario_with_fewer_requests_than_streams_is_refused(tmp_path):
    with pytest.raises(InputError, match="8 requests never keep 16 streams in flight"):
        sweep(tmp_path, "benchmark:\n  scenarios:\n    - {name: chat, input_tokens: 8, output_tokens: 2, "
                        "concurrency: [1, 16], requests: 8}\n")
