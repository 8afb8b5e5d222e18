"""Code that runs ON the GPU host, standard library only: the agent (`agent.py`), the benchmark
client (`bench.py`) and the torch.profiler wrapper (`torchprof.py`). They are uploaded once per
connection into a directory named by their content, read once per process, so every run of a sweep
uses exactly the same bytes.

The host is shared with other users: everything the harness writes there lives in the workdir, which
must be the SSH user's own and private (0700, owned by it, writable by no one else); otherwise anyone
on the host could replace the agent and run code as that user. `install` makes or checks it, resolves
it to an absolute path (a leading `~/` is the user's home there), uploads the tools and checks that
what landed is byte for byte what was sent.
"""

from __future__ import annotations

import hashlib
import shlex
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import harness
from harness.errors import RemoteError
from harness.transport.base import shell_path

FILES = ("agent.py", "bench.py", "torchprof.py")
DEFAULT_WORKDIR = "~/.cache/harness"
_OK, _FOREIGN, _OPEN = "__harness_workdir__", "__harness_workdir_foreign__", "__harness_workdir_open__"


@cache
def payload() -> dict[str, bytes]:
    here = Path(__file__).resolve().parent
    return {name: (here / name).read_bytes() for name in FILES}


def remote_dir(workdir: str) -> str:
    digest = hashlib.sha256(b"".join(payload().values())).hexdigest()[:12]
    return f"{workdir.rstrip('/')}/.harness/{harness.__version__}-{digest}"


@dataclass(frozen=True)
class Installed:
    workdir: str        # absolute, checked private
    tools: str          # where agent.py, bench.py and torchprof.py are
    home: str           # the SSH user's home there: what a leading `~/` of a host's paths means

    def resolve(self, path: str | None) -> str | None:
        """A host path with a leading `~/` made absolute (quoted paths keep `~` literally otherwise)."""
        if path and (path == "~" or path.startswith("~/")):
            return self.home.rstrip("/") + path[1:]
        return path


def private_workdir(transport, workdir: str, *, host: str) -> str:
    """The workdir as an absolute path, created 0700 when missing; refused when someone else owns it or
    others may write in it."""
    return _private(transport, workdir, host=host)[0]


def _private(transport, workdir: str, *, host: str) -> tuple[str, str]:
    d = shell_path(workdir)
    command = (f'mkdir -p -m 700 {d} && d=$(cd {d} && pwd -P) && owner=$(stat -c %u "$d") && '
               f'mode=$(stat -c %a "$d") && if [ "$owner" != "$(id -u)" ]; then '
               f'echo {_FOREIGN} "$(stat -c %U "$d")" "$d"; elif [ $((0$mode & 022)) -ne 0 ]; then '
               f'echo {_OPEN} "$mode" "$d"; else printf "home:%s\\n" "$HOME"; echo {_OK} "$d"; fi')
    out = transport.run(command, timeout=60).stdout.strip().splitlines()
    words = out[-1].split(" ", 2) if out else []
    if words[:1] == [_OK] and len(words) == 2 and len(out) >= 2 and out[-2].startswith("home:"):
        return words[1], out[-2].removeprefix("home:")   # "" when the host's environment has no HOME
    if words[:1] == [_FOREIGN]:
        raise RemoteError(f"the workdir {words[2]} belongs to {words[1]}, not to the SSH user: anyone who "
                          "owns it could replace the harness's agent. Choose a workdir of your own "
                          f"(`workdir:` in the inventory; default {DEFAULT_WORKDIR})", host=host, kind="preflight")
    if words[:1] == [_OPEN]:
        raise RemoteError(f"the workdir {words[2]} is writable by others (mode {words[1]}): they could "
                          f"replace the harness's agent. Make it private: chmod 700 {shlex.quote(words[2])}",
                          host=host, kind="preflight")
    raise RemoteError(f"could not make or check the workdir {workdir}", host=host, kind="preflight",
                      output="\n".join(out))


def install(transport, workdir: str, *, host: str = "") -> Installed:
    """Make sure of the workdir, upload the agent and the client under it and check what landed."""
    workdir, home = _private(transport, workdir, host=host)
    where = remote_dir(workdir)
    for name, data in payload().items():
        transport.put(data, f"{where}/{name}")
    sums = transport.run(f"cd {shlex.quote(where)} && sha256sum -- {' '.join(FILES)}", timeout=60).stdout
    landed = dict(reversed(line.split(None, 1)) for line in sums.splitlines() if line.strip())
    wrong = [n for n, data in payload().items() if landed.get(n, "").strip() != hashlib.sha256(data).hexdigest()]
    if wrong:
        raise RemoteError(f"the uploaded {', '.join(wrong)} in {where} differ from what was sent: something "
                          "on the host changed them; refusing to run them", host=host, kind="preflight")
    return Installed(workdir, where, home)
