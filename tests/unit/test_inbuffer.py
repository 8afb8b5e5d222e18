"""The receive side's buffers (harness/transport/inbuffer.py): the channel buffer against paramiko's own
(the same answers to the same calls, waits that end when they should, and the event `select` waits
on), and the socket read ahead over a real socketpair. Over a real sshd every SSH test uses both
(tests/e2e/test_transport.py)."""

from __future__ import annotations

import contextlib
import random
import socket
import threading

import pytest
from paramiko.buffered_pipe import BufferedPipe, PipeTimeout

from harness.transport.inbuffer import PacketBuffer, ReadAhead


def test_any_sequence_of_packets_and_reads_gives_what_paramikos_buffer_gives():
    rng = random.Random(7)
    for _ in range(200):
        ours, theirs = PacketBuffer(), BufferedPipe()
        for _ in range(rng.randint(1, 40)):
            if rng.random() < 0.5:
                data = rng.randbytes(rng.choice([0, 1, 3, 100, 32768, 40000]))
                ours.feed(data)
                theirs.feed(data)
            elif len(theirs):
                n = rng.choice([1, 2, 7, 4096, 32768, 1 << 18])
                assert ours.read(n, 0.0) == theirs.read(n, 0.0)
            assert len(ours) == len(theirs) and ours.read_ready() == theirs.read_ready()
        assert ours.empty() == theirs.empty() and len(ours) == 0


def test_an_empty_buffer_times_out_unless_closed_and_then_reads_empty():
    buf = PacketBuffer()
    with pytest.raises(PipeTimeout):
        buf.read(10, 0.0)
    with pytest.raises(PipeTimeout):
        buf.read(10, 0.05)
    buf.feed(b"last")
    buf.close()
    assert buf.read(10) == b"last"     # what came before the close is still read
    assert buf.read(10) == b"" and buf.read(10, 0.0) == b""


def test_a_waiting_read_wakes_for_a_packet_from_another_thread():
    buf = PacketBuffer()
    feeder = threading.Timer(0.05, buf.feed, args=(b"hello",))
    feeder.start()
    assert buf.read(100) == b"hello"   # no timeout: it waits as long as it takes
    feeder.join()
    closer = threading.Timer(0.05, buf.close)
    closer.start()
    assert buf.read(100, 30) == b""    # a close ends the wait
    closer.join()


def test_the_event_is_set_while_data_is_there_or_once_closed():
    buf, event = PacketBuffer(), threading.Event()
    buf.feed(b"ab")
    buf.set_event(event)
    assert event.is_set()
    assert buf.read(1) == b"a" and event.is_set()
    assert buf.read(1) == b"b" and not event.is_set()
    buf.feed(b"c")
    assert event.is_set()
    assert buf.empty() == b"c" and not event.is_set()
    buf.close()
    assert event.is_set()
    late = threading.Event()
    buf.set_event(late)
    assert late.is_set()


def test_reads_ahead_of_a_real_socket_give_its_bytes_in_order_in_any_sizes():
    """A socketpair written in odd pieces, read through ReadAhead with the sizes paramiko asks for
    (4, then a packet's rest) and others: the same bytes in order, never more than asked."""
    rng = random.Random(11)
    data = rng.randbytes(3 << 20)
    ours, theirs = socket.socketpair()
    writer = threading.Thread(target=_send_in_pieces, args=(theirs, data, random.Random(12)))
    writer.start()
    ours.settimeout(30)
    reader, got = ReadAhead(ours, size=1 << 16), bytearray()
    try:
        while chunk := reader.recv(n := rng.choice([1, 4, 16, 32768 + 20, 70000, 1 << 18])):
            assert len(chunk) <= n
            got += chunk
    finally:
        ours.close()   # a failed read ends the writer too
        writer.join()
    assert bytes(got) == data


def _send_in_pieces(sock: socket.socket, data: bytes, rng: random.Random) -> None:
    at = 0
    with sock, contextlib.suppress(OSError):   # OSError: the reader gave up
        while at < len(data):
            n = rng.choice([1, 5, 4096, 32768 + 20, 100_000])
            sock.sendall(data[at:at + n])
            at += n


def test_a_read_ahead_socket_keeps_its_timeout_and_everything_else_of_its_own():
    ours, theirs = socket.socketpair()
    with ours, theirs:
        reader = ReadAhead(ours)
        reader.settimeout(0.05)              # the socket's own, as paramiko sets it
        assert ours.gettimeout() == 0.05
        with pytest.raises(TimeoutError):    # nothing came: the socket's timeout, as paramiko expects
            reader.recv(4)
        theirs.sendall(b"abcdef")
        assert reader.recv(4) == b"abcd" and reader.recv(100) == b"ef"
        reader.send(b"back")                 # sending is the socket's own
        assert theirs.recv(10) == b"back"
        theirs.close()
        assert reader.recv(4) == b""         # the end of the stream, as the socket says it
