"""The decode benchmark client: standard library only, run on the GPU host, next to the server.

The harness ships it in its host zipapp and runs it inside the host's venv, so it imports nothing outside
the standard library (the GLM-5 campaign's timing script died on `ModuleNotFoundError: requests`) and
nothing from the rest of `harness` but its sibling `stats.py` (percentiles and distributions):

    python harness.pyz bench --url http://127.0.0.1:30000 --model NAME --concurrency 1,8,32 --out bench.json

Each concurrency level runs in order: `--warmup` requests that are not measured, then `--requests`
requests (default: twice the concurrency, at least 16) with `concurrency` of them in flight (a closed
loop: a stream sends its next request when its last one ends), or as many as fit in `--duration`
seconds. `--plan '{"scenarios": [...], "slo": {...}, "search": {...}, "random_state": N}'` runs
workloads instead (docs/formats.md "Workloads"): each scenario's levels, closed loop or open loop
(requests sent at the instants an arrival process drew, whatever is in flight), every request its own
prompt of exactly `input_tokens` tokens (PromptMaker: the server's /tokenize, else calibrated from its
usage), then the probes of the max_load search (bisect_max_load); with an SLO every level records its
goodput. Requests are greedy (temperature 0), streamed, ask for usage, and ignore EOS by default so
every request decodes `--max-tokens` tokens. Results: bench.json (docs/formats.md "bench.json and
requests.jsonl") and requests.jsonl beside it; a short summary goes to stderr. Exit 0 when every level
completed (or failed no more than --max-failed-share of its requests); 4 when a level failed more,
naming the errors; 3 when no request of any level completed; 2 on bad arguments.

Definitions (per request; a level's distributions pool its completed requests):
    TTFT = first chunk carrying text (or reasoning text) - request sent (open loop: - its scheduled
           send time, so a late send counts against the latency a user would have seen)
    ITL  = gaps between consecutive text-carrying chunks (pooled over the level's requests): per chunk
    ITL per token (itl_token_ms) = each gap / the tokens its chunk carried (usage per chunk when the
           engine sends it, else the request's completion_tokens / its text chunks). An engine may put
           several tokens in one chunk, or send a token that decodes to no text as an event with empty
           text (counted as empty_events, not as a chunk): then ITL per chunk is a multiple of TPOT
           and ITL per token is the figure to compare with a client that counts every event
    TPOT = (E2E - TTFT) / (completion_tokens - 1), for requests of two tokens or more
    E2E  = last text-carrying chunk - request sent (open loop: - scheduled)
    schedule lag (open loop) = sent - scheduled; achieved rate = (sent - 1) / (last send - first send)
    goodput = requests meeting every SLO bound (each its own TTFT, TPOT, E2E, ITL percentile) / duration
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
The open loop keeps that loop: select() is asked to return up to a millisecond before the next send
(epoll waits whole milliseconds) and the loop then polls, stamping reads as ever, until the instant;
prompts and schedules are built before a level starts. benchmarks/open_loop.py measures the rate it
achieves and its lag. `--workers K` splits each level's streams over K processes that start together
(a closed loop of the one prompt only); use it only beyond
~100,000 chunks a second and where cores are free beside the server's own (on a 2-core host it makes
things worse).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import gc
import http.client
import json
import math
import multiprocessing
import os
import platform
import queue
import random
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
    """Where to send and the exact bytes of the request (a scenario's requests each bring their own,
    built from `head` before the level starts: `request_for`)."""

    host: str
    family: int
    address: str                # host resolved once, so no request waits on a resolver
    port: int
    tls: bool
    request: bytes
    head: str = ""              # the request head up to Content-Length, for `request_for`

    def request_for(self, body: dict) -> bytes:
        payload = json.dumps(body).encode()
        return f"{self.head}Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload


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
    scheduled_ns: int | None = None   # open loop: when the arrival process said to send it


# --------------------------------------------------------------------------- the hot path

class _Exchange:
    """One request on its own connection (`Connection: close`), moved along by _Loop:
    connect -> handshake (TLS only) -> send -> read -> done.

    The read path stamps, stores, and watches the framing only to know when the response is complete
    (chunked terminator, Content-Length, or connection close).
    """

    __slots__ = ("sock", "deadline_ns", "state", "out", "reads", "sent_ns", "end_ns", "error", "head_done",
                 "chunked", "left", "tail", "request", "scheduled_ns")

    def __init__(self, sock: socket.socket, deadline_ns: int, request: bytes, scheduled_ns: int | None = None):
        self.sock, self.deadline_ns = sock, deadline_ns
        self.request, self.scheduled_ns = request, scheduled_ns
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

    def run(self, streams: int, count: int | None, duration: float | None,
            requests: Sequence[bytes] | None = None) -> list[_Exchange]:
        """`streams` streams, each sending its next request when its last one ends, until `count`
        requests were sent or `duration` seconds passed; returns them all, ended. `requests`: the
        bytes of each request in turn (default: the target's one request, every time)."""
        stop_ns = None if duration is None else time.monotonic_ns() + int(duration * 1e9)
        started = 0
        self.finished = []
        try:
            while True:
                now = time.monotonic_ns()
                free = streams - len(self.live)
                while free and (count is None or started < count) and (stop_ns is None or now < stop_ns):
                    self._start(self.target.request if requests is None else requests[started % len(requests)])
                    started, free = started + 1, free - 1
                if not self.live:
                    return self.finished
                oldest = next(iter(self.live))
                self._wait(now, max(0, oldest.deadline_ns - now))
                now = time.monotonic_ns()
                while self.live and oldest.deadline_ns <= now:
                    self._finish(oldest, "timeout")
                    oldest = next(iter(self.live), oldest)
                self._progress(now)
        finally:
            for x in list(self.live):
                self._finish(x, "benchmark interrupted")

    def run_open(self, offsets_ns: Sequence[int], requests: Sequence[bytes]) -> list[_Exchange]:
        """Open loop: request i is sent at start + offsets_ns[i], whatever is still in flight (no
        waiting for a free stream, so a slow server cannot slow the arrivals: no coordinated
        omission). select() waits whole milliseconds (epoll rounds its timeout up), so it is asked
        to return up to a millisecond early and the loop polls (select with no wait, stamping any
        reads as usual) until the instant, at the cost of up to a millisecond of polling per request;
        opening the request's connection then takes a fraction of a millisecond more (its schedule
        lag, measured in benchmarks/README.md)."""
        self.finished = []
        nxt, n = 0, len(offsets_ns)
        t0 = time.monotonic_ns()
        try:
            while True:
                now = time.monotonic_ns()
                while nxt < n and t0 + offsets_ns[nxt] <= now:
                    self._start(requests[nxt], t0 + offsets_ns[nxt])
                    nxt += 1
                if not self.live and nxt >= n:
                    return self.finished
                wait = None if nxt >= n else t0 + offsets_ns[nxt] - now
                if wait is not None and wait > 1_000_000:
                    wait -= 1_000_000
                elif wait is not None:
                    wait = 0
                if self.live:
                    oldest = next(iter(self.live))
                    wait = max(0, oldest.deadline_ns - now) if wait is None else min(wait, oldest.deadline_ns - now)
                self._wait(now, max(0, wait or 0))
                now = time.monotonic_ns()
                while self.live and (oldest := next(iter(self.live))).deadline_ns <= now:
                    self._finish(oldest, "timeout")
                self._progress(now)
        finally:
            for x in list(self.live):
                self._finish(x, "benchmark interrupted")

    def _wait(self, now: int, timeout_ns: int) -> None:
        """One select(): every read it reports is stamped with the instant it returned."""
        events = self.sel.select(timeout_ns / 1e9)
        now = time.monotonic_ns()
        for key, _ in events:
            x = key.data
            if x.state == "read":
                self._read(x, now)
            elif x.state != "done":
                self._advance(x)

    def _progress(self, now: int) -> None:
        if self.tick is not None and now >= self.next_tick_ns:
            self.next_tick_ns = now + 1_000_000_000
            self.tick(self.finished)

    def _start(self, request: bytes, scheduled_ns: int | None = None) -> None:
        t = self.target
        sock = socket.socket(t.family, socket.SOCK_STREAM)
        sock.setblocking(False)
        x = _Exchange(sock, time.monotonic_ns() + self.timeout_ns, request, scheduled_ns)
        self.live[x] = None
        err = sock.connect_ex((t.address, t.port))
        if err not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
            return self._finish(x, f"cannot connect: [Errno {err}] {os.strerror(err)}")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sel.register(sock, selectors.EVENT_WRITE, x)
        if err == 0:   # connected at once (loopback usually is): send now, not after another select()
            self._advance(x)

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
                x.out, x.sent_ns = x.request, time.monotonic_ns()
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
               timeout: float, barrier=None, tick=None, requests: Sequence[bytes] | None = None,
               offsets_ns: Sequence[int] | None = None) -> tuple[list[Outcome], float]:
    """Warm up, wait for the other workers, measure; parse only once every stream has ended. Returns
    the outcomes and the CPU seconds the measured streams cost this process (parsing excluded).
    `requests`: each request's bytes, the warm-up's first; `offsets_ns`: open loop, each measured
    request's send time from the start."""
    loop = _Loop(target, timeout)
    collecting = gc.isenabled()
    gc.disable()  # a full collection mid-level would show up as an ITL outlier
    try:
        if warmup:
            loop.run(min(streams, warmup), warmup, None, None if requests is None else requests[:warmup])
        if barrier is not None:
            barrier.wait()
        measured = None if requests is None else requests[warmup:]
        cpu = time.process_time()
        loop.tick = tick
        if offsets_ns is not None:
            assert measured is not None
            exchanges = loop.run_open(offsets_ns, measured)
        else:
            exchanges = loop.run(streams, count, duration, measured)
        cpu = time.process_time() - cpu
    finally:
        loop.sel.close()
        if collecting:
            gc.enable()
    outcomes = [parse_exchange(x.sent_ns, x.end_ns, x.reads, x.error) for x in exchanges]
    for o, x in zip(outcomes, exchanges):
        o.scheduled_ns = x.scheduled_ns
    return outcomes, cpu


