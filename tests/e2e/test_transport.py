"""The transport against a real OpenSSH server on a loopback port, and against this machine.

Both transports promise the same things, so most tests run on both; what only SSH can get wrong
(host keys, credentials, a frozen or vanished peer, ssh config, jump hosts) runs on SSH alone.
"""

from __future__ import annotations

import bz2
import functools
import hashlib
import io
import lzma
import os
import shlex
import shutil
import subprocess
import tarfile
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import paramiko
import pytest

from harness.errors import AuthError, CommandFailed, HostKeyError, RemoteError, RemoteTimeout, UnreachableError
from harness.transport import HostSpec, connect
from harness.transport.base import KILL_BUDGET_S, OUTPUT_LIMIT
from harness.transport.inbuffer import ReadAhead
from harness.transport.tarpull import Refused, Staging, TooLarge
from tests.conftest import contents
from tests.peak import peak_kb, reset_peak
from tests.sshd import Sshd

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    with Sshd(tmp_path_factory.mktemp("sshd")) as server:
        yield server


@pytest.fixture
def own_sshd(tmp_path):
    """A server of the test's own, for tests that freeze or kill it."""
    with Sshd(tmp_path / "sshd") as server:
        yield server


@pytest.fixture(scope="module", params=["ssh", "ssh-exec", "local"])
def transport(request, sshd):
    """One transport per kind for the module, as callers reuse one per host and worker. "ssh" starts
    its commands through the host's command starter (harness/remote/mux.py), "ssh-exec" on an exec
    channel each, as a host without python3 has them."""
    spec = sshd.host_spec() if request.param.startswith("ssh") else HostSpec(name="localhost", transport="local")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HARNESS_SSH_MUX", "0" if request.param == "ssh-exec" else "1")
        t = connect(spec)
    yield t
    t.close()


def alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# -- run ----------------------------------------------------------------------------------------

def test_run_returns_stdout_stderr_and_exit_code(transport):
    result = transport.run("echo out; echo err >&2; exit 3", timeout=10, check=False)
    assert (result.stdout, result.stderr, result.exit_code, result.ok) == ("out\n", "err\n", 3, False)


def test_run_uses_bash(transport):
    assert transport.run("echo ${BASH_VERSION:+bash}", timeout=10).stdout == "bash\n"


def test_a_failing_command_raises_with_its_exit_code_and_output_tail(transport):
    with pytest.raises(CommandFailed) as failed:
        transport.run("seq 100; echo 'no such model' >&2; exit 7", timeout=10)
    assert failed.value.exit_code == 7
    assert failed.value.command.startswith("seq 100")
    assert "no such model" in failed.value.output and "100" in failed.value.output
    assert "no such model" in failed.value.detail()


def test_stdin_is_delivered_and_then_closed(transport):
    data = os.urandom(3 << 20)
    result = transport.run("sha256sum", stdin=data, timeout=30)
    assert result.stdout.split()[0] == hashlib.sha256(data).hexdigest()


def test_stdin_the_command_does_not_read_is_no_error(transport):
    assert transport.run("exit 0", stdin=os.urandom(8 << 20), timeout=30).ok


def test_a_command_past_its_timeout_is_killed_with_its_whole_process_group(transport, tmp_path):
    marker = tmp_path / "child.pid"
    with pytest.raises(RemoteTimeout) as timed_out:
        transport.run(f"sleep 300 & echo $! > {marker}; echo started; wait", timeout=2)
    assert "started" in timed_out.value.output
    assert not alive(int(marker.read_text()))
    assert transport.run("echo still usable", timeout=10).stdout == "still usable\n"


def test_an_output_flood_neither_deadlocks_nor_grows_memory(transport):
    reset_peak()   # the test run's own peak so far would hide growth below it
    before = peak_kb()
    result = transport.run("yes | head -c 128M; echo done >&2", timeout=120)
    grown_mb = (peak_kb() - before) / 1024
    assert len(result.stdout) == OUTPUT_LIMIT and result.stdout.endswith("y\n")
    assert result.stderr == "done\n"
    assert grown_mb < 64


