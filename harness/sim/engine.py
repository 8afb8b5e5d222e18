"""Continuous batching and the OpenAI stream format.

The scheduler advances every running request one token per tick, like a real engine's decode loop:
a tick lasts `LatencyModel.itl_ms(batch)` (or `prefill_ms` when new requests are admitted, which
stalls the running ones, as a prefill batch does), and each tick is one "forward step" for the
profiler (a `trace.Step`). vLLM also runs a step with nothing scheduled when its last running
requests finished (it frees them in a step of its own; 48 of 318 steps on vLLM 0.26, H200): an idle
step of `IDLE_STEP_MS`. Chunks are pre-encoded per request (a fixed JSON prefix and suffix around the
text) and written straight to the sockets from the tick, so 256 streams cost one loop pass, not 256
wake-ups.

The stream, as vLLM 0.26 / 0.32 completions show it: one event per token; several in one event with
--stream-interval N, or under load (vLLM merges the outputs a request's consumer has not taken yet:
here, while the client has not read what was sent before, i.e. the socket's write buffer is not
empty); `"text": ""` for a token that decodes to no text (HARNESS_SIM_EMPTY_TEXT_EVERY: on the H200
and on the CPU build with a random-weight byte-level-BPE model, every other token of a greedy
64-token answer was empty); with `stream_options.include_usage` a last `choices: []` event with the
usage; then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
import zlib
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, Callable

from harness.sim import http
from harness.sim.model import IDLE_STEP_MS, LatencyModel
from harness.sim.trace import Step

VOCAB = tuple(w.encode() for w in (
    " The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", ",", " and", " then",
    " it", " runs", " far", " away", " into", " a", " quiet", " forest", ".", " Every", " morning", " sun",
    " rises", " again", " over", " green", " hills", " while", " birds", " sing"))
_WORDS = re.compile(r"\w+|[^\w\s]")
_PLACEHOLDER = "\x00"
DONE = b"data: [DONE]\n\n"

StepHook = Callable[[Step], Awaitable[None]]


def count_tokens(text: str) -> int:
    """A stand-in tokenizer: words and punctuation marks (close to BPE counts for English)."""
    return len(_WORDS.findall(text))


CHAT_TEMPLATE_TOKENS = 4
"""What the stand-in chat template adds around each message (its usage counts them too)."""


def token_ids(text: str) -> list[int]:
    """The stand-in tokenizer's ids: one a word or punctuation mark, as count_tokens counts them."""
    return [zlib.crc32(w.encode()) % 32000 + 100 for w in _WORDS.findall(text)]


def tokenize(body: dict[str, Any]) -> list[int]:
    """The ids of a /tokenize body's `prompt` (a string) or `messages` (the chat template's few ids a
    message, then its content), exactly what a generation with that prompt reports as prompt_tokens;
    raises ValueError on a body that has neither."""
    messages, prompt = body.get("messages"), body.get("prompt")
    if isinstance(messages, list) and messages:
        ids: list[int] = []
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            ids += list(range(1, CHAT_TEMPLATE_TOKENS + 1))
            ids += token_ids(content if isinstance(content, str) else json.dumps(content))
        return ids
    if isinstance(prompt, str):
        return token_ids(prompt)
    raise ValueError("'prompt' must be a string, or 'messages' a non-empty list")


class EmitLog:
    """Token emission times, buffered in memory so that logging does not disturb the timing."""

    def __init__(self, path: str):
        self.path = path
        self.rows: list[tuple] = []
        open(path, "w").close()

    def record(self, request: str, first: int, count: int, t_ns: int) -> None:
        self.rows.append((request, first, count, t_ns))

    def flush(self) -> None:
        rows, self.rows = self.rows, []
        if not rows:
            return
        with open(self.path, "a") as f:
            f.write("".join('{"request": "%s", "token": %d, "t_ns": %d}\n' % (r, first + i, t)
                            for r, first, n, t in rows for i in range(n)))