def _worker(results, *share) -> None:
    outcomes, cpu = _run_share(*share)
    results.put(([vars(o) for o in outcomes], cpu))


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (i < total % parts) for i in range(parts)]


def _run_level(target: Target, concurrency: int, count: int | None, warmup: int,
               duration: float | None, timeout: float, workers: int, tick=None,
               requests: Sequence[bytes] | None = None,
               offsets_ns: Sequence[int] | None = None) -> tuple[list[Outcome], float]:
    workers = min(workers, concurrency)
    if workers == 1 or requests is not None:   # a scenario's own prompts, or an open loop: one process
        return _run_share(target, concurrency, count, warmup, duration, timeout, tick=tick,
                          requests=requests, offsets_ns=offsets_ns)
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


def request_record(concurrency: int | None, index: int, o: Outcome) -> dict:
    """One line of requests.jsonl. TTFT and E2E count from the scheduled send time in an open loop
    (a late send is the client's delay, which a user of the server would have waited too), else
    from the send."""
    tokens = o.tokens if o.tokens is not None else len(o.times)
    ttft = e2e = tpot = None
    origin = o.sent_ns if o.scheduled_ns is None else o.scheduled_ns
    if o.times:
        ttft, e2e = _ms(o.times[0] - origin), _ms(o.times[-1] - origin)
        if tokens >= 2:
            tpot = (e2e - ttft) / (tokens - 1)
    itl = [_ms(b - a) for a, b in zip(o.times, o.times[1:])]
    return {"concurrency": concurrency, "index": index, "scheduled_ns": o.scheduled_ns, "start_ns": o.sent_ns,
            "end_ns": o.end_ns,
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


def summarize_level(concurrency: int | None, outcomes: Sequence[Outcome],
                    slo: dict[str, float] | None = None) -> tuple[dict, list[dict]]:
    """A level of bench.json and its requests.jsonl records (indexed in the order they were sent, or
    scheduled in an open loop). With `slo`, the level's goodput (`goodput`)."""
    records = [request_record(concurrency, i, o) for i, o in
               enumerate(sorted(outcomes, key=lambda o: o.sent_ns if o.scheduled_ns is None else o.scheduled_ns))]
    ok = [r for r in records if r["error"] is None]
    duration_s = 0.0
    if outcomes:
        duration_s = (max(o.end_ns for o in outcomes) - min(o.sent_ns for o in outcomes)) / 1e9
    output_tokens = sum(r["output_tokens"] for r in ok)
    level = {
        "concurrency": concurrency, "requests": len(records), "completed": len(ok),
        "failed": len(records) - len(ok), "duration_s": duration_s, "output_tokens": output_tokens,
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
        "decode": decode_window(outcomes, concurrency) if concurrency else None,
    }
    if slo:
        good = sum(request_meets(r, slo) for r in records)
        level.update(slo=slo, slo_met_requests=good, goodput_req_s=good / duration_s if duration_s else None)
        level["slo_met"] = level_meets(level, slo)
    return level, records


# --------------------------------------------------------------------------- SLOs, arrivals, the search

def _slo_parts(metric: str) -> tuple[str, str]:
    """"ttft_ms_p99" -> ("ttft_ms", "p99")."""
    name, _, stat = metric.rpartition("_")
    return name, stat


def request_meets(record: dict, slo: dict[str, float]) -> bool:
    """Whether one completed request meets every bound: its TTFT, TPOT and E2E against their bounds
    (whatever statistic the bound names: a request has one value of each), its own ITL percentile
    for itl_ms_*. A request of one token has no TPOT nor ITL, and meets those bounds; a failed one
    meets none."""
    if record["error"] is not None:
        return False
    for metric, bound in slo.items():
        name, stat = _slo_parts(metric)
        if name == "itl_ms":
            if not record["itl_ms"]:
                continue
            value = distribution(record["itl_ms"])[stat]
        else:
            value = record.get(name)
            if value is None:
                if name == "tpot_ms":
                    continue
                return False
        if value > bound:
            return False
    return True


def level_meets(level: dict, slo: dict[str, float]) -> bool:
    """Whether a level as a whole meets the SLO (what max_load searches for): every request completed
    and each bound holds for the level's own statistic (ttft_ms_p99: the p99 of the level's TTFTs;
    itl_ms_p99: of its pooled ITLs)."""
    if not level["completed"] or level["failed"]:
        return False
    for metric, bound in slo.items():
        name, stat = _slo_parts(metric)
        value = (level.get(name) or {}).get(stat)
        if value is None and name in ("tpot_ms", "itl_ms"):
            continue   # outputs of one token: no gaps to bound
        if value is None or value > bound:
            return False
    return True


ARRIVALS = ("poisson", "gamma", "constant")


def arrival_offsets(rate: float, count: int, arrival: str = "poisson", burstiness: float = 1.0,
                    random_state: int = 0) -> list[int]:
    """Open loop: each request's send time, ns from the first (which is at 0), drawn from a fixed
    random state so a level's schedule can be drawn again. Gaps: exponential of mean 1/rate
    (poisson), gamma of shape `burstiness` and the same mean (below 1 burstier than Poisson, above
    more regular; 1 is Poisson), or exactly 1/rate (constant)."""
    if rate <= 0 or count < 0 or arrival not in ARRIVALS or burstiness <= 0:
        raise ValueError("a rate above 0, a count, an arrival of " + ", ".join(ARRIVALS) + " and burstiness above 0")
    rng = random.Random(random_state)
    t, out = 0.0, []
    for _ in range(count):
        out.append(round(t * 1e9))
        if arrival == "constant":
            t += 1 / rate
        elif arrival == "poisson":
            t += rng.expovariate(rate)
        else:
            t += rng.gammavariate(burstiness, 1 / (rate * burstiness))
    return out


def bisect_max_load(low: float, high: float, steps: int, integer: bool,
                    meets: Callable[[float], bool]) -> dict:
    """The highest load in [low, high] that `meets`, assuming fewer loads meet as the load grows, in at
    most `steps` probes: low first (if it misses, nothing meets), then high (if it meets, it is the
    answer), then the middle of the last load that met and the first that missed, until `steps`
    probes were made or (integers) no load lies between them. Returns {value, met, probes}:
    value None and met False when low already missed."""
    if integer:
        low, high = math.ceil(low), math.floor(high)
    if low > high or steps < 1:
        raise ValueError(f"max_load: low {low} is above high {high}, or steps below 1")
    probes: list[dict] = []

    def probe(load: float) -> bool:
        ok = bool(meets(load))
        probes.append({"load": load, "met": ok})
        return ok

    if not probe(low):
        return {"value": None, "met": False, "probes": probes}
    if steps == 1 or high == low:
        return {"value": low, "met": True, "probes": probes}
    if probe(high):
        return {"value": high, "met": True, "probes": probes}
    good, bad = low, high
    while len(probes) < steps:
        mid = (good + bad) // 2 if integer else (good + bad) / 2
        if integer and mid <= good:
            break
        if probe(mid):
            good = mid
        else:
            bad = mid
    return {"value": good, "met": True, "probes": probes}


# --------------------------------------------------------------------------- prompts of exact lengths

PREFIX_WORDS = 6       # a request's own opening words (of _WORDS: 40^6 ways), so no two share a cached prefix
MAX_ANSWER = 64 << 20  # bytes of a tokenizer's or probe's answer read at most


class PromptMaker:
    """Prompts of exactly N of the server's tokens, each opening with its own random words.

    With a tokenizer endpoint (`POST /tokenize`: vLLM's, and SGLang's since at least 0.5.23; both
    answer {"count": N, "tokens": [...], "max_model_len": M}) each prompt is counted there and its
    word count adjusted until it is N (`prompt_source: "tokenize"`). Without one, probe requests of
    one output token, with an opening no measured request uses, find the word count whose
    `usage.prompt_tokens` is N, used for every request (`"usage-calibrated"`: every request's own
    opening may tokenize a little differently; the server's counts afterwards say). With neither,
    N words (`"words"`). Requests are built before a level starts, off its clock."""

    def __init__(self, url: str, model: str, api: str, headers: dict[str, str], timeout: float,
                 extra_body: dict | None = None):
        parts = urlsplit(url)
        self.tls, self.host, self.port = parts.scheme == "https", parts.hostname or "", parts.port
        base = parts.path.rstrip("/")
        self.root = base[:-3] if base.endswith("/v1") else base
        self.model, self.api, self.headers, self.timeout = model, api, headers, timeout
        self.extra_body = extra_body or {}
        self.conn: http.client.HTTPConnection | None = None
        self.tokenizer: bool | None = None   # whether the server has /tokenize (None: not asked yet)
        self.how: dict[int, str] = {}           # input tokens -> "usage-calibrated" or "words"
        self.calls = 0
        self.used: set[tuple[int, ...]] = set()
        self.calibrated: dict[int, int] = {}   # usage-calibrated: input tokens -> words
        self.guess: dict[int, int] = {}        # tokenize: input tokens -> the last word count that fit

    def _post(self, path: str, body: dict) -> tuple[int, Any]:
        for attempt in (0, 1):   # a kept-alive connection the server closed meanwhile: once more
            if self.conn is None:
                cls = http.client.HTTPSConnection if self.tls else http.client.HTTPConnection
                self.conn = cls(self.host, self.port, timeout=self.timeout)
            try:
                self.conn.request("POST", path, json.dumps(body),
                                  {"Content-Type": "application/json", **self.headers})
                resp = self.conn.getresponse()
                data = resp.read(MAX_ANSWER + 1)
                break
            except (OSError, http.client.HTTPException):
                self.conn.close()
                self.conn = None
                if attempt:
                    raise
        self.calls += 1
        if len(data) > MAX_ANSWER:
            raise ValueError(f"{path}: an answer of more than {MAX_ANSWER} bytes")
        try:
            return resp.status, json.loads(data)
        except ValueError:
            return resp.status, None

    def content(self, text: str) -> dict:
        return {"messages": [{"role": "user", "content": text}]} if self.api == "chat" else {"prompt": text}

    def _tokenized(self, text: str) -> int | None:
        try:
            status, answer = self._post(self.root + "/tokenize", {"model": self.model, **self.content(text)})
        except (OSError, ValueError, http.client.HTTPException):
            return None
        count = answer.get("count") if status == 200 and isinstance(answer, dict) else None
        return count if isinstance(count, int) and not isinstance(count, bool) else None

    def _usage(self, text: str) -> int | None:
        body = {**self.extra_body, "model": self.model, "max_tokens": 1, "temperature": 0, "stream": False,
                **self.content(text)}
        try:
            status, answer = self._post(self.root + "/v1" + APIS[self.api], body)
        except (OSError, ValueError, http.client.HTTPException):
            return None
        usage = answer.get("usage") if status == 200 and isinstance(answer, dict) else None
        count = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        return count if isinstance(count, int) and not isinstance(count, bool) else None

    def _words(self, rng: random.Random) -> list[str]:
        while True:
            pick = tuple(rng.randrange(len(_WORDS)) for _ in range(PREFIX_WORDS))
            if pick not in self.used:
                self.used.add(pick)
                return [_WORDS[i] for i in pick]

    @staticmethod
    def _text(opening: list[str], words: int) -> str:
        filler = (_WORDS[i % len(_WORDS)] for i in range(max(0, words - len(opening))))
        return " ".join([*opening[:words], *filler])

    @staticmethod
    def _fit(count: Callable[[int], int | None], tokens: int, guess: int) -> tuple[int, int | None]:
        """The word count whose prompt counts `tokens`, from `guess`, in a few counts at most (the
        closest found when none fits exactly, or the count is unknown)."""
        seen: dict[int, int] = {}
        words = max(1, guess)
        for _ in range(8):
            got = count(words)
            if got is None:
                return words, None
            seen[words] = got
            if got == tokens:
                break
            words = max(1, words + tokens - got)
            if words in seen:
                break
        best = min(seen, key=lambda w: (abs(seen[w] - tokens), seen[w] > tokens))
        return best, seen[best]

    def prompts(self, tokens: int, count: int, rng: random.Random) -> list[str]:
        """`count` prompts of `tokens` tokens, each with its own opening."""
        if self.tokenizer is None:
            self.tokenizer = self._tokenized("hello") is not None
        if not self.tokenizer and tokens not in self.calibrated:
            probe = self._words(rng)
            words, got = self._fit(lambda w: self._usage(self._text(probe, w)), tokens, tokens)
            self.calibrated[tokens] = words if got is not None else tokens
            self.how[tokens] = "usage-calibrated" if got is not None else "words"
        out = []
        for _ in range(count):
            opening = self._words(rng)
            if self.tokenizer:
                def counted(w: int, o: list[str] = opening) -> int | None:
                    return self._tokenized(self._text(o, w))
                words, _ = self._fit(counted, tokens, self.guess.get(tokens, tokens))
                self.guess[tokens] = words
            else:
                words = self.calibrated.setdefault(tokens, tokens)
            out.append(self._text(opening, words))
        return out

    def source(self, tokens: int) -> str:
        """How prompts of `tokens` tokens were made (bench.json's prompt_source)."""
        return "tokenize" if self.tokenizer else self.how.get(tokens, "words")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


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
    start = (f"POST {path} HTTP/1.1\r\nHost: {parts.netloc.rpartition('@')[2]}\r\n"
             f"Content-Type: application/json\r\nAccept: text/event-stream\r\n{extra}")
    head = f"{start}Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    try:
        family, *_, sockaddr = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)[0]
    except OSError as e:
        raise ValueError(f"cannot resolve {parts.hostname!r}: {e}") from e
    address = str(sockaddr[0])  # already a str for an IP family (typeshed also allows the int of other families)
    return Target(parts.hostname, family, address, port, tls, head.encode() + payload, start)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_scenario(sc: Any, searched: bool) -> None:
    name = sc.get("name") if isinstance(sc, dict) else None
    _check(isinstance(name, str) and bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.\-]*", name)),
           f"a scenario needs a name of letters, digits, '.', '_', '-' (got {sc!r})")
    for key in ("input_tokens", "output_tokens"):
        _check(isinstance(sc.get(key), int) and sc[key] >= 1, f"scenario {name}: {key} must be a positive integer")
    conc, rate = sc.get("concurrency"), sc.get("request_rate")
    _check((conc is None) != (rate is None), f"scenario {name}: give concurrency (closed loop) or request_rate "
           "(open loop), one of them")
    _check(all(isinstance(c, int) and c >= 1 for c in conc or ()), f"scenario {name}: concurrency levels are "
           "positive integers")
    _check(all(isinstance(r, (int, float)) and r > 0 for r in rate or ()), f"scenario {name}: request rates are "
           "positive numbers")
    _check(searched or bool(conc or rate), f"scenario {name}: no levels")
    _check(sc.get("arrival", "poisson") in ARRIVALS, f"scenario {name}: arrival is one of {', '.join(ARRIVALS)}")
    _check(float(sc.get("burstiness", 1.0)) > 0, f"scenario {name}: burstiness must be above 0")
    _check(sc.get("requests") is None or sc["requests"] >= 1, f"scenario {name}: requests must be at least 1")


