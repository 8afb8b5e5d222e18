"""The host's tools as one zipapp: the same bytes on every build, every tool reachable through its
`__main__`, runnable by a bare Python in a folder of its own, uploaded and checked as one file."""

from __future__ import annotations

import ast
import hashlib
import io
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

import harness.remote as remote
from harness.errors import RemoteError
from harness.remote import PACKAGE, SHIPPED, TOOLS_KEPT_DAYS, ZIPAPP, install, remote_dir, tool_command, zipapp
from harness.transport.base import HostSpec
from harness.transport.local import LocalTransport

HERE = Path(remote.__file__).resolve().parent


@pytest.fixture
def pyz(tmp_path) -> Path:
    path = tmp_path / "tools" / ZIPAPP
    path.parent.mkdir()
    path.write_bytes(zipapp())
    return path


def run_isolated(pyz: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python -I` (no PYTHONPATH, no user site, not the current folder on the path) in a folder that
    holds nothing of the harness, with an environment that names nothing of it either."""
    return subprocess.run([sys.executable, "-I", str(pyz), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin"})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_bytes_depend_on_the_sources_alone():
    first, again = zipapp.__wrapped__(), zipapp.__wrapped__()
    assert first == again == zipapp()
    entries = zipfile.ZipFile(io.BytesIO(first)).infolist()
    names = [e.filename for e in entries]
    assert names == sorted(names) == sorted(["__main__.py", f"{PACKAGE}/__init__.py",
                                             *(f"{PACKAGE}/{n}" for n in SHIPPED)])
    assert {e.date_time for e in entries} == {(1980, 1, 1, 0, 0, 0)}
    assert {(e.compress_type, e.external_attr >> 16, e.create_system) for e in entries} == {
        (zipfile.ZIP_STORED, 0o100644, 3)}
    with zipfile.ZipFile(io.BytesIO(first)) as z:
        for name in SHIPPED:   # what ships is what the package holds, byte for byte
            assert z.read(f"{PACKAGE}/{name}") == (HERE / name).read_bytes()
    assert remote_dir("/w/") == f"/w/.harness/{remote.harness.__version__}-{hashlib.sha256(first).hexdigest()[:12]}"


def test_a_bare_python_in_a_clean_folder_answers_agent_probe(pyz, tmp_path):
    clean = tmp_path / "clean"
    clean.mkdir()
    port = free_port()
    done = run_isolated(pyz, "agent", "probe", "--module", "json", "--port", str(port), "--dir", str(clean),
                        cwd=clean)
    assert done.returncode == 0, done.stderr
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    assert probe["module_ok"] and probe["port_free"] and probe["python"] == sys.version.split()[0]
    assert list(clean.iterdir()) == []   # it wrote nothing beside itself


@pytest.mark.parametrize(("module", "marked"), [("json", True), ("no_such_engine_module", False)])
def test_the_probe_marks_the_host_only_when_the_engine_imports(pyz, tmp_path, module, marked):
    mark = tmp_path / "cache" / "module.ok"
    mark.parent.mkdir()
    done = run_isolated(pyz, "agent", "probe", "--module", module, "--imported", str(mark),
                        "--port", str(free_port()), "--dir", str(tmp_path / "run"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    assert probe["module_ok"] is marked and mark.exists() is marked
    if not marked:
        assert "no_such_engine_module" in probe["module_error"]


def test_a_mark_that_cannot_be_written_leaves_the_probe_whole(pyz, tmp_path):
    """The mark only spares later imports: where it cannot be made, the probe still answers."""
    mark = tmp_path / "gone" / "module.ok"
    done = run_isolated(pyz, "agent", "probe", "--module", "json", "--imported", str(mark),
                        "--port", str(free_port()), "--dir", str(tmp_path / "run"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["module_ok"] and not mark.exists()


def test_every_tool_is_reached_through_main(pyz, tmp_path):
    # the client against a port where nothing listens: a failed run (exit 3) with its own message
    out = tmp_path / "b" / "bench.json"
    bench = run_isolated(pyz, "bench", "--url", f"http://127.0.0.1:{free_port()}", "--model", "m",
                         "--requests", "1", "--warmup", "0", "--out", str(out), cwd=tmp_path)
    assert bench.returncode == 3 and "bench.py: no request completed" in bench.stderr, bench.stderr
    assert json.loads(out.read_text())["levels"][0]["failed"] == 1
    # torchprof runs the command it is given in its own process (its window waits for a .start)
    data = tmp_path / "in.json"
    data.write_text('{"a": [1, 2]}')
    prof = run_isolated(pyz, "torchprof", "--dir", str(tmp_path / "p"), "--", "-m", "json.tool", "--compact",
                        str(data), cwd=tmp_path)
    assert (prof.returncode, prof.stdout.strip()) == (0, '{"a":[1,2]}'), prof.stderr
    assert (tmp_path / "p").is_dir()
    # the agent's own argument errors, and a tool that does not exist
    assert run_isolated(pyz, "agent", "stop", cwd=tmp_path).stderr.startswith("usage: agent stop")
    for args, said in [(["nosuch"], "no tool named 'nosuch'"), ([], "name a tool")]:
        wrong = run_isolated(pyz, *args, cwd=tmp_path)
        assert wrong.returncode == 2 and said in wrong.stderr and "agent,bench,torchprof" in wrong.stderr


def copies(pyz: Path) -> list[str]:
    return sorted(p.name for p in pyz.parent.iterdir() if p.name.startswith(".harness_host-"))


def test_the_tools_run_from_a_copy_unpacked_beside_the_zipapp_where_their_bytecode_is_kept(pyz, tmp_path):
    probe = ("agent", "probe", "--port", str(free_port()), "--dir", str(tmp_path / "run"))
    first = run_isolated(pyz, *probe, cwd=tmp_path)
    assert first.returncode == 0 and json.loads(first.stdout)["port_free"], first.stderr
    [name] = copies(pyz)
    compiled = list((pyz.parent / name / PACKAGE / "__pycache__").glob("agent.*.pyc"))
    assert len(compiled) == 1   # imported from the copy, not from the zip (which keeps no bytecode)
    made = compiled[0].stat().st_mtime_ns
    again = run_isolated(pyz, *probe, cwd=tmp_path)
    assert again.returncode == 0 and json.loads(again.stdout)["port_free"], again.stderr
    assert copies(pyz) == [name] and compiled[0].stat().st_mtime_ns == made   # the same copy, not compiled again


def test_the_bytecode_is_kept_where_the_environment_says_to_write_none(pyz, tmp_path):
    """Container images often set PYTHONDONTWRITEBYTECODE: the copy is the harness's own, so it keeps
    the tools' bytecode regardless (the real H200 image sets it)."""
    done = subprocess.run([sys.executable, str(pyz), "agent", "stop"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"})
    assert done.stderr.startswith("usage: agent stop")
    [name] = copies(pyz)
    assert list((pyz.parent / name / PACKAGE / "__pycache__").glob("agent.*.pyc"))
    # what a tool runs in its own process (torchprof: the engine's server) keeps the host's setting
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "server.py").write_text("import helper\nprint(helper.ANSWER)\n")
    (engine / "helper.py").write_text("ANSWER = 42\n")
    ran = subprocess.run([sys.executable, str(pyz), "torchprof", "--dir", str(tmp_path / "p"), "--", "-m", "server"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(engine)})
    assert (ran.returncode, ran.stdout.strip()) == (0, "42"), ran.stderr
    assert not (engine / "__pycache__").exists()


def test_a_zipapp_with_other_bytes_gets_a_copy_of_its_own(pyz, tmp_path):
    assert run_isolated(pyz, "agent", "stop", cwd=tmp_path).stderr.startswith("usage: agent stop")
    changed = io.BytesIO()
    with zipfile.ZipFile(pyz) as old, zipfile.ZipFile(changed, "w") as new:
        for entry in old.infolist():
            data = old.read(entry)
            if entry.filename == f"{PACKAGE}/__main__.py":
                data = b"TOOLS = ()\n\ndef main():\n    print('the other bytes')\n    return 0\n"
            new.writestr(entry, data)
    pyz.write_bytes(changed.getvalue())
    done = run_isolated(pyz, "agent", "stop", cwd=tmp_path)
    assert (done.returncode, done.stdout) == (0, "the other bytes\n"), done.stderr
    assert len(copies(pyz)) == 2


def test_where_no_copy_can_be_made_the_tools_run_from_the_zip(pyz, tmp_path):
    run_isolated(pyz, "agent", "stop", cwd=tmp_path)
    [name] = copies(pyz)
    shutil.rmtree(pyz.parent / name)
    (pyz.parent / name).write_text("in the way")   # a file where the copy would go: it cannot be renamed there
    done = run_isolated(pyz, "agent", "probe", "--port", str(free_port()), "--dir", str(tmp_path / "run"),
                        cwd=tmp_path)
    assert done.returncode == 0 and json.loads(done.stdout)["port_free"], done.stderr
    assert [p.name for p in pyz.parent.iterdir() if ".part-" in p.name] == []   # the half-made copy removed


def test_tools_starting_at_once_on_a_fresh_host_share_one_whole_copy(pyz, tmp_path):
    starts = [subprocess.Popen([sys.executable, "-I", str(pyz), "agent", "probe", "--port", str(free_port()),
                                "--dir", str(tmp_path / f"run{i}")], cwd=tmp_path, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env={"PATH": "/usr/bin:/bin"}) for i in range(6)]
    for start in starts:
        out, err = start.communicate(timeout=120)
        assert start.returncode == 0 and json.loads(out)["port_free"], err
    assert len(copies(pyz)) == 1


def test_the_command_line_quotes_every_word_and_runs(tmp_path):
    tools = tmp_path / "it's a $(dir)"
    tools.mkdir()
    (tools / ZIPAPP).write_bytes(zipapp())
    command = tool_command(sys.executable, str(tools), "agent", "probe", "--port", free_port(), "--dir", tools)
    assert shlex.split(command)[:4] == [sys.executable, f"{tools}/{ZIPAPP}", "agent", "probe"]
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    assert json.loads(done.stdout)["port_free"], done.stderr


def test_what_ships_runs_on_the_oldest_python_a_host_has_and_imports_only_the_standard_library():
    for name in (*SHIPPED, "_bootstrap.py"):   # the last is the zipapp's __main__.py
        tree = ast.parse((HERE / name).read_text(), name, feature_version=(3, 9))
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module.split(".")[0] for n in ast.walk(tree)
                     if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module}
        ours = {"torch", PACKAGE}   # torch only where the engine has it; the package is the zipapp's own
        assert imported - ours <= sys.stdlib_module_names, f"{name} imports {imported - sys.stdlib_module_names}"
        relative = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level]
        siblings = {n.module or a.name for n in relative for a in n.names}   # `from .x import` or `from . import x`
        assert {f"{s}.py" for s in siblings} <= set(SHIPPED), f"{name} imports a module that does not ship"


def test_the_shipped_modules_say_why_they_exist_and_import_one_another_without_a_cycle():
    """Each room of the host's tools opens with its docstring, and following their imports of one another
    never leads back to where it started (a cycle would make their order of import matter)."""
    imports: dict[str, set[str]] = {}
    for name in SHIPPED:
        tree = ast.parse((HERE / name).read_text(), name)
        assert ast.get_docstring(tree), f"{name} has no docstring"
        relative = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level]
        imports[name] = {f"{n.module or a.name}.py" for n in relative for a in n.names}
    assert imports["stats.py"] == set() and imports["exchange.py"] == set()
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"an import cycle: {' -> '.join((*path, name))}"
        if name not in done:
            for other in imports[name]:
                visit(other, (*path, name))
            done.add(name)

    for name in SHIPPED:
        visit(name, ())


def test_the_statistics_need_no_client():
    """reproduce and the bench table use the statistics without loading the socket client."""
    done = subprocess.run([sys.executable, "-c", "import sys, harness.reproduce, harness.report.bench_view, "
                           "harness.report.compare; print(sorted(m for m in sys.modules if m.startswith("
                           "('harness.remote.', 'socket', 'selectors', 'ssl'))))"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = set(json.loads(done.stdout.replace("'", '"')))
    assert {m for m in loaded if m.startswith("harness.remote.")} == {"harness.remote.stats",
                                                                       "harness.remote.exposition",
                                                                       "harness.remote.names"}
    for name, allowed in (("stats.py", {"__future__", "math", "collections.abc"}), ("names.py", set()),
                          ("exposition.py", {"__future__", "csv", "math", "re", "typing"})):
        tree = ast.parse((HERE / name).read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert imported <= allowed, name


class Tampering(LocalTransport):
    """A host where something changes what it is sent on its way in."""

    def run(self, command: str, *, timeout: float, check: bool = True, stdin: bytes | None = None):
        if stdin:
            stdin = stdin[:-1] + bytes([stdin[-1] ^ 1])
        return super().run(command, timeout=timeout, check=check, stdin=stdin)


def test_install_uploads_one_file_in_one_command_and_refuses_one_that_changed_on_the_way(tmp_path):
    work = tmp_path / "work"
    commands = []

    class Counting(LocalTransport):
        def run(self, command, **kwargs):
            commands.append(command)
            return super().run(command, **kwargs)

    installed = install(Counting(HostSpec("h", transport="local")), str(work), host="h")
    assert len(commands) == 1   # the workdir's check, the upload and its sha256: one round trip
    assert installed.tools == remote_dir(str(work.resolve()))
    assert sorted(p.name for p in Path(installed.tools).iterdir()) == [ZIPAPP]
    assert (Path(installed.tools) / ZIPAPP).read_bytes() == zipapp()
    with pytest.raises(RemoteError, match=f"the uploaded {ZIPAPP} in .* differs from what was sent") as e:
        install(Tampering(HostSpec("h", transport="local")), str(work), host="h")
    assert (e.value.host, e.value.kind) == ("h", "preflight")
    # the host itself kept the changed bytes out of the tools' place: what landed before stays, alone
    assert sorted(p.name for p in Path(installed.tools).iterdir()) == [ZIPAPP]
    assert (Path(installed.tools) / ZIPAPP).read_bytes() == zipapp()


def test_install_removes_other_versions_tools_once_unused_for_their_time(tmp_path):
    work = tmp_path / "work"
    old, recent = work / ".harness" / "0.0.1-aaaaaaaaaaaa", work / ".harness" / "0.0.2-bbbbbbbbbbbb"
    for folder in (old, recent):
        folder.mkdir(parents=True)
        (folder / ZIPAPP).write_bytes(b"older tools")
    long_ago = time.time() - (TOOLS_KEPT_DAYS + 2) * 86400
    os.utime(old, (long_ago, long_ago))
    os.utime(recent, (time.time() - 86400,) * 2)
    work.chmod(0o700)
    installed = install(LocalTransport(HostSpec("h", transport="local")), str(work), host="h")
    assert sorted(p.name for p in (work / ".harness").iterdir()) == sorted([recent.name, Path(installed.tools).name])
    # its own folder, however old, is renewed by the install itself
    os.utime(installed.tools, (long_ago, long_ago))
    install(LocalTransport(HostSpec("h", transport="local")), str(work), host="h")
    assert Path(installed.tools, ZIPAPP).read_bytes() == zipapp()


def test_install_says_when_the_zipapp_cannot_be_written(tmp_path):
    work = tmp_path / "work"
    work.mkdir(mode=0o700)
    (work / ".harness").write_text("a file where the tools' folder goes")
    with pytest.raises(RemoteError, match=f"could not write {ZIPAPP} into .*/.harness/") as e:
        install(LocalTransport(HostSpec("h", transport="local")), str(work), host="h")
    assert (e.value.host, e.value.kind) == ("h", "preflight")
