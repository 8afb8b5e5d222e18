"""Just enough HTTP/1.1 for the simulated engine: requests with a Content-Length body, keep-alive,
plain responses, and chunked streaming responses (what uvicorn sends for server-sent events).

asyncio streams instead of http.server because hundreds of clients stream at once on a small box:
one task per connection and no thread per client.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
           409: "Conflict", 500: "Internal Server Error", 503: "Service Unavailable"}
MAX_HEADER_LINES = 100
MAX_BODY = 64 << 20


@dataclass
class Request:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes

    @property
    def keep_alive(self) -> bool:
        return self.headers.get("connection", "").lower() != "close"

    def json(self) -> Any:
        """The body as JSON; an empty body is {}; raises ValueError when it is not JSON."""
        return json.loads(self.body) if self.body.strip() else {}


class BadRequest(Exception):
    pass


async def read_request(reader: asyncio.StreamReader) -> Request | None:
    """The next request on the connection, or None when the client closed it."""
    try:
        line = await reader.readline()
    except (ConnectionError, asyncio.LimitOverrunError, ValueError):
        return None
    if not line.strip():
        return None
    try:
        method, target, _version = line.decode("latin-1").split()
    except ValueError:
        raise BadRequest("malformed request line") from None
    headers: dict[str, str] = {}
    for _ in range(MAX_HEADER_LINES):
        raw = await reader.readline()
        if raw in (b"\r\n", b"\n", b""):
            break
        name, _, value = raw.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    try:
        length = int(headers.get("content-length") or 0)
    except ValueError:
        raise BadRequest("bad Content-Length") from None
    if length < 0 or length > MAX_BODY:
        raise BadRequest("bad Content-Length")
    body = await reader.readexactly(length) if length else b""
    path, _, query = target.partition("?")
    return Request(method.upper(), path, query, headers, body)


def response(status: int, body: bytes = b"", content_type: str = "application/json",
             keep_alive: bool = True) -> bytes:
    head = (f"HTTP/1.1 {status} {REASONS.get(status, 'Unknown')}\r\n"
            f"content-type: {content_type}\r\ncontent-length: {len(body)}\r\n"
            f"connection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n")
    return head.encode("latin-1") + body


def json_response(status: int, value: Any, keep_alive: bool = True) -> bytes:
    return response(status, json.dumps(value).encode(), keep_alive=keep_alive)


def text_response(status: int, text: str, keep_alive: bool = True) -> bytes:
    return response(status, text.encode(), "text/plain; charset=utf-8", keep_alive)


def stream_head(keep_alive: bool = True) -> bytes:
    return ("HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
            f"transfer-encoding: chunked\r\nconnection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n"
            ).encode("latin-1")


def chunk(data: bytes) -> bytes:
    """One piece of a chunked body."""
    return b"%x\r\n%s\r\n" % (len(data), data)


LAST_CHUNK = b"0\r\n\r\n"
