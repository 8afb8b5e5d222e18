"""Stream the events of a torch.profiler (Kineto) Chrome trace without holding the file in memory.

Traces are often gigabytes, so the file (plain, or gzip read as a stream) is read as bytes in chunks
of a megabyte and only the current chunk is held. The top-level object is walked key by key, wherever
its keys sit relative to `traceEvents`: those read later (`META_KEYS`: `distributedInfo`) are decoded
into `meta`, up to a megabyte of text each; every other (`deviceProperties`, ...) is stepped over
without being decoded, however large or deep. From the events array only complete events of the wanted
categories come out, as `Event` tuples. A byte range of the array can be read on its own (see
`event_start_at`), which is how one large file is shared between worker processes; the bytes are
those of the JSON text, so a gzip'd file's range is found by inflating the stream up to it.

Most of a trace is events nobody asked for (runtime calls, flows, Python frames, args), so the wanted
ones are found with one regular expression over the raw bytes, without decoding anything else:

1. The key order of the file's events is learned from the first decoded event of a wanted category:
   torch's `export_chrome_trace` (libkineto's output_json.cpp) writes `ph, cat, name, pid, tid, ts,
   dur, args` over several lines; `json.dump` of a dict keeps the dict's order, `sort_keys` puts
   `args` first. Whitespace is free (`\\s*`), so one event per line, everything on one line and
   indented layouts read alike.
2. When `cat` comes before the other fields, the expression starts at `"cat": "<wanted>"` with the
   rest optional, so it stops at every wanted category key in the chunk and nowhere else. A string
   cannot fake such a key (its quotes would be escaped), so a match whose fields did not follow is an
   event outside the learned layout, and the chunk is decoded in full instead: nothing is skipped
   silently. When fields come before `cat`, a second expression counts the wanted keys for the same
   check.
3. Decoding in full (the first chunk, and any chunk the expression cannot vouch for) cuts the chunk at
   an event boundary: a `}`, `,`, `{` (any whitespace) whose `{` decodes as an object with a `"ph"`.
   Demangled names contain `{lambda()#1}, {lambda()#2}`, which is why the cut is proven by decoding.

An event with a wanted category and a `dur` is a complete event: Chrome's format gives `dur` to
`"ph": "X"` alone. A wanted event whose name is not a string, or whose ts or dur is not a number from 0
to `MAX_TIME_US` (NaN, Infinity, a negative duration, a 400-digit integer), makes the file unreadable:
its figures could not be right. So does nesting deeper than Python's decoder goes.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Generator, Iterator
from operator import itemgetter
from pathlib import Path
from typing import IO, Any, cast

from isal import igzip, isal_zlib

from harness.errors import InputError

# (isal's stubs declare its error an instance: it is a class)
INFLATE_ERRORS = (OSError, EOFError, cast(type[Exception], isal_zlib.error))
"""What reading a gzip'd trace raises for a file that is not one, is cut, or is corrupt (a bad header or
CRC is gzip.BadGzipFile, an OSError; a cut stream EOFError; a bad block ISA-L's own error)."""

Event = tuple[str, str, object, object, float, float]
"""cat, name, pid, tid, ts, dur of one complete event; ts and dur in microseconds as in the trace."""

CHUNK_BYTES = 1 << 20
"""Bytes read at a time: enough to amortise the per-chunk work, and small enough that a chunk and what
is found in it stay small (1 MB read no slower than 4 here, with 9 MB less memory a process)."""
_MAX_VALUE_BYTES = 4 << 20
"""No event is this large: past it, a value that will not decode is corrupt. Real events are a few kB
(the largest of the vLLM, SGLang and transformers traces here: 1.7 kB; shapes of a cat of many tensors
reach tens of kB), and decoding one takes about 30 times its size in memory."""
_DECODE_BYTES = 256 << 10
"""At most this much is decoded in full at a time (the events the learned layout cannot vouch for)."""
_PROBE_BYTES = 256 << 10
"""An event boundary is proven by decoding the event after it, read this far at most."""
_META_BYTES = 1 << 20
"""A top-level value that is read (META_KEYS), or a key, is at most this much text."""
META_KEYS = frozenset({"distributedInfo"})
"""The top-level keys besides traceEvents that are read (summary: the rank); the others are skipped
undecoded."""
MAX_TIME_US = 1e18
"""A ts or dur past this (30,000 years in microseconds) is no clock's; below it sums stay finite."""
_WHITESPACE = b" \t\n\r"
_FIELDS = ("cat", "name", "pid", "tid", "ts", "dur")

