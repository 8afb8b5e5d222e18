"""Text from outside the harness as rich shows it: as written, never as markup.

Kernel names come from a trace (C++ names hold `[...]`: `operator[]`, `k<float>::operator[/x](int)`),
host, run, configuration and sweep names from files and folders, reasons from a journal, paths from
the user. Given to rich as a `str`, `[/x]` closes a style that was never opened (rich.errors.MarkupError)
and `[bold red]` vanishes into a style; `:name:` may become an emoji. As `Text` each prints as it is.

Such text may also hold a terminal's control sequences (`ESC [2J` clears the screen, `ESC ]0;...` retitles
the window, a kernel name or an error message from a host can carry any): they are shown escaped
(`\\x1b[2J`), never sent to the terminal.
"""

from __future__ import annotations

from typing import Any

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from harness.report.escape import CONTROL, printable


def plain(value: RenderableType) -> RenderableType:
    """A string as Text, printed as written; a Text holding control characters as its printable copy
    (its whole style kept); any other renderable as it is."""
    if isinstance(value, str):
        return Text(printable(value))
    if isinstance(value, Text) and CONTROL.search(value.plain):
        return Text(printable(value.plain), style=value.style, justify=value.justify, overflow=value.overflow,
                    no_wrap=value.no_wrap, end=value.end)
    return value


class PlainTable(Table):
    """A rich Table whose strings, title, headers and cells alike, are shown as written (module
    docstring). Styles go on a whole cell or row, or in a Text made on purpose."""

    def __init__(self, *headers: Any, title: Any = None, **kwargs: Any):
        if isinstance(title, str):   # as rich styles a title of its own
            title = Text(printable(title), style=kwargs.get("title_style") or "table.title")
        super().__init__(*headers, title=title, **kwargs)   # a header given as a str comes to add_column

    def add_column(self, header: RenderableType = "", *args: Any, **kwargs: Any) -> None:
        super().add_column(plain(header), *args, **kwargs)

    def add_row(self, *renderables: RenderableType | None, **kwargs: Any) -> None:
        super().add_row(*(None if r is None else plain(r) for r in renderables), **kwargs)
