"""The decode benchmark client: standard library only, run on the GPU host, next to the server.

The harness ships it in its host zipapp and runs it inside the host's venv, so it imports nothing outside
the standard library (the GLM-5 campaign's timing script died on `ModuleNotFoundError: requests`) and
nothing from the rest of `harness` but its sibling `stats.py` (percentiles and distributions):

    python harness.pyz bench --url http://127.0.0.1:30000 --model NAME --concurrency 1,8,32 --out bench.json

Each concurrency level runs in order: `--warmup` requests that are not measured, then `--requests`
requests (default: twice the concurrency, at least 16) with `concurrency` of them in flight (a closed
loop: a stream sends its next request when its last one ends), or as many as fit in `--duration`
seconds. Requests are greedy (temperature 0), streamed, ask for usage, and ignore EOS by default so
every request decodes `--max-tokens` tokens. Results: bench.json (docs/formats.md "bench.json and
requests.jsonl") and requests.jsonl beside it; a short summary goes to stderr. Exit 0 when every level
completed (or failed no more than --max-failed-share of its requests); 4 when a level failed more,
naming the errors; 3 when no request of any level completed; 2 on bad arguments.

Definitions (per request; a level's distributions pool its completed requests):
    TTFT = first chunk carrying text (or reasoning text) - request sent
    ITL  = gaps between consecutive text-carrying chunks (pooled over the level's requests): per chunk
    ITL per token (itl_token_ms) = each gap / the tokens its chunk carried (usage per chunk when the
           engine sends it, else the request's completion_tokens / its text chunks). An engine may put
           several tokens in one chunk, or send a token that decodes to no text as an event with empty
           text (counted as empty_events, not as a chunk): then ITL per chunk is a multiple of TPOT
           and ITL per token is the figure to compare with a client that counts every event
    TPOT = (E2E - TTFT) / (completion_tokens - 1), for requests of two tokens or more
    E2E  = last text-carrying chunk - request sent
    completion_tokens from the server's usage; without usage, the chunk count (tokens_from: "chunks")
    level duration = first send to last finish; output_tok_s = completed requests' tokens / duration
    decode = the steady-state window, rule "first-wave" (named in bench.json as decode.rule): among
             the first `concurrency` requests sent, from the last of their first tokens to the first
             of their last tokens, so every stream of the batch decodes and no newcomer's prefill
             interrupts. Over a whole closed-loop level that window is always empty (a finished
             stream's successor is still in prefill). per_user_tok_s and aggregate_tok_s are the
             window's tokens (chunks scaled by each request's usage/chunks ratio) per second.
    percentiles: linear interpolation between closest ranks (numpy's default method "linear");
    std is the population standard deviation (numpy's default ddof=0).

Fidelity: the hot path is a plain selector loop over non-blocking sockets, with no event-loop
machinery between a socket and its stamp. Every read of one select() return is stamped with the
instant select() returned, so a burst of streams (one decode step of a batch) read one socket after
another is not stamped progressively later. Per chunk it does one recv, one append and a 7-byte
comparison (to see the response end); HTTP, SSE and JSON parsing wait until the level has finished,
and the garbage collector is paused during a level. Events that arrive in one read share its stamp (an
ITL of 0): that is what the client saw. bench.json records the client's own CPU per chunk while
streaming (client_cpu_us_per_chunk): about 5 us on a small 2-core machine, so one process follows
256 streams at 100 tok/s (25,600 chunks a second) on about an eighth of a core.
benchmarks/bench_fidelity.py measures the errors against a server that knows its true emission times.
`--workers K` splits each level's streams over K processes that start together; use it only beyond
~100,000 chunks a second and where cores are free beside the server's own (on a 2-core host it makes
things worse).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import gc
import json
import multiprocessing
import os
import platform
import queue
import re
import selectors
import socket
import ssl
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

from .stats import distribution, several_per_chunk

SCHEMA = "harness.bench/1"
DEFAULT_MAX_TOKENS = 128
DEFAULT_TIMEOUT_S = 600.0
DEFAULT_PROMPT_WORDS = 16
APIS = {"completions": "/completions", "chat": "/chat/completions"}
DECODE_RULE = "first-wave"  # the decode window's definition, named in bench.json (module docstring)

# Common words that most tokenizers keep whole, so N words make roughly N prompt tokens.
_WORDS = ("the of and to in is was for on that with as by at from his it an were are which this be or "
          "has had not but what all when there can more one about some time").split()
_EVENT_END = re.compile(rb"\r?\n\r?\n")
Reads = list[tuple[int, bytes]]


@dataclass(frozen=True)
class Target:
    """Where to send and the exact bytes of the request; every request of a run is the same."""

    host: str
    family: int
    address: str                # host resolved once, so no request waits on a resolver
    port: int
    tls: bool
    request: bytes


@dataclass
class Outcome:
    """What one request produced, parsed after its level ended; times are time.monotonic_ns()."""

    sent_ns: int
    end_ns: int
    times: list[int]            # arrival of each text-carrying chunk
    tokens: int | None          # usage.completion_tokens; None when the server sent no usage
    prompt_tokens: int | None
    status: int | None
    error: str | None
    chunk_tokens: list[int] | None = None   # completion_tokens so far at each text chunk, when
                                            # every one carried usage (SGLang's continuous usage)
    empty_events: int = 0       # events with a choice but no text (a token that decodes to nothing, or
                                # a closing event that only gives the finish reason)


# --------------------------------------------------------------------------- the hot path

class _Exchange:
    """One request on its own connection (`Connection: close`), moved along by _Loop:
    connect -> handshake (TLS only) -> send -> read -> done.

    The read path stamps, stores, and watches the framing only to know when the response is complete
    (chunked terminator, Content-Length, or connection close).
    """

    __slots__ = ("sock", "deadline_ns", "state", "out", "reads", "sent_ns", "end_ns", "error", "head_done",
                 "chunked", "left", "tail")

    def __init__(self, sock: socket.socket, deadline_ns: int):
        self.sock, self.deadline_ns = sock, deadline_ns
        self.state, self.out = "connect", b""
        self.reads: Reads = []
        self.sent_ns = self.end_ns = 0
        self.error: str | None = None
        self.head_done = self.chunked = False
        self.left: int | None = None      # Content-Length bytes still to come
        self.tail = b"\r\n"               # last bytes of a chunked body, to spot its terminator

    def received(self, t: int, data: bytes) -> bool:
        """Store one read stamped `t`; True once the response is complete (ValueError: not HTTP)."""
        self.reads.append((t, data))
        if not self.head_done:
            buf = b"".join(d for _, d in self.reads)
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return False
            _, self.chunked, self.left = _parse_head(buf[:end])
            self.head_done = True
            data = buf[end + 4:]
        if self.chunked:
            self.tail = (self.tail + data)[-7:]
            return self.tail == b"\r\n0\r\n\r\n"
        if self.left is not None:
            self.left -= len(data)
            return self.left <= 0
        return False

    def cut_short(self) -> str | None:
        """What a close by the server means at this point of the response (None: a clean end)."""
        if not self.head_done:
            return "connection closed before the response"
        return "connection closed mid-response" if self.chunked or self.left else None


class _Loop:
    """Closed-loop streams over one selector, with no event-loop machinery between a socket and its stamp.

    Every read of one select() return is stamped with the instant select() returned, so a burst of
    streams (one decode step of a batch) read one socket after another is not stamped progressively
    later; per chunk the loop does one recv, one append and a 7-byte comparison.
    """

    def __init__(self, target: Target, timeout: float, tick: Callable[[list[_Exchange]], None] | None = None):
        self.target, self.timeout_ns = target, int(timeout * 1e9)
        self.tick, self.next_tick_ns = tick, 0   # progress, at most once a second: off the hot path
        self.sel = selectors.DefaultSelector()
        self.tls = ssl.create_default_context() if target.tls else None
        self.live: dict[_Exchange, None] = {}   # in flight, oldest (the next to time out) first
        self.finished: list[_Exchange] = []

    def run(self, streams: int, count: int | None, duration: float | None) -> list[_Exchange]:
        """`streams` streams, each sending its next request when its last one ends, until `count`
        requests were sent or `duration` seconds passed; returns them all, ended."""
        stop_ns = None if duration is None else time.monotonic_ns() + int(duration * 1e9)
        started = 0
        self.finished = []
        try:
            while True:
                now = time.monotonic_ns()
                free = streams - len(self.live)
                while free and (count is None or started < count) and (stop_ns is None or now < stop_ns):
                    started, free = started + 1, free - 1
                    self._start()
                if not self.live:
                    return self.finished
                oldest = next(iter(self.live))
                events = self.sel.select(max(0.0, (oldest.deadline_ns - now) / 1e9))
                now = time.monotonic_ns()
                for key, _ in events:
                    x = key.data
                    if x.state == "read":
                        self._read(x, now)
                    elif x.state != "done":
                        self._advance(x)
                while self.live and oldest.deadline_ns <= now:
                    self._finish(oldest, "timeout")
                    oldest = next(iter(self.live), oldest)
                if self.tick is not None and now >= self.next_tick_ns:
                    self.next_tick_ns = now + 1_000_000_000
                    self.tick(self.finished)
        finally:
            for x in list(self.live):
                self._finish(x, "benchmark interrupted")

    def _start(self) -> None:
        t = self.target
        sock = socket.socket(t.family, socket.SOCK_STREAM)
        sock.setblocking(False)
        x = _Exchange(sock, time.monotonic_ns() + self.timeout_ns)
        self.live[x] = None
        err = sock.connect_ex((t.address, t.port))
        if err not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
            return self._finish(x, f"cannot connect: [Errno {err}] {os.strerror(err)}")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sel.register(sock, selectors.EVENT_WRITE, x)

    def _advance(self, x: _Exchange) -> None:
        """Connect, shake hands and send, each as far as the socket allows without blocking."""
        try:
            if x.state == "connect":
                err = x.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    return self._finish(x, f"cannot connect: [Errno {err}] {os.strerror(err)}")
                x.state = "send"
                if self.tls is not None:
                    self.sel.unregister(x.sock)
                    x.sock = self.tls.wrap_socket(x.sock, server_hostname=self.target.host,
                                                  do_handshake_on_connect=False)
                    self.sel.register(x.sock, selectors.EVENT_WRITE, x)
                    x.state = "handshake"
            if x.state == "handshake":
                x.sock.do_handshake()  # type: ignore[attr-defined]
                x.state = "send"
            if not x.sent_ns:
                x.out, x.sent_ns = self.target.request, time.monotonic_ns()
            x.out = x.out[x.sock.send(x.out):]
            if not x.out:
                x.state = "read"
                self.sel.modify(x.sock, selectors.EVENT_READ, x)
        except ssl.SSLWantReadError:
            self.sel.modify(x.sock, selectors.EVENT_READ, x)
        except (ssl.SSLWantWriteError, BlockingIOError, InterruptedError):
            self.sel.modify(x.sock, selectors.EVENT_WRITE, x)
        except OSError as e:
            self._finish(x, f"{'connection error' if x.sent_ns else 'cannot connect'}: {e}")

    def _read(self, x: _Exchange, now: int) -> None:
        while True:
            try:
                data = x.sock.recv(65536)
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return
            except OSError as e:
                return self._finish(x, f"connection error: {e}")
            if not data:
                return self._finish(x, x.cut_short())
            try:
                if x.received(now, data):
                    return self._finish(x, None)
            except ValueError:
                return self._finish(x, "malformed response head")
            if self.tls is None or not x.sock.pending():  # type: ignore[attr-defined]
                return

    def _finish(self, x: _Exchange, error: str | None) -> None:
        x.state, x.error = "done", error
        x.end_ns = x.reads[-1][0] if error is None and x.reads else time.monotonic_ns()
        with contextlib.suppress(KeyError):  # its connect failed at once: never registered
            self.sel.unregister(x.sock)
        x.sock.close()
        del self.live[x]
        self.finished.append(x)


def _run_share(target: Target, streams: int, count: int | None, warmup: int, duration: float | None,
               timeout: float, barrier=None, tick=None) -> tuple[list[Outcome], float]:
    """Warm up, wait for the other workers, measure; parse only once every stream has ended. Returns
    the outcomes and the CPU seconds the measured streams cost this process (parsing excluded)."""
    loop = _Loop(target, timeout)
    collecting = gc.isenabled()
    gc.disable()  # a full collection mid-level would show up as an ITL outlier
    try:
        if warmup:
            loop.run(min(streams, warmup), warmup, None)
        if barrier is not None:
            barrier.wait()
        cpu = time.process_time()
        loop.tick = tick
        exchanges = loop.run(streams, count, duration)
        cpu = time.process_time() - cpu
    finally:
        loop.sel.close()
        if collecting:
            gc.enable()
    return [parse_exchange(x.sent_ns, x.end_ns, x.reads, x.error) for x in exchanges], cpu


def _worker(results, *share) -> None:
    outcomes, cpu = _run_share(*share)
    results.put(([vars(o) for o in outcomes], cpu))


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (i < total % parts) for i in range(parts)]


def _run_level(target: Target, concurrency: int, count: int | None, warmup: int,
               duration: float | None, timeout: float, workers: int, tick=None) -> tuple[list[Outcome], float]:
    workers = min(workers, concurrency)
    if workers == 1:
        return _run_share(target, concurrency, count, warmup, duration, timeout, tick=tick)
    # spawn, not fork: run_benchmark may be called in-process by a harness that has threads.
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(workers), ctx.Queue()
    counts = [None] * workers if count is None else _split(count, workers)
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(results, target, streams, n, w, duration, timeout, barrier))
             for streams, n, w in zip(_split(concurrency, workers), counts, _split(warmup, workers))]
    for p in procs:
        p.start()
    try:
        outcomes: list[Outcome] = []
        cpu = 0.0
        for _ in procs:
            share, share_cpu = _collect(results, procs)
            outcomes += [Outcome(**o) for o in share]
            cpu += share_cpu
        return outcomes, cpu
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()


def _collect(results, procs) -> tuple[list, float]:
    while True:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"a benchmark worker process exited with code {dead[0]}") from None


# --------------------------------------------------------------------------- parsing, after the fact

def _parse_head(head: bytes) -> tuple[int, bool, int | None]:
    """Status, chunked or not, and Content-Length of an HTTP/1.x response head (ValueError if not one)."""
    lines = head.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    if not version.startswith("HTTP/"):
        raise ValueError(lines[0])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    chunked = "chunked" in headers.get("transfer-encoding", "").lower()
    length = None if chunked or "content-length" not in headers else int(headers["content-length"])
    return int(rest.split(" ", 1)[0]), chunked, length


def _dechunk(reads: Iterable[tuple[int, bytes]]) -> Iterator[tuple[int, bytes]]:
    """Undo chunked transfer-encoding, keeping each piece with the stamp of the read that completed it."""
    buf = b""
    for t, data in reads:
        buf += data
        out: list[bytes] = []
        while True:
            eol = buf.find(b"\r\n")
            if eol < 0:
                break
            size = int(buf[:eol].split(b";")[0], 16)
            if size == 0:
                yield t, b"".join(out)
                return
            if len(buf) < eol + 4 + size:
                break
            out.append(buf[eol + 2:eol + 2 + size])
            buf = buf[eol + 4 + size:]
        yield t, b"".join(out)


def _sse_events(reads: Iterable[tuple[int, bytes]], ended: bool) -> Iterator[tuple[int, bytes]]:
    """Server-sent events, each stamped with the read that completed it; a last event without its blank
    line too when the stream `ended` cleanly (a cut-off one is a fragment)."""
    buf, t = b"", 0
    for t, data in reads:
        *events, buf = _EVENT_END.split(buf + data)
        for event in events:
            yield t, event
    if ended and buf.strip():
        yield t, buf


def _event_data(event: bytes) -> bytes | None:
    lines = [line[5:] for line in event.splitlines() if line.startswith(b"data:")]
    if not lines:
        return None
    return b"\n".join(line[1:] if line.startswith(b" ") else line for line in lines)


def _error_message(obj: dict) -> str | None:
    """The text of an error sent inside a 200 stream: `{"object": "error", ...}` or `{"error": ...}`."""
    if obj.get("object") == "error":
        return str(obj.get("message") or obj)
    err = obj.get("error")
    if not err:
        return None
    return str(err.get("message") or err) if isinstance(err, dict) else str(err)


def _carries_text(obj: dict) -> bool:
    """Completions `text`, chat `content`, or reasoning (`reasoning_content` SGLang, `reasoning` vLLM)."""
    for choice in obj.get("choices") or ():
        delta = choice.get("delta") or {}
        if choice.get("text") or delta.get("content") or delta.get("reasoning_content") \
                or delta.get("reasoning"):
            return True
    return False


def _excerpt(data: bytes, limit: int = 200) -> str:
    text = " ".join(data.decode("utf-8", "replace").split())
    return (text[:limit] + "...") if len(text) > limit else (text or "(empty)")


def parse_exchange(sent_ns: int, end_ns: int, reads: Reads, error: str | None = None) -> Outcome:
    """Turn one request's stamped reads (raw HTTP response bytes) into an Outcome.

    `error` is what the connection said (timeout, reset, closed early); an error the server reported
    in the response (a non-200 status, an error event) takes precedence, being the more telling.
    """
    head = b""
    for i, (t, piece) in enumerate(reads):  # noqa: B007  (i and t are used after the break: where the head ends)
        head += piece
        end = head.find(b"\r\n\r\n")
        if end >= 0:
            break
    else:
        return Outcome(sent_ns, end_ns, [], None, None, None, error or "no response")
    try:
        status, chunked, _ = _parse_head(head[:end])
    except ValueError:
        return Outcome(sent_ns, end_ns, [], None, None, None, "malformed response head")
    body: Reads = [(t, head[end + 4:])] + reads[i + 1:]
    times: list[int] = []
    running: list[int] | None = []
    tokens = prompt_tokens = None
    failure = None
    empty = 0
    try:
        if chunked:
            body = list(_dechunk(body))
        if status != 200:
            return Outcome(sent_ns, end_ns, [], None, None, status,
                           f"HTTP {status}: {_excerpt(b''.join(d for _, d in body))}")
        seen_data = False
        for t, event in _sse_events(body, ended=error is None):
            data = _event_data(event)
            if data is None:
                continue
            seen_data = True
            if data == b"[DONE]":
                break
            obj = json.loads(data)
            if not isinstance(obj, dict):
                raise ValueError(data)
            failure = _error_message(obj)
            if failure:
                break
            usage = obj.get("usage")
            if usage:  # assigned, not added: usage on the last content chunk counts once
                tokens, prompt_tokens = usage.get("completion_tokens"), usage.get("prompt_tokens")
            if _carries_text(obj):
                times.append(t)
                if running is not None and usage and isinstance(tokens, int):
                    running.append(tokens)
                else:
                    running = None
            elif obj.get("choices"):
                empty += 1
        if not seen_data and failure is None:
            failure = "not an event stream: " + _excerpt(b"".join(d for _, d in body))
    except (ValueError, AttributeError, TypeError) as e:  # bad chunk size, JSON or JSON shape
        failure = f"malformed response: {e}"
    return Outcome(sent_ns, end_ns, times, tokens, prompt_tokens, status, failure or error,
                   running if running else None, empty)


# --------------------------------------------------------------------------- statistics

def _ms(ns: int) -> float:
    return ns / 1e6


def request_record(concurrency: int, index: int, o: Outcome) -> dict:
    """One line of requests.jsonl."""
    tokens = o.tokens if o.tokens is not None else len(o.times)
    ttft = e2e = tpot = None
    if o.times:
        ttft, e2e = _ms(o.times[0] - o.sent_ns), _ms(o.times[-1] - o.sent_ns)
        if tokens >= 2:
            tpot = (e2e - ttft) / (tokens - 1)
    itl = [_ms(b - a) for a, b in zip(o.times, o.times[1:])]
    return {"concurrency": concurrency, "index": index, "start_ns": o.sent_ns, "end_ns": o.end_ns,
            "ttft_ms": ttft, "itl_ms": itl, "itl_token_ms": _per_token(itl, o, tokens),
            "tpot_ms": tpot, "e2e_ms": e2e, "output_tokens": tokens,
            "tokens_from": "usage" if o.tokens is not None else "chunks", "chunks": len(o.times),
            "empty_events": o.empty_events, "prompt_tokens": o.prompt_tokens, "status": o.status,
            "error": o.error}


def _per_token(itl: list[float], o: Outcome, tokens: int) -> list[float]:
    """Each gap divided by the tokens its (later) chunk carried: from usage per chunk when the engine
    sends it, else the request's tokens over its text chunks (an engine may send several tokens in one
    chunk, or a token that decodes to no text in an event of its own)."""
    if o.chunk_tokens and len(o.chunk_tokens) == len(o.times):
        counts = [b - a for a, b in zip(o.chunk_tokens, o.chunk_tokens[1:])]
        return [gap / n for gap, n in zip(itl, counts) if n > 0]
    per_chunk = tokens / len(o.times) if o.times else 1
    return [gap / per_chunk for gap in itl] if per_chunk > 0 else []


def decode_window(outcomes: Sequence[Outcome], concurrency: int) -> dict | None:
    """Steady-state decode of the first wave: every one of its streams is past its first token and
    none has finished, so no prefill of a newcomer interrupts. Chunk counts are scaled to tokens by
    each request's usage/chunks ratio. None when the window is empty."""
    wave = [o for o in sorted(outcomes, key=lambda o: o.sent_ns)[:concurrency] if o.error is None and o.times]
    if not wave:
        return None
    start, end = max(o.times[0] for o in wave), min(o.times[-1] for o in wave)
    if end <= start:
        return None
    window_s = (end - start) / 1e9
    tokens = [sum(start < t <= end for t in o.times) * (o.tokens or len(o.times)) / len(o.times)
              for o in wave]
    return {"rule": DECODE_RULE, "window_s": window_s, "streams": len(wave),
            "per_user_tok_s": sum(tokens) / len(wave) / window_s, "aggregate_tok_s": sum(tokens) / window_s}