# -- put ----------------------------------------------------------------------------------------

def test_put_writes_a_secret_with_mode_0600_creating_parent_directories(transport, tmp_path):
    target = tmp_path / "a" / "b" / "token"
    transport.put(b"s3cret; $(id)", str(target), mode=0o600)
    assert target.read_bytes() == b"s3cret; $(id)"
    assert target.stat().st_mode & 0o777 == 0o600


def test_put_replaces_a_file_atomically_leaving_no_temporary_file(transport, tmp_path):
    target = tmp_path / "launch.sh"
    target.write_text("old")
    transport.put(b"#!/bin/bash\n", str(target), mode=0o755)
    assert target.read_bytes() == b"#!/bin/bash\n"
    assert target.stat().st_mode & 0o777 == 0o755
    assert os.listdir(tmp_path) == ["launch.sh"]


# -- pull ---------------------------------------------------------------------------------------

def test_pull_brings_back_nested_files_with_their_sizes(transport, tmp_path):
    remote = tmp_path / "remote"
    (remote / "profile" / "rank0").mkdir(parents=True)
    (remote / "server.log").write_text("ready\n")
    (remote / "profile" / "rank0" / "trace.json").write_bytes(b"{}" * 50_000)
    pulled = transport.pull(str(remote), tmp_path / "local", timeout=30)
    assert pulled.files == 2 and pulled.bytes == 100_006
    assert contents(tmp_path / "local") == contents(remote)
    assert pulled.sizes == {"profile/rank0/trace.json": 100_000, "server.log": 6}


def test_pull_merges_into_an_existing_directory(transport, tmp_path):
    (tmp_path / "remote").mkdir()
    (tmp_path / "remote" / "bench.json").write_text("new")
    local = tmp_path / "local"
    local.mkdir()
    (local / "manifest.json").write_text("kept")
    (local / "bench.json").write_text("old")
    transport.pull(str(tmp_path / "remote"), local, timeout=30)
    assert (local / "manifest.json").read_text() == "kept"
    assert (local / "bench.json").read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == ["local", "remote"]  # no staging directory left behind


def test_hostile_remote_names_stay_inside_the_local_directory(transport, tmp_path):
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "line\nbreak").write_text("a")
    (remote / "-rf").write_text("b")
    (remote / "passwd").symlink_to("/etc/passwd")
    (remote / "etc").symlink_to("/etc")
    local = tmp_path / "local"
    pulled = transport.pull(str(remote), local, timeout=30)
    assert sorted(pulled.sizes) == ["-rf", "line\nbreak"]
    assert sorted(os.listdir(local)) == ["-rf", "line\nbreak"]
    assert sorted(pulled.skipped) == ["./etc (link to /etc)", "./passwd (link to /etc/passwd)"]


def test_a_pull_of_a_missing_directory_fails_and_leaves_nothing(transport, tmp_path):
    with pytest.raises(CommandFailed) as failed:
        transport.pull(str(tmp_path / "absent"), tmp_path / "local", timeout=30)
    assert "absent" in failed.value.output
    assert os.listdir(tmp_path) == []


def test_a_pull_larger_than_max_bytes_is_refused_and_leaves_nothing(transport, tmp_path):
    (tmp_path / "remote").mkdir()
    (tmp_path / "remote" / "big").write_bytes(b"x" * 10_000)
    with pytest.raises(TooLarge, match="max_bytes=1000"):
        transport.pull(str(tmp_path / "remote"), tmp_path / "local", timeout=30, max_bytes=1000)
    assert os.listdir(tmp_path) == ["remote"]


