"""Runs on the host, one per SSH connection: starts each command the harness sends it, so that a
command costs a fork instead of a new SSH session and its login shell. The login shell reads the
user's ~/.bashrc every time (bash run by sshd does, whatever the command), and a ~/.bashrc that sets
up pyenv or conda takes a fifth of a second or more: several times a run, on every host.

The harness starts it over an exec channel as `python3 -c SOURCE` (this file less this docstring;
standard library only, Python 3.6 and later), after the login shell has read ~/.bashrc once: the
commands it starts inherit that environment, as commands run by sshd do. One command at a time. The
protocol, on its stdin and stdout (lengths are 4 bytes, big-endian):

    hello      MAGIC, once, when it is ready
    request    length + JSON {"command": str, "stdin": n} + the n bytes the command reads as stdin
    frames     kind + length + payload: b"O" stdout, b"E" stderr, b"X" the exit code in ASCII, last

A command runs as `bash --norc -c COMMAND` with its stdin fed from a thread (so a command that does
not read it cannot block the frames) and closed after. It ends at EOF on its stdin or when its
stdout is gone (the channel closed).

Every byte of a pull passes through here, so the copying is kept short: the command's stdout and
stderr pipes are enlarged to one read (256 kB, where Linux gives 64 kB; elsewhere they stay as
they are), and a frame's header and payload go out in one `writev`, not joined into a new bytes.
"""

import contextlib
import fcntl
import json
import os
import selectors
import struct
import subprocess
import sys
import threading

MAGIC = b"\x00harness-mux-1\n"
READ = 1 << 18
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)   # Linux's number; the name is Python 3.10's


def _exactly(stream, n):
    data = b""
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _write_all(fd, parts):
    """Writes the parts in order with as few system calls as they take, without joining them."""
    parts = [memoryview(part) for part in parts]
    while parts:
        done = os.writev(fd, parts)
        while parts and done >= len(parts[0]):
            done -= len(parts[0])
            parts.pop(0)
        if parts:
            parts[0] = parts[0][done:]


def _feed(pipe, data):
    try:
        if data:
            pipe.write(data)
    except OSError:
        pass   # the command ended without reading it all: its exit code says how
    finally:
        with contextlib.suppress(OSError):
            pipe.close()


def _run(request, data, frame):
    proc = subprocess.Popen(["bash", "--norc", "-c", request["command"]], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    feeder = threading.Thread(target=_feed, args=(proc.stdin, data), daemon=True)
    feeder.start()
    for pipe in (proc.stdout, proc.stderr):
        # a pipe holds 64 kB; a larger one lets one read (and one frame) carry up to READ bytes
        with contextlib.suppress(OSError):
            fcntl.fcntl(pipe.fileno(), F_SETPIPE_SZ, READ)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, b"O")
    sel.register(proc.stderr, selectors.EVENT_READ, b"E")
    open_pipes = 2
    while open_pipes:
        for key, _ in sel.select():
            chunk = os.read(key.fileobj.fileno(), READ)
            if chunk:
                frame(key.data, chunk)
            else:
                sel.unregister(key.fileobj)
                open_pipes -= 1
    sel.close()
    proc.stdout.close()
    proc.stderr.close()
    code = proc.wait()
    feeder.join()
    frame(b"X", str(code).encode())


def main():
    inp, out = sys.stdin.buffer, sys.stdout.fileno()

    def frame(kind, payload):
        # one write: a header written alone would leave sshd a 5-byte packet to send for every chunk
        _write_all(out, [kind + struct.pack(">I", len(payload)), payload])

    _write_all(out, [MAGIC])
    while True:
        head = _exactly(inp, 4)
        if head is None:
            return 0
        body = _exactly(inp, struct.unpack(">I", head)[0])
        if body is None:
            return 0
        request = json.loads(body.decode("utf-8"))
        data = _exactly(inp, request["stdin"]) if request["stdin"] else b""
        if data is None:
            return 0
        _run(request, data, frame)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (BrokenPipeError, KeyboardInterrupt):
        sys.exit(0)
