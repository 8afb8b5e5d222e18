"""Parse the launch commands a playbook renders with the installed engine's own argument parser.

Run it in a virtualenv where the real engine (SGLang or vLLM) is installed; no GPU is needed, only the
engine's Python package and what it imports to build its parser:

    python benchmarks/check_engine_flags.py playbooks/tp_vs_ep.yaml -i inventory.yaml
    harness plan playbooks/tp_vs_ep.yaml --format json | python benchmarks/check_engine_flags.py -

The first form imports `harness` (install it in that venv, or set PYTHONPATH to the checkout); the
second reads the plan that `harness plan --format json` printed elsewhere. Each run prints `OK` or its
problems, and the exit status is 1 when any run has one:

- rejected: the parser's own message ("unrecognized arguments", "ambiguous option", a bad choice), or
  the error the launcher's checks after parsing raise (vLLM's `validate_parsed_serve_args` and
  `AsyncEngineArgs.from_cli_args`, SGLang's `ServerArgs.from_cli_args`);
- overwritten: an option given more than once where the parser keeps only the last value (a list
  rendered as a repeated flag, a vLLM mapping and a dotted field of the same config, ...);
- abbreviated: a flag that exists only as a prefix of a longer one; argparse accepts it until a second
  flag with that prefix appears, then every launch fails ("ambiguous option"), as `--cuda-graph-max-bs`
  did in SGLang 0.5.20;
- engine warnings logged while parsing (deprecated flags) are printed as `warning:` and do not fail.

A sweep costs hours of GPU time; this catches in seconds what `--help` greps cannot: values, choices
and the parser's own prefix and override rules.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import re
import shlex
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# launcher words -> the engine whose parser reads the rest (the simulator speaks its flavor's flags)
LAUNCHERS: dict[tuple[str, ...], str] = {
    ("python", "-m", "sglang.launch_server"): "sglang",
    ("sglang", "serve"): "sglang",
    ("vllm", "serve"): "vllm",
    ("python", "-m", "harness.sim", "sglang"): "sglang",
    ("python", "-m", "harness.sim", "vllm"): "vllm",
}
# actions that add to the value instead of replacing it: giving them twice is the point
_ACCUMULATING = (argparse._AppendAction, argparse._AppendConstAction, argparse._CountAction,
                 argparse._ExtendAction)
_FLAG = re.compile(r"^--?[A-Za-z]")


@dataclass(frozen=True)
class EngineParser:
    """An engine's command line as its launcher reads it."""
    name: str
    parser: argparse.ArgumentParser               # holds the launcher's options
    parse: Callable[[list[str]], argparse.Namespace]
    finish: Callable[[argparse.Namespace], Any]   # the launcher's own checks after parsing
    normalize: Callable[[str], str] = lambda flag: flag   # how the launcher spells a flag it reads


def exec_words(script: str) -> list[str]:
    """The words of a rendered launch script's `exec` line (backslash-continued lines joined)."""
    lines = [line for line in script.replace("\\\n", " ").splitlines() if line.startswith("exec ")]
    if not lines:
        raise ValueError("the launch script has no `exec` line")
    return shlex.split(lines[-1])[1:]


def launch_argv(script: str) -> tuple[str, list[str]]:
    """(engine, the words after the launcher) of a launch script; an nsys prefix is skipped."""
    words = exec_words(script)
    for start in range(len(words)):
        for launcher, engine in LAUNCHERS.items():
            if tuple(words[start:start + len(launcher)]) == launcher:
                return engine, words[start + len(launcher):]
    raise ValueError(f"no known launcher in: {shlex.join(words)}")


