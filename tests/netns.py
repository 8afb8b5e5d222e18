"""Several SSH hosts on one machine: a network namespace each, reached over a veth pair.

Loopback cannot lose a link; a namespace can. Each host gets a namespace of its own, a veth pair
(10.213.X.1 on this side, 10.213.X.2 inside) and a real sshd (tests/sshd.py) serving port 22 inside
it, with its own host key pinned in its own known_hosts file. `link_down()` takes this side of the
pair down: packets stop both ways while both TCP ends stay open, like a pulled cable or a switch that
reboots. `freeze()` SIGSTOPs the host's sshd: a peer that holds the link but never answers.

No packet leaves this machine. Taking a link down deletes the kernel's connected route to its /24, and
without a stand-in the address would then be routed out through the default gateway. So every host's
/24 also has a `blackhole` route of a worse metric: it is never used while the link is up and takes
over the moment it goes down, so the address stays unreachable. Behind those, the whole test range
(10.213.0.0/16) has an `unreachable` route of the same worse metric that is never removed: once a host
is gone (its veth, its blackhole), a process that still tries its address (a reconnect with backoff,
a sweep a test left running) fails here instead of leaving by default. It wins only where nothing
better exists, so a machine's own routes into that range keep working. Inside a namespace there is
only the link's own /24, no default route: nothing there has a path out either. Every cut checks
both, before and after, with `ip route get` (`assert_contained`), and so does every teardown.

    with netns_hosts(4, tmp_path) as hosts:
        transport = connect(hosts[0].host_spec())
        hosts[0].link_down()

`routed=True` lets the hosts reach one another too (the nodes of a server on several hosts meet at
node 0's address): each namespace gets a route to every other host's /24 through its own link, and
this side forwards between the hosts' veths only (per-interface `forwarding`, never the machine-wide
`ip_forward`), so nothing but the test's own subnets becomes reachable from inside.

Needs root and `ip netns`; otherwise `pytest.skip` says why (CI runs as root and fails on skipped
end-to-end tests, so there it must work). Every sshd runs commands as root on this machine's
filesystem: hosts share files, so give each its own working directory. `tc netem` (delay, loss) is
not available on every kernel, so nothing here depends on it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.transport.base import HostSpec
from tests.sshd import Sshd

# Namespaces are named PREFIX-<pid>-<serial>, so a session can tell its own from a dead session's.
PREFIX = "harness-test"
SUBNET = ipaddress.ip_network("10.213.0.0/16")
# The stand-ins' metric (each /24's blackhole, the range's unreachable route): worse than a connected
# route's 0, so used only where that is gone.
BLACKHOLE_METRIC = "4242"
VETH = r"hv\d+x\d+p?"    # a host's veth pair: this side hv<pid>x<serial>, the peer with a "p" after
_serials = itertools.count()  # unique names within this session, however many times hosts are made


class NetnsHost:
    """One namespace with an address, a veth pair to this side, and an sshd."""

    def __init__(self, index: int, directory: Path, octet: int, *, sshd: bool = True):
        self.with_sshd = sshd
        self.name = f"host{index}"
        serial = next(_serials)
        self.netns = f"{PREFIX}-{os.getpid()}-{serial}"
        self.veth = f"hv{os.getpid()}x{serial}"  # this side's end (VETH); Linux allows 15 characters
        self._peer = f"{self.veth}p"
        self.gateway = f"10.213.{octet}.1"
        self.address = f"10.213.{octet}.2"
        self.subnet = f"10.213.{octet}.0/24"
        self.workdir = directory / "work"
        self.sshd = Sshd(directory / "sshd", address=self.address, port=22,
                         prefix=["ip", "netns", "exec", self.netns])

    def create(self) -> None:
        _ip("netns", "add", self.netns)
        _ip("link", "add", self.veth, "type", "veth", "peer", "name", self._peer)
        _ip("link", "set", self._peer, "netns", self.netns)
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.veth)
        _ip("route", "replace", "blackhole", self.subnet, "metric", BLACKHOLE_METRIC)
        _ip("link", "set", self.veth, "up")
        inside = ["-n", self.netns]
        _ip(*inside, "addr", "add", f"{self.address}/24", "dev", self._peer)
        _ip(*inside, "link", "set", self._peer, "up")
        _ip(*inside, "link", "set", "lo", "up")
        self.assert_contained()
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.with_sshd:
            self.sshd.start()

    def route_to(self, other: NetnsHost) -> None:
        """Reach `other` through this host's link (this side forwards it on to `other`'s)."""
        _ip("-n", self.netns, "route", "replace", other.subnet, "via", self.gateway)

    def forward(self) -> None:
        """Let this side forward packets that arrive on this host's veth (and only on it)."""
        Path(f"/proc/sys/net/ipv4/conf/{self.veth}/forwarding").write_text("1\n")

    def host_spec(self, name: str | None = None, **overrides) -> HostSpec:
        return self.sshd.host_spec(name or self.name, **overrides)

    def link_down(self) -> None:
        """Cut the link: nothing passes either way; open connections notice nothing until they time out.
        The address stays unreachable meanwhile (the blackhole route), never routed out by default."""
        self.assert_contained()
        _ip("link", "set", self.veth, "down")
        self.assert_contained()

    def link_up(self) -> None:
        self.assert_contained()
        _ip("link", "set", self.veth, "up")
        self.assert_contained()

    def assert_contained(self) -> None:
        """Raise unless a packet to this host goes over its own veth or into the blackhole, and the
        namespace has no route beyond its link. A leak here would send test traffic off the machine."""
        route = _route_get(self.address)
        if route is None:
            held = subprocess.run(["ip", "route", "show", "type", "blackhole", self.subnet],
                                  capture_output=True, text=True).stdout
            if not held.strip():
                raise AssertionError(f"{self.address}: no route and no blackhole for {self.subnet}")
        elif "gateway" in route or route.get("dev") != self.veth:
            raise AssertionError(f"{self.address} would leave by {route}, not by {self.veth}: "
                                 "test traffic must never be routed off this machine")
        outside = _route_get("192.0.2.1", netns=self.netns)  # TEST-NET-1: any address off the link
        if outside is not None:
            raise AssertionError(f"namespace {self.netns} has a path out: {outside}")

    def freeze(self) -> None:
        self.sshd.freeze()

    def thaw(self) -> None:
        self.sshd.thaw()

    def destroy(self) -> None:
        """Stop the sshd, delete the veth pair (now: the kernel drops a deleted namespace's own links
        a little later), then the namespace and the blackhole; the range's backstop then holds the
        address unreachable, which is checked."""
        if self.with_sshd:
            self.sshd.stop()
        subprocess.run(["ip", "link", "del", self.veth], capture_output=True)
        _delete_namespace(self.netns)
        subprocess.run(["ip", "route", "del", "blackhole", self.subnet, "metric", BLACKHOLE_METRIC],
                       capture_output=True)
        gone = _route_get(self.address)
        if gone is not None:
            raise AssertionError(f"{self.address} is routed by {gone} once its host is gone: "
                                 "test traffic must never be routed off this machine")


