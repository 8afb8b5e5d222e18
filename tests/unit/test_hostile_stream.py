"""What a host that is not trusted may send back, checked without a host: a pull's tar stream as
`Staging` reads it, the line a wrapped command starts with (harness/transport/ssh.py), the exit frame
of the host's command starter, and a chunked response to the benchmark client. Each is bounded and
checked, and fails as the host's error (a Refused pull, a lost link, a malformed response), never as
an empty success or an exception of ours."""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import tarfile
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from harness.errors import UnreachableError
from harness.remote.exchange import parse_exchange
from harness.transport import HostSpec, connect, ssh
from harness.transport.tarpull import Refused, Staging


def entry(name: str, data: bytes | None = b"", **attrs) -> bytes:
    """One tar entry as a host writes it (pax): a file of `data`, a folder for None, or what `attrs` say."""
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE if data is None else tarfile.REGTYPE
    for key, value in attrs.items():
        setattr(info, key, value)
    if info.type == tarfile.REGTYPE and data:
        info.size = len(data)
        return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape") + data + b"\0" * (-len(data) % 512)
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


END = b"\0" * 1024


def tar_of(*entries: bytes) -> bytes:
    """What `tar -C DIR -cf - .` writes: the folder itself first, the entries, the archive's end."""
    return entry(".", None) + b"".join(entries) + END


def chunks(*parts: bytes, size: int = 65536) -> Callable[[], bytes]:
    data = b"".join(parts)
    return functools.partial(next, iter([data[i:i + size] for i in range(0, len(data), size)]), b"")


# -- a pull's stream after its size line ------------------------------------------------------------

GOOD = tar_of(entry("server.log", b"ready\n"))


@pytest.mark.parametrize("stream", [
    b"4100\nWelcome to gpu-cluster (quota 91%)\n" + GOOD,
    b"4100\n28114\n" + GOOD,
    b"4100\nthis is not a tar stream\n",
    b"4100\n" + random.Random(7).randbytes(8192),
    b"4100\n" + b"\0" * 512 + GOOD,
    b"4100\n" + entry("server.log", b"ready\n") + END,
    b"4100\n" + zlib.compress(entry("server.log", b"ready\n") + END, wbits=31),
    b"4100\n" + zlib.compress(b"not a tar stream, compressed", wbits=31),
], ids=["a-banner-line", "a-second-number", "text", "random", "zeros", "no-folder-first", "gzip-no-folder",
        "gzip-text"])
def test_what_is_no_stream_of_a_folder_after_the_size_line_is_refused_never_an_empty_pull(tmp_path, stream):
    """tarfile reads a bad first header as an error only where it was opened at offset 0; past the size
    line it took one for the end of an empty archive, and the pull came back with no files, the run ok
    and its folder on the host deleted."""
    local = tmp_path / "run"
    with Staging(local, label="gpu-01:/w/run") as staging, pytest.raises(Refused, match="gpu-01:/w/run") as refused:
        staging.extract(chunks(stream, size=7), announced=True)
    assert refused.value.kind == "collect" and not local.exists()
    assert os.listdir(tmp_path) == []


def test_the_stream_of_a_folder_after_its_size_line_arrives_whole_in_any_chunking(tmp_path):
    for size in (1, 5, 511, 513, 65536):
        with Staging(tmp_path / f"run{size}", label="gpu-01:/w/run") as staging:
            staging.extract(chunks(b"4100\n", GOOD, size=size), announced=True)
            assert sorted(staging.commit().sizes) == ["server.log"]


def test_nothing_after_the_size_line_is_left_to_the_remote_tars_exit_status(tmp_path):
    """A remote tar that failed wrote nothing: its exit status and stderr say why (the pull checks
    them when the stream is no archive), so an empty stream stays tarfile's own error."""
    with Staging(tmp_path / "run", label="gpu-01:/w/run") as staging, pytest.raises(tarfile.ReadError):
        staging.extract(chunks(b"\n"), announced=True)


@pytest.mark.parametrize("cut", [0, 100, 512], ids=["at-an-entry", "inside-a-header", "after-a-header"])
def test_an_archive_cut_short_between_entries_is_no_valid_stream_whatever_the_tars_exit_status(tmp_path, cut):
    """Cut at an entry's end, tarfile took the stream's end for the archive's and the pull came back
    shorter, the run ok. Now it is a tarfile error, which the transports judge after the remote tar's
    exit status and the link (a lost link or a failed tar says more)."""
    first = entry(".", None) + entry("server.log", b"ready\n")
    stream = (first + entry("profile/rank0.json", b"{}"))[:len(first) + cut]
    with Staging(tmp_path / "run", label="gpu-01:/w/run") as staging, \
            pytest.raises(tarfile.ReadError, match="without its end blocks|unexpected end of data|truncated"):
        staging.extract(chunks(b"4100\n", stream, size=7), announced=True)
    assert not (tmp_path / "run").exists()


# -- entries left out ---------------------------------------------------------------------------------