SLO_FORM = "metrics like ttft_ms_p99 or itl_ms_p50, each to a bound in ms above 0"


def _is_slo(slo: Any) -> bool:
    return isinstance(slo, dict) and all(
        isinstance(k, str) and re.fullmatch(r"(ttft|itl|tpot|e2e)_ms_(mean|p50|p90|p95|p99|max)", k) is not None
        and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for k, v in slo.items())


def _load_label(level: dict) -> str:
    scenario = f"{level['scenario']} " if level.get("scenario") else ""
    if level.get("request_rate") is not None:
        return f"{scenario}rate {level['request_rate']:g}/s"
    return f"{scenario}concurrency {level['concurrency']}"


def run_benchmark(url: str, model: str, *, concurrency: Sequence[int] = (1,), requests: int | None = None,
                  warmup: int = 1, max_tokens: int = DEFAULT_MAX_TOKENS, prompt: str | None = None,
                  prompt_tokens: int | None = None, api: str = "completions", ignore_eos: bool = True,
                  timeout: float = DEFAULT_TIMEOUT_S, duration: float | None = None, workers: int = 1,
                  progress: Callable[[dict], None] | None = None, extra_body: dict | None = None,
                  headers: dict[str, str] | None = None, on_tick: Callable[[dict], None] | None = None,
                  scenarios: Sequence[dict] | None = None, slo: dict[str, float] | None = None,
                  search: dict | None = None, random_state: int = 0) -> dict:
    """Run every level; return bench.json's content plus "requests" (requests.jsonl's lines).

    Without `scenarios`, one level per `concurrency`, every request the same prompt. With them, each
    scenario's levels in turn (closed loop at each of its `concurrency`, or open loop at each of its
    `request_rate`), each request its own prompt of exactly `input_tokens` tokens (PromptMaker),
    asking `output_tokens` with ignore_eos; then, with `search` ({scenario, slo, low, high, steps}),
    the probes of the highest load of that scenario that meets the SLO (bisect_max_load), each an
    ordinary level marked `probe`, after every scenario's own levels. `random_state` fixes the
    arrivals and prompts (level i draws from random_state + i). `slo` adds goodput to every level.

    `requests` is per level (default: max(2 x concurrency, 16), or max(2 x rate, 16) in an open
    loop; with `duration`, a cap). Raises ValueError on bad arguments; failed requests are recorded,
    never raised. `progress` is called with each level as it finishes. `ignore_eos` is sent only
    when true (some servers refuse unknown fields, transformers serve with HTTP 422); `extra_body`
    adds engine-specific fields to every request.
    """
    scenarios = list(scenarios or ())
    _check(bool(concurrency) and all(c >= 1 for c in concurrency), "concurrency must be positive integers")
    _check(requests is None or requests >= 1, "requests must be at least 1")
    _check(warmup >= 0, "warmup must be 0 or more")
    _check(max_tokens >= 1, "max_tokens must be at least 1")
    _check(prompt is None or prompt_tokens is None, "give a prompt or prompt_tokens, not both")
    _check(prompt_tokens is None or prompt_tokens >= 1, "prompt_tokens must be at least 1")
    _check(api in APIS, f"api must be one of {', '.join(APIS)}")
    _check(timeout > 0 and (duration is None or duration > 0), "timeout and duration must be positive")
    _check(workers >= 1, "workers must be at least 1")
    _check(not scenarios or (prompt is None and prompt_tokens is None),
           "scenarios make their own prompts: give no prompt nor prompt_tokens with them")
    _check(not scenarios or duration is None, "scenarios count their requests: no duration with them")
    _check(search is None or bool(scenarios), "search needs scenarios (the scenario whose load it searches)")
    _check(slo is None or _is_slo(slo), "slo: " + SLO_FORM)
    _check(isinstance(random_state, int) and random_state >= 0, "random_state must be an integer, 0 or more")
    searched = None
    if search is not None:
        _check(isinstance(search, dict) and all(isinstance(search.get(k), (int, float)) for k in ("low", "high")),
               "search: {scenario, slo, low, high, steps}, low and high numbers")
        names = [sc.get("name") for sc in scenarios if isinstance(sc, dict)]
        searched = search.get("scenario") or (names[0] if names else None)
        _check(searched in names, f"search: no scenario named {searched!r} (have: {', '.join(map(str, names))})")
        _check(_is_slo(search.get("slo")) and bool(search["slo"]), "search: an SLO to meet: " + SLO_FORM)
        _check(isinstance(search.get("steps"), int) and search["steps"] >= 1, "search: steps must be at least 1")
        _check(0 < search.get("low", 0) <= search.get("high", 0), "search: 0 < low <= high")
    for sc in scenarios:
        _check_scenario(sc, sc.get("name") == searched if isinstance(sc, dict) else False)
    words: int | None = None
    if prompt is not None:
        text = prompt
    else:
        words = None if scenarios else (prompt_tokens or DEFAULT_PROMPT_WORDS)
        text = synthetic_prompt(words or DEFAULT_PROMPT_WORDS)
    base = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if ignore_eos:
        base["ignore_eos"] = True
    body = dict(base)
    body.update({"messages": [{"role": "user", "content": text}]} if api == "chat" else {"prompt": text})
    body.update(extra_body or {})
    target = build_target(url, body, api, headers)

    result: dict[str, Any]
    result = {"schema": SCHEMA, "url": url, "model": model, "api": api,
              "max_tokens": None if scenarios else max_tokens, "prompt_tokens": None, "prompt": prompt,
              "prompt_words": words, "ignore_eos": ignore_eos or bool(scenarios),
              "temperature": 0, "warmup": warmup, "timeout_s": timeout, "duration_limit_s": duration,
              "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "client": {"name": "harness-bench", "python": platform.python_version(),
                         "host": socket.gethostname(), "workers": workers, "clock": "time.monotonic_ns",
                         "percentiles": "linear interpolation (numpy default)",
                         "latency_origin": "the send time; in an open loop the scheduled send time"},
              "slo": slo or None, "random_state": random_state, "scenarios": scenarios or None,
              "levels": [], "requests": []}
    maker = PromptMaker(url, model, api, headers or {}, timeout, extra_body) if scenarios else None
    plan: list[dict] = []
    if scenarios:
        for sc in scenarios:
            kind = "concurrency" if sc.get("concurrency") is not None else "request_rate"
            plan += [{"scenario": sc, kind: load} for load in sc[kind] or ()]
    else:
        plan = [{"concurrency": c} for c in concurrency]
    levels_total = len(plan) + (search["steps"] if search else 0)

    def measure(spec: dict, level_slo: dict | None, probe: bool = False) -> dict:
        index = len(result["levels"])
        sc, c, rate = spec.get("scenario"), spec.get("concurrency"), spec.get("request_rate")
        n: int | None = (sc or {}).get("requests") or requests
        count: int | None
        if rate is None:
            assert c is not None   # a level is closed loop or open
            count = n if n is not None or duration is not None else max(2 * c, 16)
        else:
            count = n or (math.ceil(rate * duration) if duration else max(16, math.ceil(2 * rate)))
        state = random_state + index
        reqs = offsets = None
        if sc is not None:
            assert maker is not None and count is not None   # a scenario's level counts its requests
            scenario_body = {**base, "max_tokens": sc["output_tokens"], "ignore_eos": True, **(extra_body or {})}
            texts = maker.prompts(sc["input_tokens"], count + warmup, random.Random(f"prompts/{state}"))
            reqs = [target.request_for(scenario_body | maker.content(t)) for t in texts]
            if rate is not None:
                offsets = arrival_offsets(rate, count, sc.get("arrival", "poisson"), float(sc.get("burstiness", 1.0)),
                                          state)
        streams = c if c is not None else 1
        tick = (_ticker(on_tick, _load_label({"scenario": sc and sc["name"], "concurrency": c, "request_rate": rate}),
                        c, count, duration, sc["output_tokens"] if sc else max_tokens, levels_total, index)
                if on_tick else None)
        outcomes, cpu_s = _run_level(target, streams, count, warmup, duration if offsets is None else None, timeout,
                                     workers, tick, reqs, offsets)
        level, records = summarize_level(c, outcomes, level_slo)
        chunks = sum(r["chunks"] for r in records)
        level["client_cpu_s"] = cpu_s
        level["client_cpu_us_per_chunk"] = cpu_s * 1e6 / chunks if chunks else None
        if sc is not None:
            assert maker is not None
            level = _scenario_fields(level, records, outcomes, sc, rate, state, maker.source(sc["input_tokens"]), probe)
        result["levels"].append(level)
        result["requests"] += records
        if result["prompt_tokens"] is None:
            result["prompt_tokens"] = next((o.prompt_tokens for o in outcomes if o.prompt_tokens), None)
        if progress:
            progress(level)
        return level

    try:
        for spec in plan:
            measure(spec, slo)
        if search is not None:
            sc = next(s for s in scenarios if s["name"] == searched)
            kind = "concurrency" if sc.get("concurrency") is not None else "request_rate"
            probes: list[int] = []

            def meets(load: float) -> bool:
                level = measure({"scenario": sc, kind: int(load) if kind == "concurrency" else load}, search["slo"],
                                probe=True)
                probes.append(len(result["levels"]) - 1)
                return bool(level["slo_met"])

            found = bisect_max_load(search["low"], search["high"], search["steps"], kind == "concurrency", meets)
            for p, index in zip(found["probes"], probes):
                p["level"] = index
            result["max_load"] = {"scenario": searched, "kind": kind, "low": search["low"], "high": search["high"],
                                  "steps": search["steps"], "slo": search["slo"], **found}
    finally:
        if maker is not None:
            maker.close()
    return result


