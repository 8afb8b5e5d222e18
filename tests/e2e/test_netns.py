"""The SSH transport against several hosts whose links can fail: one network namespace and sshd each.

What loopback cannot show: a link that goes down while both ends of the TCP connection stay open
(RELIABILITY cases 5 and 6), many hosts pulling at once, each over its own connection (case 23), and
the zstd-compressed pulls that a host across a link sends (loopback pulls go uncompressed).
"""

from __future__ import annotations

import os
import socket
import subprocess
import tarfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness.errors import RemoteTimeout, UnreachableError
from harness.transport import connect
from harness.transport.base import KILL_BUDGET_S
from harness.transport.tarpull import Staging, tar_command
from tests.conftest import contents
from tests.leakwatch import LeakWatch
from tests.netns import _ip, netns_hosts
from tests.sshd import Sshd

pytestmark = pytest.mark.e2e

# Slack beyond a deadline for the kill attempt and the watchdog (SSHTransport._spawn) to finish.
SLACK_S = KILL_BUDGET_S + 3


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    with netns_hosts(4, tmp_path_factory.mktemp("netns")) as made:
        yield made


@pytest.fixture
def host(tmp_path):
    """A host of the test's own, for tests that cut its link."""
    with netns_hosts(1, tmp_path) as (made,):
        yield made


def test_each_host_runs_commands_at_its_own_address(hosts):
    for h in hosts:
        transport = connect(h.host_spec())
        try:
            inside = transport.run("ip -o -4 addr show scope global", timeout=10).stdout
        finally:
            transport.close()
        assert f"inet {h.address}/24" in inside
        assert all(f"inet {other.address}/" not in inside for other in hosts if other is not h)


def test_a_cut_link_leaves_the_address_unreachable_never_routed_out(host):
    """While the link is down the kernel has no route to the host but the blackhole: a connection
    attempt fails on this machine instead of leaving by the default gateway."""
    host.link_down()
    try:
        route = subprocess.run(["ip", "-j", "route", "get", host.address], capture_output=True, text=True)
        assert route.returncode != 0, f"{host.address} is routed while its link is down: {route.stdout}"
        with pytest.raises(OSError), socket.create_connection((host.address, 22), timeout=2):
            pass
    finally:
        host.link_up()
    assert connect(host.host_spec()).run("echo back", timeout=10).stdout == "back\n"


def test_the_containment_check_catches_a_cut_link_routed_by_a_gateway(tmp_path):
    """A cut link whose address a gateway takes over (as the default route would, without the
    stand-ins) must be refused before any packet goes. The gateway here is the second test host,
    whose namespace forwards nothing: nothing can leave even while the check is being tested."""
    with netns_hosts(2, tmp_path) as (cut, other):
        cut.link_down()
        subprocess.run(["ip", "route", "add", cut.subnet, "via", other.address, "metric", "100"], check=True)
        try:
            with pytest.raises(AssertionError, match="never be routed off this machine"):
                cut.assert_contained()
        finally:
            subprocess.run(["ip", "route", "del", cut.subnet, "via", other.address, "metric", "100"],
                           check=True)
            cut.link_up()


def test_a_host_once_gone_is_unreachable_not_routed_out(tmp_path):
    """After teardown (veth, namespace and blackhole gone) the range's backstop holds the address:
    a process that still tries it fails on this machine."""
    with netns_hosts(1, tmp_path) as (host,):
        address = host.address
    route = subprocess.run(["ip", "-j", "route", "get", address], capture_output=True, text=True)
    assert route.returncode != 0, f"{address} is routed once its host is gone: {route.stdout}"
    with pytest.raises(OSError), socket.create_connection((address, 22), timeout=2):
        pass


def assert_cut_off(transport, command: str) -> None:
    """The command fails within its 2 s deadline (plus the kill budget), however the link went."""
    started = time.monotonic()
    with pytest.raises((RemoteTimeout, UnreachableError)):
        transport.run(command, timeout=2)
    assert time.monotonic() - started < 2 + SLACK_S


def test_a_link_down_past_the_deadline_times_out_and_a_new_connection_works_once_it_is_back(host):
    transport = connect(host.host_spec())
    host.link_down()
    try:
        assert_cut_off(transport, "echo lost")
    finally:
        host.link_up()
        transport.close()
    fresh = connect(host.host_spec())
    assert fresh.run("echo back", timeout=10).stdout == "back\n"
    fresh.close()


def test_a_link_that_goes_down_mid_command_times_the_command_out(host):
    transport = connect(host.host_spec())
    cut = threading.Timer(0.5, host.link_down)
    cut.start()
    try:
        assert_cut_off(transport, "for i in $(seq 100); do echo $i; sleep 0.1; done")
    finally:
        cut.join()
        host.link_up()
        transport.close()


def test_a_short_blip_mid_command_is_no_failure(host):
    transport = connect(host.host_spec())
    script = "for i in $(seq 30); do echo $i; sleep 0.1; done"
    blip = threading.Thread(target=lambda: (time.sleep(0.5), host.link_down(), time.sleep(1), host.link_up()))
    blip.start()
    try:
        result = transport.run(script, timeout=20)
    finally:
        blip.join()
        host.link_up()
        transport.close()
    assert result.stdout.split() == [str(i) for i in range(1, 31)]


