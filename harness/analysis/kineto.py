"""Stream the events of a torch.profiler (Kineto) Chrome trace without holding the file in memory.

Traces are often gigabytes, so the file (plain or gzip) is read as text in chunks of about a
megabyte and only the current chunk is ever held. The top-level object is walked key by key: small
values (`distributedInfo`, `deviceProperties`, `baseTimeNanoseconds`, ...) are decoded whole into
`meta`, wherever they sit relative to `traceEvents`. From the events array only complete `"ph": "X"`
events of the wanted categories come out, as `Event` tuples.

Two ways through the events array, each checked so that neither can silently miss an event:

1. Kineto's own layout (torch's `export_chrome_trace`, which writes every per-rank file of both
   engines) starts each event with fixed lines: `{` newline `"ph": "X", "cat": ..., "name": ...,
   "pid": ..., "tid": ...,` newline `"ts": ..., "dur": ...`. A raw newline cannot occur inside a
   JSON string, so a regular expression anchored on `{` + newline finds real event objects only, and
   it reads the six fields without decoding anything else (args, flow events, runtime calls: most of
   the bytes). Its result for a chunk is used only when it found every wanted event there: its match
   count must equal the count of `"cat": "<wanted>"` keys in any spacing, which string contents
   cannot fake because their quotes are escaped.
2. Otherwise the chunk is decoded in full, in one C call: it is cut at the last place that looks like
   an event boundary (`}` `,` `{`, any whitespace: Kineto's layout and `json.dump`'s) and the text
   before the cut is decoded as one JSON array. The cut is a guess (demangled kernel names contain
   `{lambda()#1}, {lambda()#2}`), proven right when the array decodes: the decoder reads the prefix
   exactly as it reads the whole file, so a cut inside a string or a nested object cannot decode.
   Failing guesses give way to earlier ones and, last, to decoding one event with `raw_decode`.

Measured on a synthetic 100 MB trace on one modest core: path 1 reads 100-120 MB/s of JSON text
(gzip included), path 2 about 45 MB/s, both in about 30 MB of memory; json.load of the same file
takes longer than either and gigabytes.
"""

from __future__ import annotations

import gzip
import io
import json
import re
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

from harness.errors import InputError

Event = tuple[str, str, object, object, float, float]
"""cat, name, pid, tid, ts, dur of one complete event; ts and dur in microseconds as in the trace."""

CHUNK_CHARS = 1 << 20
"""Characters read at a time: enough to amortise the per-batch Python work, little enough that the
decoded events of a batch stay a few megabytes."""
_MAX_VALUE_CHARS = 64 << 20
"""No event or top-level value is this large: past it, a value that will not decode is corrupt, and
reading on would only pull the rest of a broken file into memory."""
_GUESSES = 4
"""Boundary guesses tried on one chunk before decoding a single event instead."""
_WHITESPACE = " \t\n\r"

# strict=False: event names with raw control characters occur in real traces (google/perfetto#598);
# Kineto's own TensorBoard plugin reads its traces the same way (pytorch/kineto#131).
_decoder = json.JSONDecoder(strict=False)


def open_text(path: Path) -> io.TextIOBase:
    """The file as text; gzip is recognised by its magic bytes rather than trusted to the name."""
    with open(path, "rb") as probe:
        gzipped = probe.read(2) == b"\x1f\x8b"
    raw = gzip.open(path, "rb") if gzipped else open(path, "rb")
    # Malformed UTF-8 in one kernel name must not cost the whole analysis; newline="" because
    # translating line ends is work that JSON does not need.
    return io.TextIOWrapper(raw, encoding="utf-8", errors="replace", newline="")


def iter_event_batches(path: Path, meta: dict, wanted: frozenset[str]) -> Iterator[list[Event]]:
    """Yield every complete event whose category is in `wanted`, in lists, in file order.

    `meta` receives the other top-level keys. Any read or decode failure (truncated gzip, broken
    JSON, no traceEvents) becomes an InputError that names the file.
    """
    try:
        with open_text(path) as f:
            yield from _Parser(f.read, meta, wanted).events()
    except (OSError, EOFError, zlib.error, ValueError) as e:
        # JSONDecodeError and gzip.BadGzipFile are ValueError and OSError; EOFError is a cut gzip.
        raise InputError(f"not a readable trace: {e}", file=str(path)) from e


