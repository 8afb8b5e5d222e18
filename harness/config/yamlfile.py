"""Reading YAML so that every mistake can be reported as `file:line: key: what is wrong`.

PyYAML's safe loader is used through a subclass that remembers the line of every mapping key and
sequence item. pydantic's ValidationError `loc` is then mapped back to a line (`located`), so a user
sees `playbooks/x.yaml:14: configs[1].args.tp-size: Input should be a valid integer`.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from harness.errors import InputError
from harness.secrets import is_secret

Loc = tuple[str | int, ...]


MAX_NODES = 200_000
"""Values one file may hold once its aliases are expanded: far beyond any playbook or inventory,
short of a few lines of aliases nested in aliases that expand to billions (and hang the loader)."""
MAX_DEPTH = 64
"""How deep values may nest: a playbook is a handful of levels deep."""


class _Refused(Exception):
    """The document cannot be taken as it is: `message` at `line`, under key `loc`."""

    def __init__(self, message: str, loc: Loc, line: int):
        super().__init__(message)
        self.message, self.loc, self.line = message, loc, line


class _LineLoader(yaml.SafeLoader):
    """SafeLoader that records `path-in-document -> line` for every key and list item, and refuses,
    before anything is built, what PyYAML would take silently or choke on: a key given twice in one
    mapping (the first value would be lost), an alias inside itself, aliases that expand beyond
    MAX_NODES values, nesting deeper than MAX_DEPTH."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.lines: dict[Loc, int] = {}
        self._nodes = 0

    def construct_document(self, node):
        self._record(node, (), ())
        return super().construct_document(node)

    def _record(self, node, loc: Loc, inside: tuple[int, ...]) -> None:
        line = node.start_mark.line + 1
        self._nodes += 1
        if id(node) in inside:
            raise _Refused("an alias that contains itself (a value cannot include itself)", loc, line)
        if self._nodes > MAX_NODES:
            raise _Refused(f"more than {MAX_NODES:,} values once its aliases are expanded", loc, line)
        if len(inside) >= MAX_DEPTH:
            raise _Refused(f"values nested more than {MAX_DEPTH} levels deep", loc, line)
        self.lines.setdefault(loc, line)
        inside += (id(node),)
        if isinstance(node, yaml.MappingNode):
            seen: dict[tuple[str, str], int] = {}
            for key_node, value_node in node.value:
                if isinstance(key_node, yaml.ScalarNode):
                    key_line = key_node.start_mark.line + 1
                    key = (key_node.tag, key_node.value)   # 8 and '8' are two keys
                    if key in seen and key_node.tag != "tag:yaml.org,2002:merge":
                        raise _Refused(f"{key_node.value!r} is given twice in one mapping (lines {seen[key]} "
                                       f"and {key_line}): keep one", loc + (key_node.value,), key_line)
                    seen[key] = key_line
                    child = loc + (key_node.value,)
                    self.lines[child] = key_line
                    self._record(value_node, child, inside)
                else:
                    self._record(value_node, loc, inside)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._record(item, loc + (i,), inside)


class YamlDoc:
    """A parsed YAML file and the line of each of its keys."""

    def __init__(self, path: Path, data: Any, lines: dict[Loc, int]):
        self.path, self.data, self.lines = path, data, lines

    def line(self, loc: Loc) -> int | None:
        """The line of `loc`, or of its nearest ancestor that has one."""
        while loc:
            if loc in self.lines:
                return self.lines[loc]
            loc = loc[:-1]
        return self.lines.get(())

    def error(self, loc: Loc, message: str) -> InputError:
        return InputError(message, file=str(self.path), key=dotted(loc) or None, line=self.line(loc))

    def validate(self, model: type[BaseModel], data: Any = None, *, at: Loc = (), context=None):
        """Validate `data` (default: the whole document) into `model`. Every mistake is named (key and
        line), not only the first, so one run of the command shows what to fix; an unknown key that is
        near a known one says which."""
        try:
            return model.model_validate(self.data if data is None else data, context=context)
        except ValidationError as e:
            errors = e.errors()
            names = _field_names(model)
            found = [(at + tuple(p for p in err["loc"] if not _is_union_tag(p)), _message(err, names))
                     for err in errors]
            found = list(dict.fromkeys(found))
            loc, message = found[0]
            more = [f"  {self.path}:{self.line(lc) or '?'}: {dotted(lc)}: {m}" for lc, m in found[1:10]]
            if len(found) > 10:
                more.append(f"  ... and {len(found) - 10} more")
            raise self.error(loc, message + ("\n" + "\n".join(more) if more else "")) from None


