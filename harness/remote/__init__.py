"""Code that runs ON the GPU host, standard library only: the agent (`agent.py`), the benchmark
client (`bench.py`, its front, and its rooms `exchange.py`, `loop.py`, `workload.py`, `levels.py` and
`maxload.py`: bench.py's docstring says which holds what) and its statistics (`stats.py`), the
telemetry sampler (`telemetry.py`) and the text formats it reads (`exposition.py`), the torch.profiler
wrapper (`torchprof.py`), and the `__main__.py` that dispatches to them. They ship as one zipapp,
`harness.pyz`, built here in memory with bytes that depend on those sources alone, uploaded once per
connection into a directory named by its sha256, so every run of a sweep uses exactly the same bytes.
Its `__main__.py` (`_bootstrap.py`) unpacks it once beside itself, so that the host's Python keeps
the tools' bytecode instead of compiling them at every start.
`tool_command` is the one way to build a command line that runs a tool there:
`PYTHON TOOLS/harness.pyz agent probe ...`.
"""

from __future__ import annotations

import hashlib
import io
import shlex
import stat
import zipfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import harness
from harness.errors import Kind, RemoteError
from harness.transport.base import shell_path

ZIPAPP = "harness.pyz"
PACKAGE = "harness_host"   # the tools' package inside the zipapp: a name no engine's import can meet
SHIPPED = ("__main__.py", "agent.py", "bench.py", "exchange.py", "exposition.py", "levels.py", "loop.py", "maxload.py",
           "names.py", "stats.py", "telemetry.py", "torchprof.py", "workload.py")
DEFAULT_WORKDIR = "~/.cache/harness"
_OK, _FOREIGN, _OPEN = "__harness_workdir__", "__harness_workdir_foreign__", "__harness_workdir_open__"
_SUM = "__harness_sha256__:"
_EPOCH = (1980, 1, 1, 0, 0, 0)   # the earliest time a zip entry can carry: one for every entry
_INIT = b'"""The tools of the harness on a GPU host (agent, bench, telemetry, torchprof), shipped as one zipapp."""\n'


@cache
def zipapp() -> bytes:
    """The zipapp's bytes: the shipped modules as the package `harness_host`, and a `__main__.py`
    (`_bootstrap.py`) that runs its dispatcher from the unpacked copy. They depend on the sources alone
    (entries sorted, one fixed timestamp and mode, stored uncompressed: another zlib could compress the
    same bytes differently), so the sha256 that names the remote directory is the same on every machine
    with this harness."""
    here = Path(__file__).resolve().parent
    files = {"__main__.py": (here / "_bootstrap.py").read_bytes(), f"{PACKAGE}/__init__.py": _INIT}
    files |= {f"{PACKAGE}/{name}": (here / name).read_bytes() for name in SHIPPED}
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for name in sorted(files):
            entry = zipfile.ZipInfo(name, date_time=_EPOCH)
            entry.create_system = 3   # Unix, so the mode below is read as one
            entry.external_attr = (stat.S_IFREG | 0o644) << 16
            z.writestr(entry, files[name])
    return out.getvalue()


def remote_dir(workdir: str) -> str:
    return f"{workdir.rstrip('/')}/{_tools_subdir()}"


def _tools_subdir() -> str:
    """Where the tools live under a workdir: named by this harness's version and the zipapp's sha256."""
    return f".harness/{harness.__version__}-{hashlib.sha256(zipapp()).hexdigest()[:12]}"


def tool_words(tools_dir: str, tool: str, *args: str | int | float) -> str:
    """`TOOLS/harness.pyz TOOL ARGS...`, every word quoted: what follows a Python on the command line."""
    return shlex.join([f"{tools_dir}/{ZIPAPP}", tool, *map(str, args)])


def tool_command(python: str, tools_dir: str, tool: str, *args: str | int | float) -> str:
    """The command line that runs one tool (`agent`, `bench`, `torchprof`) on the host with `python`:
    `PYTHON TOOLS/harness.pyz TOOL ARGS...`, every word quoted."""
    return f"{shlex.quote(python)} {tool_words(tools_dir, tool, *args)}"


@dataclass(frozen=True)
class Installed:
    workdir: str        # absolute, checked private
    tools: str          # the directory that holds harness.pyz
    home: str           # the SSH user's home there: what a leading `~/` of a host's paths means

    def resolve(self, path: str | None) -> str | None:
        """A host path with a leading `~/` made absolute (quoted paths keep `~` literally otherwise)."""
        if path and (path == "~" or path.startswith("~/")):
            return self.home.rstrip("/") + path[1:]
        return path


def private_workdir(transport, workdir: str, *, host: str) -> str:
    """The workdir as an absolute path, created 0700 when missing; refused when someone else owns it or
    others may write in it."""
    return _private(workdir, host=host, out=transport.run(_private_script(workdir), timeout=60).stdout)[0]


