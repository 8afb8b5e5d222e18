"""The SSH transport: one verified connection per object, commands on raw exec channels.

Built on fabric's `Connection` for what it does well (reading ~/.ssh/config: HostName, Port, User,
IdentityFile, ProxyJump, ProxyCommand; gateways) and on paramiko channels for the rest, because the
traps are in the layers between (docs/reliability.md):

- fabric accepts any host key (fabric #2071): each client loads the known_hosts file and rejects
  unknown keys with the command that pins them; a changed key is refused and never retried.
- keepalives do not notice a frozen peer (paramiko #2463) and `Channel.exec_command` waits for the
  server's reply without a timeout: every wait here has a deadline, and a watchdog closes the
  connection if a paramiko call is still blocked after it. The next call reconnects.
- `Connection.run(timeout=...)` leaves the remote command running, and without a pty nothing is
  signalled when a channel closes: each command runs under coreutils `timeout` (its own process
  group, killed by the host itself a little after our deadline, even if we have lost the link),
  prints that group's id first on a line of its own (whatever a login script printed before it is
  dropped with it), and on our deadline we kill the group over a second channel.
- files go up through the same exec channel (`cat > tmp && chmod && mv`), not SFTP: nothing to
  share between threads (paramiko #718), works where the sftp subsystem is off, atomic, one round trip.
- every exec channel costs a login shell, and bash run by sshd reads ~/.bashrc whatever the command
  (0.2 s a command on a host with pyenv; conda takes longer): each connection starts one command
  starter on the host (harness/remote/mux.py, `python3 -c`) and sends it the commands, wrapped as they
  would be on an exec channel (a group of their own, the host's own timer), one at a time. A command
  that cannot take it (another one is running: a kill) takes an exec channel; so does a lasting one
  (a Slurm step, which may hold a server past its command's end), and every command of a host
  without python3, or with HARNESS_SSH_MUX=0.
"""

from __future__ import annotations

import ast
import binascii
import contextlib
import functools
import ipaddress
import itertools
import json
import math
import os
import posixpath
import re
import secrets
import select
import shlex
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import paramiko
from fabric import Config, Connection

from harness.errors import AuthError, HostKeyError, RemoteError, UnreachableError
from harness.transport import inbuffer
from harness.transport.base import KILL_BUDGET_S, HostSpec, Tail, shell_path
from harness.transport.process import ProcessTransport

_CHUNK = 1 << 16
# A channel's receive window, and the most stdout taken in one read. The window bounds what is in
# flight, so it caps a pull at window / round trip: paramiko's 2 MB gives 40 MB/s over 50 ms, 4 MB
# twice that. Larger was slower here with paramiko's own receive buffer, which shifts its unread
# bytes down at every read (a 16 MB window halved loopback pulls, benchmarks/README.md); channels
# take ours (inbuffer.py), and 16 MB still gained nothing on loopback. 256 kB reads beat 64 kB.
_WINDOW = 4 << 20
_RECV = 1 << 18
# The host kills a command this long after our deadline if we could not (link lost, peer frozen).
REMOTE_GRACE_S = 10
KEEPALIVE_S = 30  # keeps NAT and firewalls from dropping an idle link; detects nothing (paramiko #2463)
_LINK_ERRORS = (paramiko.SSHException, EOFError, OSError)
_FAST_CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com")
# TERM the group, wait up to a second, then KILL. "Alive" skips zombies: in a container whose init
# never reaps, the killed children stay zombies in the group for good.
_KILL_GROUP = """
alive() { for f in /proc/[0-9]*/stat; do read -r s < "$f" 2>/dev/null || continue; s=${s##*) }
  set -- $s; [ "$3" = PGID ] && [ "$1" != Z ] && return 0; done; return 1; }
kill -TERM -- -PGID 2>/dev/null || exit 0
for i in $(seq 20); do alive || exit 0; sleep 0.05; done
kill -KILL -- -PGID 2>/dev/null
for i in $(seq 10); do alive || exit 0; sleep 0.05; done
"""


