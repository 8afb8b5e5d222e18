"""Rendering launch scripts: one Jinja environment, strict about undefined names, quoting everything.

Filters:
  shquote  a value as one shell word (`shlex.quote`); every value that reaches a shell goes through it
           (a `ShellWords` value, a command prefix the harness quoted word by word, passes as it is)
  flags    an args mapping as command-line flags: true = bare flag, false/null = omitted,
           list = the flag repeated (a nested list = one flag, several values), mapping = JSON;
           names without a leading dash get `--`
String values in args and env are themselves templates (`"{{ run.profile_dir }}"`), rendered first with
the same context, so a typo there fails before any host is touched.
"""

from __future__ import annotations

import functools
import json
import re
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jinja2

from harness.errors import InputError

BUILTIN_TEMPLATES = Path(__file__).resolve().parent / "templates"
"""The launch templates that ship with the package (also `templates/` at the top of a checkout)."""


def builtin_templates() -> list[str]:
    return sorted(p.name for p in BUILTIN_TEMPLATES.glob("*.sh.j2") if not p.name.startswith("_"))


class ShellWords(str):
    """Words the harness has already quoted one by one (`tools.torchprof`: the zipapp and its tool),
    so `shquote` leaves them as they are rather than making one word of them."""


def shquote(value: Any) -> str:
    if value is None:   # an unset variable (env: null) or a missing value: never the word None
        raise jinja2.TemplateRuntimeError("shquote of a null value: an env value of null means the variable "
                                          "is unset; test `value is none` first, as the built-in "
                                          "_common.sh.j2 does (`unset NAME`)")
    if isinstance(value, ShellWords):
        return str(value)
    if isinstance(value, bool):
        value = "true" if value else "false"
    elif isinstance(value, (dict, list)):
        value = json.dumps(value, separators=(",", ":"))
    return shlex.quote(str(value))


def flag_name(name: str) -> str:
    return name if name.startswith("-") else f"--{name}"


def flag_pairs(args: Mapping[str, Any]) -> list[tuple[str, list[str]]]:
    """(flag, values) for an args mapping; no values for a bare flag.

    A list repeats the flag; a list inside that list gives one flag several values (argparse's
    nargs='+', e.g. `cuda-graph-bs-decode: [[1, 2, 4, 8]]`). A dotted name is a vLLM config field
    (`--compilation-config.level 3`), which takes an explicit true/false rather than a bare flag.
    """
    pairs: list[tuple[str, list[str]]] = []
    for name, value in args.items():
        flag = flag_name(name)
        if "." in name and isinstance(value, bool):
            pairs.append((flag, [_word(value)]))
        elif value is None or value is False:
            continue
        elif value is True:
            pairs.append((flag, []))
        else:
            for item in value if isinstance(value, list) else [value]:
                pairs.append((flag, [_word(v) for v in item] if isinstance(item, list) else [_word(item)]))
    return pairs


class EnvRef(str):
    """A flag value that is a reference to an environment variable (a secret's): rendered `"$NAME"`,
    so the value itself never appears in the script."""


def hide_flag_value(value: Any, env_name: str) -> tuple[Any, dict[str, str]]:
    """A secret flag's value with each of its words replaced by an EnvRef, and what each of those
    variables holds: `sk-1` -> `"$HARNESS_ARG_API_KEY"`; a flag given several values (`[[sk-1, sk-2]]`,
    vLLM's --api-key takes several) -> `"$HARNESS_ARG_API_KEY" "$HARNESS_ARG_API_KEY_1"`. A bare
    flag (true) or one left out (false, null) holds no value and stays as it is."""
    held: dict[str, str] = {}

    def hide(item: Any) -> Any:
        if isinstance(item, list):
            return [hide(v) for v in item]
        if item is None or isinstance(item, bool):
            return item
        name = f"{env_name}_{len(held)}" if held else env_name
        held[name] = _word(item)
        return EnvRef(name)
    return hide(value), held


