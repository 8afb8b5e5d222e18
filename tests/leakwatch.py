"""A watch on this machine's own interfaces for packets to the test hosts' range: there must be none.

tests/netns.py keeps the test range (10.213.0.0/16) unreachable except over the test hosts' own veth
pairs, and checks the routes with `ip route get` at every cut and teardown. This watches what that
promises: every IPv4 packet that leaves by an interface that is not a test host's (eth0, a bridge, a
VPN's tunnel: whatever was there when the watch began) is read as it goes out, and one addressed to
the test range is recorded. The test session fails if any was (tests/conftest.py), naming each.

    with LeakWatch() as watch:
        ...                      # link cuts, teardowns, sweeps in subprocesses
    assert not watch.leaks

A packet socket (AF_PACKET, datagram mode: the IP header first; every protocol, since the kernel hands
packets going out only to such sockets) per interface, read by one thread; it needs root, and is not
started without it. Loopback is left out (it never leaves the machine), so are interfaces that are down
(they send nothing) and the test hosts' veths, which exist only later and carry the test traffic
itself.
"""

from __future__ import annotations

import errno
import ipaddress
import re
import selectors
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

from tests.netns import SUBNET, VETH

ETH_P_ALL, ETH_P_IP = 0x0003, 0x0800   # the kernel hands packets going out to ETH_P_ALL sockets only


@dataclass(frozen=True)
class Leak:
    interface: str
    source: str
    destination: str
    protocol: int

    def __str__(self) -> str:
        return f"{self.source} -> {self.destination} (IP protocol {self.protocol}) out of {self.interface}"


class LeakWatch:
    def __init__(self, interfaces: list[str] | None = None, *, subnet: ipaddress.IPv4Network = SUBNET):
        """Watch `interfaces` (default: every interface of this machine but loopback and test veths)."""
        names = interfaces if interfaces is not None else [
            name for _, name in socket.if_nameindex()
            if name != "lo" and not re.fullmatch(VETH, name) and _is_up(name)]
        self.subnet = subnet
        self.leaks: list[Leak] = []
        self._selector = selectors.DefaultSelector()
        self.unwatched: list[str] = []   # interfaces that could not be read: said at the end
        for name in names:
            sock = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(ETH_P_ALL))
            try:
                sock.bind((name, 0))
            except OSError as e:
                sock.close()
                self.unwatched.append(f"{name} ({e.strerror})")
                continue
            self._selector.register(sock, selectors.EVENT_READ, sock)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="leak-watch", daemon=True)

    def __enter__(self) -> LeakWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Read what is still queued, then stop and close the sockets."""
        self._stop.set()
        self._thread.join()
        for key in list(self._selector.get_map().values()):
            key.data.close()
        self._selector.close()

    def _run(self) -> None:
        while True:
            ready = self._selector.select(timeout=0.2)
            for key, _ in ready:
                self._read(key.data)
            if self._stop.is_set() and not ready:
                return

    def _read(self, sock: socket.socket) -> None:
        try:
            packet, (interface, protocol, kind, *_) = sock.recvfrom(64)   # the IP header is all we read
        except OSError as e:
            if e.errno != errno.ENETDOWN:   # the interface is gone: nothing leaves by it any more
                self._selector.unregister(sock)
                sock.close()
            return
        if kind != socket.PACKET_OUTGOING or protocol != ETH_P_IP or len(packet) < 20:
            return
        destination = ipaddress.IPv4Address(packet[16:20])
        if destination in self.subnet:
            self.leaks.append(Leak(interface, str(ipaddress.IPv4Address(packet[12:16])), str(destination),
                                   packet[9]))


def _is_up(interface: str) -> bool:
    """Whether the interface is up (IFF_UP): one that is down sends nothing, and reading it fails."""
    try:
        return bool(int(Path(f"/sys/class/net/{interface}/flags").read_text(), 16) & 0x1)
    except (OSError, ValueError):
        return False