# strict=False: event names with raw control characters occur in real traces (google/perfetto#598);
# Kineto's own TensorBoard plugin reads its traces the same way (pytorch/kineto#131).
_decoder = json.JSONDecoder(strict=False)


def _text(data: bytes) -> str:
    """Bytes as text that encodes back to the same bytes, so offsets can be mapped back."""
    return data.decode("utf-8", "surrogateescape")


def is_gzip(path: Path) -> bool:
    """Recognised by its magic bytes rather than trusted to the name."""
    with open(path, "rb") as probe:
        return probe.read(2) == b"\x1f\x8b"


def iter_event_batches(path: Path, meta: dict, wanted: frozenset[str], *, start: int = 0,
                       stop: int | None = None) -> Iterator[list[Event]]:
    """Yield every complete event whose category is in `wanted`, in lists, in file order.

    `meta` receives the top-level keys of META_KEYS. With `start` (an event's first byte, from
    `event_start_at`) only events from there on are read, and with `stop` only those before it; the
    top-level keys come only from the part of the file a range covers. Any read or decode failure
    (truncated gzip, broken JSON, no traceEvents, a malformed wanted event, nesting too deep to decode)
    becomes an InputError that names the file.
    """
    try:
        with _open_at(path, start) as f:
            yield from _Parser(f.read, meta, wanted, base=start, stop=stop).events(in_array=start > 0)
    except (*INFLATE_ERRORS, ValueError, OverflowError) as e:  # a JSONDecodeError is a ValueError
        raise InputError(f"not a readable trace: {e}", file=str(path)) from e
    except RecursionError as e:
        raise InputError("not a readable trace: a value nested too deep to decode", file=str(path)) from e


def json_size(path: Path) -> int | None:
    """The bytes of JSON text a trace holds: a plain file's size, a gzip stream's from its trailer
    (the length of its last member modulo 2**32, so None when that cannot be the whole text)."""
    size = path.stat().st_size
    if not is_gzip(path):
        return size
    with open(path, "rb") as f:
        f.seek(max(0, size - 4))
        inflated = int.from_bytes(f.read(4), "little")
    return inflated if inflated >= size else None


@contextlib.contextmanager
def _open_at(path: Path, offset: int) -> Iterator[IO[bytes] | igzip.IGzipFile]:
    """The file's JSON text from byte `offset` on: a gzip stream is inflated up to there (in chunks:
    seek inflates 8 kB at a time). ISA-L inflates the standard gzip format three to four times as fast
    as zlib here (0.08 s against 0.29 s for 262 MB of trace), which is most of what reading a gzip'd
    trace costs beyond reading it plain."""
    if not is_gzip(path):
        with open(path, "rb") as f:
            f.seek(offset)
            yield f
        return
    with igzip.open(path, "rb") as f:
        left = offset
        while left > 0 and (skipped := len(f.read(min(left, CHUNK_BYTES)))):
            left -= skipped
        yield f


_LEAD = 4096
"""How far before an offset the search for the next event's start begins (it looks back for `},`)."""


def event_start_at(path: Path, offset: int) -> int | None:
    """The first byte (of the JSON text) of the first event that starts at or after `offset`, if any
    is found within a chunk of it. A gzip'd file is inflated up to there."""
    lo = max(0, offset - _LEAD)
    with _open_at(path, lo) as f:
        return _start_in(f.read(CHUNK_BYTES), offset - lo, lo)