class _Parser:
    """A cursor over a sliding text buffer: `buf[pos:]` is what has not been consumed yet."""

    def __init__(self, read: Callable[[int], str], meta: dict, wanted: frozenset[str]):
        self.read, self.meta, self.wanted = read, meta, wanted
        self.buf, self.pos, self.eof = "", 0, False
        self.base = 0  # characters of the file before buf[0], to say where a problem is
        self.layout = _KinetoLayout(wanted)

    def events(self) -> Iterator[list[Event]]:
        self._expect("{")
        seen_events = False
        while self._peek(",") != "}":
            key = self._value()
            if not isinstance(key, str):
                raise ValueError(f"expected a key at character {self.base + self.pos}, found {key!r}")
            self._expect(":")
            if key == "traceEvents":
                self._expect("[")
                yield from self._array()
                seen_events = True
            else:
                self.meta[key] = self._value()
        if not seen_events:
            raise ValueError("no traceEvents array")

    def _array(self) -> Iterator[list[Event]]:
        while self._peek(",") != "]":
            events = self.layout.batch(self)
            if events is None:
                decoded = self._batch()
                events = self._select(decoded if decoded is not None else [self._value()])
            yield events
        self.pos += 1

    def _select(self, decoded: list) -> list[Event]:
        wanted = self.wanted
        return [(ev["cat"], ev.get("name", ""), ev.get("pid"), ev.get("tid"), ev.get("ts"), ev.get("dur"))
                for ev in decoded
                if isinstance(ev, dict) and ev.get("cat") in wanted and ev.get("ph") == "X"]

    def _batch(self) -> list | None:
        """Every whole event left in the buffer, decoded at once, or None when no cut is proven."""
        buf, start, hi = self.buf, self.pos, len(self.buf)
        for _ in range(_GUESSES):
            cut = _last_boundary(buf, start, hi)
            if cut < 0:
                return None
            text = "[" + buf[start:cut + 1] + "]"
            try:
                decoded, end = _decoder.raw_decode(text)
            except json.JSONDecodeError as e:
                hi = min(cut, start + e.pos - 1)  # the next guess must lie before the failure
                continue
            if end == len(text):
                self.pos = cut + 1
                return decoded
            hi = cut  # the events array ended before the cut
        return None

    def _value(self) -> object:
        """The JSON value at the cursor, reading more text until it is complete."""
        self._peek()
        while True:
            try:
                value, end = _decoder.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as e:
                if self.eof and e.pos >= len(self.buf):
                    raise ValueError("the file ends in the middle of the trace") from e
                if self.eof or len(self.buf) - self.pos > _MAX_VALUE_CHARS:
                    raise ValueError(f"{e.msg} at character {self.base + e.pos}") from e
            else:
                # A number that runs to the end of the buffer may continue in the next chunk.
                if end < len(self.buf) or self.eof:
                    self.pos = end
                    return value
            self._fill()

    def _peek(self, skip: str = "") -> str:
        """The next significant character, past whitespace and any of `skip`."""
        while True:
            buf, pos = self.buf, self.pos
            while pos < len(buf) and (buf[pos] in _WHITESPACE or buf[pos] in skip):
                pos += 1
            self.pos = pos
            if pos < len(buf):
                return buf[pos]
            if self.eof:
                raise ValueError("the file ends in the middle of the trace")
            self._fill()

    def _expect(self, char: str) -> None:
        found = self._peek()
        if found != char:
            raise ValueError(f"expected {char!r} at character {self.base + self.pos}, found {found!r}")
        self.pos += 1

    def _fill(self) -> None:
        chunk = self.read(CHUNK_CHARS)
        self.eof = not chunk
        self.base += self.pos
        self.buf = self.buf[self.pos:] + chunk
        self.pos = 0


def _last_boundary(buf: str, lo: int, hi: int) -> int:
    """Index of the last `}` in buf[lo:hi] followed by `,` then `{` (whitespace allowed), or -1."""
    while True:
        brace = buf.rfind("{", lo, hi)
        if brace <= lo:
            return -1
        k = brace - 1
        while k > lo and buf[k] in _WHITESPACE:
            k -= 1
        if buf[k] == ",":
            k -= 1
            while k > lo and buf[k] in _WHITESPACE:
                k -= 1
            if buf[k] == "}":
                return k
        hi = brace


class _Ids(dict):
    """pid/tid text -> the value the decoder gives (an int, or a string such as "Spans"); few distinct."""

    def __missing__(self, raw: str) -> object:
        value = self[raw] = _decoder.decode(raw)
        return value


_STRING = r'"([^"\\]*(?:\\.[^"\\]*)*)"'   # a JSON string's body, escapes and all
_ID = r'(-?\d+|"[^"\\]*")'                 # a pid or tid: a number, or a plain string such as "Spans"
_NUMBER = r'(-?[\d.eE+-]+)'


class _KinetoLayout:
    """Path 1 of the module docstring: the wanted events of a chunk in Kineto's layout."""

    EVENT_START = '{\n    "ph": "X", "cat": "'

    def __init__(self, wanted: frozenset[str]):
        cats = "|".join(re.escape(c) for c in sorted(wanted))
        self.events = re.compile(
            r'\{\n\s*"ph": "X", "cat": "(' + cats + r')", "name": ' + _STRING + r', "pid": ' + _ID
            + r', "tid": ' + _ID + r',\s*"ts": ' + _NUMBER + r', "dur": ' + _NUMBER)
        self.keys = re.compile(r'"cat"\s*:\s*"(?:' + cats + r')"')
        self.ids = _Ids()

    def batch(self, parser: _Parser) -> list[Event] | None:
        """The wanted events from the cursor to the last event start in the buffer, or None."""
        buf, start = parser.buf, parser.pos
        cut = buf.rfind(self.EVENT_START, start + 1)
        if cut < 0:
            return None
        ids = self.ids
        events = [(cat, _decoder.decode(f'"{name}"') if "\\" in name else name, ids[pid], ids[tid],
                   float(ts), float(dur))
                  for cat, name, pid, tid, ts, dur in self.events.findall(buf, start, cut)]
        if len(events) != len(self.keys.findall(buf, start, cut)):
            return None
        parser.pos = cut
        return events