def _scenario_fields(level: dict, records: list[dict], outcomes: Sequence[Outcome], sc: dict, rate: float | None,
                     state: int, source: str, probe: bool) -> dict:
    """What a scenario's level adds to bench.json (and its requests to requests.jsonl): the workload,
    the prompts' lengths as the server counted them, and in an open loop the schedule's keeping."""
    reported = Counter(r["prompt_tokens"] for r in records if r["error"] is None and r["prompt_tokens"] is not None)
    kind = "concurrency" if rate is None else "request_rate"
    head = {"scenario": sc["name"], "workload": {"scenario": sc["name"], "input_tokens": sc["input_tokens"],
                                                 "output_tokens": sc["output_tokens"], "kind": kind,
                                                 "load": level["concurrency"] if rate is None else rate},
            "concurrency": level["concurrency"], "request_rate": rate, "probe": probe, "random_state": state,
            "prompt_source": source,
            "prompt_tokens_reported": {str(k): v for k, v in sorted(reported.items(), key=lambda kv: kv[0])},
            "prompt_tokens_mismatches": sum(n for k, n in reported.items() if k != sc["input_tokens"]),
            "prompt_tokens_unreported": sum(r["error"] is None and r["prompt_tokens"] is None for r in records),
            "latency_origin": "sent" if rate is None else "scheduled"}
    if rate is not None:
        head["arrival"], head["burstiness"] = sc.get("arrival", "poisson"), float(sc.get("burstiness", 1.0))
        sent = sorted(o.sent_ns for o in outcomes if o.sent_ns)
        head["achieved_rate_req_s"] = ((len(sent) - 1) / ((sent[-1] - sent[0]) / 1e9)
                                       if len(sent) > 1 and sent[-1] > sent[0] else None)
        head["schedule_lag_ms"] = distribution((o.sent_ns - o.scheduled_ns) / 1e6 for o in outcomes
                                               if o.sent_ns and o.scheduled_ns is not None)
    for r in records:
        r.update(scenario=sc["name"], request_rate=rate, probe=probe)
    return head | {k: v for k, v in level.items() if k not in head}


