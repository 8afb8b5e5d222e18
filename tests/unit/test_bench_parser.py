"""The benchmark client's parsing and arithmetic: recorded SGLang / vLLM streams, hand-computed cases."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from harness.remote.exchange import Outcome, parse_exchange
from harness.remote.levels import request_record, summarize_level
from harness.remote.stats import distribution, percentile

STREAMS = Path(__file__).parents[1] / "fixtures" / "streams"
MS = 1_000_000  # ns


def events_of(name: str) -> list[bytes]:
    text = (STREAMS / name).read_bytes()
    return [e + b"\n\n" for e in text.split(b"\n\n") if e.strip()]


def response(events: list[bytes], framing: str = "chunked", status: str = "200 OK") -> bytes:
    """The bytes a server sends: one HTTP chunk per event (as uvicorn does), or a close-delimited body."""
    head = f"HTTP/1.1 {status}\r\ncontent-type: text/event-stream\r\n"
    if framing == "chunked":
        body = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"
        return (head + "transfer-encoding: chunked\r\n\r\n").encode() + body
    return (head + "connection: close\r\n\r\n").encode() + b"".join(events)


def deliveries(raw: bytes):
    """The same bytes at once, and one byte a read (read i stamped i)."""
    yield [(1, raw)]
    yield [(i, raw[i:i + 1]) for i in range(len(raw))]


def parse_all_ways(name: str) -> list[Outcome]:
    return [parse_exchange(0, 10, reads)
            for framing in ("chunked", "close") for reads in deliveries(response(events_of(name), framing))]


@pytest.mark.parametrize("name, chunks, tokens, prompt_tokens", [
    ("sglang_completions.txt", 3, 3, 16),
    ("vllm_completions_interval4.txt", 2, 8, 16),
    ("sglang_chat_reasoning.txt", 3, 3, 20),
    ("vllm_chat_reasoning.txt", 2, 2, 20),
    ("usage_on_last_chunk_no_done.txt", 2, 2, 4),
])
def test_a_complete_stream_counts_text_chunks_and_takes_tokens_from_usage(name, chunks, tokens,
                                                                          prompt_tokens):
    for outcome in parse_all_ways(name):
        assert outcome.error is None
        assert (len(outcome.times), outcome.tokens, outcome.prompt_tokens) == (chunks, tokens, prompt_tokens)


def test_a_stream_without_usage_leaves_tokens_unknown_and_the_record_counts_chunks():
    for outcome in parse_all_ways("no_usage.txt"):
        assert (len(outcome.times), outcome.tokens, outcome.error) == (3, None, None)
        record = request_record(1, 0, outcome)
        assert (record["output_tokens"], record["tokens_from"]) == (3, "chunks")


@pytest.mark.parametrize("name, message", [
    ("sglang_error_midstream.txt", "The decoder ran out of KV cache"),
    ("error_object_midstream.txt", "Engine core died"),
])
def test_an_error_event_on_a_200_stream_fails_the_request_with_its_message(name, message):
    for outcome in parse_all_ways(name):
        assert outcome.error == message
        assert len(outcome.times) == 1


def test_a_server_s_long_error_is_cut_to_an_excerpt_on_one_line():
    """An error event of a megabyte (a server echoing the prompt back) is written into requests.jsonl,
    bench.json and the run's error once a request: an excerpt of it is."""
    event = b'data: {"object": "error", "message": "' + b"x\\n" * 350_000 + b'"}\n\n'
    for outcome in (parse_exchange(0, 10, [(1, response([event], framing))]) for framing in ("chunked", "close")):
        assert outcome.error.startswith("x x x") and outcome.error.endswith("...") and len(outcome.error) < 1100


def usage_stream(usage: bytes) -> list[tuple[int, bytes]]:
    events = [b'data: {"choices": [{"text": "a"}]}\n\n', b'data: {"choices": [{"text": "b"}], "usage": '
              + usage + b'}\n\n', b"data: [DONE]\n\n"]
    return [(1 * MS, response(events, "close"))]