def test_a_crafted_tar_stream_cannot_write_outside_or_link(tmp_path):
    """What no honest `tar -c` produces, but a compromised host could send."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        def add(name, data=b"x", **attrs):
            info = tarfile.TarInfo(name)
            info.size = len(data) if attrs.get("type", tarfile.REGTYPE) == tarfile.REGTYPE else 0
            for key, value in attrs.items():
                setattr(info, key, value)
            tar.addfile(info, io.BytesIO(data) if info.size else None)
        add("../escape")
        add("/tmp/absolute")
        add("a/../../escape2")
        add("hard", type=tarfile.LNKTYPE, linkname="/etc/passwd")
        add("soft", type=tarfile.SYMTYPE, linkname="/etc/passwd")
        add("null", type=tarfile.CHRTYPE, devmajor=1, devminor=3)
        add("setuid", mode=0o4777)
        add("ok/file", b"fine")
    chunks = iter([buf.getvalue()])
    local = tmp_path / "run" / "collected"
    with Staging(local, label="crafted") as staging:
        staging.extract(lambda: next(chunks, b""))
        pulled = staging.commit()
    assert sorted(pulled.sizes) == ["ok/file", "setuid"]
    assert len(pulled.skipped) == 6
    assert sorted(os.listdir(tmp_path)) == ["run"] and sorted(os.listdir(tmp_path / "run")) == ["collected"]
    assert (local / "setuid").stat().st_mode & 0o7000 == 0


def archive(*members: tuple[str, bytes | None, dict], fmt=tarfile.PAX_FORMAT) -> bytes:
    """A tar stream of (name, data or None for a directory, pax headers)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for name, data, pax in members:
            info = tarfile.TarInfo(name)
            info.pax_headers = pax
            if data is None:
                info.type = tarfile.DIRTYPE
            else:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data else None)
    return buf.getvalue()


def chunked(data: bytes, size: int) -> Callable[[], bytes]:
    """A `Staging.extract` source that hands `data` on in chunks of `size` bytes, then b""."""
    return functools.partial(next, iter([data[i:i + size] for i in range(0, len(data), size)]), b"")


@pytest.mark.parametrize("stream, why", [
    (archive(("profile/trace.json.gz", b"x", {"mtime": "nan"}), ("ok", b"y", {})), None),
    (archive(("a", b"file", {}), ("a/b", b"inside a file", {})), "cannot extract"),
    (archive(("d", None, {}), ("d", b"a file where a folder is", {})), "cannot extract"),
    (archive(("ok", b"y", {})) + os.urandom(3 << 20), "after the end of the archive"),
], ids=["pax-mtime-nan", "file-then-folder", "folder-then-file", "endless-trailer"])
def test_a_hostile_tar_stream_is_a_failed_collect_never_our_exception(tmp_path, stream, why):
    """Seen in an audit of what a compromised host could send: each used to escape as ValueError or
    OSError and end the host's worker; now each is a Refused pull (kind collect) or, for a time that
    is no number, a file without it, and nothing reaches the final path."""
    read = chunked(stream, 65536)
    local = tmp_path / "run"
    with Staging(local, label="hostile") as staging:
        if why is None:
            staging.extract(read)
            assert sorted(staging.commit().sizes) == ["ok", "profile/trace.json.gz"]
            return
        with pytest.raises(Refused, match=why) as refused:
            staging.extract(read)
    assert refused.value.kind == "collect" and not local.exists()


COMPRESSORS = {"plain": None, "gzip": lambda: zlib.compressobj(wbits=31), "bzip2": bz2.BZ2Compressor,
               "xz": lzma.LZMACompressor}
"""What a host could send unasked (we ask for plain tar or zstd): each is found out and read."""


@pytest.mark.parametrize("compression", list(COMPRESSORS))
def test_a_header_that_claims_a_gigabyte_is_refused_before_it_is_read(tmp_path, compression):
    """A pax header says its own size, and tarfile reads it whole into memory: a host that claims
    1 GB for one, and sends without end, is refused after 16 MB at most, not after a gigabyte,
    whether the stream is compressed or not."""
    claim = tarfile.TarInfo("././@PaxHeader")
    claim.type, claim.size = tarfile.XHDTYPE, 1 << 30
    make = COMPRESSORS[compression]
    packer, fed = make() if make else None, []

    def endless() -> bytes:
        while True:   # a compressor may keep what it was given until it has a block's worth
            fed.append(os.urandom(1 << 18) if fed else claim.tobuf(tarfile.USTAR_FORMAT))
            if out := (packer.compress(fed[-1]) if packer else fed[-1]):
                return out
    with Staging(tmp_path / "run", label="pax-claim") as staging, pytest.raises(Refused, match="header of"):
        staging.extract(endless)
    assert sum(map(len, fed)) <= 32 << 20 and not (tmp_path / "run").exists()