class SSHTransport(ProcessTransport):
    """A connection to one host; reconnects on the next call after the link was dropped."""

    def __init__(self, host: HostSpec, *, ssh_config: str | Path | None = None):
        """Connect now, so a bad host key or credential fails before any command is planned.

        `ssh_config` replaces ~/.ssh/config and /etc/ssh/ssh_config (like `ssh -F`); the environment
        variable HARNESS_SSH_CONFIG does the same for a whole sweep.
        """
        self.host = host
        self._ssh_config = ssh_config or os.environ.get("HARNESS_SSH_CONFIG")
        self._hops: list[Connection] = []  # jump hosts first, the target last
        self._lock = threading.Lock()
        self._mux: _Mux | None = None
        self._mux_works = os.environ.get("HARNESS_SSH_MUX", "1") != "0"
        self._session()

    # -- connection ---------------------------------------------------------------------------

    def _session(self) -> paramiko.Transport:
        """The open paramiko transport, connecting first if there is none (or it died)."""
        with self._lock:
            if self._hops and self._hops[-1].transport is not None and self._hops[-1].transport.is_active():
                return self._hops[-1].transport
        self.close()
        host = self.host
        config = Config(runtime_ssh_path=str(self._ssh_config)) if self._ssh_config else Config()
        keys = {"key_filename": [_existing_key(host, host.identity_file)]} if host.identity_file else {}
        gateway = Connection(host.jump, config=config, connect_kwargs=dict(keys)) if host.jump else None
        target = Connection(host.address or host.name, user=host.user, port=host.port, config=config,
                            gateway=gateway, connect_kwargs=dict(keys))
        hops = _chain(target)
        try:
            for before, conn in itertools.pairwise([None, *hops]):
                self._hops.append(conn)  # first, so that close() also ends a half-open attempt
                self._open(conn, via=before)
        except BaseException:
            self.close()
            raise
        return target.transport

    def _open(self, conn: Connection, *, via: Connection | None) -> None:
        timeout = self.host.connect_timeout
        known_hosts = _known_hosts(self.host, conn)
        pinned = load_known_hosts(known_hosts, conn.client.get_host_keys())
        conn.client.set_missing_host_key_policy(_RefuseUnknown(conn, known_hosts, self.host.name, pinned))
        # fabric rounds connect_timeout to an int (0.5 -> no timeout at all): give paramiko floats.
        conn.connect_timeout = None
        conn.connect_kwargs = {**conn.connect_kwargs, "timeout": timeout, "banner_timeout": timeout,
                               "auth_timeout": timeout, "channel_timeout": timeout,
                               "transport_factory": _fast_transport}
        where = f"{conn.host}:{conn.port}"
        try:
            if via is not None:
                # Our own direct-tcpip channel, with the timeout fabric's open_gateway does not pass.
                conn.connect_kwargs["sock"] = via.transport.open_channel(
                    "direct-tcpip", (conn.host, int(conn.port)), ("", 0), timeout=timeout)
                conn.gateway = None
            conn.open()
        except HostKeyError:
            raise
        except paramiko.BadHostKeyException as e:
            raise HostKeyError(
                f"host key for {where} CHANGED: {known_hosts} has {e.expected_key.get_name()} "
                f"{e.expected_key.fingerprint}, the host offered {e.key.get_name()} {e.key.fingerprint}. "
                f"Refusing to connect. If the host was reinstalled, check the new key out of band, then: "
                f"ssh-keygen -R {shlex.quote(_known_hosts_name(conn))} -f {shlex.quote(known_hosts)}",
                host=self.host.name) from None
        except paramiko.AuthenticationException as e:
            raise AuthError(f"{conn.user}@{where} refused our credentials: {e}", host=self.host.name) from None
        except paramiko.SSHException as e:
            if "authentication methods" in str(e):  # paramiko's word for "no key to offer"
                raise AuthError(f"{conn.user}@{where}: {e}", host=self.host.name) from None
            raise UnreachableError(f"cannot connect to {where}: {e}", host=self.host.name) from None
        except (OSError, EOFError) as e:
            raise UnreachableError(f"cannot connect to {where}: {e or type(e).__name__}",
                                   host=self.host.name) from None
        conn.transport.set_keepalive(KEEPALIVE_S)

    @property
    def compress_pulls(self) -> bool:
        """Over a link, yes. Not when the host is this machine itself: there is no link to spare, and
        the compressor only takes CPU from the decryption (benchmarks/README.md, pull speed). A host
        behind a jump host or a ProxyCommand (whose peer paramiko calls "unknown") is over a link."""
        peer = self._session().getpeername()[0]
        if len(self._hops) > 1:
            return True
        try:
            return not ipaddress.ip_address(peer).is_loopback
        except ValueError:
            return True

    def close(self) -> None:
        with self._lock:
            hops, self._hops = self._hops, []
            mux, self._mux = self._mux, None
        if mux is not None:
            mux.close()
        for conn in reversed(hops):
            conn.client.close()  # not conn.close(): fabric skips a client whose connect() failed halfway

    # -- commands -----------------------------------------------------------------------------

    def _spawn(self, command: str, *, stdin: bytes | None, timeout: float,
               lasting: bool = False) -> _ChannelProcess | _MuxProcess:
        deadline = time.monotonic() + timeout
        transport = self._session()
        watchdog = threading.Timer(timeout + KILL_BUDGET_S + 1, self.close)
        watchdog.daemon = True
        watchdog.start()
        try:
            mux = None if lasting else self._idle_mux(transport, deadline)
            if mux is not None:
                return _MuxProcess(self, mux, command, stdin, deadline, watchdog)
            return _ChannelProcess(self, transport, command, stdin, deadline, watchdog)
        except BaseException as e:
            watchdog.cancel()
            if isinstance(e, TimeoutError):
                self.close()  # the host did not even open a channel in time: the link is dead
            raise

    def _idle_mux(self, transport: paramiko.Transport, deadline: float) -> _Mux | None:
        """This connection's command starter on the host (harness/remote/mux.py), started on first use;
        None while it runs another command (that one's kill, say), or when the host cannot run it
        (no python3 there): then commands take an exec channel each, as they always could."""
        if self._mux is not None and (self._mux.transport is not transport or self._mux.dead):
            self._mux.close()
            self._mux = None
        if self._mux is None and self._mux_works:
            try:
                self._mux = _Mux.start(transport, deadline, self.host.name, python=self.host.python)
            except _MuxUnavailable:
                self._mux_works = False
        mux = self._mux
        return mux if mux is not None and not mux.busy else None

    def put(self, data: bytes, remote_path: str, *, mode: int = 0o644) -> None:
        path = shell_path(remote_path)
        tmp = shell_path(f"{remote_path}.tmp-{secrets.token_hex(4)}")
        parent = shell_path(posixpath.dirname(remote_path) or ".")
        # umask 077 makes the temporary file 0600 from birth: a secret is never readable by others.
        command = (f"mkdir -p {parent} && (umask 077 && cat > {tmp}) && chmod {mode:o} {tmp} "
                   f"&& mv -f {tmp} {path} || {{ rc=$?; rm -f {tmp}; exit $rc; }}")
        self.run(command, stdin=data, timeout=30 + len(data) / 1e6)