def summarize_level(concurrency: int, outcomes: Sequence[Outcome]) -> tuple[dict, list[dict]]:
    """A level of bench.json and its requests.jsonl records (indexed in the order they were sent)."""
    records = [request_record(concurrency, i, o)
               for i, o in enumerate(sorted(outcomes, key=lambda o: o.sent_ns))]
    ok = [r for r in records if r["error"] is None]
    duration_s = 0.0
    if outcomes:
        duration_s = (max(o.end_ns for o in outcomes) - min(o.sent_ns for o in outcomes)) / 1e9
    output_tokens = sum(r["output_tokens"] for r in ok)
    level = {
        "concurrency": concurrency, "requests": len(records), "completed": len(ok),
        "failed": len(records) - len(ok), "duration_s": duration_s, "output_tokens": output_tokens,
        "started_ns": min((o.sent_ns for o in outcomes), default=None),   # the clock of telemetry.jsonl
        "ended_ns": max((o.end_ns for o in outcomes), default=None),
        "output_tok_s": output_tokens / duration_s if duration_s else None,
        "requests_per_s": len(ok) / duration_s if duration_s else None,
        "token_count_mismatches": sum(r["tokens_from"] == "usage" and r["output_tokens"] != r["chunks"]
                                      for r in ok),
        "usage_missing": sum(r["tokens_from"] == "chunks" for r in ok),
        "errors": [{"error": e, "count": n}
                   for e, n in Counter(r["error"] for r in records if r["error"]).most_common(10)],
        "ttft_ms": distribution(r["ttft_ms"] for r in ok if r["ttft_ms"] is not None),
        "itl_ms": distribution(x for r in ok for x in r["itl_ms"]),
        "itl_token_ms": distribution(x for r in ok for x in r["itl_token_ms"]),
        "tokens_per_chunk": (output_tokens / chunks) if (chunks := sum(r["chunks"] for r in ok)) else None,
        "empty_events": sum(r["empty_events"] for r in ok),
        "tpot_ms": distribution(r["tpot_ms"] for r in ok if r["tpot_ms"] is not None),
        "e2e_ms": distribution(r["e2e_ms"] for r in ok if r["e2e_ms"] is not None),
        "decode": decode_window(outcomes, concurrency),
    }
    return level, records