@pytest.mark.parametrize("compression", ["gzip", "bzip2", "xz"])
def test_a_stream_compressed_unasked_extracts_whole_and_nothing_may_follow_it(tmp_path, compression):
    big, text = os.urandom((1 << 20) + 3), b"ready\n" * 500_000     # 3 MB that compress to little
    packer = COMPRESSORS[compression]()
    stream = packer.compress(archive(("profile/big", big, {}), ("server.log", text, {}))) + packer.flush()
    for extra, why in ((b"", None), (os.urandom(3 << 20), "after the end of the archive")):
        data = stream + extra
        read = chunked(data, 70_001)
        with Staging(tmp_path / "run", label=compression) as staging:
            if why:
                with pytest.raises(Refused, match=why):
                    staging.extract(read)
                continue
            staging.extract(read)
            assert staging.commit().sizes == {"profile/big": len(big), "server.log": len(text)}
            assert contents(tmp_path / "run") == {"profile/big": big, "server.log": text}


def test_an_endless_stream_of_entries_stops_at_the_cap(tmp_path, monkeypatch):
    monkeypatch.setattr("harness.transport.tarpull.MAX_MEMBERS", 50)
    stream = archive(*[(f"f{i}", b"", {}) for i in range(51)])
    chunks = iter([stream])
    with Staging(tmp_path / "run", label="endless") as staging, pytest.raises(Refused, match="more than 50 entries"):
        staging.extract(lambda: next(chunks, b""))


def test_a_pull_the_local_disk_cannot_hold_is_refused_before_any_file_arrives(tmp_path):
    """The host announces the folder's size first: more than the disk has free is refused at once."""
    written = []
    stream = b"%d\n" % (shutil.disk_usage(tmp_path).free + 1) + archive(("profile/trace.json", b"x" * 1000, {}))
    chunks = iter([stream])

    def read() -> bytes:
        written.extend(p.name for p in tmp_path.rglob("*") if p.is_file())
        return next(chunks, b"")
    with Staging(tmp_path / "run", label="node1:/w/run") as staging, \
            pytest.raises(TooLarge, match="node1:/w/run take .*B free, of which 268 MB stay free for the "
                                          "sweep's own records: make room"):
        staging.extract(read, announced=True)
    assert written == [] and not (tmp_path / "run").exists()


@pytest.mark.parametrize("chunk", [1, 4093, 1 << 18, 1 << 22])
def test_files_larger_than_a_read_arrive_whole_in_any_chunking(tmp_path, chunk):
    big, small = os.urandom((1 << 20) + 12345), b"tail"
    stream = b"123\n" + archive((".", None, {}), ("profile/big.trace.json.gz", big, {}), ("log", small, {}),
                                fmt=tarfile.GNU_FORMAT)
    with Staging(tmp_path / "run", label="chunked") as staging:
        staging.extract(chunked(stream, chunk), announced=True)
        pulled = staging.commit()
    assert pulled.sizes == {"profile/big.trace.json.gz": len(big), "log": len(small)}
    assert (tmp_path / "run" / "profile" / "big.trace.json.gz").read_bytes() == big


def test_a_stream_cut_inside_a_file_is_an_error_and_leaves_nothing(tmp_path):
    stream = archive(("profile/big", os.urandom(1 << 20), {}))[: 600_000]
    chunks = iter([stream])
    with Staging(tmp_path / "run", label="cut") as staging, pytest.raises(tarfile.ReadError):
        staging.extract(lambda: next(chunks, b""))
    assert not (tmp_path / "run").exists()


