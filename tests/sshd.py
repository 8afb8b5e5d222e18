"""A real OpenSSH server on a loopback port, for end-to-end tests.

Nothing is mocked: `ssh-keygen` makes a host key and a client key in a temporary directory, and
`/usr/sbin/sshd -D` serves 127.0.0.1 on a free port with a config that trusts only that client key.
The known_hosts file pins the host key, so the client under test verifies it exactly as it would a
real GPU host. `freeze()` SIGSTOPs the server and its session processes: a peer that holds the TCP
connection open but never answers, the failure that keepalives do not detect (paramiko #2463).

    with Sshd(tmp_path) as sshd:
        transport = connect(sshd.host_spec())

`address`, `port` and `prefix` serve another address under a command prefix: tests/netns.py runs
one inside each network namespace (`prefix=["ip", "netns", "exec", NS]`) on port 22.

A missing sshd is an error, never a skip: CI installs openssh-server and must run these tests.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from harness.transport.base import HostSpec

SSHD = "/usr/sbin/sshd"
START_TIMEOUT_S = 10.0


class Sshd:
    """One sshd process serving address:port; a context manager that stops it on exit."""

    def __init__(self, directory: Path | str | None = None, *, address: str = "127.0.0.1",
                 port: int | None = None, prefix: Sequence[str] = (), env: dict[str, str] | None = None):
        """`port` None: a free loopback port. `prefix` runs sshd under a command that then execs it.
        `env`: set in every session (sshd's SetEnv), e.g. where a login host's Slurm config is."""
        self._env = dict(env or {})
        if not Path(SSHD).exists():
            raise RuntimeError(f"{SSHD} is missing: install openssh-server (apt-get install openssh-server)")
        self._own_dir = directory is None
        self.dir = Path(directory or tempfile.mkdtemp(prefix="sshd-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.user = getpass.getuser()
        self.address = address
        self._fixed_port = port
        self._prefix = list(prefix)
        self.host_key = self._keygen("host_key")
        self.client_key = self._keygen("client_key")
        (self.dir / "authorized_keys").write_text(Path(f"{self.client_key}.pub").read_text())
        self.known_hosts = self.dir / "known_hosts"
        self.log = self.dir / "sshd.log"
        self.port = 0
        self._proc: subprocess.Popen | None = None

    def _keygen(self, name: str) -> Path:
        path = self.dir / name
        if not path.exists():
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(path)],
                           check=True)
        return path

    def start(self) -> Sshd:
        # sshd refuses to start without its privilege-separation directory.
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        for _ in range(3):  # a free port can be taken between probing and binding: try another
            self.port = self._fixed_port or _free_port()
            config = self.dir / "sshd_config"
            config.write_text(self._config())
            with open(self.log, "ab") as log:
                self._proc = subprocess.Popen([*self._prefix, SSHD, "-D", "-e", "-f", str(config)],
                                              stdin=subprocess.DEVNULL, stdout=log, stderr=log)
            if self._wait_listening():
                public = Path(f"{self.host_key}.pub").read_text().split()
                self.known_hosts.write_text(f"{self.known_hosts_name} {public[0]} {public[1]}\n")
                return self
        raise RuntimeError(f"sshd did not start; its log:\n{self.log.read_text()[-4000:]}")

    def _config(self) -> str:
        lines = [
            f"Port {self.port}",
            f"ListenAddress {self.address}",
            f"HostKey {self.host_key}",
            f"AuthorizedKeysFile {self.dir / 'authorized_keys'}",
            f"PidFile {self.dir / 'sshd.pid'}",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "PubkeyAuthentication yes",
            "StrictModes no",
            "UsePAM no",
            "PermitRootLogin yes",
            "AllowTcpForwarding yes",
            "MaxStartups 100",
            "MaxSessions 100",
            "LogLevel VERBOSE",
            "Subsystem sftp internal-sftp",
        ]
        lines += [f"SetEnv {name}={value}" for name, value in self._env.items()]
        if _sshd_version() >= (9, 8):
            # Since 9.8 sshd blocks a source address after failed logins; tests fail logins on purpose.
            lines.append("PerSourcePenalties no")
        return "\n".join(lines) + "\n"

    def _wait_listening(self) -> bool:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return False
            try:
                socket.create_connection((self.address, self.port), timeout=1).close()
                return True
            except OSError:
                time.sleep(0.05)
        self.stop()
        return False

    @property
    def known_hosts_name(self) -> str:
        """How known_hosts names this server: the bare address on port 22, else [address]:port."""
        return self.address if self.port == 22 else f"[{self.address}]:{self.port}"

    @property
    def pid(self) -> int:
        assert self._proc is not None, "sshd is not started"
        return self._proc.pid

    def host_spec(self, name: str = "sshd-test", **overrides) -> HostSpec:
        """A HostSpec that reaches this server with the pinned host key and the authorized client key."""
        fields = dict(name=name, address=self.address, port=self.port, user=self.user,
                      identity_file=str(self.client_key), known_hosts=str(self.known_hosts),
                      connect_timeout=5.0)
        fields.update(overrides)
        return HostSpec(**fields)

    def _processes(self) -> list[int]:
        """The listener and every sshd process below it (one per connection, since OpenSSH forks)."""
        children: dict[int, list[int]] = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        found, todo = [], [self.pid]
        while todo:
            pid = todo.pop()
            found.append(pid)
            todo.extend(c for c in children.get(pid, []) if _comm(c).startswith("sshd"))
        return found

    def freeze(self) -> None:
        """SIGSTOP the listener and its sessions: connections stay open and nothing answers."""
        for pid in self._processes():
            _signal(pid, signal.SIGSTOP)

    def thaw(self) -> None:
        for pid in self._processes():
            _signal(pid, signal.SIGCONT)

    def stop(self) -> None:
        if self._proc is None:
            return
        processes = self._processes()
        for pid in processes:
            _signal(pid, signal.SIGKILL)
        self._proc.wait(timeout=10)
        self._proc = None

    def __enter__(self) -> Sshd:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _sshd_version() -> tuple[int, int]:
    out = subprocess.run([SSHD, "-V"], capture_output=True, text=True).stderr
    match = re.search(r"OpenSSH_(\d+)\.(\d+)", out)
    return (int(match[1]), int(match[2])) if match else (0, 0)