@dataclass
class Generation:
    """One request in flight: its limits, its socket and its pre-encoded chunk frame."""

    id: str
    engine: str
    model: str
    chat: bool
    stream: bool
    prompt_tokens: int
    max_tokens: int
    include_usage: bool
    writer: asyncio.StreamWriter
    done: asyncio.Future[None]
    tokens: int = 0
    pending: list[bytes] = field(default_factory=list)
    text: list[bytes] = field(default_factory=list)
    finish_reason: str = "length"
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.prefix, self.suffix = self._frame(_PLACEHOLDER, None).split(b'"\\u0000"')

    def _choice(self, text: str | None, finish: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["delta"] = {} if text is None else {"content": text}
        else:
            choice["text"] = "" if text is None else text
        choice.update(logprobs=None, finish_reason=finish)
        if self.engine == "sglang":
            choice["matched_stop"] = None
        else:
            choice["stop_reason"] = None
        return choice

    def _frame(self, text: str | None, finish: str | None) -> bytes:
        return self._event([self._choice(text, finish)])

    def _event(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        obj: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                               "created": self.created, "model": self.model, "choices": choices}
        if usage is not None or self.engine == "sglang":
            obj["usage"] = usage
        return json.dumps(obj).encode()

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.tokens,
                "total_tokens": self.prompt_tokens + self.tokens}

    def role_chunk(self) -> bytes:
        c = self._choice(None, None)
        c["delta"] = {"role": "assistant", "content": ""}
        return http.chunk(b"data: " + self._event([c]) + b"\n\n")

    def text_chunk(self, words: bytes, finish: str | None = None) -> bytes:
        body = (self.prefix + b'"' + words + b'"' + self.suffix if finish is None
                else self._frame(words.decode(), finish))
        return http.chunk(b"data: " + body + b"\n\n")

    def closing(self) -> bytes:
        """What follows the last token: SGLang's empty finishing chunk, the usage chunk, [DONE]."""
        out = b""
        if self.engine == "sglang":
            out += self.text_chunk(b"", self.finish_reason)
        if self.include_usage:
            out += http.chunk(b"data: " + self._event([], self.usage()) + b"\n\n")
        return out + http.chunk(DONE) + http.LAST_CHUNK

    def body(self) -> bytes:
        """The non-streaming answer."""
        text = b"".join(self.text).decode()
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice.update(logprobs=None, finish_reason=self.finish_reason)
        obj = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": [choice], "usage": self.usage()}
        return json.dumps(obj).encode()