@pytest.mark.parametrize("usage, field", [
    (b'{"completion_tokens": "3", "prompt_tokens": 4}', "completion_tokens"),
    (b'{"completion_tokens": 2, "prompt_tokens": -1}', "prompt_tokens"),
    (b'{"completion_tokens": 2.0}', "completion_tokens"),
    (b'{"completion_tokens": true}', "completion_tokens"),
    (b'{"completion_tokens": 1' + b"0" * 400 + b"}", "completion_tokens"),
    (b'{"completion_tokens": 2, "prompt_tokens": 1000000001}', "prompt_tokens"),
], ids=["a-string", "negative", "a-float", "a-boolean", "10^400", "past-a-billion"])
def test_a_token_count_that_is_no_count_fails_the_request_naming_the_field(usage, field):
    """A server that sends `"completion_tokens": "3"` or -1 has sent no count, and one of 10^400 broke the
    level's arithmetic (OverflowError: the run lost its bench.json): the request fails, saying which
    count was wrong, and the level is summed as ever."""
    outcome = parse_exchange(0, 10 * MS, usage_stream(usage))
    assert outcome.error.startswith(f"malformed response: usage.{field} is not a token count (a whole number "
                                    "from 0 to 1,000,000,000): ")
    assert len(outcome.error) < 200
    level, (record,) = summarize_level(1, [outcome], {"ttft_ms_p99": 1000})
    assert (level["completed"], level["failed"], level["output_tokens"], level["slo_met"]) == (0, 1, 0, False)


def test_a_usage_without_a_count_counts_the_text_chunks_instead():
    outcome = parse_exchange(0, 10 * MS, usage_stream(b'{"completion_tokens": null}'))
    assert (outcome.error, outcome.tokens, outcome.prompt_tokens) == (None, None, None)
    level, (record,) = summarize_level(1, [outcome])
    assert (record["output_tokens"], record["tokens_from"]) == (2, "chunks")
    assert (level["completed"], level["output_tokens"]) == (1, 2)


def aborted_stream(usage: bool) -> list[bytes]:
    """What vLLM sends for a request its engine aborted: HTTP 200, tokens, a last event with
    finish_reason "abort", usage when asked, [DONE]."""
    events = [b'data: {"choices": [{"index": 0, "text": " w", "finish_reason": null}]}\n\n'] * 3
    events.append(b'data: {"choices": [{"index": 0, "text": "", "finish_reason": "abort"}]}\n\n')
    if usage:
        events.append(b'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}\n\n')
    return events + [b"data: [DONE]\n\n"]


def test_a_stream_the_server_aborted_is_a_failed_request_with_its_tokens_so_far():
    """It was counted completed, and a level that lost requests to aborts met its SLO."""
    for usage, said in ((True, "3 tokens"), (False, "3 text chunks")):
        for framing in ("chunked", "close"):
            for reads in deliveries(response(aborted_stream(usage), framing)):
                outcome = parse_exchange(0, 10, reads)
                assert outcome.error == f"server aborted the request (finish_reason abort) after {said}"
                assert len(outcome.times) == 3
    level, _ = summarize_level(1, [outcome], {"ttft_ms_p99": 1000})
    assert (level["completed"], level["failed"], level["output_tokens"], level["slo_met"]) == (0, 1, 0, False)
    assert level["errors"] == [{"error": "server aborted the request (finish_reason abort) after 3 text chunks",
                                "count": 1}]


def test_an_answer_shorter_than_the_tokens_asked_with_ignore_eos_is_failed_by_its_usage():
    """Asked to ignore EOS, the server owes `max_tokens` exactly; fewer by its own usage is a request
    stopped short. A count from chunks (no usage) holds it to nothing: a chunk may carry several."""
    whole = Outcome(0, 41 * MS, [10 * MS, 20 * MS, 30 * MS, 40 * MS], 4, 16, 200, None)
    short = Outcome(1 * MS, 31 * MS, [11 * MS, 21 * MS, 31 * MS], 3, 16, 200, None)
    unknown = Outcome(2 * MS, 32 * MS, [12 * MS, 22 * MS], None, 16, 200, None)
    level, records = summarize_level(3, [whole, short, unknown], {"ttft_ms_p99": 1000}, asked=4)
    assert [r["error"] for r in records] == [None, "short answer: 3 of the 4 tokens asked with ignore_eos", None]
    assert (level["completed"], level["failed"], level["output_tokens"], level["slo_met"]) == (2, 1, 6, False)
    assert level["decode"]["streams"] == 2   # the short one is no stream of the first wave
    level, _ = summarize_level(3, [whole, short, unknown], {"ttft_ms_p99": 1000})
    assert (level["completed"], level["slo_met"]) == (3, True)


