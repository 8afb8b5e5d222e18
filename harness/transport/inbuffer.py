"""What a connection receives, buffered where paramiko's own buffering costs a pull its CPU.

`ReadAhead`: the connection's socket as paramiko's packet reader sees it, read in pieces of 256 kB.
paramiko reads each packet with two `recv` calls (its length, then the rest), and a `recv` on a socket
with a timeout is a `poll` and a `recv`: four system calls for every 32 kB packet sshd sends. Here one
`recv` brings several packets and the reader's calls are served from it (a pull of 256 MB: 0.69 ->
0.60 s of the harness's CPU, benchmarks/README.md). paramiko's transport thread is the only reader,
so it needs no lock; every other use of the socket (send, timeouts, close) is the socket's own.

`PacketBuffer`: a channel's receive buffer that keeps what arrives as the packets it came in.
paramiko's own (`BufferedPipe`) appends every packet to one array and, on each read, copies the bytes
out and shifts the rest of the array down: with a window of megabytes, a pull copies each byte
several times, and that was a fifth of a pull's CPU here (benchmarks/README.md, collect). This one
holds the packets in a deque: a read joins whole packets (one copy) and splits at most one.

A channel takes it in place of its own before the command starts (`install`): paramiko only ever calls
the methods below, the same ones with the same meaning (the event is what `select` on a channel
waits on).
"""

from __future__ import annotations

import collections
import socket
import threading
import time
from typing import Any

import paramiko
from paramiko.buffered_pipe import PipeTimeout

READ_AHEAD = 1 << 18


class ReadAhead:
    """`sock`, a connected socket, its reads served from pieces of `size` bytes."""

    def __init__(self, sock: socket.socket, size: int = READ_AHEAD):
        self._sock, self._size = sock, size
        self._buf = b""
        self._pos = 0

    def recv(self, n: int) -> bytes:
        """At most `n` bytes: what is left of the last piece, else a new piece (b"" at the end, and the
        socket's own timeout when nothing comes)."""
        if self._pos < len(self._buf):
            out = self._buf[self._pos:self._pos + n]
            self._pos += len(out)
            return out
        data = self._sock.recv(max(n, self._size))
        if len(data) <= n:
            return data
        self._buf, self._pos = data, n
        return data[:n]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class PacketBuffer:
    def __init__(self) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._chunks: collections.deque[bytes] = collections.deque()
        self._size = 0
        self._event: threading.Event | None = None
        self._closed = False

    def set_event(self, event: threading.Event) -> None:
        """Set `event` whenever data is ready or the buffer is closed, clear it when neither."""
        with self._cv:
            self._event = event
            if self._closed or self._size:
                event.set()
            else:
                event.clear()

    def feed(self, data: bytes) -> None:
        with self._cv:
            if self._event is not None:
                self._event.set()
            if data:
                self._chunks.append(bytes(data))
                self._size += len(data)
            self._cv.notify_all()

    def read_ready(self) -> bool:
        with self._cv:
            return self._size > 0

    def read(self, nbytes: int, timeout: float | None = None) -> bytes:
        """Up to `nbytes` as soon as any are there; b"" once closed and drained; PipeTimeout when none
        came within `timeout` seconds (None: wait as long as it takes; 0: do not wait)."""
        with self._cv:
            if not self._size:
                if self._closed:
                    return b""
                if timeout == 0.0:
                    raise PipeTimeout()
                deadline = None if timeout is None else time.monotonic() + timeout
                while not self._size and not self._closed:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise PipeTimeout()
                    self._cv.wait(left)
                if not self._size:
                    return b""
            out = self._take(nbytes)
            if not self._size and self._event is not None and not self._closed:
                self._event.clear()
            return out

    def _take(self, nbytes: int) -> bytes:
        parts, left = [], nbytes
        while self._chunks and left > 0:
            chunk = self._chunks[0]
            if len(chunk) <= left:
                parts.append(self._chunks.popleft())
                left -= len(chunk)
            else:
                parts.append(chunk[:left])
                self._chunks[0] = chunk[left:]
                left = 0
        out = parts[0] if len(parts) == 1 else b"".join(parts)
        self._size -= len(out)
        return out

    def empty(self) -> bytes:
        """Everything buffered, taken out."""
        with self._cv:
            out = self._take(self._size) if self._size else b""
            if self._event is not None and not self._closed:
                self._event.clear()
            return out

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            if self._event is not None:
                self._event.set()

    def __len__(self) -> int:
        with self._cv:
            return self._size


def install(chan: paramiko.Channel) -> paramiko.Channel:
    """`chan`, its stdout received into a PacketBuffer: call before the command starts, while nothing
    has arrived yet."""
    assert not len(chan.in_buffer), "a channel's buffer is replaced before anything arrives"
    chan.in_buffer = PacketBuffer()
    return chan
