"""The launch commands the templates render are pinned in golden files, so a template change that
alters a command shows up in review; `benchmarks/check_engine_flags.py`, which parses those commands
with the real engines' parsers, keeps working.

After an intended change: HARNESS_UPDATE_GOLDEN=1 pytest tests/unit/test_rendered_commands.py
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import sys
from pathlib import Path

import pytest

from harness.config.playbook import load_playbook
from harness.plan import load_sweep
from harness.sim.flags import sglang_parser

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden"
PLAYBOOKS = [REPO / "playbooks" / "tp_vs_ep.yaml", GOLDEN / "vllm_flags.yaml"]
UPDATE = os.environ.get("HARNESS_UPDATE_GOLDEN") == "1"
# planning touches no host: the address is never contacted
INVENTORY = """\
all:
  vars: {workdir: /srv/harness}
  children:
    gpu:
      vars: {venv: /opt/engine-venv}
      hosts: {gpu-01: {address: 192.0.2.1}}
"""
CASES = [(pb, config.name) for pb in PLAYBOOKS for config in load_playbook(pb)[0].configs]


def _load_checker():
    path = REPO / "benchmarks" / "check_engine_flags.py"
    spec = importlib.util.spec_from_file_location("check_engine_flags", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


checker = _load_checker()


@pytest.fixture(scope="module")
def scripts(tmp_path_factory) -> dict[tuple[str, str], str]:
    """(playbook stem, config) -> the launch script of its first run."""
    inventory = tmp_path_factory.mktemp("inventory") / "inventory.yaml"
    inventory.write_text(INVENTORY)
    out = {}
    for playbook in PLAYBOOKS:
        sweep = load_sweep(playbook, inventory, sweep_id="golden")
        for run in sweep.runs:
            out.setdefault((playbook.stem, run.config.name), sweep.render(run, run.hosts[0]).script)
    return out


def golden_text(script: str) -> str:
    """The `exec` command as a shell command: the launcher, then one flag and its values a line."""
    words = checker.exec_words(script)
    argv = checker.launch_argv(script)[1]
    lines = [words[:len(words) - len(argv)]]
    for word in argv:
        if checker._FLAG.match(word):
            lines.append([])
        lines[-1].append(word)
    return " \\\n  ".join(shlex.join(line) for line in lines) + "\n"


def golden_path(playbook: Path, config: str) -> Path:
    return GOLDEN / f"{playbook.stem}.{config}.txt"


@pytest.mark.parametrize("playbook, config", CASES, ids=[f"{p.stem}.{c}" for p, c in CASES])
def test_each_rendered_command_matches_its_golden_file(scripts, playbook, config):
    text = golden_text(scripts[playbook.stem, config])
    path = golden_path(playbook, config)
    if UPDATE:
        path.write_text(text)
    assert path.is_file(), f"{path.name} is missing: run with HARNESS_UPDATE_GOLDEN=1"
    assert text == path.read_text(), "the rendered command changed: if intended, HARNESS_UPDATE_GOLDEN=1"


def test_every_golden_file_belongs_to_a_rendered_configuration():
    expected = {golden_path(p, c).name for p, c in CASES}
    stale = sorted(p.name for p in GOLDEN.glob("*.txt") if p.name not in expected)
    if UPDATE:
        for name in stale:
            (GOLDEN / name).unlink()
        stale = []
    assert stale == []


def test_the_argv_after_the_launcher_is_found_behind_an_nsys_prefix():
    script = ("#!/usr/bin/env bash\nexec nsys profile --trace-fork-before-exec=true \\\n"
              "  --capture-range-end=stop -o /w/p python -m sglang.launch_server --model-path '/m/a b' --tp-size 8\n")
    assert checker.launch_argv(script) == ("sglang", ["--model-path", "/m/a b", "--tp-size", "8"])


def test_every_golden_command_names_the_engine_of_its_playbook(scripts):
    for (stem, _), script in scripts.items():
        engine, argv = checker.launch_argv(script)
        assert engine == {"tp_vs_ep": "sglang", "vllm_flags": "vllm"}[stem] and argv


# The checker's rules, exercised with the simulator's parser (plain argparse, like SGLang's) as the
# engine: the real engines are not installed here.

@pytest.fixture
def sim_sglang():
    parser = sglang_parser()
    return checker.EngineParser("sglang", parser, parser.parse_args, lambda ns: ns)


def test_the_checker_passes_every_golden_sglang_command(scripts, sim_sglang):
    for (stem, config), script in scripts.items():
        if stem == "tp_vs_ep":
            assert checker.check_argv(sim_sglang, checker.launch_argv(script)[1]) == ([], []), config


def test_the_checker_reports_an_unknown_flag_in_the_parsers_own_words(sim_sglang):
    problems, _ = checker.check_argv(sim_sglang, ["--model-path", "m", "--enable-piecewise-cuda-graph"])
    assert problems == ["rejected: unrecognized arguments: --enable-piecewise-cuda-graph"]


def test_the_checker_reports_a_list_rendered_as_a_repeated_flag_as_overwritten(sim_sglang):
    argv = ["--model-path", "m", "--cuda-graph-bs-decode", "1", "--cuda-graph-bs-decode", "8"]
    problems, _ = checker.check_argv(sim_sglang, argv)
    assert problems == ["overwritten: --cuda-graph-bs-decode given 2 times (1; 8); only the last counts"]


def test_the_checker_reports_a_flag_that_works_only_as_an_abbreviation(sim_sglang):
    problems, _ = checker.check_argv(sim_sglang, ["--model-path", "m", "--tp", "8"])
    assert problems == ["abbreviated: --tp is accepted only as a prefix of --tp-size; spell it out"]


def test_the_checker_leaves_the_parser_as_it_found_it(sim_sglang):
    checker.check_argv(sim_sglang, ["--model-path", "m"])
    assert "_get_values" not in vars(sim_sglang.parser)