# --------------------------------------------------------------------------- the API

def synthetic_prompt(words: int) -> str:
    """A deterministic prompt of `words` words (about as many tokens)."""
    return " ".join(_WORDS[i % len(_WORDS)] for i in range(words))


def build_target(url: str, body: dict, api: str, headers: dict[str, str] | None = None) -> Target:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"url must look like http://HOST:PORT, got {url!r}")
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)  # .port raises ValueError for a bad port
    base = parts.path.rstrip("/")
    path = (base if base.endswith("/v1") else base + "/v1") + APIS[api]
    payload = json.dumps(body).encode()
    extra = ""
    for name, value in (headers or {}).items():
        if not re.fullmatch(r"[A-Za-z0-9-]+", name) or any(c in value for c in "\r\n"):
            raise ValueError(f"header {name!r}: a name of letters, digits and '-', a value on one line")
        extra += f"{name}: {value}\r\n"
    head = (f"POST {path} HTTP/1.1\r\nHost: {parts.netloc.rpartition('@')[2]}\r\n"
            f"Content-Type: application/json\r\nAccept: text/event-stream\r\n{extra}"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n")
    try:
        family, *_, sockaddr = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)[0]
    except OSError as e:
        raise ValueError(f"cannot resolve {parts.hostname!r}: {e}") from e
    address = str(sockaddr[0])  # already a str for an IP family (typeshed also allows the int of other families)
    return Target(parts.hostname, family, address, port, tls, head.encode() + payload)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def run_benchmark(url: str, model: str, *, concurrency: Sequence[int] = (1,), requests: int | None = None,
                  warmup: int = 1, max_tokens: int = DEFAULT_MAX_TOKENS, prompt: str | None = None,
                  prompt_tokens: int | None = None, api: str = "completions", ignore_eos: bool = True,
                  timeout: float = DEFAULT_TIMEOUT_S, duration: float | None = None, workers: int = 1,
                  progress: Callable[[dict], None] | None = None, extra_body: dict | None = None,
                  headers: dict[str, str] | None = None, on_tick: Callable[[dict], None] | None = None) -> dict:
    """Run every concurrency level; return bench.json's content plus "requests" (requests.jsonl's lines).

    `requests` is per level (default: max(2 x concurrency, 16); with `duration`, a cap). Raises
    ValueError on bad arguments; failed requests are recorded, never raised. `progress` is called with
    each level as it finishes. `ignore_eos` is sent only when true (some servers refuse unknown
    fields, transformers serve with HTTP 422); `extra_body` adds engine-specific fields to every request.
    """
    _check(bool(concurrency) and all(c >= 1 for c in concurrency), "concurrency must be positive integers")
    _check(requests is None or requests >= 1, "requests must be at least 1")
    _check(warmup >= 0, "warmup must be 0 or more")
    _check(max_tokens >= 1, "max_tokens must be at least 1")
    _check(prompt is None or prompt_tokens is None, "give a prompt or prompt_tokens, not both")
    _check(prompt_tokens is None or prompt_tokens >= 1, "prompt_tokens must be at least 1")
    _check(api in APIS, f"api must be one of {', '.join(APIS)}")
    _check(timeout > 0 and (duration is None or duration > 0), "timeout and duration must be positive")
    _check(workers >= 1, "workers must be at least 1")
    words: int | None = None
    if prompt is not None:
        text = prompt
    else:
        words = prompt_tokens or DEFAULT_PROMPT_WORDS
        text = synthetic_prompt(words)
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    body.update({"messages": [{"role": "user", "content": text}]} if api == "chat" else {"prompt": text})
    body.update(extra_body or {})
    target = build_target(url, body, api, headers)

    result: dict[str, Any]
    result = {"schema": SCHEMA, "url": url, "model": model, "api": api, "max_tokens": max_tokens,
              "prompt_tokens": None, "prompt": prompt, "prompt_words": words, "ignore_eos": ignore_eos,
              "temperature": 0, "warmup": warmup, "timeout_s": timeout, "duration_limit_s": duration,
              "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "client": {"name": "harness-bench", "python": platform.python_version(),
                         "host": socket.gethostname(), "workers": workers, "clock": "time.monotonic_ns",
                         "percentiles": "linear interpolation (numpy default)"},
              "levels": [], "requests": []}
    for index, c in enumerate(concurrency):
        count = requests if requests is not None or duration is not None else max(2 * c, 16)
        tick = _ticker(on_tick, c, count, duration, max_tokens, len(concurrency), index) if on_tick else None
        outcomes, cpu_s = _run_level(target, c, count, warmup, duration, timeout, workers, tick)
        level, records = summarize_level(c, outcomes)
        chunks = sum(r["chunks"] for r in records)
        level["client_cpu_s"] = cpu_s
        level["client_cpu_us_per_chunk"] = cpu_s * 1e6 / chunks if chunks else None
        result["levels"].append(level)
        result["requests"] += records
        if result["prompt_tokens"] is None:
            result["prompt_tokens"] = next((o.prompt_tokens for o in outcomes if o.prompt_tokens), None)
        if progress:
            progress(level)
    return result