def sglang_parser() -> EngineParser:
    """SGLang's parser, built as `sglang.srt.server_args.prepare_server_args` builds it (0.5.x)."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    return EngineParser("sglang", parser, parser.parse_args, ServerArgs.from_cli_args)


def vllm_parser() -> EngineParser:
    """`vllm serve`'s parser, built as `vllm.entrypoints.cli.main` builds it (0.33)."""
    from vllm import platforms

    # The parser's defaults construct a DeviceConfig, which needs a platform; on a machine without a
    # GPU use the CPU one, as `vllm bench` does (vllm/entrypoints/cli/main.py).
    if platforms.current_platform.is_unspecified():
        from vllm.platforms.cpu import CpuPlatform
        platforms.current_platform = CpuPlatform()
    import typing

    from vllm.config import cache
    # 0.33 names the known dtypes; 0.26-0.32 have only the Literal type of the field
    KV_CACHE_DTYPES = getattr(cache, "KV_CACHE_DTYPES", None) or typing.get_args(cache.CacheDType)
    is_known_kv_cache_dtype = getattr(cache, "is_known_kv_cache_dtype", lambda d: d in KV_CACHE_DTYPES)
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    top = FlexibleArgumentParser(prog="vllm")
    command = ServeSubcommand()
    serve = command.subparser_init(top.add_subparsers(dest="subparser"))

    def finish(ns: argparse.Namespace) -> None:
        command.validate(ns)
        ns.model = ns.model_tag or ns.model
        engine_args = AsyncEngineArgs.from_cli_args(ns)
        # The parser takes any string for these two; vLLM refuses an unknown one only after loading the
        # model's config (CacheConfig, ModelConfig), so ask the same registries now.
        if not is_known_kv_cache_dtype(engine_args.kv_cache_dtype):
            raise ValueError(f"--kv-cache-dtype {engine_args.kv_cache_dtype!r} is not one vLLM knows "
                             f"({', '.join(KV_CACHE_DTYPES)})")
        if engine_args.quantization not in (None, *QUANTIZATION_METHODS):
            raise ValueError(f"--quantization {engine_args.quantization!r} is not one vLLM knows "
                             f"({', '.join(QUANTIZATION_METHODS)})")

    def normalize(flag: str) -> str:
        # FlexibleArgumentParser: `_` reads as `-` before the first `.`; `--a.b` and `-cc.x` set fields of
        # `--a`; `-O3` and `-O 3` read as `--optimization-level 3`
        if flag.startswith("-O"):
            return "--optimization-level"
        base = flag.split(".", 1)[0]
        return base[:2] + base[2:].replace("_", "-") if base.startswith("--") else base

    return EngineParser("vllm", serve, lambda argv: top.parse_args(["serve", *argv]), finish, normalize)


PARSERS: dict[str, Callable[[], EngineParser]] = {"sglang": sglang_parser, "vllm": vllm_parser}


def check_argv(engine: EngineParser, argv: list[str]) -> tuple[list[str], list[str]]:
    """(problems, warnings) of one command line under the engine's parser."""
    problems: list[str] = []
    with _recording(engine.parser) as calls, _captured(engine.name) as (stderr, logged):
        try:
            engine.finish(engine.parse(list(argv)))
        except SystemExit:
            problems.append("rejected: " + _parser_error(stderr.getvalue()))
        except Exception as e:   # the launcher's own checks raise plain exceptions
            problems.append(f"rejected: {type(e).__name__}: {e}")
    if not problems:
        problems += _abbreviations(engine, argv) + _overwritten(calls)
    return problems, list(dict.fromkeys(logged))


def _parser_error(stderr: str) -> str:
    """argparse's message, from `error:` on, on one line (pydantic's messages span several)."""
    _, _, message = stderr.rpartition("error: ")
    lines = [line.strip() for line in (message or stderr).splitlines()]
    return "; ".join(line for line in lines if line and not line.startswith("For further information"))