def event_starts_at(path: Path, offsets: list[int]) -> list[int | None]:
    """`event_start_at` of each of `offsets` (in increasing order). A gzip'd file is inflated once for
    them all, rather than from its start again for each: a file cut into 16 ranges would be inflated
    7.5 times over before its first range was read."""
    if not is_gzip(path):
        return [event_start_at(path, offset) for offset in offsets]
    found: list[int | None] = []
    with _open_at(path, 0) as f:
        pos, buf = 0, b""   # buf: the text from byte pos on
        for offset in offsets:
            lo = max(0, offset - _LEAD)
            if lo > pos + len(buf):
                left = lo - pos - len(buf)
                while left > 0 and (skipped := len(f.read(min(left, CHUNK_BYTES)))):
                    left -= skipped
                pos, buf = lo - left, b""
            else:
                pos, buf = lo, buf[lo - pos:]
            buf += f.read(CHUNK_BYTES - len(buf))
            found.append(_start_in(buf, offset - pos, pos))
    return found


def _start_in(buf: bytes, lead: int, base: int) -> int | None:
    """The offset in the text (`buf` holds it from byte `base` on) of the first event starting at or
    after buf[lead]."""
    brace = buf.find(b"{", lead)
    while brace >= 0:
        if _is_event_start(buf, brace, 0):
            return base + brace
        brace = buf.find(b"{", brace + 1)
    return None


def _is_event_start(buf: bytes, brace: int, lo: int) -> bool:
    """Whether buf[brace] opens an array element that decodes as an event (an object with "ph")."""
    k = brace + 1
    while k < len(buf) and buf[k] in _WHITESPACE:
        k += 1
    if k < len(buf) and buf[k] != 0x22:   # not a key: `{}` (a run of them after the array costs nothing)
        return False
    k = brace - 1
    while k > lo and buf[k] in _WHITESPACE:
        k -= 1
    if buf[k] != 0x2C:  # ","
        return False
    k -= 1
    while k > lo and buf[k] in _WHITESPACE:
        k -= 1
    if buf[k] != 0x7D:  # "}"
        return False
    try:
        value, _ = _decoder.raw_decode(_text(buf[brace:brace + _PROBE_BYTES]))
    except (ValueError, RecursionError):
        return False
    return isinstance(value, dict) and "ph" in value