def _open_channel(transport: paramiko.Transport, deadline: float) -> paramiko.Channel:
    """A session channel with our window and receive buffer (inbuffer.py), opened by `deadline`."""
    return inbuffer.install(transport.open_session(window_size=_WINDOW,
                                                   timeout=max(deadline - time.monotonic(), 0.01)))


class _GroupCommand:
    """What a wrapped command (`_wrap`) prints: its process group's id on a line of its own
    (`_PGID_MARK` and the id), which stdout loses together with whatever a login script printed
    before it; stderr kept aside."""

    def __init__(self, host: str) -> None:
        self._host = host
        self._err = Tail()
        self._head: bytearray | None = bytearray()  # stdout up to the group's line; then None
        self._mark = -1   # where in `_head` the group's line begins, once it has come
        self._pgid: int | None = None

    def _strip_pgid(self, data: bytes) -> bytes:
        head = self._head
        if head is None:
            return data
        seen = len(head)
        head += data
        if self._mark < 0:
            self._mark = head.find(_PGID_MARK, max(seen - len(_PGID_MARK) + 1, 0))
        end = head.find(b"\n", max(self._mark + len(_PGID_MARK), seen)) if self._mark >= 0 else -1
        if end < 0:
            if len(head) > _NOISE_MAX:
                raise UnreachableError(f"the host printed {len(head)} bytes and not the line that starts a command "
                                       "(a login script's output?)", host=self._host)
            return b""
        self._head = None
        # Not a number only if the host changed it: then the group cannot be killed by id.
        found = _PGID.fullmatch(head, self._mark + len(_PGID_MARK), end)
        self._pgid = int(found[1]) if found and int(found[1]) > 1 else None
        return bytes(head[end + 1:])

    def stderr(self) -> bytes:
        return self._err.value()