def _abbreviations(engine: EngineParser, argv: list[str]) -> list[str]:
    known = engine.parser._option_string_actions
    out = []
    for word in argv:
        if not _FLAG.match(word):
            continue
        flag = engine.normalize(word.split("=", 1)[0])
        if flag in known or (flag[:2] in known and not flag.startswith("--")):   # -n2: value attached
            continue
        matches = sorted(o for o in known if o.startswith(flag))
        out.append(f"abbreviated: {flag} is accepted only as a prefix of {', '.join(matches)}; "
                   f"spell it out")
    return out


def _overwritten(calls: list[tuple[argparse.Action, list[str]]]) -> list[str]:
    given: dict[str, list[str]] = {}   # the action's first option -> raw values, in order
    for action, strings in calls:
        if action.option_strings and not isinstance(action, _ACCUMULATING):
            given.setdefault(action.option_strings[0], []).append(" ".join(strings) or "(bare)")
    return [f"overwritten: {option} given {len(values)} times ({'; '.join(map(_short, values))}); "
            f"only the last counts" for option, values in given.items() if len(set(values)) > 1]


def _short(text: str, limit: int = 100) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


@contextlib.contextmanager
def _recording(parser: argparse.ArgumentParser) -> Iterator[list[tuple[argparse.Action, list[str]]]]:
    """Every (action, raw strings) the parser consumes, in order.

    Overrides are invisible in the parsed namespace (the last value simply wins), and vLLM folds dotted
    fields into extra options before argparse sees them, so the strings are watched where argparse
    converts them (`ArgumentParser._get_values`, called once per consumed option).
    """
    calls: list[tuple[argparse.Action, list[str]]] = []
    convert = parser._get_values

    def record(action: argparse.Action, strings: list[str]) -> Any:
        calls.append((action, list(strings)))
        return convert(action, strings)

    parser._get_values = record   # type: ignore[method-assign]
    try:
        yield calls
    finally:
        del parser._get_values


@contextlib.contextmanager
def _captured(engine: str) -> Iterator[tuple[io.StringIO, list[str]]]:
    """The parser's stderr, and the warnings the engine logs or raises while parsing."""
    logged: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            logged.append("warning: " + re.sub(r"\x1b\[[0-9;]*m", "", record.getMessage()))

    handler = Collect(logging.WARNING)
    loggers = [logging.getLogger(), logging.getLogger(engine)]   # vLLM's logger does not propagate
    for logger in loggers:
        logger.addHandler(handler)
    stderr = io.StringIO()
    try:
        with warnings.catch_warnings(record=True) as raised, contextlib.redirect_stderr(stderr):
            warnings.simplefilter("always")
            yield stderr, logged
        logged += [f"warning: {w.message}" for w in raised]
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


def plan_entries(source: str, inventory: str, limit: str | None) -> list[dict[str, str]]:
    """{run_id, config, script} of every run: from a playbook, or a `harness plan --format json` file."""
    if source == "-" or source.endswith(".json"):
        text = sys.stdin.read() if source == "-" else Path(source).read_text()
        return json.loads(text)
    from harness.plan import load_sweep

    sweep = load_sweep(source, inventory, limit=limit)
    return [{"run_id": run.run_id, "config": run.config.name,
             "script": sweep.render(run, run.hosts[0]).script} for run in sweep.runs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source", help="a playbook, or a `harness plan --format json` file ('-': stdin)")
    ap.add_argument("-i", "--inventory", default="inventory.yaml", help="inventory (with a playbook)")
    ap.add_argument("--limit", help="hosts, as `harness plan --limit`")
    args = ap.parse_args(argv)
    parsers: dict[str, EngineParser] = {}
    failed = 0
    for entry in plan_entries(args.source, args.inventory, args.limit):
        engine, words = launch_argv(entry["script"])
        if engine not in parsers:
            parsers[engine] = PARSERS[engine]()
        problems, notes = check_argv(parsers[engine], words)
        failed += bool(problems)
        print(f"{'FAIL' if problems else 'OK'}  {entry['run_id']}  ({engine})")
        for line in problems + notes:
            print(f"  {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
