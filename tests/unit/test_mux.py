"""The host's command starter (harness/remote/mux.py) run as the real process it is on a host, spoken
to over its stdin and stdout as the transport does; over a real sshd the transport's tests use it for
every command (tests/e2e/test_transport.py)."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from harness.remote import mux

SOURCE = Path(mux.__file__)
F_GETPIPE_SZ = 1032   # Linux's number (fcntl names it from Python 3.10)


def run(command: str, stdin: bytes = b"") -> tuple[list[tuple[bytes, int]], bytes, bytes, int]:
    """One command through a fresh starter: its frames (kind, size), stdout, stderr and exit code."""
    proc = subprocess.Popen([sys.executable, str(SOURCE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout.read(len(mux.MAGIC)) == mux.MAGIC
    body = json.dumps({"command": command, "stdin": len(stdin)}).encode()
    proc.stdin.write(struct.pack(">I", len(body)) + body + stdin)
    proc.stdin.flush()
    frames, out, err = [], bytearray(), bytearray()
    while True:
        kind = proc.stdout.read(1)
        payload = proc.stdout.read(struct.unpack(">I", proc.stdout.read(4))[0])
        if kind == b"X":
            break
        frames.append((kind, len(payload)))
        (out if kind == b"O" else err).extend(payload)
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0
    return frames, bytes(out), bytes(err), int(payload)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pipe sizes are Linux's")
def test_a_commands_output_pipes_hold_a_whole_read():
    probe = f"import fcntl; print(fcntl.fcntl(1, {F_GETPIPE_SZ}), fcntl.fcntl(2, {F_GETPIPE_SZ}))"
    _, out, _, code = run(f"{sys.executable} -c '{probe}'")
    assert code == 0 and out.split() == [str(mux.READ).encode()] * 2


def test_large_output_on_both_streams_arrives_whole_in_frames_no_larger_than_a_read():
    # 8 MB of stdout and 1 MB of stderr, written in pieces of odd sizes from the data fed on stdin
    data = os.urandom(9_000_000)
    script = ("import sys; d = sys.stdin.buffer.read(); o, e = sys.stdout.buffer, sys.stderr.buffer\n"
              "for i in range(0, 8_000_000, 99_991): o.write(d[i:min(i + 99_991, 8_000_000)]); o.flush()\n"
              "for i in range(8_000_000, 9_000_000, 7_777): e.write(d[i:i + 7_777]); e.flush()\n"
              "sys.exit(5)")
    frames, out, err, code = run(f"{sys.executable} -c '{script}'", stdin=data)
    assert code == 5
    assert hashlib.sha256(out).digest() == hashlib.sha256(data[:8_000_000]).digest()
    assert err == data[8_000_000:]
    assert all(0 < size <= mux.READ for _, size in frames)


def test_a_write_that_takes_only_part_of_what_it_was_given_is_carried_on(monkeypatch):
    real = os.writev

    def few(fd, parts):   # a system call may take less than asked (a signal, a full pipe)
        left, taken = 7, []
        for part in parts:
            taken.append(bytes(part[:left]))
            left -= len(taken[-1])
            if not left:
                break
        return real(fd, taken)

    monkeypatch.setattr(os, "writev", few)
    read, write = os.pipe()
    parts = [b"O" + struct.pack(">I", 3), b"abc", b"", memoryview(b"0123456789" * 5)]
    mux._write_all(write, parts)
    os.close(write)
    with os.fdopen(read, "rb") as got:
        assert got.read() == b"".join(bytes(part) for part in parts)