def new_generation(engine: str, model: str, chat: bool, body: dict[str, Any],
                   writer: asyncio.StreamWriter, loop: asyncio.AbstractEventLoop) -> Generation:
    """A Generation from an OpenAI request body; raises ValueError on a malformed one."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' must be a non-empty list")
        prompt = 0
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            prompt += CHAT_TEMPLATE_TOKENS + count_tokens(content if isinstance(content, str) else json.dumps(content))
        default_max = 4096
    else:
        p = body.get("prompt")
        if isinstance(p, str):
            prompt = count_tokens(p)
        elif isinstance(p, list) and p and all(isinstance(x, int) for x in p):
            prompt = len(p)
        elif isinstance(p, list) and p and isinstance(p[0], str):
            prompt = count_tokens(p[0])
        else:
            raise ValueError("'prompt' must be a string or a list of token ids")
        default_max = 16
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or default_max
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError("'max_tokens' must be a positive integer")
    options = body.get("stream_options") or {}
    gid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    g = Generation(id=gid, engine=engine, model=model, chat=chat, stream=bool(body.get("stream")),
                   prompt_tokens=max(1, prompt), max_tokens=max_tokens,
                   include_usage=bool(options.get("include_usage")), writer=writer, done=loop.create_future())
    if not body.get("ignore_eos"):
        # Without ignore_eos the simulated model ends its answer by itself, as a real one does.
        natural = 64 + zlib.crc32(json.dumps(body.get("messages") or body.get("prompt")).encode()) % 192
        if natural < g.max_tokens:
            g.max_tokens, g.finish_reason = natural, "stop"
    return g


class Scheduler:
    """The engine's decode loop: admits waiting requests with a prefill tick, then decodes in ticks."""

    def __init__(self, model: LatencyModel, *, engine: str, time_scale: float, stream_interval: int,
                 max_running: int | None, emit: EmitLog | None, log: Callable[[str], None],
                 log_interval: int = 40, empty_text_every: int | None = None):
        self.model, self.engine, self.scale = model, engine, time_scale
        self.interval = max(1, stream_interval)
        self.empty_every = empty_text_every or 0
        self.freed = False
        """Requests finished since the last step: vLLM frees them in the next one, idle or not."""
        self.max_running = max_running
        self.emit, self.log, self.log_interval = emit, log, max(1, log_interval)
        self.hooks: list[StepHook] = []
        self.waiting: list[Generation] = []
        self.running: list[Generation] = []
        self.wake = asyncio.Event()
        self.frozen = asyncio.Event()
        self.prompt_tokens_total = self.generation_tokens_total = self.decode_steps = 0

    def submit(self, g: Generation) -> None:
        if g.stream and g.chat and self.engine == "vllm":
            g.writer.write(g.role_chunk())  # vLLM answers the role at once; SGLang with the first token
        self.waiting.append(g)
        self.wake.set()

    def freeze(self) -> None:
        """Stop ticking for good (the hang fault): streams in flight stall where they are."""
        self.frozen.set()
        self.wake.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        window_start, window_tokens = loop.time(), 0
        while True:
            if not (self.waiting or self.running or self.freed) and not self.frozen.is_set():
                self.wake.clear()
                await self.wake.wait()
                deadline = loop.time()
            if self.frozen.is_set():
                await asyncio.Event().wait()
            admitted, step = self._next_step()
            step_ms = self._step_ms(step)
            # Absolute deadlines keep the average tick exact; after a stall, start afresh.
            deadline = max(deadline + step_ms * self.scale / 1000, loop.time() - step_ms * self.scale / 1000)
            await asyncio.sleep(max(0.0, deadline - loop.time()))
            if self.frozen.is_set():
                continue
            batch = admitted or (self.running if step.decode else [])
            if admitted:
                self.prompt_tokens_total += step.prefill_tokens
                self.running.extend(admitted)
                if self.engine == "sglang":
                    self.log(f"Prefill batch. #new-seq: {len(admitted)}, #new-token: {step.prefill_tokens}, "
                             f"#cached-token: 0, token usage: 0.00, #running-req: {len(self.running) - len(admitted)}, "
                             f"#queue-req: {len(self.waiting)},")
            elif step.decode:
                self.decode_steps += 1
            self.freed = False
            self._advance(batch)
            window_tokens += len(batch)
            if step.decode and self.decode_steps % self.log_interval == 0:
                now = loop.time()
                self._log_decode(window_tokens / max(now - window_start, 1e-9) * self.scale)
                window_start, window_tokens = now, 0
            for hook in self.hooks:
                await hook(step)

    def _next_step(self) -> tuple[list[Generation], Step]:
        """Admit what fits (a prefill step), else decode the running requests, else an idle step."""
        room = len(self.waiting) if self.max_running is None else self.max_running - len(self.running)
        admitted, self.waiting = self.waiting[:max(0, room)], self.waiting[max(0, room):]
        if admitted:
            return admitted, Step(prefill=len(admitted), prefill_tokens=sum(g.prompt_tokens for g in admitted))
        return [], Step(decode=len(self.running))

    def _step_ms(self, step: Step) -> float:
        if step.prefill:
            return self.model.prefill_ms(step.prefill_tokens)
        return self.model.itl_ms(step.decode) if step.decode else IDLE_STEP_MS

    def _log_decode(self, throughput: float) -> None:
        running = len(self.running)
        if self.engine == "sglang":
            self.log(f"Decode batch. #running-req: {running}, #token: {running * 64}, token usage: 0.00, "
                     f"cuda graph: {self.model.config.cuda_graphs}, gen throughput (token/s): {throughput:.2f}, "
                     f"#queue-req: {len(self.waiting)},")
        else:
            self.log(f"Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: "
                     f"{throughput:.1f} tokens/s, Running: {running} reqs, Waiting: {len(self.waiting)} reqs, "
                     "GPU KV cache usage: 0.1%, Prefix cache hit rate: 0.0%")

    def _advance(self, batch: list[Generation]) -> None:
        """One token for every request of the batch; send the chunks that are due."""
        finished = False
        for g in batch:
            if g.writer.is_closing():  # the client went away: abort, as the engines do
                g.tokens = g.max_tokens
                g.finish_reason = "abort"
                finished = True
                if not g.done.done():
                    g.done.set_result(None)
                continue
            g.tokens += 1
            word = self._word(g)
            self.generation_tokens_total += 1
            last = g.tokens >= g.max_tokens
            if not g.stream:
                g.text.append(word)
            else:
                g.pending.append(word)
                due = g.tokens == 1 or len(g.pending) >= self.interval
                if last or (due and not self._lagging(g)):
                    self._send(g, last)
            if last:
                finished = True
                if g.stream:
                    g.writer.write(g.closing())
                g.done.set_result(None)
        if finished:
            self.running = [g for g in self.running if not g.done.done()]
            self.freed = self.engine == "vllm"

    def _word(self, g: Generation) -> bytes:
        """The text of a request's latest token: every N-th is empty with HARNESS_SIM_EMPTY_TEXT_EVERY=N."""
        if self.empty_every and g.tokens % self.empty_every == 0:
            return b""
        return VOCAB[(g.tokens - 1 + len(g.id)) % len(VOCAB)]

    def _lagging(self, g: Generation) -> bool:
        """vLLM merges a request's outputs while its consumer lags: the client has not read the last event."""
        return self.engine == "vllm" and g.writer.transport.get_write_buffer_size() > 0

    def _send(self, g: Generation, last: bool) -> None:
        data = b""
        if g.tokens == len(g.pending) and g.chat and self.engine == "sglang":
            data = g.role_chunk()
        words, n = b"".join(g.pending), len(g.pending)
        g.pending.clear()
        data += g.text_chunk(words, g.finish_reason if last and self.engine == "vllm" else None)
        g.writer.write(data)
        if self.emit is not None:
            self.emit.record(g.id, g.tokens - n, n, time.monotonic_ns())