class _Parser:
    """A cursor over a sliding byte buffer: `buf[pos:]` is what has not been consumed yet."""

    def __init__(self, read: Callable[[int], bytes], meta: dict, wanted: frozenset[str], *,
                 base: int = 0, stop: int | None = None):
        self.read, self.meta, self.wanted = read, meta, wanted
        self.buf, self.pos, self.eof = b"", 0, False
        self.base = base  # bytes of the file before buf[0]
        self.stop = stop
        self.layout: _Layout | None = None

    def events(self, *, in_array: bool = False) -> Iterator[list[Event]]:
        """The wanted events, from the top of the file or (`in_array`) from an event's first byte."""
        if not in_array:
            self._expect(b"{")
        seen_events = in_array
        while True:
            if in_array:
                if not (yield from self._array()):
                    return  # stopped at `stop`: the rest of the file is another range's
                in_array, seen_events = False, True
            if self._peek(b",") == b"}":
                break
            at = self.base + self.pos
            key = self._value(_META_BYTES)
            if not isinstance(key, str):
                raise ValueError(f"expected a key at byte {at}, found {str(key)[:80]!r}")
            self._expect(b":")
            if key == "traceEvents":
                self._expect(b"[")
                in_array = True
            elif key in META_KEYS:
                self.meta[key] = self._value(_META_BYTES)
            else:
                self._skip()
        if not seen_events:
            raise ValueError("no traceEvents array")

    def _array(self) -> Generator[list[Event], None, bool]:
        """The events from the cursor on; returns whether the array ended (rather than `stop` came)."""
        while True:
            if len(self.buf) - self.pos < CHUNK_BYTES and not self.eof:
                self._fill()
            if self.stop is not None and self.base + self.pos >= self.stop:
                return False
            if self._peek(b",") == b"]":
                self.pos += 1
                return True
            cut = self._cut()
            if cut < 0:
                yield self._select([self._value()])
                continue
            events = self.layout.scan(self.buf, self.pos, cut) if self.layout else None
            if events is None:
                # Decode little at a time: decoded events weigh ten times their text.
                cut = self._cut(self.pos + _DECODE_BYTES) if cut - self.pos > _DECODE_BYTES else cut
                cut = cut if cut > 0 else self._cut()
                # The events before the cut, without the comma that joins them to the one at the cut.
                body = self.buf[self.pos:cut].rstrip(_WHITESPACE).removesuffix(b",")
                decoded = _decoder.decode("[" + _text(body) + "]")
                self.layout = _Layout.learn(decoded, self.wanted) or self.layout
                events = self._select(decoded)
            self.pos = cut
            yield events

    def _cut(self, hi: int | None = None) -> int:
        """An event start after the cursor, as late before `hi` (default: the buffer's end) as can be
        proven; -1 if none."""
        buf, lo = self.buf, self.pos
        if self.stop is not None and self.stop - self.base <= min(len(buf), hi or len(buf)):
            return self.stop - self.base if self.stop - self.base > lo else -1
        hi = len(buf) if hi is None else min(hi, len(buf))
        while (brace := buf.rfind(b"{", lo + 1, hi)) > 0:
            if _is_event_start(buf, brace, lo):
                return brace
            hi = brace
        return -1

    def _select(self, decoded: list[Any]) -> list[Event]:
        wanted = self.wanted
        events = [(ev["cat"], ev.get("name", ""), ev.get("pid"), ev.get("tid"), ev.get("ts"), ev.get("dur"))
                  for ev in decoded
                  if isinstance(ev, dict) and ev.get("cat") in wanted and ev.get("ph") == "X"]
        for event in events:
            _check(event)
        return cast(list[Event], events)

    def _value(self, limit: int = _MAX_VALUE_BYTES) -> object:
        """The JSON value at the cursor, reading more until it is complete (at most `limit` bytes)."""
        self._peek()
        while True:
            text = _text(self.buf[self.pos:])
            try:
                value, end = _decoder.raw_decode(text)
            except json.JSONDecodeError as e:
                if self.eof and e.pos >= len(text):
                    raise ValueError("the file ends in the middle of the trace") from e
                if self.eof:
                    raise ValueError(f"{e.msg} at byte {self.base + self.pos + e.pos}") from e
                if len(text) > limit:
                    raise ValueError(f"no whole value in the {limit >> 20} MB from byte {self.base + self.pos} "
                                     f"({e.msg})") from e
            else:
                # A number that runs to the end of the buffer may continue in the next chunk.
                if end < len(text) or self.eof:
                    self.pos += len(text[:end].encode("utf-8", "surrogateescape"))
                    return value
            self._fill()

    def _skip(self) -> None:
        """Step over the JSON value at the cursor without decoding it: its strings (escapes and all) are
        passed whole and its brackets only counted, so no depth or size of it costs more memory than
        the chunk in hand. A value that is not JSON may pass unnoticed; the keys and events around it
        are still checked."""
        if self._peek() not in b'"[{':   # a number or a literal: up to the comma or brace after it
            while (found := _SCALAR_END.search(self.buf, self.pos)) is None:
                self.pos = len(self.buf)
                self._more()
            self.pos = found.start()
            return
        depth = 0
        while True:
            buf = self.buf
            for m in _SKIPPED.finditer(buf, self.pos):
                first, end = m.span()
                if end - first > 1:        # a whole string
                    if depth == 0:
                        self.pos = end
                        return
                elif buf[first] == 0x22:   # a string that goes on past the chunk
                    self.pos = end
                    self._skip_string()
                    if depth == 0:
                        return
                    break
                else:
                    depth += 1 if buf[first] in b"[{" else -1
                    if depth == 0:
                        self.pos = end
                        return
            else:
                self.pos = len(buf)
                self._more()

    def _skip_string(self) -> None:
        """Step past the rest of a string whose opening quote is behind the cursor, chunk by chunk."""
        while True:
            self.pos = cast(re.Match, _STRING_BODY.match(self.buf, self.pos)).end()
            if self.pos < len(self.buf) and self.buf[self.pos] == 0x22:   # its closing quote
                self.pos += 1
                return
            self._more()   # its end, or a backslash whose escaped byte is in the next chunk

    def _more(self) -> None:
        """Read on, keeping what is after the cursor; the file must not end here."""
        if self.eof:
            raise ValueError("the file ends in the middle of the trace")
        self._fill()

    def _peek(self, skip: bytes = b"") -> bytes:
        """The next significant byte, past whitespace and any of `skip`."""
        while True:
            buf, pos = self.buf, self.pos
            while pos < len(buf) and (buf[pos] in _WHITESPACE or buf[pos] in skip):
                pos += 1
            self.pos = pos
            if pos < len(buf):
                return buf[pos:pos + 1]
            if self.eof:
                raise ValueError("the file ends in the middle of the trace")
            self._fill()

    def _expect(self, char: bytes) -> None:
        found = self._peek()
        if found != char:
            raise ValueError(f"expected {char.decode()!r} at byte {self.base + self.pos}, "
                             f"found {found.decode(errors='replace')!r}")
        self.pos += 1

    def _fill(self) -> None:
        chunk = self.read(CHUNK_BYTES)
        self.eof = not chunk
        self.base += self.pos
        self.buf = self.buf[self.pos:] + chunk
        self.pos = 0


