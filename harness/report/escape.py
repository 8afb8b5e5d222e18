"""Text from a host written out so that a terminal shows it and obeys none of it: a kernel name, an error
message, a configuration's name may hold `ESC [2J` (clear the screen) or `ESC ]0;...` (retitle the
window). Kept apart from `harness.report.plain` so that the command line takes it without rich's tables."""

from __future__ import annotations

import re

CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
"""C0 and C1 control characters and DEL, but for tab and newline (a log's tail keeps its lines)."""


def printable(text: str) -> str:
    """`text` with every control character written out (`\\x1b`), so that it prints as it is."""
    return CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode(), text)