def test_files_after_a_refused_one_and_a_sparse_one_arrive_whole(tmp_path):
    """The plain tar stream is read as a file that only seeks forward: a refused member's megabyte
    is read past, a sparse file (GNU tar -S) goes through tarfile's own reader, and the files after
    each arrive byte for byte, from chunks of odd sizes."""
    (tmp_path / "src").mkdir()
    with open(tmp_path / "src" / "sparse", "wb") as f:
        f.seek(3 << 20)
        f.write(b"end of a sparse file")
    big, after = os.urandom((1 << 20) + 7), os.urandom(300_001)
    (tmp_path / "src" / "z-after").write_bytes(after)
    sparse = subprocess.run(["tar", "-C", str(tmp_path / "src"), "-S", "--format=gnu", "-cf", "-", "sparse", "z-after"],
                            capture_output=True, check=True).stdout
    head = archive(("../refused", big, {}), ("kept", b"kept", {}), fmt=tarfile.GNU_FORMAT)
    stream = head[:3 * 512 + len(big) + 505] + sparse   # the two members without the archive's end
    with Staging(tmp_path / "run", label="forward") as staging:
        staging.extract(chunked(stream, 70_001))
        pulled = staging.commit()
    assert sorted(pulled.sizes) == ["kept", "sparse", "z-after"]
    assert pulled.skipped and (tmp_path / "run" / "z-after").read_bytes() == after
    assert (tmp_path / "run" / "sparse").read_bytes() == (tmp_path / "src" / "sparse").read_bytes()


def test_a_compressed_stream_arriving_a_byte_at_a_time_extracts_whole(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "server.log").write_text("ready\n" * 100)
    archive = subprocess.run(["bash", "-c", f"tar -C {tmp_path / 'src'} -cf - . | gzip -1"],
                             capture_output=True, check=True).stdout
    with Staging(tmp_path / "local", label="bytewise") as staging:
        staging.extract(chunked(archive, 1))
        assert staging.commit().sizes == {"server.log": 600}
    assert contents(tmp_path / "local") == {"server.log": b"ready\n" * 100}


# -- SSH only: host keys, credentials, reachability ------------------------------------------------

def test_an_unknown_host_key_is_refused_with_the_command_that_pins_it(sshd, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    with pytest.raises(HostKeyError) as refused:
        connect(sshd.host_spec(known_hosts=str(empty)))
    assert f"ssh-keyscan -p {sshd.port} 127.0.0.1 >> {empty}" in str(refused.value)
    assert not refused.value.retryable


def test_a_changed_host_key_is_refused_showing_both_fingerprints(sshd, tmp_path):
    other = tmp_path / "other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{sshd.port} {(tmp_path / 'other.pub').read_text()}")
    with pytest.raises(HostKeyError) as refused:
        connect(sshd.host_spec(known_hosts=str(known)))
    message = str(refused.value)
    fingerprints = [subprocess.run(["ssh-keygen", "-lf", f"{key}.pub"], capture_output=True, text=True,
                                   check=True).stdout.split()[1] for key in (other, sshd.host_key)]
    assert "CHANGED" in message and all(fp in message for fp in fingerprints)


def test_standard_known_hosts_markers_load_and_a_revoked_key_is_refused(sshd, tmp_path):
    """OpenSSH's `@cert-authority` and `@revoked` lines (sshd(8)) made paramiko's own loader raise
    InvalidHostKey on every connection. A CA line is no reason to refuse a pinned host; a revoked key
    is refused even where another line pins it; a line no parser can read is skipped, as OpenSSH does."""
    ca = tmp_path / "ca"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(ca)], check=True)
    pinned = Path(sshd.known_hosts).read_text()
    known = tmp_path / "known_hosts"
    known.write_text(f"@cert-authority *.example.com {(tmp_path / 'ca.pub').read_text()}"
                     "not-a-host-key-line\n" + pinned)
    transport = connect(sshd.host_spec(known_hosts=str(known)))
    assert transport.run("echo pinned", timeout=10).stdout == "pinned\n"
    transport.close()
    host_key = Path(f"{sshd.host_key}.pub").read_text().split()
    known.write_text(pinned + f"@revoked * {host_key[0]} {host_key[1]}\n")
    with pytest.raises(HostKeyError, match="marked @revoked"):
        connect(sshd.host_spec(known_hosts=str(known)))