class _ChannelProcess(_GroupCommand):
    """A command on an exec channel: stdout as a stream, stderr kept aside, stdin fed as it drains."""

    def __init__(self, owner: SSHTransport, transport: paramiko.Transport, command: str,
                 stdin: bytes | None, deadline: float, watchdog: threading.Timer):
        super().__init__(owner.host.name)
        self._owner, self._transport, self._watchdog = owner, transport, watchdog
        self._stdin = memoryview(stdin) if stdin is not None else None
        try:
            self._chan = _open_channel(transport, deadline)
            self._chan.exec_command(_wrap(command, deadline - time.monotonic()))
            if self._stdin is None:
                self._chan.shutdown_write()
        except _LINK_ERRORS as e:
            raise _lost(e, deadline, owner.host.name) from None

    def read(self, deadline: float) -> bytes:
        chan = self._chan
        while True:
            ended = chan.eof_received or chan.closed  # sampled first: then every byte is buffered
            try:
                if chan.recv_stderr_ready():
                    self._err.feed(chan.recv_stderr(_CHUNK))
                    continue
                if chan.recv_ready():
                    if data := self._strip_pgid(chan.recv(_RECV)):
                        return data
                    continue
                if ended:
                    return b""
                self._feed_stdin()
            except _LINK_ERRORS as e:
                raise _lost(e, deadline, self._owner.host.name) from None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            # While stdin waits for window space, poll for it; otherwise sleep until data or EOF.
            select.select([chan], [], [], min(remaining, 0.05) if self._stdin is not None else remaining)

    def _feed_stdin(self) -> None:
        while self._stdin is not None and self._chan.send_ready():  # send_ready: window space, no block
            try:
                sent = self._chan.send(bytes(self._stdin[:_CHUNK]))
            except OSError:
                if not self._chan.closed:
                    raise
                self._stdin = None  # the command ended without reading it all: its exit code says how
                return
            self._stdin = self._stdin[sent:]
            if not self._stdin:
                self._chan.shutdown_write()
                self._stdin = None

    def wait(self, deadline: float) -> int:
        if not self._chan.status_event.wait(max(deadline - time.monotonic(), 0)):
            raise TimeoutError
        code = self._chan.recv_exit_status()
        if code == -1 and not self._transport.is_active():
            raise _lost(EOFError("the link closed while the command ran"), deadline, self._owner.host.name)
        return code

    def kill(self) -> None:
        """TERM the command's process group, then KILL it; drop the link if the host does not answer."""
        self._close_channel()
        if self._pgid is None:  # it never started (or printed nothing yet): the host's timer remains
            return
        if not _kill_group(self._owner, self._transport, self._pgid, self._watchdog):
            self._owner.close()

    def close(self) -> None:
        self._watchdog.cancel()
        self._close_channel()

    def _close_channel(self) -> None:
        # Closing sends a message: on a link that just died it raises, and would hide the error that
        # brought us here (the lost link, already raised as UnreachableError).
        with contextlib.suppress(*_LINK_ERRORS):
            self._chan.close()


