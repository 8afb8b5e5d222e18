"""Host facts: the snippet that collects them, run by a real bash, and the parsers that read them back."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from harness.facts import Fact, collect_script, parse_facts


def run(script: str) -> None:
    subprocess.run(["bash", "-c", script], check=True, timeout=60)


def test_every_fact_is_written_failures_included_into_a_folder_whose_name_needs_quoting(tmp_path):
    facts_dir = tmp_path / "a folder; with $(echo spaces)"
    facts_dir.mkdir()
    facts = [Fact("python", "echo 'Python 3.11.2'"),
             Fact("missing", "no-such-command-here"),
             Fact("lines", "printf 'x==1\\ny==2\\n'", lambda t: len(t.splitlines()))]
    run(collect_script(facts, str(facts_dir)))
    assert sorted(p.name for p in facts_dir.iterdir()) == ["lines.txt", "missing.txt", "python.txt"]
    assert "no-such-command-here" in (facts_dir / "missing.txt").read_text()   # the shell's complaint, kept
    assert parse_facts(facts, facts_dir) == {"python": "Python 3.11.2", "missing": (facts_dir / "missing.txt")
                                             .read_text().strip(), "lines": 2}


def test_the_facts_are_collected_at_once_not_one_after_another(tmp_path):
    """The first fact waits (up to 30 s) for a file that the last one writes: run one after another, it
    would give up waiting and say so."""
    mark = tmp_path / "mark"
    first = Fact("first", f"for i in $(seq 300); do [ -e {shlex.quote(str(mark))} ] && {{ echo saw it; exit 0; }}; "
                          "sleep 0.1; done; echo alone")
    last = Fact("last", f"touch {shlex.quote(str(mark))}; echo done")
    run(collect_script([first, Fact("middle", "true"), last], str(tmp_path)))
    assert (tmp_path / "first.txt").read_text() == "saw it\n"
    assert (tmp_path / "last.txt").read_text() == "done\n"


def test_what_comes_before_the_snippet_holds_for_every_fact(tmp_path):
    """The venv is activated in front of the snippet (`source activate && SNIPPET`): every fact runs in it."""
    facts = [Fact(name, "echo $IN_VENV") for name in ("a", "b", "c")]
    run("IN_VENV=no; f() { IN_VENV=yes; }; f && " + collect_script(facts, str(tmp_path)))
    assert [(tmp_path / f"{name}.txt").read_text() for name in "abc"] == ["yes\n"] * 3


def test_the_snippet_returns_only_once_every_fact_is_written(tmp_path):
    slow = Fact("slow", "sleep 0.5; echo finished")
    run(collect_script([slow, Fact("quick", "echo quick")], str(tmp_path)) + f"; cat {tmp_path}/slow.txt > "
        f"{tmp_path}/seen")
    assert Path(tmp_path / "seen").read_text() == "finished\n"