def test_entries_left_out_are_listed_short_and_at_most_a_thousand(tmp_path):
    many = 1500
    links = (entry(f"l{i}-" + "n" * 5000, type=tarfile.SYMTYPE, linkname="t" * 100_000) for i in range(many))
    stream = tar_of(*links, entry("dev", type=tarfile.CHRTYPE), entry("server.log", b"ready\n"))
    with Staging(tmp_path / "run", label="gpu-01:/w/run") as staging:
        staging.extract(chunks(b"4100\n", stream), announced=True)
        pulled = staging.commit()
    assert pulled.files == 1 and len(pulled.skipped) == 1001
    assert pulled.skipped[-1] == f"... {many + 1 - 1000} more"
    assert pulled.skipped[0].startswith("l0-nnn") and "(link to ttt" in pulled.skipped[0]
    assert max(map(len, pulled.skipped)) <= 2 * 200 + 20   # a name and a link target of 200 each


def test_an_entry_left_out_whose_name_is_no_utf8_is_listed_as_text_any_writer_can_encode(tmp_path):
    """tarfile keeps bytes that are no UTF-8 as lone surrogates, which a UTF-8 writer (a terminal, a
    report) refuses."""
    stream = tar_of(entry("./bad-\udcff-name", type=tarfile.SYMTYPE, linkname="/etc/\udcfe"))
    with Staging(tmp_path / "run", label="gpu-01:/w/run") as staging:
        staging.extract(chunks(b"0\n", stream), announced=True)
        skipped = staging.commit().skipped
    assert skipped == ("./bad-?-name (link to /etc/?)",)
    json.dumps(skipped, ensure_ascii=False).encode()


def test_entries_of_megabytes_each_are_not_kept_while_the_stream_is_read(tmp_path):
    """A pax header may give an entry megabytes of name, link or attributes: tarfile keeps every entry
    it read, and the names of those left out were kept too; now one at a time is."""
    big = 1 << 20
    stream = tar_of(*(entry(f"l{i}", type=tarfile.SYMTYPE, linkname="x" * big) for i in range(20)),
                    *(entry(f"d{i}", None, pax_headers={"comment": "y" * big}) for i in range(20)))
    read = chunks(b"0\n", stream, size=big)
    tracemalloc.start()
    try:
        with Staging(tmp_path / "run", label="gpu-01:/w/run") as staging:
            staging.extract(read, announced=True)
            staging.commit()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * big, f"{peak / big:.0f} MB held for 40 MB of entries"


# -- merging into a folder that exists ------------------------------------------------------------------

@pytest.mark.parametrize("local_has, sent", [
    ("file", tar_of(entry("a.log", b"A"), entry("launch.sh", None), entry("launch.sh/x", b"x"))),
    ("folder", tar_of(entry("a.log", b"A"), entry("launch.sh", b"#!/bin/sh\n"))),
], ids=["a-folder-where-a-file-is", "a-file-where-a-folder-is"])
def test_a_merge_that_meets_a_local_file_or_folder_of_the_same_name_is_refused_before_anything_moves(
        tmp_path, local_has, sent):
    local = tmp_path / "run"
    (local / "keep").mkdir(parents=True)
    if local_has == "file":
        (local / "launch.sh").write_text("ours\n")
    else:
        (local / "launch.sh").mkdir()
        (local / "launch.sh" / "ours").write_text("ours\n")
    before = sorted(str(p.relative_to(local)) for p in local.rglob("*"))
    with Staging(local, label="gpu-01:/w/run") as staging:
        staging.extract(chunks(b"0\n", sent), announced=True)
        with pytest.raises(Refused, match=r"gpu-01:/w/run: the host sent 'launch.sh' as a") as refused:
            staging.commit()
    assert refused.value.kind == "collect"
    assert sorted(str(p.relative_to(local)) for p in local.rglob("*")) == before   # a.log not moved in
    assert sorted(os.listdir(tmp_path)) == ["run"]


def test_a_pull_over_the_local_transport_that_meets_a_local_file_is_a_refused_collect(tmp_path):
    remote, local = tmp_path / "host-run", tmp_path / "results-run"
    (remote / "launch.sh").mkdir(parents=True)
    (remote / "a.log").write_text("A")
    (remote / "launch.sh" / "x").write_text("x")
    local.mkdir()
    (local / "launch.sh").write_text("#!/bin/sh\n")
    transport = connect(HostSpec(name="gpu-01", transport="local"))
    with pytest.raises(Refused, match="gpu-01:.*'launch.sh' as a folder"):
        transport.pull(str(remote), local, timeout=30)
    assert sorted(os.listdir(local)) == ["launch.sh"] and (local / "launch.sh").read_text() == "#!/bin/sh\n"


# -- the line a wrapped command starts with -----------------------------------------------------------

MARK = b"harness-pgid-4b7e "   # begins the line a wrapped command starts with (`_wrap` prints it)


def stripped(*pieces: bytes) -> tuple[bytes, int | None]:
    """What stdout keeps of `pieces` after the wrapper's line, and the group id that line gave."""
    command = ssh._GroupCommand("gpu-01")
    out = b"".join(command._strip_pgid(piece) for piece in pieces)
    return out, command._pgid


