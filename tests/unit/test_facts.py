"""Host facts: the snippet that collects them, run by a real bash, and the parsers that read them back."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.engines.base import Engine
from harness.facts import (
    Fact,
    agent_words,
    await_script,
    background_script,
    collect_script,
    facts_for,
    parse_facts,
)
from harness.remote import tool_command, zipapp
from tests.remote_venv import plant_distribution


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


def gated(tmp_path: Path, name: str = "slow") -> tuple[Fact, Path]:
    """A fact that writes `opened` once the test creates its gate file (`alone` after 30 s without)."""
    gate = tmp_path / f"{name}.gate"
    return Fact(name, f"for i in $(seq 300); do [ -e {shlex.quote(str(gate))} ] && {{ echo opened; exit 0; }}; "
                      "sleep 0.1; done; echo alone"), gate


def start(facts: list[Fact], folder: Path) -> str:
    """Start the collection as the preflight does, with a `wait` of the command's own after it: the
    command must end at once however long the collection takes (the gate stays shut for 30 s). The
    pid of the collection running afterwards (the command notes it before it ends)."""
    run(background_script(collect_script(facts, f"{folder}.tmp"), str(folder)) + "; wait")
    return Path(f"{folder}.pid").read_text().strip()


def test_the_collection_runs_apart_and_the_run_takes_the_facts_once_written(tmp_path):
    """The command that starts the collection ends before the collection does (were it waited for,
    `run` would time out: the gate stays shut until the command has ended); the run's copy then waits
    for it and takes every fact."""
    slow, gate = gated(tmp_path)
    folder, into = tmp_path / "host" / "facts", tmp_path / "run" / "facts"
    folder.parent.mkdir()
    into.mkdir(parents=True)
    start([slow, Fact("quick", "echo quick")], folder)
    assert not folder.exists()   # still collecting: the slow fact waits on the gate
    gate.touch()
    run(await_script(str(folder), str(into)))
    assert (into / "slow.txt").read_text() == "opened\n" and (into / "quick.txt").read_text() == "quick\n"
    assert sorted(p.name for p in folder.iterdir()) == ["quick.txt", "slow.txt"]
    assert not Path(f"{folder}.tmp").exists()


def test_a_collection_that_runs_is_not_started_again_and_one_that_died_is(tmp_path):
    slow, gate = gated(tmp_path)
    folder = tmp_path / "facts"
    first = start([slow], folder)
    assert start([slow], folder) == first      # it still runs: nothing started
    os.killpg(int(first), 9)                   # its own session and group: the host rebooted, the sweep was killed
    for _ in range(300):
        try:
            if "zombie" in Path(f"/proc/{first}/status").read_text():
                break
        except OSError:   # gone, reaped
            break
        time.sleep(0.1)
    assert Path(f"{folder}.tmp").is_dir() and not folder.exists()
    again = start([slow], folder)              # a dead one (a zombie too: some inits never reap) is started again
    assert again != first
    gate.touch()
    into = tmp_path / "run"
    into.mkdir()
    run(await_script(str(folder), str(into)))
    assert (into / "slow.txt").read_text() == "opened\n"
    assert start([slow], folder) == again      # done: nothing started


def test_a_collection_that_outlives_the_wait_leaves_the_run_what_it_wrote(tmp_path):
    """A fact that hangs (nvidia-smi on a broken driver) costs a run at most the wait; the facts written
    by then are the run's."""
    slow, gate = gated(tmp_path)
    folder, into = tmp_path / "facts", tmp_path / "run"
    into.mkdir()
    start([slow, Fact("quick", "echo quick")], folder)
    quick = Path(f"{folder}.tmp") / "quick.txt"
    for _ in range(300):
        if quick.exists() and quick.read_text():
            break
        time.sleep(0.1)
    run(await_script(str(folder), str(into), wait_s=0.2))   # `run` gives up after 60 s: the gate takes 30
    assert (into / "quick.txt").read_text() == "quick\n"
    assert (into / "slow.txt").read_text() == ""
    gate.touch()


def test_with_no_collection_the_run_takes_nothing_and_does_not_wait(tmp_path):
    into = tmp_path / "run"
    into.mkdir()
    run(await_script(str(tmp_path / "facts"), str(into), wait_s=3600))
    assert list(into.iterdir()) == []


def test_the_snippet_returns_only_once_every_fact_is_written(tmp_path):
    slow = Fact("slow", "sleep 0.5; echo finished")
    run(collect_script([slow, Fact("quick", "echo quick")], str(tmp_path)) + f"; cat {tmp_path}/slow.txt > "
        f"{tmp_path}/seen")
    assert Path(tmp_path / "seen").read_text() == "finished\n"


