"""The benchmark client's hot path: one selector loop over non-blocking sockets that sends each request
and stamps every read, closed loop (`_Loop.run`: a stream sends its next request when its last one
ends) or open loop (`_Loop.run_open`: each request at its scheduled instant, whatever is in flight),
and `run_level`, which runs one level in this process or split over worker processes.

A room of its own because every figure of bench.json rests on it: nothing else runs between a socket
and its stamp, and what a change here costs is measured, not guessed (benchmarks/bench_fidelity.py,
benchmarks/open_loop.py). The requests arrive as bytes (exchange.py builds them, workload.py their
prompts and schedules) and leave as stamped reads that exchange.py parses after the level.

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

import contextlib
import errno
import gc
import multiprocessing
import os
import queue
import selectors
import socket
import ssl
import time
from collections.abc import Sequence
from typing import Callable, cast

from .exchange import Outcome, Reads, Target, parse_exchange, parse_head

MAX_RESPONSE_BYTES = 64 << 20
"""The most one response may bring (a long answer with logprobs is a few MB): past it the request
fails, rather than a server that never ends its answer filling the host's memory beside the engine."""
MAX_HEAD_BYTES = 64 << 10
"""The most a response's head may take before its blank line (a real one is a few hundred bytes)."""
REFUSED_PAUSE_NS = (10_000_000, 1_000_000_000)
"""A level bound by time whose requests are refused before they are sent (the server stopped
listening) waits before starting more: from 10 ms, doubling, to 1 s, until one goes out again. Without
the pause it spun through tens of thousands of refusals a second, each kept for bench.json."""


class Oversized(ValueError):
    """A response past MAX_HEAD_BYTES or MAX_RESPONSE_BYTES."""