def test_the_wrapper_prints_its_line_with_the_mark():
    assert f'echo "{MARK.decode()}$PPID"' in ssh._wrap("true", 10)


@pytest.mark.parametrize("before", [b"", b"Welcome to gpu-cluster (quota 91%)\n", b"1234\n5678\n",
                                    b"a banner without its newline", b"7" * 5000 + b"\n", b"x" * 60_000],
                         ids=["nothing", "a-banner", "numbers", "unterminated", "5000-digits", "60-kB"])
def test_whatever_a_login_script_prints_before_the_wrappers_line_is_dropped_however_it_is_cut(before):
    stream = before + MARK + b"4242\n" + b'{"status": "healthy"}\n' + MARK + b"1\n"
    for cut in {*range(0, len(stream), max(len(stream) // 300, 1)), *range(len(before), len(before) + 30)}:
        assert stripped(stream[:cut], stream[cut:]) == (b'{"status": "healthy"}\n' + MARK + b"1\n", 4242)
    assert stripped(*(stream[i:i + 1] for i in range(min(len(stream), 2000))), stream[2000:])[1] == 4242


@pytest.mark.parametrize("line", [b"99999999999999999999", b"1", b"0", b"-5", b"12 34", b""])
def test_a_group_id_that_is_no_process_group_of_a_command_is_not_kept(line):
    assert stripped(MARK + line + b"\nout") == (b"out", None)


def test_a_login_script_that_prints_without_end_is_a_lost_link_after_64_kb():
    command = ssh._GroupCommand("gpu-01")
    with pytest.raises(UnreachableError, match=r"\[gpu-01\] the host printed .* bytes") as lost:
        for _ in range(10_000):
            command._strip_pgid(b"A" * 1000)
    assert lost.value.kind == "unreachable"
    assert len(command._head or b"") <= (64 << 10) + 1000


class _Starter:
    """The host's command starter as `_MuxProcess` reads it: the frames given, then nothing."""

    host = "gpu-01"

    def __init__(self, *frames: tuple[bytes, bytes]):
        self.frames, self.busy, self.dead = list(frames), False, False

    def send(self, command: str, stdin: bytes | None, deadline: float) -> None: ...

    def frame(self, deadline: float) -> tuple[bytes, bytes]:
        return self.frames.pop(0)

    def close(self) -> None:
        self.dead = True


@pytest.mark.parametrize("code, expected", [(b"0", 0), (b"-15", -15), (b"137", 137),
                                            (b"7" * 5000, None), (b"", None), (b"12x", None)],
                         ids=["0", "-15", "137", "5000-digits", "empty", "12x"])
def test_the_starters_exit_frame_is_a_bounded_number_or_a_malformed_frame(code, expected):
    starter = _Starter((b"O", MARK + b"4242\nhi\n"), (b"X", code))
    process = ssh._MuxProcess(None, starter, "echo hi", None, 0.0, None)  # type: ignore[arg-type]
    assert process.read(0) == b"hi\n"
    if expected is not None:
        assert process.wait(0) == expected and not starter.dead
        return
    with pytest.raises(UnreachableError, match="malformed frame"):
        process.wait(0)
    assert starter.dead


# -- a chunked response to the benchmark client -------------------------------------------------------

@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Fail, rather than loop on, what should return at once."""
    def expired(*_):
        raise TimeoutError(f"still running after {seconds} s")
    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n"
EVENT = b'data: {"choices": [{"text": "hi!"}]}\n\n'


@pytest.mark.parametrize("size", [b"-6", b"+26", b"0x26", b" 26", b"2_6", b"", b"26 garbage", b"-0"])
def test_a_chunk_size_that_is_no_hex_number_is_a_malformed_response_at_once(size):
    response = HEAD + size + b"\r\n" + EVENT * 100
    with deadline(0.5):
        outcome = parse_exchange(0, 1, [(1, response)])
    assert outcome.error is not None and outcome.error.startswith("malformed response: bad chunk size")
    assert outcome.times == []


@pytest.mark.parametrize("size", [b"26", b"0026", b"26;name=value", b"26 ;ext"])
def test_a_chunk_size_in_hex_with_or_without_extensions_is_read(size):
    assert len(EVENT) == 0x26
    response = HEAD + size + b"\r\n" + EVENT + b"\r\n0\r\n\r\n"
    outcome = parse_exchange(0, 1, [(1, response)])
    assert outcome.error is None and outcome.times == [1]


@pytest.mark.parametrize("opening", [b"[", b'{"a": '])
def test_json_nested_past_the_parser_s_stack_is_a_malformed_response_not_an_exception(opening):
    """An event of `[[[[...` 100,000 deep raised RecursionError out of the level's parsing, and the run
    lost its bench.json."""
    event = EVENT + b"data: " + opening * 100_000 + b"\n\n"
    response = HEAD + b"%x\r\n%s\r\n0\r\n\r\n" % (len(event), event)
    with deadline(2):
        outcome = parse_exchange(0, 1, [(1, response)])
    assert (outcome.error, outcome.times) == ("malformed response: JSON nested too deep", [1])