@pytest.fixture(scope="module")
def pyz(tmp_path_factory) -> Path:
    """The host tools as the harness uploads them."""
    path = tmp_path_factory.mktemp("tools") / "harness.pyz"
    path.write_bytes(zipapp())
    return path


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory) -> Path:
    """A venv without pip, as uv makes them unless seeded."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    return venv / "bin"


def agent_facts(pyz: Path, bin_dir: Path, site: Path, engine: Engine, tmp_path: Path) -> tuple[Path, dict]:
    """`collect_script` with the agent's `facts`, in the venv of `bin_dir` activated as a host's is
    (its bin first on PATH) with `site` on its path; the folder and its facts as parsed."""
    facts_dir = tmp_path / "facts"
    facts_dir.mkdir()
    facts = [f for f in facts_for(engine) if not f.command]
    agent = tool_command(str(bin_dir / "python"), str(pyz.parent), "agent", *agent_words(engine, str(facts_dir)))
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONPATH": str(site), "HOME": str(tmp_path)}
    subprocess.run(["bash", "-c", collect_script(facts, str(facts_dir), agent)], check=True, timeout=120,
                   env=env, cwd=tmp_path)
    return facts_dir, parse_facts(facts, facts_dir)


@pytest.mark.parametrize("installed", [True, False])
def test_the_engine_version_comes_from_its_metadata_and_the_import_only_without(tmp_path, pyz, bare_venv,
                                                                                   installed):
    """Importing a real engine for its version takes seconds beside the probe's own import; an engine
    installed with metadata is not imported, one on a bare path is (its __version__)."""
    site = tmp_path / "site"
    package = site / "fakeengine"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("import pathlib\npathlib.Path(__file__).with_name('imported').touch()\n"
                                         "__version__ = '2.0-from-import'\n")
    if installed:
        plant_distribution(site, "fakeengine", "1.2.3")
    engine = Engine(name="fake", launcher="", module="fakeengine", default_port=1, template="",
                    distribution="fakeengine")
    facts_dir, parsed = agent_facts(pyz, bare_venv, site, engine, tmp_path)
    assert parsed["engine_version"] == ("1.2.3" if installed else "2.0-from-import")
    assert (package / "imported").exists() is not installed
    assert parsed["python"] == "Python " + subprocess.run([bare_venv / "python", "-c", "import platform; "
                                                          "print(platform.python_version())"], capture_output=True,
                                                         text=True, check=True).stdout.strip()
    assert parsed["engine_git"] is None   # not a git checkout: git's complaint is kept, no commit
    assert "not a git repository" in (facts_dir / "engine_git.txt").read_text()
    assert not (facts_dir / "agent_facts.txt").exists()   # the agent had nothing to say


def test_an_engine_version_that_cannot_be_told_is_no_version_and_says_why(tmp_path, pyz, bare_venv):
    engine = Engine(name="fake", launcher="", module="no_such_engine_module", default_port=1, template="",
                    distribution="no-such-engine")
    facts_dir, parsed = agent_facts(pyz, bare_venv, tmp_path / "site", engine, tmp_path)
    assert parsed["engine_version"] is None
    assert "No module named 'no_such_engine_module'" in (facts_dir / "engine_version.txt").read_text()
    assert "no source file for no_such_engine_module" in (facts_dir / "engine_git.txt").read_text()
    assert parsed["python"].startswith("Python 3.")   # the other facts still came


def test_an_editable_engine_is_known_by_its_commit_and_its_local_changes(tmp_path, pyz, bare_venv):
    site = tmp_path / "checkout"
    (site / "fakeengine").mkdir(parents=True)
    (site / "fakeengine" / "__init__.py").write_text("__version__ = '0.1'\n")
    git = ["git", "-C", str(site), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "first"], check=True)
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    (site / "fakeengine" / "local.py").write_text("")
    engine = Engine(name="fake", launcher="", module="fakeengine", default_port=1, template="")
    _, parsed = agent_facts(pyz, bare_venv, site, engine, tmp_path)
    assert parsed["engine_git"] == {"commit": commit, "dirty": True}
    assert parsed["engine_version"] == "0.1"


@pytest.mark.parametrize("with_pip", [True, False], ids=["pip", "no-pip"])
def test_the_venvs_packages_are_listed_with_pip_or_without_it(tmp_path, pyz, bare_venv, with_pip):
    """A venv made by uv has no pip unless seeded: its packages are still listed, name==version, from
    the distributions Python finds, under a comment that says so."""
    site = tmp_path / "site"
    plant_distribution(site, "fakeengine", "1.2.3")
    bin_dir = Path(sys.executable).parent if with_pip else bare_venv   # the tests' own venv has pip
    engine = Engine(name="fake", launcher="", module="", default_port=1, template="")
    facts_dir, parsed = agent_facts(pyz, bin_dir, site, engine, tmp_path)
    listed = (facts_dir / "pip_freeze.txt").read_text()
    assert "fakeengine==1.2.3" in listed.splitlines()
    assert ("# no pip in this venv" in listed) is not with_pip
    assert "No module named pip" not in listed
    packages = [line for line in listed.splitlines() if line and not line.startswith("#")]
    assert len(packages) >= (10 if with_pip else 1)
    assert parsed["pip_freeze"] == f"{len(packages)} packages (facts/pip_freeze.txt)"
    assert sorted(p.name for p in facts_dir.iterdir()) == ["pip_freeze.txt", "python.txt"]   # no engine to ask


def test_an_agent_that_cannot_start_leaves_what_it_said_beside_the_other_facts(tmp_path):
    facts_dir = tmp_path / "facts"
    facts_dir.mkdir()
    facts = [Fact("kernel", "uname -s"), Fact("python", "")]
    run(collect_script(facts, str(facts_dir), "/no/such/python /no/such/harness.pyz agent facts"))
    assert (facts_dir / "kernel.txt").read_text() == "Linux\n"
    assert "/no/such/python" in (facts_dir / "agent_facts.txt").read_text()
    assert parse_facts(facts, facts_dir) == {"kernel": "Linux"}