@contextlib.contextmanager
def netns_hosts(count: int, directory: Path, *, routed: bool = False,
                sshd: bool = True) -> Iterator[list[NetnsHost]]:
    """`count` hosts, each in a namespace of its own with an sshd (unless `sshd` is False: a namespace
    for another daemon, tests/slurm.py's slurmd); all gone on exit, even after a failure.
    `routed`: the hosts reach one another as well."""
    _require_netns()
    _ip("route", "replace", "unreachable", str(SUBNET), "metric", BLACKHOLE_METRIC)
    _remove_stale_namespaces()
    hosts = [NetnsHost(i, directory / f"host{i}", octet, sshd=sshd)
             for i, octet in enumerate(_free_octets(count))]
    try:
        for host in hosts:
            host.create()
        if routed:
            for host in hosts:
                host.forward()
                for other in hosts:
                    if other is not host:
                        host.route_to(other)
            for host in hosts:
                host.assert_contained()
        yield hosts
    finally:
        leaks = []
        for host in hosts:   # every host goes, even when one of them is found routed out
            try:
                host.destroy()
            except AssertionError as e:
                leaks.append(str(e))
        if leaks:
            raise AssertionError("; ".join(leaks))


def _require_netns() -> None:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("`ip` is missing: install iproute2 (make sshd does)")
    probe = f"{PREFIX}-{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"`ip netns add` failed: {made.stderr.strip()}")
    _delete_namespace(probe)


def _free_octets(count: int) -> list[int]:
    """Third octets X of 10.213.X.0/24 subnets that no interface of this machine overlaps yet.
    Two sessions creating hosts at the same instant could pick the same subnet (Linux accepts an
    address twice); their connections would then fail on host key checks, never reach a wrong host
    unnoticed."""
    used = _interface_networks()
    free = [net for net in SUBNET.subnets(new_prefix=24) if not any(net.overlaps(u) for u in used)]
    octets = [net.network_address.packed[2] for net in free if 0 < net.network_address.packed[2] < 255]
    if len(octets) < count:
        raise RuntimeError(f"fewer than {count} free /24 subnets left in {SUBNET}")
    return octets[:count]


def _remove_stale_namespaces() -> None:
    """Delete namespaces left by test sessions that were killed before they could clean up, and the
    blackhole routes of subnets that no interface holds any more."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        if name.startswith(f"{PREFIX}-") and len(parts) == 4 and parts[2].isdigit() \
                and not Path(f"/proc/{parts[2]}").exists():
            _delete_namespace(name)
    held = {str(net) for net in _interface_networks()}
    routes = subprocess.run(["ip", "-j", "route", "show", "type", "blackhole"], capture_output=True,
                            text=True).stdout
    for route in json.loads(routes or "[]"):
        dst = route.get("dst", "")
        if "/" in dst and ipaddress.ip_network(dst).subnet_of(SUBNET) and dst not in held:
            subprocess.run(["ip", "route", "del", "blackhole", dst, "metric", BLACKHOLE_METRIC],
                           capture_output=True)


def _interface_networks() -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    listing = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True,
                             check=True).stdout
    return [ipaddress.ip_interface(cidr).network for cidr in re.findall(r"inet (\S+)", listing)]


def _route_get(address: str, netns: str | None = None) -> dict | None:
    """The route the kernel would take to `address` (`ip -j route get`), or None when there is none
    (unreachable, or a blackhole)."""
    where = ["-n", netns] if netns else []
    done = subprocess.run(["ip", *where, "-j", "route", "get", address], capture_output=True, text=True)
    if done.returncode != 0:
        return None
    routes = json.loads(done.stdout)
    return routes[0] if routes else None


def _delete_namespace(name: str) -> None:
    """Kill whatever still runs in the namespace, then delete it."""
    pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), 9)
    subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