def _ticker(on_tick: Callable[[dict], None], concurrency: int, count: int | None, duration: float | None,
            max_tokens: int, levels: int, index: int) -> Callable[[list[_Exchange]], None]:
    """Once a second, where the level stands: requests done (and failed) of how many, elapsed, an ETA,
    and tokens a second so far (completed requests x max_tokens: an estimate until the level ends)."""
    started = time.monotonic()

    def tick(finished: list[_Exchange]) -> None:
        elapsed = time.monotonic() - started
        done, failed = len(finished), sum(x.error is not None for x in finished)
        total = count if count is not None else None
        eta = (elapsed / done * (total - done) if total and done else
               (duration - elapsed if duration else None))
        on_tick({"concurrency": concurrency, "level": index + 1, "levels": levels, "done": done,
                 "failed": failed, "of": total, "elapsed_s": round(elapsed, 1),
                 "eta_s": None if eta is None else round(max(0.0, eta), 1),
                 "tok_s_estimate": round((done - failed) * max_tokens / elapsed, 1) if elapsed else None})
    return tick


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_results(result: dict, out_path) -> None:
    """bench.json at `out_path` (without the per-request lines) and requests.jsonl beside it."""
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(out, json.dumps({k: v for k, v in result.items() if k != "requests"}, indent=2) + "\n")
    _write_atomic(out.with_name("requests.jsonl"), "".join(json.dumps(r) + "\n" for r in result["requests"]))