def test_a_wrong_client_key_is_an_auth_error(sshd, tmp_path):
    stranger = tmp_path / "stranger"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True)
    with pytest.raises(AuthError):
        connect(sshd.host_spec(identity_file=str(stranger)))


def test_a_closed_port_is_unreachable_at_once(own_sshd):
    spec = own_sshd.host_spec()
    own_sshd.stop()
    started = time.monotonic()
    with pytest.raises(UnreachableError) as unreachable:
        connect(spec)
    assert time.monotonic() - started < spec.connect_timeout
    assert unreachable.value.retryable


def test_a_frozen_server_gives_a_timeout_and_the_transport_reconnects_after(own_sshd):
    transport = connect(own_sshd.host_spec())
    own_sshd.freeze()
    try:
        started = time.monotonic()
        with pytest.raises(RemoteTimeout):
            transport.run("echo hello", timeout=1)
        assert time.monotonic() - started < 1 + KILL_BUDGET_S + 2
    finally:
        own_sshd.thaw()
    assert transport.run("echo back", timeout=10).stdout == "back\n"
    transport.close()


def test_a_session_frozen_mid_command_gives_a_timeout_not_a_hang(own_sshd):
    """The command stops its own sshd session processes, so the freeze lands while it runs."""
    transport = connect(own_sshd.host_spec())
    freeze_my_session = (
        f"p=$PPID; while [ $p -gt 1 ] && [ $p != {own_sshd.pid} ]; do "
        "case $(cat /proc/$p/comm) in sshd*) kill -STOP $p;; esac; "
        "p=$(cut -d' ' -f4 /proc/$p/stat); done; sleep 5")
    started = time.monotonic()
    with pytest.raises(RemoteTimeout):
        transport.run(freeze_my_session, timeout=1)
    assert time.monotonic() - started < 1 + KILL_BUDGET_S + 2
    transport.close()


def test_a_connection_lost_mid_pull_leaves_nothing_at_the_final_path(own_sshd, tmp_path):
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "trace.bin").write_bytes(os.urandom(64 << 20))
    local = tmp_path / "results" / "run"
    transport = connect(own_sshd.host_spec())

    def kill_once_bytes_arrive():
        while not any(p.stat().st_size for p in (tmp_path / "results").glob(".run.pull-*/*")):
            time.sleep(0.01)
        own_sshd.stop()

    killer = threading.Thread(target=kill_once_bytes_arrive, daemon=True)
    (tmp_path / "results").mkdir()
    killer.start()
    with pytest.raises(RemoteError) as lost:
        transport.pull(str(remote), local, timeout=60)
    killer.join(10)
    assert isinstance(lost.value, (UnreachableError, CommandFailed)), lost.value
    assert os.listdir(tmp_path / "results") == []


def test_workers_pull_at_once_each_on_its_own_connection(sshd, tmp_path):
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "trace.json").write_bytes(b"[1,2,3]" * 200_000)
    results: dict[int, object] = {}

    def worker(i: int) -> None:
        transport = connect(sshd.host_spec(name=f"worker-{i}"))
        try:
            results[i] = transport.pull(str(remote), tmp_path / f"local-{i}", timeout=60)
        except Exception as e:  # reported below, with the worker that hit it
            results[i] = e
        finally:
            transport.close()

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert [getattr(results.get(i), "sizes", results.get(i)) for i in range(6)] == [{"trace.json": 1_400_000}] * 6
    assert all(contents(tmp_path / f"local-{i}") == contents(remote) for i in range(6))


