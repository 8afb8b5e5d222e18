"""Secrets: env values that must never appear in launch.sh, logs, manifests, the journal or errors.

A name is secret when one of its words (split at `-`, `_`, `.` and between a lower-case letter and a
capital) is or ends with TOKEN, SECRET(S), PASSWORD(S), PASSWD or KEY(S), or is PASS, in any case
(HF_TOKEN, api-key, AWS_SECRET_ACCESS_KEY, NGC_APIKEY, apiKey, sudo_pass), or when
it is listed under `secrets:` in the inventory or the playbook; an inventory's host variables of such
names are masked as its env is. Words are what keep the engines' tuning flags and settings public:
`max-num-batched-tokens`, `tokenizer`, TOKENIZERS_PARALLELISM hold no secret, and a value taken for
one would be masked in every log and manifest (8192 would read *** wherever it appears).

A server flag with a secret name (`api-key`) is a secret too: its value travels in an environment
variable the flag names. Secret values reach the host in a mode-0600 file that the launch script
sources; everything the harness writes or prints goes through `Redactor.text`, and so do the text
files pulled back (an engine may log its arguments).

A server launched with an API key (`--api-key`, vLLM and SGLang alike; or vLLM's VLLM_API_KEY) asks
every client for it: the harness's own requests on the host (health, benchmark, profiler) read it
from the secrets file into their environment and send `Authorization: Bearer`, see `api_key_env`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

MASK = "***"
_SECRET_WORD = re.compile(r"(TOKEN|SECRETS?|PASSWORDS?|PASSWD|KEYS?)$|^PASS$", re.IGNORECASE)
_WORDS = re.compile(r"[-_.\s]+|(?<=[a-z0-9])(?=[A-Z])")


def is_secret(name: str, listed: Iterable[str] = ()) -> bool:
    return any(_SECRET_WORD.search(word) for word in _WORDS.split(name)) or name in set(listed)


def masked_args(args: Mapping[str, object], listed: Iterable[str] = ()) -> dict[str, object]:
    """Server args with every value of a secret flag shown as MASK (a list keeps its shape, so that
    `harness reproduce` knows how many values to ask for); bare and left-out flags as they are."""
    listed = list(listed)

    def mask(value: object) -> object:
        if isinstance(value, list):
            return [mask(v) for v in value]
        return value if value is None or isinstance(value, bool) else MASK
    return {k: mask(v) if is_secret(k, listed) else v for k, v in args.items()}


def arg_env_name(flag: str) -> str:
    """The environment variable a secret flag's value travels in (`api-key` -> HARNESS_ARG_API_KEY):
    the launch script says `--api-key "$HARNESS_ARG_API_KEY"` and the value lives in the secrets file."""
    return "HARNESS_ARG_" + re.sub(r"[^A-Za-z0-9]", "_", flag.lstrip("-")).upper()


API_KEY_FLAGS = frozenset({"api-key"})
"""Server flags whose value clients must send as `Authorization: Bearer` (vLLM 0.26, SGLang 0.5.23)."""
API_KEY_ENV = frozenset({"VLLM_API_KEY"})
"""Environment variables an engine takes its key from when no flag gives one (vLLM)."""


def api_key_env(args: Mapping[str, object], secret_env: Mapping[str, str]) -> str | None:
    """The environment variable, among a run's secrets, that holds the key the server asks clients
    for; None when it asks for none."""
    for flag, value in args.items():
        name = arg_env_name(flag)
        if flag.lstrip("-") in API_KEY_FLAGS and value not in (None, False) and name in secret_env:
            return name
    return next((name for name in sorted(API_KEY_ENV) if secret_env.get(name)), None)


class Redactor:
    def __init__(self, values: Iterable[str] = ()):
        # longest first, so a secret that contains another is masked whole
        self._values = sorted({v for v in values if v and len(v) >= 3}, key=len, reverse=True)

    def text(self, s: str) -> str:
        for v in self._values:
            s = s.replace(v, MASK)
        return s

    def env(self, env: Mapping[str, str | None], listed: Iterable[str] = ()) -> dict[str, str | None]:
        """Each value masked where its name is a secret's (None, an unset variable, stays None)."""
        listed = list(listed)
        return {k: v if v is None else MASK if is_secret(k, listed) else self.text(v) for k, v in env.items()}

    def data(self, obj):
        """Redact every string inside a JSON-like structure, and every number that is a secret (an
        `api-key: 12345` stays a number in a playbook's dump)."""
        if isinstance(obj, str):
            return self.text(obj)
        if isinstance(obj, (int, float)) and not isinstance(obj, bool) and str(obj) in self._values:
            return MASK
        if isinstance(obj, Mapping):
            return {k: self.data(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [self.data(x) for x in obj]
        return obj
