"""Installing the host-side tools over a link with latency: one command against the three it was.

A host is opened once per worker and again after every reconnect: the connection, then the tools'
install (`harness.remote.install`: the workdir's check, the zipapp's upload and its sha256 on the host),
then the reap of servers left by earlier sweeps. This times the install as it is now, one command,
against the sequence it replaced, three commands over the same primitives (`private_workdir`, `put`,
then `sha256sum`), alternating, over one open connection, through a TCP relay on loopback that
holds every chunk for `--delay-ms` each way (the kernel here has no netem): a GPU host seen from a
laptop is tens of milliseconds away. A real sshd (tests/sshd.py) at the relay's other end.

Prints the round trip of `run("true")` on that connection, each install's median, and their ratio.

    .venv/bin/python benchmarks/host_open.py [--delay-ms 25] [--repeats 9]
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import shlex
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from harness.remote import ZIPAPP, install, private_workdir, remote_dir, zipapp  # noqa: E402
from harness.transport.ssh import SSHTransport  # noqa: E402
from tests.sshd import Sshd  # noqa: E402


class DelayRelay:
    """127.0.0.1:port -> target, every chunk delivered `delay` seconds after it arrived, in order."""

    def __init__(self, target: tuple[str, int], delay: float):
        self.target, self.delay = target, delay
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            client, _ = self.listener.accept()
            server = socket.create_connection(self.target)
            for s in (client, server):   # the relay adds its delay, not Nagle's
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        held: collections.deque[tuple[float, bytes]] = collections.deque()
        ready = threading.Condition()

        def deliver() -> None:
            while True:
                with ready:
                    while not held:
                        ready.wait()
                    due, data = held.popleft()
                time.sleep(max(0.0, due - time.monotonic()))
                if not data:
                    dst.shutdown(socket.SHUT_WR)
                    return
                try:
                    dst.sendall(data)
                except OSError:   # the other side closed: drop the rest
                    return

        threading.Thread(target=deliver, daemon=True).start()
        while True:
            try:
                data = src.recv(1 << 16)
            except OSError:
                data = b""
            with ready:
                held.append((time.monotonic() + self.delay, data))
                ready.notify()
            if not data:
                return


def install_before(transport, workdir: str) -> None:
    """The install as it was: the workdir's check, the upload, then its sha256, one command each."""
    workdir = private_workdir(transport, workdir, host="h")
    where = remote_dir(workdir)
    data = zipapp()
    transport.put(data, f"{where}/{ZIPAPP}")
    landed = transport.run(f"sha256sum -- {shlex.quote(f'{where}/{ZIPAPP}')}", timeout=60).stdout.split()
    assert landed[:1] == [hashlib.sha256(data).hexdigest()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--delay-ms", type=float, default=25.0, help="held each way, so the round trip is twice")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="host-open-") as tmp_name, Sshd(Path(tmp_name) / "sshd") as sshd:
        tmp = Path(tmp_name)
        relay = DelayRelay((sshd.address, sshd.port), args.delay_ms / 1000)
        known = tmp / "known_hosts"
        known.write_text(sshd.known_hosts.read_text().replace(sshd.known_hosts_name, f"[127.0.0.1]:{relay.port}"))
        transport = SSHTransport(sshd.host_spec("h", port=relay.port, known_hosts=str(known)))
        try:
            transport.run("true", timeout=30)
            rtts, now, before = [], [], []
            for i in range(args.repeats):
                started = time.perf_counter()
                transport.run("true", timeout=30)
                rtts.append(time.perf_counter() - started)
                for label, times in (("now", now), ("before", before)):
                    workdir = str(tmp / f"work-{label}-{i}")
                    started = time.perf_counter()
                    if label == "now":
                        install(transport, workdir, host="h")
                    else:
                        install_before(transport, workdir)
                    times.append(time.perf_counter() - started)
        finally:
            transport.close()
    rtt, one, three = statistics.median(rtts), statistics.median(now), statistics.median(before)
    print(f"round trip of run('true'): {rtt * 1000:.0f} ms (relay holding {args.delay_ms:g} ms each way)")
    print(f"install, one command:    {one * 1000:.0f} ms  (each: {', '.join(f'{t * 1000:.0f}' for t in now)})")
    print(f"install, three commands: {three * 1000:.0f} ms  (each: {', '.join(f'{t * 1000:.0f}' for t in before)})")
    print(f"summary: the install takes {one / three:.2f}x the time it took ({(three - one) * 1000:.0f} ms less, "
          f"{(three - one) / rtt:.1f} round trips); median of {args.repeats}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