def use_ssh_config(monkeypatch, path: Path, sshd: Sshd, name: str, *extra: str) -> None:
    """An ssh config whose Host `name` is the test sshd (address, port, user, key, known hosts), with
    `extra` lines, made the harness's own (HARNESS_SSH_CONFIG)."""
    lines = ["HostName 127.0.0.1", f"Port {sshd.port}", f"User {sshd.user}", f"IdentityFile {sshd.client_key}",
             f"UserKnownHostsFile {sshd.known_hosts}", *extra]
    path.write_text(f"Host {name}\n" + "".join(f"  {line}\n" for line in lines))
    monkeypatch.setenv("HARNESS_SSH_CONFIG", str(path))


def test_ssh_config_supplies_address_port_user_key_and_known_hosts(sshd, tmp_path, monkeypatch):
    use_ssh_config(monkeypatch, tmp_path / "ssh_config", sshd, "gpu-alias")
    transport = connect(HostSpec(name="gpu-alias"))
    assert transport.run("echo via config", timeout=10).stdout == "via config\n"
    transport.close()


def test_a_jump_host_carries_the_connection(sshd):
    transport = connect(sshd.host_spec(jump=f"{sshd.user}@127.0.0.1:{sshd.port}"))
    assert transport.run("echo jumped", timeout=10).stdout == "jumped\n"
    transport.close()


def _pulls_whole(transport, tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "trace.json").write_bytes(os.urandom(3 << 20))
    pulled = transport.pull(str(remote), tmp_path / "local", timeout=60)
    assert (tmp_path / "local" / "trace.json").read_bytes() == (remote / "trace.json").read_bytes()
    assert pulled.sizes == {"trace.json": 3 << 20}


def test_a_socket_is_read_ahead_and_a_jump_hosts_channel_is_left_as_it_is(sshd, tmp_path):
    """The connection's own socket is read in large pieces (inbuffer.ReadAhead); through a jump host
    that is the first hop's, while the target's "socket" is a channel of it, left alone."""
    transport = connect(sshd.host_spec(jump=f"{sshd.user}@127.0.0.1:{sshd.port}"))
    try:
        _pulls_whole(transport, tmp_path)
        jump, target = (hop.transport.sock for hop in transport._hops)
        assert isinstance(jump, ReadAhead) and not isinstance(target, ReadAhead)
    finally:
        transport.close()


def test_a_proxy_command_carries_the_connection_unbuffered(sshd, tmp_path, monkeypatch):
    """ssh config's ProxyCommand (here bash's /dev/tcp relay): its `recv` waits for all it is asked,
    so it is not read ahead, and commands and pulls go through it whole."""
    relay = "bash -c 'exec 3<>/dev/tcp/%h/%p; cat <&3 & exec cat >&3'"
    use_ssh_config(monkeypatch, tmp_path / "ssh_config", sshd, "via-proxy", f"ProxyCommand {relay}")
    transport = connect(HostSpec(name="via-proxy"))
    try:
        assert transport.run("echo proxied", timeout=10).stdout == "proxied\n"
        _pulls_whole(transport, tmp_path)
        assert isinstance(transport._hops[-1].transport.sock, paramiko.ProxyCommand)
        assert transport.compress_pulls   # a ProxyCommand is a link, and its peer no address
    finally:
        transport.close()


def test_remote_paths_may_start_with_the_home_directory(sshd):
    transport = connect(sshd.host_spec())
    name = f"harness-put-test-{os.getpid()}"
    try:
        transport.put(b"x", f"~/{name}/f")
        assert transport.run(f"cat ~/{shlex.quote(name)}/f", timeout=10).stdout == "x"
    finally:
        transport.run(f"rm -rf ~/{shlex.quote(name)}", timeout=10)
        transport.close()


# -- the command starter (harness/remote/mux.py) -------------------------------------------------

def starter(transport):
    """The connection's command starter, or None (its commands take exec channels)."""
    return transport._mux