def _kill_group(owner: SSHTransport, transport: paramiko.Transport, pgid: int, watchdog: threading.Timer) -> bool:
    """TERM a process group on the host, then KILL it, over an exec channel of its own; whether the
    host answered within KILL_BUDGET_S."""
    deadline = time.monotonic() + KILL_BUDGET_S
    try:
        killer = _ChannelProcess(owner, transport, _KILL_GROUP.replace("PGID", str(pgid)), None, deadline, watchdog)
        try:
            while killer.read(deadline):
                pass
            killer.wait(deadline)
        finally:
            killer.close()
    except (TimeoutError, RemoteError):
        return False
    return True


MUX_START_S = 15.0
"""How long the host's command starter may take to say it is ready before exec channels are used instead."""
_MUX_SOURCE = Path(__file__).resolve().parents[1] / "remote" / "mux.py"
_MUX_MAGIC = b"\x00harness-mux-1\n"   # harness/remote/mux.py MAGIC
_MUX_FRAME_MAX = 1 << 20                # the starter reads 256 kB at a time: a longer frame is not its own
_NOISE_MAX = 1 << 16   # what a login script may print before the starter's hello, or before a command's start
_PGID_MARK = b"harness-pgid-4b7e "   # begins the line `_wrap` prints before the command: its group's id
_PGID = re.compile(rb"(\d{1,10})")
_EXIT = re.compile(rb"(-?\d{1,10})")   # the starter's exit frame


class _MuxUnavailable(Exception):
    """The host could not start the command starter (no python3, say): commands take exec channels."""