def _ticker(on_tick: Callable[[dict], None], label: str, concurrency: int | None, count: int | None,
            duration: float | None, max_tokens: int, levels: int, index: int) -> Callable[[list[_Exchange]], None]:
    """Once a second, where the level stands: requests done (and failed) of how many, elapsed, an ETA,
    and tokens a second so far (completed requests x max_tokens: an estimate until the level ends)."""
    started = time.monotonic()

    def tick(finished: list[_Exchange]) -> None:
        elapsed = time.monotonic() - started
        done, failed = len(finished), sum(x.error is not None for x in finished)
        total = count if count is not None else None
        eta = (elapsed / done * (total - done) if total and done else
               (duration - elapsed if duration else None))
        on_tick({"concurrency": concurrency, "load": label, "level": index + 1, "levels": levels, "done": done,
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
    line = (f"{_load_label(level)}: {level['completed']}/{level['requests']} completed, "
            f"{f(level['output_tok_s'])} tok/s, TTFT p50 {f(level['ttft_ms']['p50'])} ms, "
            f"ITL p50 {f(level['itl_ms']['p50'])} p99 {f(level['itl_ms']['p99'])} ms"
            + (f" (per token {f(level['itl_token_ms']['p50'])} p99 {f(level['itl_token_ms']['p99'])}, "
               f"{level['tokens_per_chunk']:.2f} tokens a chunk)" if several_per_chunk(level) else "")
            + f", TPOT p50 {f(level['tpot_ms']['p50'])} ms, "
            f"decode {f(decode and decode['per_user_tok_s'])} tok/s/user")
    if level["usage_missing"]:
        line += f"\n  {level['usage_missing']} responses had no usage: tokens counted from chunks"
    if level.get("goodput_req_s") is not None:
        line += (f"\n  goodput {f(level['goodput_req_s'])} req/s ({level['slo_met_requests']} of "
                 f"{level['requests']} within the SLO; the level {'meets' if level['slo_met'] else 'misses'} it)")
    if level.get("schedule_lag_ms"):
        lag = level["schedule_lag_ms"]
        line += (f"\n  open loop: {f(level['achieved_rate_req_s'])} req/s achieved of {level['request_rate']:g}, "
                 f"schedule lag p50 {f(lag['p50'])} p99 {f(lag['p99'])} ms")
    if level.get("prompt_tokens_mismatches"):
        line += (f"\n  {level['prompt_tokens_mismatches']} prompts were not {level['workload']['input_tokens']} tokens "
                 f"as the server counted them ({level['prompt_source']}): {level['prompt_tokens_reported']}")
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
    p.add_argument("--concurrency", type=_positive_ints, help="levels, e.g. 1,8,32 (default 1)")
    p.add_argument("--requests", type=int,
                   help="measured requests per level (default max(2 x concurrency, 16))")
    p.add_argument("--duration", type=float, help="seconds per level instead of a request count")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests before each level (default 1)")
    p.add_argument("--max-tokens", type=int, help=f"output tokens a request (default {DEFAULT_MAX_TOKENS})")
    p.add_argument("--plan", type=json.loads, help="a JSON object: scenarios (a list, as the playbook's "
                   "benchmark.scenarios), slo, search (max_load: scenario, slo, low, high, steps), random_state; "
                   "instead of --concurrency, --max-tokens and the prompt options")
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
        if level.get("probe"):   # a probe of max_load that lost requests merely misses the SLO
            continue
        if level["requests"] and level["failed"] / level["requests"] > max_share:
            why = "; ".join(f"{e['count']} x {e['error']}" for e in level["errors"][:3])
            lines.append(f"{_load_label(level)}: {level['failed']} of {level['requests']} "
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
    plan = args.plan or {}
    if args.plan is not None:
        given = [o for o, v in (("--concurrency", args.concurrency), ("--max-tokens", args.max_tokens),
                                ("--prompt", args.prompt), ("--prompt-tokens", args.prompt_tokens)) if v is not None]
        if not isinstance(plan, dict) or set(plan) - {"scenarios", "slo", "search", "random_state"}:
            print("bench.py: error: --plan is a JSON object of scenarios, slo, search and random_state",
                  file=sys.stderr)
            return 2
        if given and plan.get("scenarios"):
            print(f"bench.py: error: --plan's scenarios replace {', '.join(given)}: give one or the other",
                  file=sys.stderr)
            return 2
    headers = {}
    if args.api_key_env:
        if not os.environ.get(args.api_key_env):
            print(f"bench.py: error: --api-key-env: {args.api_key_env} is not set in the environment", file=sys.stderr)
            return 2
        headers["Authorization"] = f"Bearer {os.environ[args.api_key_env]}"
    try:
        result = run_benchmark(
            args.url, args.model, concurrency=args.concurrency or [1], requests=args.requests, warmup=args.warmup,
            max_tokens=args.max_tokens or DEFAULT_MAX_TOKENS, prompt=args.prompt, prompt_tokens=args.prompt_tokens,
            api=args.api,
            ignore_eos=args.ignore_eos, timeout=args.timeout, duration=args.duration, workers=args.workers,
            extra_body=args.extra_body, headers=headers, scenarios=plan.get("scenarios"), slo=plan.get("slo"),
            search=plan.get("search"), random_state=plan.get("random_state", 0),
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
