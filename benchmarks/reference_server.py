"""A reference streaming server whose true emission times are known, to measure a benchmark client against.

It behaves like a continuously batched engine: every `--itl-ms` a decode step sends one chunk (of
`--tokens-per-chunk` tokens) to every stream in the batch, so the streams' chunks leave in a burst, as
they do from SGLang or vLLM. A request joins the batch at the first step `--ttft-ms` after it was read.
The wire format is the engines' own (docs/engines.md): chunked
transfer-encoding, one event per HTTP chunk, `finish_reason` on an empty-text chunk, the usage-only chunk
with `choices: []` when `stream_options.include_usage` is asked, then `data: [DONE]`.

The truth: each chunk's time is time.monotonic_ns() taken right after send() handed its bytes to the
kernel; a request's arrival is the instant the select() that reported its last bytes returned (so a
burst of 256 arriving requests is not stamped later and later as the server works through it), or
the read itself for one read straight after accept(). `GET /emissions` returns (and forgets) every
finished request as JSON: {recv_ns, max_tokens, tokens, chunk_ns: [...], stalled} (stalled: chunks
that did not fit in the socket at once, so their time is early; expected 0). Clients on the
same machine read the same monotonic clock, so their records line up with these.

It is deliberately lean so that it is never the bottleneck it is meant to expose: one thread, a
selector, non-blocking sockets, every chunk's bytes encoded once at start. Run it with

    python benchmarks/reference_server.py --port 18000 --itl-ms 10
"""

from __future__ import annotations

import argparse
import contextlib
import json
import selectors
import socket
import time

HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
        b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n")


def _chunk(event: dict) -> bytes:
    """One SSE event in one HTTP chunk, as uvicorn frames an engine's stream."""
    data = b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


def _choice(chat: bool, text: str | None, finish: str | None = None) -> dict:
    if chat:
        return {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}


class Wire:
    """Every byte string the server sends, encoded once."""

    def __init__(self, tokens_per_chunk: int):
        self.tokens_per_chunk = tokens_per_chunk
        self.token = {}
        self.finish = {}
        for chat, kind in ((False, "text_completion"), (True, "chat.completion.chunk")):
            base = {"id": "ref", "object": kind, "created": 0, "model": "ref"}
            self.token[chat] = {n: _chunk({**base, "choices": [_choice(chat, " tok" * n)], "usage": None})
                                for n in range(1, tokens_per_chunk + 1)}
            self.finish[chat] = _chunk({**base, "choices": [_choice(chat, "", "length")], "usage": None})
        self.role = _chunk({"id": "ref", "object": "chat.completion.chunk", "created": 0, "model": "ref",
                            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}], "usage": None})
        self.done = b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"

    def usage(self, chat: bool, prompt: int, tokens: int) -> bytes:
        return _chunk({"id": "ref", "object": "chat.completion.chunk" if chat else "text_completion",
                       "created": 0, "model": "ref", "choices": [],
                       "usage": {"prompt_tokens": prompt, "completion_tokens": tokens,
                                 "total_tokens": prompt + tokens}})


class Stream:
    """One streaming request in the batch."""

    __slots__ = ("sock", "recv_ns", "max_tokens", "sent", "chat", "usage", "prompt", "join_at", "chunk_ns",
                 "pending", "stalled")

    def __init__(self, sock: socket.socket, recv_ns: int, body: dict, chat: bool, join_at: float):
        self.sock, self.recv_ns, self.chat, self.join_at = sock, recv_ns, chat, join_at
        self.max_tokens = max(1, int(body.get("max_tokens") or 16))
        self.usage = bool((body.get("stream_options") or {}).get("include_usage"))
        prompt = body.get("prompt") if not chat else " ".join(m.get("content", "") for m in body["messages"])
        self.prompt = len(str(prompt).split())
        self.sent = 0
        self.chunk_ns: list[int] = []
        self.pending = b""
        self.stalled = 0        # chunks whose bytes did not all fit in the socket at their step


