"""One request and its response as bytes, with no clock: the request the loop sends (`Target`, made by
`build_target`: the host resolved once, the exact bytes built before a level starts) and the response
it recorded, parsed once the level has ended (`parse_exchange`: the HTTP head, chunked
transfer-encoding, server-sent events, JSON) into an `Outcome`.

A room of its own so that the hot path (loop.py) stays a loop that only sends, stamps and stores:
whatever costs CPU per byte is here and runs after the measurement, and it is tested on recorded
streams without a socket. Standard library only, Python >= 3.9, like every module the zipapp carries.
"""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit


def auth_headers(env_name: str | None) -> dict[str, str]:
    """`Authorization: Bearer` with the server's API key, read from the environment variable `env_name`
    (so the key itself is never on a command line); none without a name. ValueError, naming the
    variable, when it is not set."""
    if not env_name:
        return {}
    key = os.environ.get(env_name, "")
    if not key:
        raise ValueError(f"--api-key-env: {env_name} is not set in the environment")
    return {"Authorization": f"Bearer {key}"}


APIS = {"completions": "/completions", "chat": "/chat/completions"}

_EVENT_END = re.compile(rb"\r?\n\r?\n")
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]+)[ \t]*(?:;.*)?")   # a chunk's size line: hex digits, extensions
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
                                # a closing event that only gives the finish reason; not the chat API's
                                # first, which names the role)
    scheduled_ns: int | None = None   # open loop: when the arrival process said to send it


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


def parse_head(head: bytes) -> tuple[int, bool, int | None]:
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
    """Undo chunked transfer-encoding, keeping each piece with the stamp of the read that completed it.
    A growing bytearray, consumed from the front once per read: a chunk that spans many reads costs
    its length once, not once per read."""
    buf = bytearray()
    for t, data in reads:
        buf += data
        out: list[bytes | bytearray] = []
        at = 0
        while True:
            eol = buf.find(b"\r\n", at, at + 4096)
            if eol < 0 and len(buf) - at >= 4096:   # a size line is a few bytes: never read to its end
                raise ValueError(f"bad chunk size {bytes(buf[at:at + 40])!r}...")
            if eol < 0:
                break
            line = _CHUNK_SIZE.fullmatch(buf, at, eol)
            if line is None:   # int() would take "-6" too, and then this loop would never end
                raise ValueError(f"bad chunk size {bytes(buf[at:min(eol, at + 40)])!r}")
            size = int(line[1], 16)
            if size == 0:
                yield t, b"".join(out)
                return
            if len(buf) < eol + 4 + size:
                break
            out.append(buf[eol + 2:eol + 2 + size])
            at = eol + 4 + size
        del buf[:at]
        yield t, b"".join(out)


def _sse_events(reads: Iterable[tuple[int, bytes]], ended: bool) -> Iterator[tuple[int, bytes]]:
    """Server-sent events, each stamped with the read that completed it; a last event without its blank
    line too when the stream `ended` cleanly (a cut-off one is a fragment)."""
    pending: list[bytes] = []   # the event so far, joined only once a read may end it: linear in its size
    tail, t = b"", 0            # its last 3 bytes: a blank line may start there
    for t, data in reads:
        if not _EVENT_END.search(tail + data):
            pending.append(data)
            tail = (tail + data)[-3:]
            continue
        *events, rest = _EVENT_END.split(b"".join(pending) + data)
        pending, tail = [rest], rest[-3:]
        for event in events:
            yield t, event
    buf = b"".join(pending)
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
    return _clip(data.decode("utf-8", "replace"), limit) or "(empty)"


def _clip(text: str, limit: int = 200) -> str:
    """`text` on one line, at most `limit` characters: what a server says lands in requests.jsonl,
    bench.json and the run's error, once a request."""
    text = " ".join(text.split())
    return (text[:limit] + "...") if len(text) > limit else text


MAX_TOKEN_COUNT = 10**9
"""The most tokens a usage count may say (no context holds more): beyond it the count is no count."""


def _count(usage: dict, key: str) -> int | None:
    """A token count of the server's usage: None when it gives none (the level then counts the
    request's text chunks instead); ValueError, naming the field, when what it gives is no count (a
    string, a negative number, one beyond MAX_TOKEN_COUNT, whose arithmetic would overflow a float)."""
    value = usage.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_TOKEN_COUNT:
        raise ValueError(f"usage.{key} is not a token count (a whole number from 0 to {MAX_TOKEN_COUNT:,}): "
                         f"{_clip(json.dumps(value), 60)}")
    return value


def _announces_role(obj: dict) -> bool:
    """The chat API's first event: it names the answer's role and carries no token."""
    return all((choice.get("delta") or {}).get("role") for choice in obj["choices"])


def _aborted(obj: dict) -> bool:
    """A choice that ends with finish_reason "abort": the engine dropped the request (vLLM sends it on an
    ordinary 200 stream, with usage and [DONE] after it)."""
    return any(choice.get("finish_reason") == "abort" for choice in obj.get("choices") or ())


def parse_exchange(sent_ns: int, end_ns: int, reads: Reads, error: str | None = None) -> Outcome:
    """Turn one request's stamped reads (raw HTTP response bytes) into an Outcome.

    `error` is what the connection said (timeout, reset, closed early); an error the server reported
    in the response (a non-200 status, an error event, an abort, a usage count that is none) takes
    precedence, being the more telling.
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
        status, chunked, _ = parse_head(head[:end])
    except ValueError:
        return Outcome(sent_ns, end_ns, [], None, None, None, "malformed response head")
    body: Reads = [(t, head[end + 4:])] + reads[i + 1:]
    times: list[int] = []
    running: list[int] | None = []
    tokens = prompt_tokens = None
    failure = None
    empty = 0
    aborted = False
    received = sum(len(d) for _, d in body)   # as it came: a chunk cut off is no dechunked byte
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
                tokens, prompt_tokens = _count(usage, "completion_tokens"), _count(usage, "prompt_tokens")
            if _carries_text(obj):
                times.append(t)
                if running is not None and usage and isinstance(tokens, int):
                    running.append(tokens)
                else:
                    running = None
            elif obj.get("choices") and not _announces_role(obj):
                empty += 1
            aborted = aborted or _aborted(obj)
        if aborted and failure is None:
            failure = ("server aborted the request (finish_reason abort) after "
                       + (f"{tokens} tokens" if tokens is not None else f"{len(times)} text chunks"))
        if not seen_data and failure is None:
            failure = (f"{error} after the response head and {received} bytes of its body" if error else
                       "not an event stream: " + _excerpt(b"".join(d for _, d in body)))
    except (ValueError, AttributeError, TypeError) as e:  # bad chunk size, JSON, JSON shape or usage count
        failure = f"malformed response: {_clip(str(e))}"
    except RecursionError:   # JSON nested deeper than the parser's stack: no answer of a server
        failure = "malformed response: JSON nested too deep"
    return Outcome(sent_ns, end_ns, times, tokens, prompt_tokens, status, _clip(failure, 1000) if failure else error,
                   running if running else None, empty)
