"""What the benchmark sends and when: synthetic prompts (`synthetic_prompt`), prompts of exactly N of the
server's tokens, each opening with its own words (`PromptMaker`: the server's /tokenize, else
calibrated from its usage), and the open loop's arrival schedules (`arrival_offsets`: poisson, gamma or
constant, drawn from a random_state).

A room of its own: all of it is made before a level starts, off its clock (PromptMaker asks the server
with plain blocking requests, never while a level is measured), and a level's prompts and schedule can
be drawn again from its random_state alone.
"""

from __future__ import annotations

import http.client
import json
import random
from typing import Any, Callable
from urllib.parse import urlsplit

from .exchange import APIS

# Common words that most tokenizers keep whole, so N words make roughly N prompt tokens.
_WORDS = ("the of and to in is was for on that with as by at from his it an were are which this be or "
          "has had not but what all when there can more one about some time").split()
PREFIX_WORDS = 6       # a request's own opening words (of _WORDS: 40^6 ways), so no two share a cached prefix
MAX_ANSWER = 64 << 20  # bytes of a tokenizer's or probe's answer read at most


def synthetic_prompt(words: int) -> str:
    """A deterministic prompt of `words` words (about as many tokens)."""
    return " ".join(_WORDS[i % len(_WORDS)] for i in range(words))


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