class Server:
    def __init__(self, port: int, itl_ms: float, ttft_ms: float, tokens_per_chunk: int):
        self.listener = socket.create_server(("127.0.0.1", port), backlog=4096)
        self.listener.setblocking(False)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ)
        self.step_s, self.ttft_s = itl_ms / 1000, ttft_ms / 1000
        self.wire = Wire(tokens_per_chunk)
        self.inbox: dict[socket.socket, bytes] = {}
        self.batch: list[Stream] = []
        self.finished: list[dict] = []

    def serve_forever(self) -> None:
        next_step = time.monotonic() + self.step_s
        while True:
            events = self.sel.select(max(0.0, next_step - time.monotonic()))
            seen_ns = time.monotonic_ns()  # when these bytes were there to read, however long the batch
            for key, _ in events:
                if key.fileobj is self.listener:
                    self._accept(seen_ns)
                else:
                    self._read(key.fileobj, seen_ns)  # type: ignore[arg-type]
            now = time.monotonic()
            if now >= next_step:
                self._step(now)
                next_step += self.step_s
                if next_step < now:  # an overrun step is late, never made up for in a burst
                    next_step = now + self.step_s

    def _accept(self, seen_ns: int) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except BlockingIOError:
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.inbox[sock] = b""
            self.sel.register(sock, selectors.EVENT_READ)
            self._read(sock, time.monotonic_ns())  # usually there already; stamped when read, not before

    def _read(self, sock: socket.socket, seen_ns: int) -> None:
        try:
            data = sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            return self._drop(sock)
        buf = self.inbox[sock] + data
        self.inbox[sock] = buf
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            return
        lines = buf[:end].decode("latin-1").split("\r\n")
        method, path = (lines[0].split() + ["", ""])[:2]
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        if len(buf) < end + 4 + length:
            return
        recv_ns = seen_ns
        self.sel.unregister(sock)
        del self.inbox[sock]
        self._route(sock, method, path.split("?")[0], buf[end + 4:end + 4 + length], recv_ns)

    def _route(self, sock: socket.socket, method: str, path: str, body: bytes, recv_ns: int) -> None:
        if method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            chat = path.endswith("chat/completions")
            stream = Stream(sock, recv_ns, json.loads(body), chat, time.monotonic() + self.ttft_s)
            self._send(stream, HEAD + (self.wire.role if chat else b""))
            self.batch.append(stream)
        elif method == "GET" and path == "/emissions":
            finished, self.finished = self.finished, []
            self._reply(sock, json.dumps(finished).encode())
        elif method == "GET" and path == "/v1/models":
            self._reply(sock, b'{"object":"list","data":[{"id":"ref","object":"model","owned_by":"ref"}]}')
        elif method == "GET" and path in ("/health", "/health_generate"):
            self._reply(sock, b"{}")
        else:
            self._reply(sock, b'{"object":"error","message":"not found","code":404}', b"404 Not Found")

    @staticmethod
    def _reply(sock: socket.socket, body: bytes, status: bytes = b"200 OK") -> None:
        sock.setblocking(True)
        with contextlib.suppress(OSError):
            sock.sendall(b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                         b"connection: close\r\n\r\n%s" % (status, len(body), body))
        sock.close()

    def _drop(self, sock: socket.socket) -> None:
        self.sel.unregister(sock)
        self.inbox.pop(sock, None)
        sock.close()

    def _send(self, stream: Stream, data: bytes) -> bool:
        """Hand bytes to the kernel; what does not fit waits for the next step (a client that falls
        this far behind is measured late, which is the truth). False when the client is gone."""
        data = stream.pending + data
        try:
            n = stream.sock.send(data)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError:
            return False
        stream.pending = data[n:]
        return True

    def _step(self, now: float) -> None:
        """One decode step: a chunk to every stream that has joined; finished streams leave."""
        token, wire, keep = self.wire.token, self.wire, []
        per_chunk = wire.tokens_per_chunk
        for s in self.batch:
            if s.join_at > now:
                keep.append(s)
                continue
            n = min(per_chunk, s.max_tokens - s.sent)
            alive = self._send(s, token[s.chat][n])
            s.chunk_ns.append(time.monotonic_ns())
            s.stalled += bool(s.pending)
            s.sent += n
            if alive and s.sent < s.max_tokens:
                keep.append(s)
                continue
            if alive:
                tail = wire.finish[s.chat] + (wire.usage(s.chat, s.prompt, s.sent) if s.usage else b"")
                self._send(s, tail + wire.done)
                if s.pending:  # rare: flush the rest blocking rather than cut the stream short
                    s.sock.setblocking(True)
                    with contextlib.suppress(OSError):
                        s.sock.sendall(s.pending)
            s.sock.close()
            self.finished.append({"recv_ns": s.recv_ns, "max_tokens": s.max_tokens, "tokens": s.sent,
                                  "chunk_ns": s.chunk_ns, "stalled": s.stalled, "completed": alive})
        self.batch = keep


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=18000)
    p.add_argument("--itl-ms", type=float, default=10.0, help="decode step, the true ITL (default 10)")
    p.add_argument("--ttft-ms", type=float, default=20.0,
                   help="prefill: a request joins the first step this long after it was read (default 20)")
    p.add_argument("--tokens-per-chunk", type=int, default=1, help="tokens in each chunk (default 1)")
    args = p.parse_args()
    server = Server(args.port, args.itl_ms, args.ttft_ms, args.tokens_per_chunk)
    print(f"reference server on http://127.0.0.1:{server.listener.getsockname()[1]}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()


if __name__ == "__main__":
    main()