def format_level(level: dict) -> str:
    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    decode = level["decode"]
    line = (f"concurrency {level['concurrency']}: {level['completed']}/{level['requests']} completed, "
            f"{f(level['output_tok_s'])} tok/s, TTFT p50 {f(level['ttft_ms']['p50'])} ms, "
            f"ITL p50 {f(level['itl_ms']['p50'])} p99 {f(level['itl_ms']['p99'])} ms"
            + (f" (per token {f(level['itl_token_ms']['p50'])} p99 {f(level['itl_token_ms']['p99'])}, "
               f"{level['tokens_per_chunk']:.2f} tokens a chunk)" if several_per_chunk(level) else "")
            + f", TPOT p50 {f(level['tpot_ms']['p50'])} ms, "
            f"decode {f(decode and decode['per_user_tok_s'])} tok/s/user")
    if level["usage_missing"]:
        line += f"\n  {level['usage_missing']} responses had no usage: tokens counted from chunks"
    for e in level["errors"][:3]:
        line += f"\n  {e['count']} failed: {e['error']}"
    return line


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,8,32, got {text!r}")
    return values


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench.py",
                                description="Decode benchmark of an OpenAI-compatible server.")
    p.add_argument("--url", required=True, help="server root, e.g. http://127.0.0.1:30000")
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--api", choices=sorted(APIS), default="completions")
    p.add_argument("--concurrency", type=_positive_ints, default=[1], help="levels, e.g. 1,8,32 (default 1)")
    p.add_argument("--requests", type=int,
                   help="measured requests per level (default max(2 x concurrency, 16))")
    p.add_argument("--duration", type=float, help="seconds per level instead of a request count")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests before each level (default 1)")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", help="a file holding the prompt (UTF-8), for prompts a command line "
                     "cannot carry (hundreds of KB, or starting with '-')")
    src.add_argument("--prompt-tokens", type=int,
                     help=f"a synthetic prompt of N words (default {DEFAULT_PROMPT_WORDS})")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask the server to ignore end-of-sequence (--no-ignore-eos sends no such field)")
    p.add_argument("--extra-body", type=json.loads, default=None,
                   help="a JSON object of fields added to every request (engine-specific)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per request")
    p.add_argument("--workers", type=int, default=1,
                   help="processes to split each level's streams over (default 1; raise it only beyond "
                        "~20,000 chunks/s and where cores are free beside the server's)")
    p.add_argument("--out", default="bench.json", help="bench.json path; requests.jsonl goes beside it")
    p.add_argument("--progress-file", help="a JSON file rewritten once a second with where the level stands")
    p.add_argument("--api-key-env", help="an environment variable holding the server's API key, sent as "
                   "Authorization: Bearer (the key itself never on the command line)")
    p.add_argument("--max-failed-share", type=float, default=0.0,
                   help="exit 4 when more than this share of a level's requests failed (default 0: any)")
    return p