def test_a_frozen_host_times_out_and_answers_again_once_thawed(host):
    transport = connect(host.host_spec())
    host.freeze()
    try:
        with pytest.raises(RemoteTimeout):
            transport.run("echo frozen", timeout=1)
    finally:
        host.thaw()
    assert transport.run("echo thawed", timeout=10).stdout == "thawed\n"
    transport.close()


def test_eight_transports_pull_at_once_each_on_its_own_connection(hosts):
    """Two workers per host, each pulling that host's directory: no deadlock, every checksum right."""
    for h in hosts:
        (h.workdir / "run").mkdir(exist_ok=True)
        (h.workdir / "run" / "trace.bin").write_bytes(os.urandom(4 << 20))
        (h.workdir / "run" / "server.log").write_text(f"{h.name} ready\n" * 10_000)
    workers = [(h, i) for h in hosts for i in range(2)]

    def pull(worker):
        h, i = worker
        transport = connect(h.host_spec(f"{h.name}-worker{i}"))
        try:
            local = h.workdir.parent / f"pulled-{i}"
            transport.pull(str(h.workdir / "run"), local, timeout=60)
            peer = transport.run("echo $SSH_CONNECTION", timeout=10).stdout.split()
            return contents(local), (peer[0], peer[1])  # this side's address and port: the connection
        finally:
            transport.close()

    with ThreadPoolExecutor(len(workers)) as pool:
        outcomes = list(pool.map(pull, workers, timeout=120))
    for (h, _), (pulled, _) in zip(workers, outcomes, strict=True):
        assert pulled == contents(h.workdir / "run") and sorted(pulled) == ["server.log", "trace.bin"]
    assert len({connection for _, connection in outcomes}) == len(workers)


# -- compression: pulls across a link are zstd streams ---------------------------------------------

def test_pulls_across_a_link_are_compressed_and_pulls_from_this_machine_are_not(hosts, tmp_path):
    across = connect(hosts[0].host_spec())
    with Sshd(tmp_path / "sshd") as loopback:
        here = connect(loopback.host_spec())
        assert (across.compress_pulls, here.compress_pulls) == (True, False)
        here.close()
    across.close()


def zstd_tar(tmp_path, files: dict[str, bytes]) -> bytes:
    """The stream a host with zstd sends for a directory holding `files`."""
    src = tmp_path / "src"
    src.mkdir()
    for name, data in files.items():
        (src / name).write_bytes(data)
    return subprocess.run(["bash", "-c", tar_command(str(src), compress=True)], capture_output=True,
                          check=True).stdout


def test_a_zstd_stream_arriving_in_small_pieces_extracts_whole(tmp_path):
    files = {"trace.json": b'{"ph": "X"}' * 50_000, "noise.bin": os.urandom(300_000)}
    stream = zstd_tar(tmp_path, files)
    assert stream[:4] == b"\x28\xb5\x2f\xfd"  # zstd's magic number: a compressed stream indeed
    chunks = iter([stream[i:i + 1000] for i in range(0, len(stream), 1000)])
    with Staging(tmp_path / "local", label="zstd") as staging:
        staging.extract(lambda: next(chunks, b""))
        pulled = staging.commit()
    assert pulled.sizes == {name: len(data) for name, data in files.items()}
    assert contents(tmp_path / "local") == files


def test_a_truncated_zstd_stream_fails_and_leaves_nothing(tmp_path):
    stream = zstd_tar(tmp_path, {"noise.bin": os.urandom(300_000)})
    chunks = iter([stream[: len(stream) // 2]])
    with pytest.raises(tarfile.TarError), Staging(tmp_path / "local", label="cut") as staging:
        staging.extract(lambda: next(chunks, b""))
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_a_deadline_passing_mid_zstd_stream_is_raised_to_the_caller(tmp_path):
    stream = zstd_tar(tmp_path, {"noise.bin": os.urandom(300_000)})
    pieces = [stream[:100_000]]

    def read() -> bytes:
        if pieces:
            return pieces.pop()
        raise TimeoutError

    with pytest.raises(TimeoutError), Staging(tmp_path / "local", label="late") as staging:
        staging.extract(read)
    assert sorted(os.listdir(tmp_path)) == ["src"]


# -- the watch on this machine's own interfaces (tests/leakwatch.py) ---------------------------------

def test_the_leak_watch_records_a_packet_to_the_test_range_leaving_by_a_watched_interface(tmp_path):
    """A test host's veth stands in for eth0: what is sent by it ends in the host's namespace, which
    takes nothing not addressed to it, yet it leaves by the watched interface as a leak would. The
    watch names it; a packet to an address outside the range, sent the same way, it lets be."""
    with netns_hosts(1, tmp_path, sshd=False) as (host,):
        stray = host.subnet.replace(".0/24", ".9")
        _ip("route", "add", "198.51.100.200/32", "dev", host.veth)   # TEST-NET-2, into the namespace too
        for address in (stray, "198.51.100.200"):   # sent at once, no ARP asked
            _ip("neigh", "replace", address, "lladdr", "02:00:00:00:00:09", "dev", host.veth, "nud", "permanent")
        with LeakWatch([host.veth]) as watch, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.sendto(b"leak", (stray, 9))
            udp.sendto(b"fine", ("198.51.100.200", 9))
    assert [(leak.interface, leak.destination, leak.protocol) for leak in watch.leaks] == \
        [(host.veth, stray, socket.IPPROTO_UDP)]