class _Decoded(dict):
    """Raw field bytes -> the value the JSON decoder gives; names and ids repeat, so each is decoded once."""

    def __missing__(self, raw: bytes) -> object:
        value = self[raw] = _decoder.decode(raw.decode("utf-8", "replace"))
        return value


_SKIPPED = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]|"', re.DOTALL)
"""What a skipped value's end depends on: a whole string, a bracket, or a string's opening quote alone."""
_STRING_BODY = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*', re.DOTALL)   # up to its quote (or a lone \ at the end)
_SCALAR_END = re.compile(rb'[,}\]]')


def _plausible(times: list[float]) -> bool:
    """Whether a column of scanned times are all from 0 to MAX_TIME_US (a scanned number is never NaN)."""
    return not times or (min(times) >= 0 and max(times) <= MAX_TIME_US)


def _time(value: object) -> bool:
    """Whether a decoded ts or dur is a number from 0 to MAX_TIME_US (not NaN, not Infinity)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= MAX_TIME_US


def _check(event: tuple) -> None:
    """A decoded wanted event as the analysis needs it (module docstring), else ValueError naming it."""
    _, name, _, _, ts, dur = event
    if not isinstance(name, str):
        raise ValueError(f"malformed trace event: its name is {_shown(name)}, not a string")
    for field, value in (("ts", ts), ("dur", dur)):
        if not _time(value):
            raise ValueError(f"malformed trace event {name[:80]!r}: its {field} is {_shown(value)}, not a time "
                             f"in microseconds from 0 to {MAX_TIME_US:g}")


def _shown(value: object) -> str:
    """A decoded value, as the trace wrote it, in 80 characters at most."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10 ** 30:
        return f"an integer of {value.bit_length()} bits"
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