class _Mux:
    """The client of one connection's command starter on the host (harness/remote/mux.py): its exec
    channel, and the frames read from it so far. One command at a time (`busy`); `dead` once it can no
    longer be trusted to be in step (a command abandoned halfway, a malformed frame, the channel gone)."""

    def __init__(self, transport: paramiko.Transport, chan: paramiko.Channel, host: str):
        self.transport, self.chan, self.host = transport, chan, host
        self.buf = bytearray()   # read from the channel and not yet taken
        self._left = 0           # what is still to come of the stdout frame being read
        self.busy = self.dead = False

    @classmethod
    def start(cls, transport: paramiko.Transport, deadline: float, host: str, *, python: str | None = None) -> _Mux:
        """The starter, once it has said hello; _MuxUnavailable when it cannot start or says nothing
        within MUX_START_S, TimeoutError when the command's own `deadline` passed meanwhile. It runs
        under `python` (the host's venv) when that exists there, else python3 (which may be a pyenv
        shim: 0.2 s more)."""
        source = shlex.quote(_mux_source())
        command = f"exec python3 -c {source}"
        if python:
            command = f"if [ -x {shell_path(python)} ]; then exec {shell_path(python)} -c {source}; fi; {command}"
        try:
            chan = _open_channel(transport, deadline)
            chan.exec_command(command)
        except _LINK_ERRORS as e:
            raise _lost(e, deadline, host) from None
        mux = cls(transport, chan, host)
        hello_by = min(deadline, time.monotonic() + MUX_START_S)
        try:
            while (at := mux.buf.find(_MUX_MAGIC)) < 0:
                if len(mux.buf) > _NOISE_MAX or not mux._fill(hello_by):
                    raise _MuxUnavailable
        except BaseException as e:
            mux.close()
            if isinstance(e, TimeoutError) and time.monotonic() < deadline:
                raise _MuxUnavailable from None
            raise
        del mux.buf[:at + len(_MUX_MAGIC)]
        return mux

    def _fill(self, deadline: float, most: int = _RECV) -> bool:
        """Up to `most` more bytes into `buf`; False once the channel has ended."""
        data = self._recv(deadline, most)
        if data is None:
            return False
        self.buf += data
        return True

    def _recv(self, deadline: float, most: int) -> bytes | None:
        """The next bytes of stdout, at most `most` of them; None once the channel has ended."""
        chan = self.chan
        while True:
            ended = chan.eof_received or chan.closed
            try:
                if chan.recv_stderr_ready():
                    chan.recv_stderr(_CHUNK)   # the starter's own complaints: nothing to act on
                    continue
                if chan.recv_ready():
                    return chan.recv(most)
            except _LINK_ERRORS as e:
                raise _lost(e, deadline, self.host) from None
            if ended:
                return None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            select.select([chan], [], [], remaining)

    def send(self, command: str, stdin: bytes | None, deadline: float) -> None:
        body = json.dumps({"command": command, "stdin": len(stdin or b"")}).encode()
        try:
            self.chan.settimeout(max(deadline - time.monotonic(), 0.01))
            self.chan.sendall(struct.pack(">I", len(body)) + body + (stdin or b""))
            self.chan.settimeout(None)
        except _LINK_ERRORS as e:
            self.dead = True
            raise _lost(e, deadline, self.host) from None

    def frame(self, deadline: float) -> tuple[bytes, bytes]:
        """The next frame's kind and payload, or the next piece of a stdout frame's payload: those are
        handed on as they arrive (a pull's bytes are not gathered into frames and copied out again)."""
        try:
            if self._left:
                data = (self._take(min(self._left, len(self.buf))) if self.buf
                        else self._recv(deadline, min(self._left, _RECV)))
                if data is None:
                    raise UnreachableError("the host's command starter ended", host=self.host)
                self._left -= len(data)
                return b"O", data
            head = self._exactly(5, deadline)
            kind, n = head[:1], int.from_bytes(head[1:], "big")
            if kind not in (b"O", b"E", b"X") or n > _MUX_FRAME_MAX:
                raise UnreachableError("the host's command starter sent a malformed frame", host=self.host)
            if kind == b"O":
                self._left = n
                return kind, b""
            return kind, self._exactly(n, deadline)
        except BaseException:
            self.dead = True
            raise

    def _exactly(self, n: int, deadline: float) -> bytes:
        while len(self.buf) < n:
            if not self._fill(deadline, n - len(self.buf)):
                raise UnreachableError("the host's command starter ended", host=self.host)
        return self._take(n)

    def _take(self, n: int) -> bytes:
        data = bytes(self.buf[:n])
        del self.buf[:n]
        return data

    def close(self) -> None:
        self.dead = True
        with contextlib.suppress(*_LINK_ERRORS):
            self.chan.close()


@functools.cache
def _mux_source() -> str:
    """The starter's source as it is sent: without its docstring, which would stand in full on its
    command line (`ps` on the host), and named by a first line."""
    text = _MUX_SOURCE.read_text()
    first = ast.parse(text).body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and first.end_lineno:
        text = "\n".join(text.splitlines()[first.end_lineno:])
    return "# the harness's command starter (harness/remote/mux.py)\n" + text.lstrip("\n")