class Exchange:
    """One request on its own connection (`Connection: close`), moved along by _Loop:
    connect -> handshake (TLS only) -> send -> read -> done.

    The read path stamps, stores, and watches the framing only to know when the response is complete
    (chunked terminator, Content-Length, or connection close).
    """

    __slots__ = ("sock", "deadline_ns", "state", "out", "reads", "sent_ns", "end_ns", "error", "head_done",
                 "chunked", "left", "tail", "request", "scheduled_ns", "room")

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
        self.room = MAX_RESPONSE_BYTES

    def received(self, t: int, data: bytes) -> bool:
        """Store one read stamped `t`; True once the response is complete (ValueError: not HTTP, or
        larger than MAX_RESPONSE_BYTES)."""
        self.room -= len(data)
        if self.room < 0:
            raise Oversized(f"response larger than {MAX_RESPONSE_BYTES >> 20} MB")
        self.reads.append((t, data))
        if not self.head_done:
            buf = b"".join(d for _, d in self.reads)
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD_BYTES:
                    raise Oversized(f"response head longer than {MAX_HEAD_BYTES >> 10} kB")
                return False
            _, self.chunked, self.left = parse_head(buf[:end])
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

    def __init__(self, target: Target, timeout: float, tick: Callable[[list[Exchange]], None] | None = None):
        self.target, self.timeout_ns = target, int(timeout * 1e9)
        self.tick, self.next_tick_ns = tick, 0   # progress, at most once a second: off the hot path
        self.sel = selectors.DefaultSelector()
        self.tls = ssl.create_default_context() if target.tls else None
        self.live: dict[Exchange, None] = {}   # in flight, oldest (the next to time out) first
        self.finished: list[Exchange] = []
        self.refused, self.pause_ns = 0, REFUSED_PAUSE_NS[0]   # refused unsent since one went out; next pause

    def run(self, streams: int, count: int | None, duration: float | None,
            requests: Sequence[bytes] | None = None) -> list[Exchange]:
        """`streams` streams, each sending its next request when its last one ends, until `count`
        requests were sent or `duration` seconds passed; returns them all, ended. `requests`: the
        bytes of each request in turn (default: the target's one request, every time)."""
        stop_ns = None if duration is None else time.monotonic_ns() + int(duration * 1e9)
        started, resume_ns = 0, 0
        self.finished, self.refused, self.pause_ns = [], 0, REFUSED_PAUSE_NS[0]
        try:
            while True:
                now = time.monotonic_ns()
                if stop_ns is not None and self.refused >= streams:   # no longer listening: wait a while
                    resume_ns, self.refused = now + self.pause_ns, 0
                    self.pause_ns = min(2 * self.pause_ns, REFUSED_PAUSE_NS[1])
                more = (count is None or started < count) and (stop_ns is None or now < stop_ns)
                free = streams - len(self.live)
                while more and free and now >= resume_ns and (count is None or started < count):
                    self._start(self.target.request if requests is None else requests[started % len(requests)])
                    started, free = started + 1, free - 1
                paused = more and now < resume_ns
                if not self.live and not paused:
                    return self.finished
                if not self.live:
                    time.sleep((min(resume_ns, stop_ns or resume_ns) - now) / 1e9)
                    continue
                oldest = next(iter(self.live))
                until = min(oldest.deadline_ns, resume_ns) if paused else oldest.deadline_ns
                self._wait(now, max(0, until - now))
                now = time.monotonic_ns()
                while self.live and oldest.deadline_ns <= now:
                    self._finish(oldest, "timeout")
                    oldest = next(iter(self.live), oldest)
                self._progress(now)
        finally:
            for x in list(self.live):
                self._finish(x, "benchmark interrupted")

    def run_open(self, offsets_ns: Sequence[int], requests: Sequence[bytes]) -> list[Exchange]:
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
        """Open the request's connection. A socket the system will not give (no file descriptor left:
        EMFILE) fails this request as a refused connection does, never the level."""
        t = self.target
        deadline_ns = time.monotonic_ns() + self.timeout_ns
        try:
            sock = socket.socket(t.family, socket.SOCK_STREAM)
        except OSError as e:
            x = Exchange(cast(socket.socket, None), deadline_ns, request, scheduled_ns)   # no socket to close
            x.state, x.error, x.end_ns = "done", f"cannot connect: {e}", time.monotonic_ns()
            self.finished.append(x)
            self.refused += 1
            return
        x = Exchange(sock, deadline_ns, request, scheduled_ns)
        self.live[x] = None
        try:
            sock.setblocking(False)
            err = sock.connect_ex((t.address, t.port))
            if err not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
                return self._finish(x, f"cannot connect: [Errno {err}] {os.strerror(err)}")
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sel.register(sock, selectors.EVENT_WRITE, x)
        except OSError as e:
            return self._finish(x, f"cannot connect: {e}")
        if err == 0:   # connected at once (loopback usually is): send now, not after another select()
            self._advance(x)

    def _advance(self, x: Exchange) -> None:
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

    def _read(self, x: Exchange, now: int) -> None:
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
            except Oversized as e:   # what came is not kept: nothing to parse, and the memory back
                x.reads = []
                return self._finish(x, str(e))
            except ValueError:
                return self._finish(x, "malformed response head")
            if self.tls is None or not x.sock.pending():  # type: ignore[attr-defined]
                return

    def _finish(self, x: Exchange, error: str | None) -> None:
        x.state, x.error = "done", error
        x.end_ns = x.reads[-1][0] if error is None and x.reads else time.monotonic_ns()
        with contextlib.suppress(KeyError):  # its connect failed at once: never registered
            self.sel.unregister(x.sock)
        x.sock.close()
        del self.live[x]
        self.finished.append(x)
        if x.sent_ns:   # the server is there: a later refusal pauses from the shortest wait again
            self.refused, self.pause_ns = 0, REFUSED_PAUSE_NS[0]
        else:
            self.refused += 1


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


def run_level(target: Target, concurrency: int, count: int | None, warmup: int,
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