_STRING = rb'"([^"\\]*(?:\\.[^"\\]*)*)"'   # a JSON string's body, escapes and all
_ID = rb'(-?\d+|"[^"\\]*(?:\\.[^"\\]*)*")'  # a pid or tid: a number, or a string such as "Spans"
_NUMBER = rb'(-?[\d.]+(?:[eE][-+]?\d+)?)'
_SKIP = rb'(?:"[^"\\]*(?:\\.[^"\\]*)*"|[-+\w.]+|\[[^\[\]{}"]*\]|\{(?:[^{}"]|"[^"\\]*(?:\\.[^"\\]*)*")*\})'
"""A value between two wanted fields: a string, a number or literal, a flat array or a flat object."""


class _Layout:
    """The wanted events of a chunk found by one expression built for the file's key order."""

    def __init__(self, keys: list[str], wanted: frozenset[str]):
        self.keys = keys
        cats = b"|".join(re.escape(c.encode()) for c in sorted(wanted))
        wanted_at = [i for i, k in enumerate(keys) if k in _FIELDS]
        first, last = wanted_at[0], wanted_at[-1]
        parts, order = [], []
        for key in keys[first:last + 1]:
            if key == "cat":
                value = rb'"(' + cats + rb')"'
            elif key == "name":
                value = _STRING
            else:
                value = {"pid": _ID, "tid": _ID, "ts": _NUMBER, "dur": _NUMBER}.get(key, _SKIP)
            if key in _FIELDS:
                order.append(key)
            parts.append(re.escape(json.dumps(key).encode()) + rb"\s*:\s*" + value)
        sep = rb"\s*,\s*"
        # cat first: the rest is optional, so every wanted key is a match (an empty ts: not an event).
        self.cat_first = keys[first] == "cat"
        body = parts[0] + (rb"(?:" + sep + sep.join(parts[1:]) + rb")?" if self.cat_first else
                           sep + sep.join(parts[1:]))
        self.events = re.compile(body, re.DOTALL)
        self.count = None if self.cat_first else re.compile(rb'"cat"\s*:\s*"(?:' + cats + rb')"')
        self.get = itemgetter(*(order.index(f) for f in _FIELDS))
        self.values = _Decoded()
        self.names = _Names()
        self.cats = {c.encode(): c for c in wanted}

    @classmethod
    def learn(cls, decoded: list, wanted: frozenset[str]) -> _Layout | None:
        """A layout for the key order of the first complete wanted event, if there is one."""
        for ev in decoded:
            if isinstance(ev, dict) and ev.get("cat") in wanted and all(f in ev for f in _FIELDS):
                return cls(list(ev), wanted)
        return None

    def scan(self, buf: bytes, start: int, end: int) -> list[Event] | None:
        """Every wanted event in buf[start:end], or None when the expression cannot vouch for them."""
        found = self.events.findall(buf, start, end)
        count = self.count  # None exactly when cat_first
        if not found:
            return [] if count is None or not count.search(buf, start, end) else None
        cat, name, pid, tid, ts, dur = self.get(list(zip(*found, strict=True)))
        if count is None:
            if b"" in ts:
                return None
        elif len(found) != len(count.findall(buf, start, end)):
            return None
        # Column by column, so that the per-event work stays in C.
        starts, durs = list(map(float, ts)), list(map(float, dur))
        if not (_plausible(starts) and _plausible(durs)):
            return None   # decoded in full, where the event is named
        values = self.values.__getitem__
        return list(zip(map(self.cats.__getitem__, cat), map(self.names.__getitem__, name), map(values, pid),
                        map(values, tid), starts, durs, strict=True))


class _Names(dict):
    """A name's raw bytes -> its text, unescaped only when it has escapes."""

    def __missing__(self, raw: bytes) -> str:
        value = self[raw] = (_decoder.decode('"' + raw.decode("utf-8", "replace") + '"') if b"\\" in raw
                             else raw.decode("utf-8", "replace"))
        return value