def _private_script(workdir: str, then: str = "") -> str:
    """Check (or make) the workdir; in it `$d` is the workdir's absolute path, and `then` runs only when
    it is ours and private."""
    d = shell_path(workdir)
    return (f'mkdir -p -m 700 {d} && d=$(cd {d} && pwd -P) && owner=$(stat -c %u "$d") && '
            f'mode=$(stat -c %a "$d") && if [ "$owner" != "$(id -u)" ]; then '
            f'echo {_FOREIGN} "$(stat -c %U "$d")" "$d"; elif [ $((0$mode & 022)) -ne 0 ]; then '
            f'echo {_OPEN} "$mode" "$d"; else printf "home:%s\\n" "$HOME"; echo {_OK} "$d"; {then or "true"}; fi')


def _private(workdir: str, *, host: str, out: str) -> tuple[str, str]:
    """The absolute workdir and the home that `_private_script` printed, or the reason it is refused."""
    lines = out.strip().splitlines()
    ok = next((i for i, line in enumerate(lines) if line.startswith(_OK + " ")), None)
    if ok is not None and ok >= 1 and lines[ok - 1].startswith("home:"):
        return lines[ok].split(" ", 1)[1], lines[ok - 1].removeprefix("home:")   # "" without HOME
    words = lines[-1].split(" ", 2) if lines else []
    if words[:1] == [_FOREIGN] and len(words) == 3:
        raise RemoteError(f"the workdir {words[2]} belongs to {words[1]}, not to the SSH user: anyone who "
                          "owns it could replace the harness's agent. Choose a workdir of your own "
                          f"(`workdir:` in the inventory; default {DEFAULT_WORKDIR})", host=host, kind=Kind.PREFLIGHT)
    if words[:1] == [_OPEN] and len(words) == 3:
        raise RemoteError(f"the workdir {words[2]} is writable by others (mode {words[1]}): they could "
                          f"replace the harness's agent. Make it private: chmod 700 {shlex.quote(words[2])}",
                          host=host, kind=Kind.PREFLIGHT)
    raise RemoteError(f"could not make or check the workdir {workdir}", host=host, kind=Kind.PREFLIGHT,
                      output="\n".join(lines))


TOOLS_KEPT_DAYS = 30
"""Tools of other harness versions are removed from a host once unused this long: each install of a
version renews its folder's time (the zipapp is moved into it), so a sweep still running keeps its own."""
_PRUNE = (f'find "$d/.harness" -mindepth 1 -maxdepth 1 -type d -mtime +{TOOLS_KEPT_DAYS} '
          '-exec rm -rf {} + 2>/dev/null; true')


def install(transport, workdir: str, *, host: str = "") -> Installed:
    """Make sure of the workdir, upload the zipapp under it and check what landed, in one command.

    The zipapp comes on stdin into a 0600 temporary file beside its place, which it takes only when
    its sha256 on the host is the one sent; the host's sha256 is checked here too. Whatever stdin a
    refused workdir leaves unread is drained, so the command ends the same way on every host. Tools
    that no install has renewed for TOOLS_KEPT_DAYS are removed on the way."""
    data = zipapp()
    digest = hashlib.sha256(data).hexdigest()
    # The sum is printed once the file is in its place, or when it differs (and the file is dropped).
    # mktemp: a name no other upload takes, on this host or another sharing the workdir (NFS homes)
    upload = (f'w="$d"/{shlex.quote(_tools_subdir())} && mkdir -p "$w" && t=$(mktemp "$w/{ZIPAPP}.tmp-XXXXXXXX") && '
              f'(umask 077 && cat > "$t") && chmod 644 "$t" && s=$(sha256sum < "$t") && s=${{s%% *}} && '
              f'if [ "$s" = {digest} ]; then mv -f "$t" "$w"/{ZIPAPP} && echo "{_SUM}$s"; '
              f'else rm -f "$t"; echo "{_SUM}$s"; fi; {_PRUNE}')
    out = transport.run(f"{{ {_private_script(workdir, upload)}; }}; cat > /dev/null", stdin=data,
                        timeout=60 + len(data) / 1e6).stdout
    workdir, home = _private(workdir, host=host, out=out)
    where = remote_dir(workdir)
    landed = [line.removeprefix(_SUM) for line in out.splitlines() if line.startswith(_SUM)]
    if landed != [digest]:
        raise RemoteError(f"the uploaded {ZIPAPP} in {where} differs from what was sent: something on the "
                          "host changed it; refusing to run it" if landed else
                          f"could not write {ZIPAPP} into {where} (a full disk, or a read-only one?)",
                          host=host, kind=Kind.PREFLIGHT, output=out[-2000:])
    return Installed(workdir, where, home)