def failures(result: dict, max_share: float = 0.0) -> list[str]:
    """One line per level whose failed requests exceed `max_share`, with the commonest errors."""
    lines = []
    for level in result["levels"]:
        if level["requests"] and level["failed"] / level["requests"] > max_share:
            why = "; ".join(f"{e['count']} x {e['error']}" for e in level["errors"][:3])
            lines.append(f"concurrency {level['concurrency']}: {level['failed']} of {level['requests']} "
                         f"requests failed ({why})")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.prompt_file:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                args.prompt = f.read()
        except (OSError, UnicodeDecodeError) as e:
            print(f"bench.py: error: cannot read --prompt-file: {e}", file=sys.stderr)
            return 2
    headers = {}
    if args.api_key_env:
        if not os.environ.get(args.api_key_env):
            print(f"bench.py: error: --api-key-env: {args.api_key_env} is not set in the environment", file=sys.stderr)
            return 2
        headers["Authorization"] = f"Bearer {os.environ[args.api_key_env]}"
    try:
        result = run_benchmark(
            args.url, args.model, concurrency=args.concurrency, requests=args.requests, warmup=args.warmup,
            max_tokens=args.max_tokens, prompt=args.prompt, prompt_tokens=args.prompt_tokens, api=args.api,
            ignore_eos=args.ignore_eos, timeout=args.timeout, duration=args.duration, workers=args.workers,
            extra_body=args.extra_body, headers=headers,
            progress=lambda level: print(format_level(level), file=sys.stderr, flush=True),
            on_tick=(lambda state: _write_atomic(Path(args.progress_file), json.dumps(state)))
            if args.progress_file else None)
    except ValueError as e:
        print(f"bench.py: error: {e}", file=sys.stderr)
        return 2
    write_results(result, args.out)
    if args.progress_file:   # its job is done: bench.json says how it ended
        with contextlib.suppress(OSError):
            os.unlink(args.progress_file)
    if not any(level["completed"] for level in result["levels"]):
        errors = Counter(r["error"] for r in result["requests"] if r["error"])
        why = errors.most_common(1)[0][0] if errors else "no request was sent"
        print(f"bench.py: no request completed at any level against {args.url} (most common error: {why})",
              file=sys.stderr)
        return 3
    failed = failures(result, args.max_failed_share)
    for line in failed:
        print(f"bench.py: {line}", file=sys.stderr)
    return 4 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