@pytest.mark.parametrize("error", ["timeout", "connection closed mid-response", "benchmark interrupted"])
def test_a_connection_that_ends_after_the_response_head_says_how_it_ended(error):
    """It read "not an event stream: (empty)", as if the server had answered something else."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    assert parse_exchange(0, 5, [(1, head)], error).error == f"{error} after the response head and 0 bytes of its body"
    part = b'2c\r\ndata: {"choices": [{"te'   # an event's chunk, cut off
    cut = parse_exchange(0, 5, [(1, head), (2, part)], error)
    assert cut.error == f"{error} after the response head and {len(part)} bytes of its body"


def test_the_chat_api_s_first_event_naming_the_role_is_no_empty_event():
    """vLLM and SGLang open a chat stream with delta {"role": "assistant", "content": ""}: no token."""
    for outcome in parse_all_ways("vllm_chat_reasoning.txt"):
        assert (len(outcome.times), outcome.empty_events) == (2, 1)   # the closing event only
    for outcome in parse_all_ways("sglang_chat_reasoning.txt"):
        assert (len(outcome.times), outcome.empty_events) == (3, 1)


def test_a_chunk_is_stamped_by_the_read_that_completes_it_and_a_shared_read_shares_the_stamp():
    raw = response(events_of("sglang_completions.txt"), "close")
    first = raw.index(b"data:") + 40                      # the first event split across two reads
    second_event = raw.index(b"data:", first)
    fourth_event = raw.index(b"data:", raw.index(b"data:", second_event + 1) + 1)
    reads = [(100, raw[:first]), (150, raw[first:second_event]), (300, raw[second_event:fourth_event]),
             (400, raw[fourth_event:])]
    outcome = parse_exchange(50, 400, reads)
    assert outcome.times == [150, 300, 300]
    assert outcome.tokens == 3


def test_crlf_event_separators_are_understood():
    events = [e.replace(b"\n", b"\r\n") for e in events_of("sglang_completions.txt")]
    outcome = parse_exchange(0, 1, [(1, response(events))])
    assert (len(outcome.times), outcome.tokens, outcome.error) == (3, 3, None)


def test_events_are_the_same_whatever_the_reads_split_and_a_long_one_is_joined_once():
    """The events of a body split at every kind of place (a blank line cut across three reads
    included) are those of the whole body split at once."""
    import random
    import re

    from harness.remote.exchange import _sse_events
    rng = random.Random(7)
    for _ in range(2000):
        pieces = [b"a", b"\r", b"\n", b"data: x", b"\r\n", b"\n\n"]
        data = b"".join(rng.choice(pieces) for _ in range(rng.randint(0, 20)))
        cuts = sorted(rng.sample(range(len(data) + 1), min(len(data) + 1, rng.randint(0, 6))))
        reads = [(i, data[a:b]) for i, (a, b) in enumerate(zip([0, *cuts], [*cuts, len(data)], strict=True))]
        *whole, rest = re.split(rb"\r?\n\r?\n", data)
        for ended in (True, False):
            assert [e for _, e in _sse_events(reads, ended)] == whole + ([rest] if ended and rest.strip() else [])


def test_a_non_200_status_fails_with_the_status_and_an_excerpt_of_the_body():
    raw = (b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 61\r\n\r\n"
           b'{"object":"error","message":"model glm-6 not found","code":400}')
    outcome = parse_exchange(0, 1, [(1, raw)])
    assert outcome.status == 400
    assert outcome.error.startswith("HTTP 400: ")
    assert "model glm-6 not found" in outcome.error


def test_the_server_s_own_error_wins_over_how_the_connection_ended():
    raw = response(events_of("sglang_error_midstream.txt"), "close")
    assert parse_exchange(0, 1, [(1, raw)], "connection closed mid-response").error == \
        "The decoder ran out of KV cache"


def test_a_connection_failure_keeps_the_chunks_seen_before_it():
    raw = response(events_of("sglang_completions.txt"), "close")
    cut = raw.index(b"data:", raw.index(b"data:") + 1) + 5
    outcome = parse_exchange(0, 1, [(7, raw[:cut])], "connection error: [Errno 104] Connection reset by peer")
    assert outcome.times == [7]
    assert outcome.error == "connection error: [Errno 104] Connection reset by peer"


def test_no_response_and_a_body_that_is_not_an_event_stream_are_failures():
    assert parse_exchange(0, 1, [], "timeout").error == "timeout"
    raw = b'HTTP/1.1 200 OK\r\ncontent-length: 13\r\n\r\n{"text":"hi"}'
    assert parse_exchange(0, 1, [(1, raw)]).error == 'not an event stream: {"text":"hi"}'
    assert parse_exchange(0, 1, [(1, b"SSH-2.0-OpenSSH_9.6\r\n\r\n")]).error == "malformed response head"


def test_request_metrics_follow_the_definitions():
    outcome = Outcome(sent_ns=0, end_ns=16 * MS, times=[10 * MS, 12 * MS, 15 * MS], tokens=5,
                      prompt_tokens=16, status=200, error=None)
    record = request_record(8, 3, outcome)
    assert record["ttft_ms"] == 10.0
    assert record["itl_ms"] == [2.0, 3.0]
    assert record["e2e_ms"] == 15.0
    assert record["tpot_ms"] == (15.0 - 10.0) / 4
    assert (record["concurrency"], record["index"], record["output_tokens"], record["chunks"]) == (8, 3, 5, 3)


def test_tpot_is_left_out_below_two_tokens():
    one = Outcome(0, 2 * MS, [MS], 1, None, 200, None)
    assert request_record(1, 0, one)["tpot_ms"] is None


def test_percentiles_interpolate_linearly_between_closest_ranks():
    xs = [1.0, 2.0, 3.0, 4.0]
    assert percentile(xs, 50) == 2.5
    assert percentile(xs, 90) == pytest.approx(3.7, abs=1e-12)
    assert percentile(xs, 99) == pytest.approx(3.97, abs=1e-12)
    assert percentile([5.0], 99) == 5.0
    stats = distribution([4.0, 1.0, 3.0, 2.0])
    assert (stats["mean"], stats["min"], stats["max"]) == (2.5, 1.0, 4.0)
    assert stats["std"] == pytest.approx(math.sqrt(1.25), abs=1e-12)
    assert stats["p95"] == pytest.approx(3.85, abs=1e-12)


def test_an_empty_distribution_is_all_nulls():
    assert distribution([]) == dict.fromkeys(["mean", "std", "min", "p50", "p90", "p95", "p99", "max"])


def test_a_level_summary_pools_completed_requests_and_counts_the_failed_ones():
    a = Outcome(0, 41 * MS, [10 * MS, 20 * MS, 30 * MS, 40 * MS], 4, 16, 200, None)
    b = Outcome(1 * MS, 36 * MS, [15 * MS, 25 * MS, 35 * MS], 6, 16, 200, None)   # two tokens a chunk
    c = Outcome(2 * MS, 100 * MS, [], None, None, None, "timeout")
    level, records = summarize_level(2, [c, b, a])

    assert [r["start_ns"] for r in records] == [0, MS, 2 * MS]
    assert (level["requests"], level["completed"], level["failed"]) == (3, 2, 1)
    assert level["duration_s"] == 0.1
    assert level["output_tokens"] == 10
    assert level["output_tok_s"] == pytest.approx(100.0)
    assert level["requests_per_s"] == pytest.approx(20.0)
    assert level["token_count_mismatches"] == 1
    assert level["errors"] == [{"error": "timeout", "count": 1}]
    assert (level["ttft_ms"]["min"], level["ttft_ms"]["max"]) == (10.0, 14.0)
    assert level["itl_ms"]["mean"] == 10.0 and level["itl_ms"]["std"] == 0.0
    assert sorted([level["tpot_ms"]["min"], level["tpot_ms"]["max"]]) == [4.0, 10.0]
    assert (level["e2e_ms"]["min"], level["e2e_ms"]["max"]) == (34.0, 40.0)
    # window (15 ms, 35 ms]: a sends 2 chunks of 1 token, b 2 chunks of 2 tokens
    assert (level["decode"]["rule"], level["decode"]["streams"]) == ("first-wave", 2)
    assert level["decode"]["window_s"] == pytest.approx(0.02)
    assert level["decode"]["aggregate_tok_s"] == pytest.approx(300.0)
    assert level["decode"]["per_user_tok_s"] == pytest.approx(150.0)


def test_a_single_stream_decodes_at_one_over_its_tpot():
    a = Outcome(0, 40 * MS, [10 * MS, 20 * MS, 30 * MS, 40 * MS], 4, 16, 200, None)
    level, _ = summarize_level(1, [a])
    assert level["decode"]["per_user_tok_s"] == pytest.approx(1000 / level["tpot_ms"]["p50"])


def test_the_decode_window_is_null_when_streams_never_overlap_in_decode():
    a = Outcome(0, 20 * MS, [10 * MS, 20 * MS], 2, 16, 200, None)
    b = Outcome(0, 40 * MS, [30 * MS, 40 * MS], 2, 16, 200, None)
    assert summarize_level(2, [a, b])[0]["decode"] is None
    assert summarize_level(2, [])[0]["decode"] is None


def test_the_decode_window_is_that_of_the_first_wave_only():
    first = [Outcome(0, 40 * MS, [10 * MS, 20 * MS, 30 * MS, 40 * MS], 4, 16, 200, None),
             Outcome(0, 40 * MS, [10 * MS, 20 * MS, 30 * MS, 40 * MS], 4, 16, 200, None)]
    later = Outcome(41 * MS, 90 * MS, [60 * MS, 70 * MS, 80 * MS, 90 * MS], 4, 16, 200, None)
    decode = summarize_level(2, [later, *first])[0]["decode"]
    assert decode["window_s"] == pytest.approx(0.03)       # (10 ms, 40 ms] of the first two
    assert decode["aggregate_tok_s"] == pytest.approx(200.0)


def test_empty_text_events_are_no_chunks_and_itl_per_token_divides_each_gap_by_its_tokens():
    """vLLM 0.32.0 (CPU build), a random-weight model with a byte-level BPE tokenizer, greedy: every
    other token decodes to no text and comes as an event of its own with text "" (64 tokens in 32 text
    events on an H200 with vLLM 0.26.0 too). A chunk then carries two tokens: ITL per chunk is twice
    the time per token, and ITL per token is what `vllm bench serve` (which counts every event) shows."""
    for outcome in parse_all_ways("vllm_completions_empty_text.txt"):
        assert (len(outcome.times), outcome.tokens, outcome.empty_events) == (4, 8, 4)
    stamps = [(i * MS, e) for i, e in enumerate(events_of("vllm_completions_empty_text.txt"))]
    raw = response([e for _, e in stamps])
    head, body = raw.split(b"\r\n\r\n", 1)
    reads = [(0, head + b"\r\n\r\n")] + [(t, b"%x\r\n%s\r\n" % (len(e), e)) for t, e in stamps]
    record = request_record(1, 0, parse_exchange(0, 20 * MS, reads + [(20 * MS, b"0\r\n\r\n")]))
    assert record["itl_ms"] == [2.0, 2.0, 2.0]
    assert record["itl_token_ms"] == [1.0, 1.0, 1.0]
    assert record["empty_events"] == 4


def test_usage_on_every_chunk_gives_each_gap_its_own_token_count():
    """SGLang sends usage with every chunk (continuous usage stats): a chunk's tokens are the growth of
    completion_tokens since the chunk before, so a chunk of 3 tokens divides its gap by 3."""
    outcome = Outcome(0, 10 * MS, [1 * MS, 2 * MS, 5 * MS], 5, 4, 200, None, chunk_tokens=[1, 2, 5])
    assert request_record(1, 0, outcome)["itl_token_ms"] == [1.0, 1.0]


def test_a_level_reports_tokens_per_chunk_and_both_itls():
    a = Outcome(0, 41 * MS, [10 * MS, 20 * MS, 30 * MS, 40 * MS], 8, 16, 200, None)   # two tokens a chunk
    level, _ = summarize_level(1, [a])
    assert level["tokens_per_chunk"] == 2.0
    assert level["itl_ms"]["p50"] == 10.0 and level["itl_token_ms"]["p50"] == 5.0