def read_text(path: Path) -> str:
    """A file we were pointed at, or an InputError naming it."""
    try:
        return path.read_text()
    except FileNotFoundError:
        raise InputError("file not found", file=str(path)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read: {e}", file=str(path)) from None


def load_yaml(path: Path | str) -> YamlDoc:
    path = Path(path)
    text = read_text(path)
    loader = _LineLoader(text)
    try:
        data = loader.get_single_data()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark else None
        raise InputError(f"invalid YAML: {e.problem or e}", file=str(path), line=line) from None
    except yaml.YAMLError as e:
        raise InputError(f"invalid YAML: {e}", file=str(path)) from None
    except _Refused as e:
        raise InputError(e.message, file=str(path), key=dotted(e.loc) or None, line=e.line) from None
    except RecursionError:   # the composer nests a frame per level, before our own depth check
        raise InputError(f"values nested too deeply (at most {MAX_DEPTH} levels)", file=str(path)) from None
    finally:
        loader.dispose()
    doc = YamlDoc(path, data if data is not None else {}, loader.lines)
    _check_text(doc, doc.data, ())
    return doc


def _check_text(doc: YamlDoc, value: Any, loc: Loc) -> None:
    """Every string must be one a host can receive: YAML's "\\ud800" escapes make lone surrogates,
    which no UTF-8 command line, file or request can carry (found by a run that died sending one)."""
    if isinstance(value, dict):
        for key, item in value.items():
            _check_text(doc, key, loc)
            _check_text(doc, item, loc + (key,))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_text(doc, item, loc + (i,))
    elif isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise doc.error(loc, f"text that is not valid Unicode ({e.reason} at character {e.start}: "
                                 f"{value[max(0, e.start - 10):e.start]!r}...)") from None
        if "\0" in value:   # no command line, environment or file name can carry one
            raise doc.error(loc, f"text with a NUL character (\\0) at character {value.index(chr(0))}")


def dotted(loc: Loc) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _is_union_tag(part) -> bool:
    # pydantic inserts the member type of a union into loc (e.g. 'list[str]'); not a key of the file
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool", "none"})


def _field_names(model: type[BaseModel]) -> set[str]:
    """Every key of `model` and of the models inside it, for a "did you mean"."""
    names: set[str] = set()
    todo: list[Any] = [model]
    seen: set[Any] = set()
    while todo:
        current = todo.pop()
        if current in seen or not (isinstance(current, type) and issubclass(current, BaseModel)):
            continue
        seen.add(current)
        for name, info in current.model_fields.items():
            names.add(name)
            todo += _models_in(info.annotation)
    return names


def _models_in(annotation: Any) -> list[Any]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in getattr(annotation, "__args__", ()) for m in _models_in(arg)]


def _message(err: ErrorDetails, names: set[str] | None = None) -> str:
    if err["type"] == "extra_forbidden":
        key = str(err["loc"][-1]) if err["loc"] else ""
        near = difflib.get_close_matches(key, sorted(names or ()), n=1, cutoff=0.75)
        return f"unknown key (did you mean {near[0]!r}?)" if near else "unknown key"
    if err["type"] == "missing":
        return "required key is missing"
    msg = err["msg"]
    if "input" in err and not isinstance(err["input"], (dict, list)) and err["type"] != "value_error" \
            and not _may_hold_secret(err["loc"], err["input"]):
        msg += f" (got {err['input']!r})"
    return msg.removeprefix("Value error, ")


def _may_hold_secret(loc: tuple[int | str, ...], value: Any) -> bool:
    """Whether a wrong value must not be repeated in the error: one under a secret-looking name, or a
    whole env/args/secrets given as text (`env: HF_TOKEN=...`), or text that names a secret itself."""
    parts = [str(p) for p in loc]
    return (any(is_secret(p) for p in parts) or bool(parts and parts[-1] in ("env", "args", "secrets"))
            or (isinstance(value, str) and is_secret(value)))