class _MuxProcess(_GroupCommand):
    """A command started by the host's command starter: the same wrapped command as on an exec
    channel (its own process group, its id first, the host's own timer), its output in frames."""

    def __init__(self, owner: SSHTransport, mux: _Mux, command: str, stdin: bytes | None, deadline: float,
                 watchdog: threading.Timer):
        super().__init__(mux.host)
        self._owner, self._mux, self._watchdog = owner, mux, watchdog
        self._code: int | None = None
        mux.busy = True
        mux.send(_wrap(command, deadline - time.monotonic()), stdin, deadline)

    def read(self, deadline: float) -> bytes:
        while self._code is None:
            kind, payload = self._mux.frame(deadline)
            if kind == b"E":
                self._err.feed(payload)
            elif kind == b"X":
                if (code := _EXIT.fullmatch(payload)) is None:
                    self._mux.dead = True
                    raise UnreachableError("the host's command starter sent a malformed frame", host=self._mux.host)
                self._code = int(code[1])
                self._mux.busy = False
            elif data := self._strip_pgid(payload):
                return data
        return b""

    def wait(self, deadline: float) -> int:
        while self._code is None:
            self.read(deadline)
        return self._code

    def kill(self) -> None:
        """As on an exec channel; then the starter's frames up to the command's end, or it is dropped."""
        if self._code is not None:
            return
        if self._pgid is None or not _kill_group(self._owner, self._mux.transport, self._pgid, self._watchdog):
            self._mux.close()
            return
        deadline = time.monotonic() + KILL_BUDGET_S
        try:
            while self.read(deadline):
                pass
        except (TimeoutError, RemoteError):
            self._mux.close()

    def close(self) -> None:
        self._watchdog.cancel()
        if self._code is None:   # abandoned halfway: the starter is out of step with us now
            self._mux.close()


@dataclass
class KnownHosts:
    """What a known_hosts file says beyond the plain keys paramiko checks itself."""

    revoked: set[str] = field(default_factory=set)     # base64 of keys marked @revoked
    authorities: int = 0                               # @cert-authority lines (not supported)
    skipped: list[int] = field(default_factory=list)   # line numbers paramiko cannot read


def load_known_hosts(path: str, into: paramiko.HostKeys) -> KnownHosts:
    """Read a known_hosts file as OpenSSH does, into paramiko's host keys.

    paramiko's own loader raises InvalidHostKey on the standard `@cert-authority` and `@revoked`
    markers (sshd(8) "SSH_KNOWN_HOSTS FILE FORMAT") and on any line it cannot parse, which would
    fail every connection. Here a `@revoked` key is refused even where another line pins it, a
    `@cert-authority` line is counted (paramiko cannot check host certificates, so such a host's key
    must be pinned itself), and unreadable lines are skipped, as OpenSSH skips them. A missing file
    pins nothing: every key is unknown and refused with the command that pins it."""
    found = KnownHosts()
    entries = []
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return found
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        marker, _, rest = text.partition(" ") if text.startswith("@") else ("", "", text)
        if marker == "@cert-authority":
            found.authorities += 1
            continue
        try:
            entry = paramiko.hostkeys.HostKeyEntry.from_line(rest, number)
        except (paramiko.SSHException, ValueError, TypeError, binascii.Error):
            entry = None
        if entry is None or marker not in ("", "@revoked"):
            found.skipped.append(number)
        elif marker == "@revoked":
            found.revoked.add(entry.key.get_base64())
        else:
            entries.append(entry)
    for entry in entries:
        if entry.key.get_base64() not in found.revoked:
            for name in entry.hostnames:
                into.add(name, entry.key.get_name(), entry.key)
    return found


class _RefuseUnknown(paramiko.RejectPolicy):
    """RejectPolicy, with a message that says how to pin the key after checking it."""

    def __init__(self, conn: Connection, known_hosts: str, name: str, pinned: KnownHosts):
        self._conn, self._known_hosts, self._name, self._pinned = conn, known_hosts, name, pinned

    def missing_host_key(self, client, hostname, key) -> None:
        conn = self._conn
        where = f"{conn.host}:{conn.port} ({key.get_name()} {key.fingerprint})"
        if key.get_base64() in self._pinned.revoked:
            raise HostKeyError(f"the host key of {where} is marked @revoked in {self._known_hosts}: "
                               "refusing to connect", host=self._name)
        authority = (" Its key may be signed by a @cert-authority listed there, but host certificates "
                     "are not checked here: pin the host's own key." if self._pinned.authorities else "")
        raise HostKeyError(
            f"unknown host key for {where}: not in {self._known_hosts}.{authority} Check the fingerprint "
            f"with the host's owner, then pin it: "
            f"ssh-keyscan -p {conn.port} {shlex.quote(conn.host)} >> {shlex.quote(self._known_hosts)}",
            host=self._name)