def test_commands_go_through_one_starter_process_per_connection(sshd):
    transport = connect(sshd.host_spec())
    try:
        first = transport.run("echo $PPID; cat /proc/$PPID/comm", timeout=10).stdout.split()
        assert starter(transport) is not None and not starter(transport).dead
        pids = {transport.run("cut -d' ' -f4 /proc/$PPID/stat", timeout=10).stdout.strip() for _ in range(3)}
        # each command: bash (under the `timeout` of its own group) under the same python3 starter
        assert len(pids) == 1
        pid = pids.pop()
        assert transport.run(f"cat /proc/{pid}/comm", timeout=10).stdout.strip().startswith("python")
        assert first[1] == "timeout"
        # its command line names it, without the module's documentation
        shown = transport.run(f"tr '\\0' ' ' < /proc/{pid}/cmdline", timeout=10).stdout
        assert "the harness's command starter" in shown and "One command at a time" not in shown
        assert len(shown) < 3500
    finally:
        transport.close()


def test_a_host_whose_starter_cannot_start_runs_commands_on_exec_channels(sshd, monkeypatch):
    from harness.transport import ssh
    monkeypatch.setattr(ssh, "_mux_source", lambda: "import sys; sys.exit(3)")
    transport = connect(sshd.host_spec())
    try:
        assert transport.run("echo hi", stdin=b"x", timeout=10).stdout == "hi\n"
        assert starter(transport) is None and not transport._mux_works
        assert transport.run("cat", stdin=b"fed", timeout=10).stdout == "fed"
    finally:
        transport.close()


def test_what_a_login_script_prints_before_the_starter_is_passed_over(sshd, monkeypatch):
    from harness.transport import ssh
    real = ssh._mux_source()
    monkeypatch.setattr(ssh, "_mux_source", lambda: "print('Welcome to the cluster! Quota: 91%')\n" + real)
    transport = connect(sshd.host_spec())
    try:
        assert transport.run("echo hi", timeout=10).stdout == "hi\n"
        assert starter(transport) is not None
    finally:
        transport.close()


def test_a_starter_that_sends_garbage_fails_the_command_as_a_lost_link(sshd, monkeypatch):
    from harness.transport import ssh
    garbage = ("import sys; out = sys.stdout.buffer; out.write(b'\\x00harness-mux-1\\n'); out.flush(); "
               "sys.stdin.buffer.read(4); out.write(b'Z' + b'\\xff' * 8); out.flush(); import time; time.sleep(30)")
    monkeypatch.setattr(ssh, "_mux_source", lambda: garbage)
    transport = connect(sshd.host_spec())
    try:
        with pytest.raises(UnreachableError, match="malformed"):
            transport.run("echo hi", timeout=10)
        assert starter(transport) is None or starter(transport).dead
    finally:
        transport.close()


def test_after_a_command_is_abandoned_the_next_one_runs_on_a_working_starter(sshd):
    transport = connect(sshd.host_spec())
    try:
        transport.run("true", timeout=10)
        first = starter(transport)
        with pytest.raises(RemoteTimeout):
            transport.run("echo started; sleep 30", timeout=1)
        assert transport.run("echo next", timeout=10).stdout == "next\n"
        assert starter(transport) is not None and not starter(transport).dead
        assert first.dead or starter(transport) is first   # killed and drained, or replaced
    finally:
        transport.close()


@pytest.mark.parametrize("venv_python", ["given", "missing"])
def test_the_starter_runs_under_the_hosts_venv_python_when_it_is_there(sshd, venv_python):
    import dataclasses
    import sys
    python = sys.executable if venv_python == "given" else "/nonexistent/venv/bin/python"
    transport = connect(dataclasses.replace(sshd.host_spec(), python=python))
    try:
        starter_pid = transport.run("cut -d' ' -f4 /proc/$PPID/stat", timeout=10).stdout.strip()
        exe = transport.run(f"readlink -f /proc/{starter_pid}/exe", timeout=10).stdout.strip()
        expected = os.path.realpath(sys.executable) if venv_python == "given" else None
        assert exe == expected if expected else Path(exe).name.startswith("python3")
    finally:
        transport.close()
