"""Secrets: env values that must never appear in launch.sh, logs, manifests, the journal or errors.

A name is secret when it contains TOKEN, SECRET, PASSWORD or KEY (any case), or is listed under
`secrets:` in the inventory or the playbook; so is a server flag with such a name (`api-key`), whose
value travels in an environment variable the flag names. Secret values reach the host in a mode-0600
file that the launch script sources; everything the harness writes or prints goes through
`Redactor.text`, and so do the text files pulled back (an engine may log its arguments).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

MASK = "***"
_SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|KEY", re.IGNORECASE)


def is_secret(name: str, listed: Iterable[str] = ()) -> bool:
    return bool(_SECRET_NAME.search(name)) or name in set(listed)


def arg_env_name(flag: str) -> str:
    """The environment variable a secret flag's value travels in (`api-key` -> HARNESS_ARG_API_KEY):
    the launch script says `--api-key "$HARNESS_ARG_API_KEY"` and the value lives in the secrets file."""
    return "HARNESS_ARG_" + re.sub(r"[^A-Za-z0-9]", "_", flag.lstrip("-")).upper()


class Redactor:
    def __init__(self, values: Iterable[str] = ()):
        # longest first, so a secret that contains another is masked whole
        self._values = sorted({v for v in values if v and len(v) >= 3}, key=len, reverse=True)

    def text(self, s: str) -> str:
        for v in self._values:
            s = s.replace(v, MASK)
        return s

    def env(self, env: Mapping[str, str], listed: Iterable[str] = ()) -> dict[str, str]:
        listed = list(listed)
        return {k: MASK if is_secret(k, listed) else self.text(v) for k, v in env.items()}

    def data(self, obj):
        """Redact every string inside a JSON-like structure."""
        if isinstance(obj, str):
            return self.text(obj)
        if isinstance(obj, Mapping):
            return {k: self.data(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [self.data(x) for x in obj]
        return obj