def _fast_transport(sock, **kwargs) -> paramiko.Transport:
    """A paramiko transport that reads its socket ahead (inbuffer.ReadAhead) and offers AES-GCM first:
    one pass for cipher and MAC, where paramiko's own first choice, aes128-ctr with hmac-sha2-256,
    takes two (benchmarks/README.md: a fifth less CPU per byte pulled). The rest stay offered, in
    paramiko's order, for hosts without GCM. Only a socket is read ahead: a ProxyCommand's `recv`
    waits until it has all it was asked for, and a jump host's channel is buffered already."""
    if isinstance(sock, socket.socket):
        sock = inbuffer.ReadAhead(sock)
    transport = paramiko.Transport(sock, **kwargs)
    options = transport.get_security_options()
    options.ciphers = sorted(options.ciphers, key=lambda name: name not in _FAST_CIPHERS)
    return transport


def _wrap(command: str, timeout: float) -> str:
    """Run `command` with bash in a process group of its own that prints its id first, on a line that
    begins with `_PGID_MARK`: what a login script printed before it is told apart from the command's
    output by that line alone.

    coreutils `timeout` makes the group (it calls setpgid) and is the host's own timer: it fires
    REMOTE_GRACE_S after our deadline, so it matters only when we could not kill the group ourselves.
    `--norc`: bash run by sshd reads ~/.bashrc (Debian's SSH_SOURCE_BASHRC); the login shell already
    did, its exports are inherited, and reading it twice more cost 0.3 s a command on a pyenv host.
    """
    inner = f'echo "{_PGID_MARK.decode()}$PPID"; exec bash --norc -c "$1"'
    return (f"exec timeout -k 5 {math.ceil(max(timeout, 0)) + REMOTE_GRACE_S} "
            f"bash --norc -c {shlex.quote(inner)} harness {shlex.quote(command)}")


def _chain(conn: Connection) -> list[Connection]:
    """The connection and its gateways, outermost jump host first (ProxyJump may come from ssh config)."""
    hops = [conn]
    while isinstance(hops[0].gateway, Connection):
        hops.insert(0, hops[0].gateway)
    return hops


def _known_hosts(host: HostSpec, conn: Connection) -> str:
    """The inventory's file, else ssh config's UserKnownHostsFile, else ~/.ssh/known_hosts."""
    configured = (conn.ssh_config.get("userknownhostsfile") or "").split()
    return os.path.expanduser(host.known_hosts or (configured[0] if configured else "~/.ssh/known_hosts"))


def _known_hosts_name(conn: Connection) -> str:
    return conn.host if int(conn.port) == 22 else f"[{conn.host}]:{conn.port}"


def _existing_key(host: HostSpec, identity_file: str) -> str:
    path = os.path.expanduser(identity_file)
    if not os.path.isfile(path):
        raise AuthError(f"identity file {identity_file} does not exist", host=host.name)
    return path


def _lost(error: BaseException, deadline: float, name: str) -> Exception:
    """A paramiko failure during a command: our deadline (passed, or the watchdog cut the link), or a lost link."""
    timed_out = isinstance(error, TimeoutError) or str(error) == "Timeout opening channel."
    if timed_out or time.monotonic() >= deadline:
        return TimeoutError()
    return UnreachableError(f"connection lost: {error or type(error).__name__}", host=name)