def flags(args: Mapping[str, Any]) -> str:
    # flag names are validated when the playbook loads (letters, digits, '-', '_', '.'): only values need quoting
    def word(value: str) -> str:
        return f'"${value}"' if isinstance(value, EnvRef) else shlex.quote(value)
    return " ".join(" ".join([flag, *map(word, values)]) for flag, values in flag_pairs(args))


def _word(value: Any) -> str:
    if isinstance(value, EnvRef):
        return value
    if isinstance(value, dict):
        return json.dumps(value, separators=(",", ":"))
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def environment(template_dir: Path | None = None) -> jinja2.Environment:
    """Templates load from `template_dir`, then from the built-in ones (so a template of one's own can
    `{% include "_common.sh.j2" %}`)."""
    loader = None
    if template_dir:
        loader = jinja2.FileSystemLoader([str(template_dir), str(BUILTIN_TEMPLATES)])
    env = jinja2.Environment(
        loader=loader,
        undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False,
        trim_blocks=True, lstrip_blocks=True)
    env.filters["shquote"] = shquote
    env.filters["flags"] = flags
    env.filters["tojson"] = lambda v: json.dumps(v)
    return env


_STRINGS = environment()


# A sweep renders every run for every host it may land on before it starts (a typo fails before any
# host), and each run again when it starts: the same few sources, compiled once each. Compiling is
# most of a render (a 4-host sweep of 8 configurations compiled its template 64 times at startup).
# Keyed by the source itself, so a template edited on disk is read and compiled anew.
@functools.lru_cache(maxsize=256)
def _compiled_string(text: str) -> jinja2.Template:
    return _STRINGS.from_string(text)


@functools.lru_cache(maxsize=16)
def _template_environment(template_dir: Path) -> jinja2.Environment:
    return environment(template_dir)   # its loader keeps what it includes, checked against the file's mtime


@functools.lru_cache(maxsize=16)
def _compiled_template(template_dir: Path, source: str) -> jinja2.Template:
    return _template_environment(template_dir).from_string(source)


def render_string(text: str, context: Mapping[str, Any], *, where: str, file: str | None = None,
                  line: int | None = None) -> str:
    """Render a template-valued setting; an undefined name is an InputError naming the key."""
    if "{{" not in text and "{%" not in text:
        return text
    try:
        return _compiled_string(text).render(context)
    except jinja2.UndefinedError as e:
        raise InputError(undefined(e, context), file=file, key=where, line=line) from None
    except jinja2.TemplateError as e:
        raise InputError(f"template error: {e}", file=file, key=where, line=line) from None


def render_template(path: Path, context: Mapping[str, Any]) -> str:
    try:
        source = path.read_text()
    except OSError as e:
        raise InputError(f"cannot read the launch template: {e.strerror}", file=str(path)) from None
    except UnicodeDecodeError as e:
        raise InputError(f"the launch template is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                         f"{e.start})", file=str(path)) from None
    try:
        return _compiled_template(path.parent, source).render(context)
    except UnicodeDecodeError as e:   # a template it includes
        raise InputError(f"a template it includes is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                         f"{e.start})", file=str(path)) from None
    except jinja2.UndefinedError as e:
        raise InputError(undefined(e, context), file=str(path), line=_template_line(e)) from None
    except jinja2.TemplateSyntaxError as e:
        raise InputError(f"template syntax error: {e.message}", file=str(path), line=e.lineno) from None
    except jinja2.TemplateError as e:
        raise InputError(f"template error: {e}", file=str(path), line=_template_line(e)) from None


def undefined(error: jinja2.UndefinedError, context: Mapping[str, Any]) -> str:
    """Jinja's "'dict object' has no attribute 'x'" in words a user can act on, with what exists."""
    said = error.message or ""
    match = re.search(r"has no attribute '([^']+)'|'([^']+)' is undefined", said)
    name = next((g for g in match.groups() if g), None) if match else None
    known = ", ".join(sorted(context))
    if name is None:
        return f"undefined template variable: {said}"
    return f"undefined template variable {name!r} (a template sees: {known}; e.g. model.path, run.dir, host.name)"


def _template_line(exc: BaseException) -> int | None:
    tb = exc.__traceback__
    line = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line
