"""Pulling a directory as one tar stream, extracted safely and committed atomically.

One stream over one exec channel, not per-file SFTP: SFTP `get` ran slower than `ssh host cat` here
and leaves a partial file at the final path when the connection dies (docs/reliability.md). The stream
lands in a temporary directory beside the destination and moves into place only once the remote tar
has exited 0, so a pull cut short leaves nothing at the final path.

The remote host is not trusted: only regular files and directories are extracted, never links,
devices or fifos, and never a name that is absolute or climbs with `..`; `tarfile.data_filter` then
checks what is left (PEP 706). Names with newlines or a leading `-` are ordinary files.
"""

from __future__ import annotations

import bz2
import contextlib
import errno
import io
import lzma
import math
import os
import queue
import shlex
import shutil
import subprocess
import tarfile
import tempfile
import threading
import zlib
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import IO, Any, cast

from harness.errors import Kind, RemoteError
from harness.transport.base import Pulled, shell_path

ZSTD = shutil.which("zstd")  # None: pulls come uncompressed
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_INFLATERS: dict[bytes, Callable[[], Any]] = {
    b"\x1f\x8b": lambda: zlib.decompressobj(wbits=31), b"BZh": bz2.BZ2Decompressor,
    b"\xfd7zXZ\x00": lzma.LZMADecompressor}
"""What gzip, bzip2 and xz streams start with, and their decompressors (a host may send those unasked)."""
_CHUNK = 1 << 16
# Our reads of a file's data, and of what a seek passes over: small reads cost a Python call each.
_TAR_BUFFER = 1 << 18


MAX_MEMBERS = 200_000
"""Entries one pull may hold: far beyond any run's files (a TP8 profile is tens), short of a stream
that never ends."""
TRAILER_MAX = 1 << 20
"""What may follow the archive's end (its zero blocks, a compressor's frame end) before we stop reading."""
MAX_HEADER_READ = 16 << 20
"""The most one exact read may ask for: a pax or GNU long-name header says its own size, and tarfile
reads it whole into memory (a name or attribute list is a few kB); file data is never read whole."""
LOCAL_RESERVE = 256 << 20
"""Free space the local disk keeps while a pull writes: the journal and manifests must still fit."""
SKIPPED_MAX = 1000
"""Entries left out (links, devices, names outside the folder) that a pull lists one by one; the rest
are counted in one last entry. Each name is cut at SKIPPED_CHARS: a pax header may give one 16 MB."""
SKIPPED_CHARS = 200


class TooLarge(RemoteError):
    """The pulled tree is larger than the caller allowed, or than the local disk can take."""

    kind = Kind.COLLECT


class Refused(RemoteError):
    """The host sent a stream that cannot be extracted as it claims (a file and a folder of one name,
    a time that is not a number, data after the end of the archive, too many entries)."""

    kind = Kind.COLLECT


def tar_command(remote_dir: str, *, compress: bool, exclude: tuple[str, ...] = (), announce: bool = False) -> str:
    """The command that writes `remote_dir` to stdout as a tar stream, zstd-compressed if asked.

    With `announce`, a line with the folder's size in bytes (`du -sb`; empty if du fails) comes
    first: `Staging.extract(announced=True)` refuses a pull the local disk cannot hold before any
    file arrives, without a round trip of its own.

    GNU tar exits 1 when a file changed while it was read (a log still being written); the archive
    holds what it read, which is what we want, so 1 counts as success.

    Compression is zstd -1 on all the host's cores, when the host has zstd (and so do we: it
    decompresses here). It shrinks Kineto JSON traces and logs 8-10x and passes already-gzipped traces
    through at memory speed. gzip -1 is no fallback: at 20-60 MB/s a core (benchmarks/README.md) it
    is slower than the link it would spare, so a host without zstd sends plain tar. `Staging.extract`
    tells the two apart by the stream's first bytes.
    """
    skip = "".join(f" --exclude={shlex.quote('./' + name)}" for name in exclude)
    tar = f"{{ tar -C {shell_path(remote_dir)}{skip} -cf - . || [ $? -eq 1 ]; }}"
    if announce:
        tar = f"printf '%s\\n' \"$(du -sb {shell_path(remote_dir)} 2>/dev/null | cut -f1)\"; {tar}"
    if not (compress and ZSTD):
        return tar
    return (f"set -o pipefail; {tar} | "
            "{ if command -v zstd >/dev/null 2>&1; then exec zstd -1 -T0 -q -c; else exec cat; fi; }")


class _Reader:
    """A file-like view of a chunk source, as tarfile reads it: whole reads (a chunk from the wire
    may be a single byte), its position, and seeks forward, which read on and drop what they pass.

    What was read stays in the buffer until the next refill, which drops it in one move: deleting
    it on every read would shift the rest of the buffer each time, copying every byte many times.
    `read_some` hands a chunk on as it came, uncopied, where a file's data needs no exact size.
    """

    def __init__(self, read: Callable[[], bytes]):
        self._next = read
        self._buf = bytearray()
        self._pos = 0
        self._offset = 0    # bytes read before the buffer's start
        self.short = False  # the last read found the stream's end before its size

    def tell(self) -> int:
        return self._offset + self._pos

    def restart(self) -> None:
        """Count positions from here. tarfile takes the position it is opened at for the archive's
        start, and reads a bad first header as an error only at position 0: past a line read first,
        it would take one for the end of an empty archive."""
        self._offset = -self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        """Forward only (tarfile skips a member's data, or its padding, with a seek)."""
        skip = {os.SEEK_SET: offset - self.tell(), os.SEEK_CUR: offset}.get(whence, -1)
        if skip < 0:
            raise io.UnsupportedOperation("a pull's stream cannot seek backwards or from its end")
        while skip and (data := self.read_some(min(skip, _TAR_BUFFER))):
            skip -= len(data)
        return self.tell()

    def read_some(self, size: int) -> bytes:
        """At most `size` bytes, at least one unless the stream has ended."""
        if self._pos == len(self._buf):
            chunk = self._next()
            if len(chunk) <= size:
                self._offset += len(chunk)
                return chunk
            self._refill(chunk)
        data = bytes(memoryview(self._buf)[self._pos:self._pos + size])
        self._pos += len(data)
        return data

    def read(self, size: int) -> bytes:
        if size > MAX_HEADER_READ:   # tarfile reads whole only headers and padding: the host's word on a size
            raise ValueError(f"an archive header of {size} bytes")
        if self._pos == len(self._buf):   # nothing buffered: a chunk that suffices passes uncopied
            chunk = self._next()
            if len(chunk) == size:
                self._offset += size
                self.short = False
                return chunk
            self._refill(chunk)
        data = self.peek(size)
        self._pos += len(data)
        self.short = len(data) < size
        return data

    def _refill(self, chunk: bytes) -> None:
        self._offset += len(self._buf)
        self._buf[:] = chunk
        self._pos = 0

    def peek(self, size: int) -> bytes:
        """The next `size` bytes (fewer at the end), left to be read again."""
        while len(self._buf) - self._pos < size and (chunk := self._next()):
            self._offset += self._pos
            del self._buf[:self._pos]
            self._pos = 0
            self._buf += chunk
        return bytes(memoryview(self._buf)[self._pos:self._pos + size])

    def line(self, limit: int) -> bytes | None:
        """The next line, without its newline; None (and nothing read) if none ends within `limit` bytes."""
        head = self.peek(limit)
        end = head.find(b"\n")
        if end < 0:
            return None
        self._pos += end + 1
        return head[:end]


class _Syncer:
    """fsync and close written files in a thread of its own, while the next file streams in.

    `finish` waits for every file handed over and raises the first error (a full disk shows here,
    as it would at the write); at most `depth` files wait, so open descriptors stay bounded.
    """

    def __init__(self, depth: int = 64):
        self._queue: queue.Queue[int | None] = queue.Queue(depth)
        self._error: OSError | None = None
        self._thread = threading.Thread(target=self._run, name="fsync", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (fd := self._queue.get()) is not None:
            try:
                if self._error is None:
                    os.fsync(fd)
            except OSError as e:
                self._error = e
            finally:
                os.close(fd)

    def put(self, fd: int) -> None:
        if self._error is not None:
            os.close(fd)
            raise self._error
        self._queue.put(fd)

    def finish(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        if self._error is not None:
            raise self._error


class _Inflated:
    """The chunks of a gzip, bzip2 or xz stream decompressed, each at most `_CHUNK` bytes however
    much one compressed chunk expands; what follows the compressed stream's end is passed on as it
    is (tarfile sees it after the archive's end: data where none belongs)."""

    def __init__(self, wire: _Reader, inflater: Any):
        self._wire, self._d, self._after = wire, inflater, False

    def read(self) -> bytes:
        d = self._d
        while not d.eof:
            if hasattr(d, "unconsumed_tail"):   # zlib keeps the input it has not used yet
                data = d.unconsumed_tail or self._wire.read_some(_CHUNK)
            else:                               # bz2 and lzma keep it themselves
                data = self._wire.read_some(_CHUNK) if d.needs_input else b""
            if out := d.decompress(data, _CHUNK):
                return out
            if not data:
                raise EOFError("the compressed stream ends early")
        if not self._after:
            self._after = True
            if d.unused_data:
                return bytes(d.unused_data)
        return self._wire.read_some(_CHUNK)


class _Unzstd:
    """The local `zstd -d` between the wire and tarfile (the standard library has no zstd before 3.14).

    A thread feeds the wire into zstd while tarfile reads zstd's output, so neither pipe can fill up
    and block the other. The feeder's failure (our deadline, a lost link) is raised again here, in
    the reader's thread, once zstd's output ends.
    """

    def __init__(self, wire: _Reader):
        assert ZSTD is not None, "a zstd stream, and no zstd here"
        self._proc = subprocess.Popen([ZSTD, "-d", "-c", "-q"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE)
        # all three are pipes (PIPE above), and stdout is buffered (bufsize=-1), so it has read1
        self._stdin = cast(IO[bytes], self._proc.stdin)
        self._stdout = cast(io.BufferedReader, self._proc.stdout)
        self._stderr = cast(IO[bytes], self._proc.stderr)
        self._error: BaseException | None = None
        self._feeder = threading.Thread(target=self._feed, args=(wire,), daemon=True)
        self._feeder.start()

    def _feed(self, wire: _Reader) -> None:
        try:
            while chunk := wire.read(_CHUNK):
                self._stdin.write(chunk)
        except BrokenPipeError:
            pass  # zstd stopped (a corrupt stream, or close()): its exit status says which
        except BaseException as e:  # noqa: BLE001 - handed to the reader's thread
            self._error = e
        finally:
            with contextlib.suppress(BrokenPipeError):
                self._stdin.close()

    def read(self) -> bytes:
        if data := self._stdout.read1(_CHUNK):
            return data
        self._feeder.join()
        if self._error is not None:
            raise self._error
        if self._proc.wait() != 0:
            raise tarfile.ReadError(f"zstd: {self._stderr.read().decode(errors='replace').strip()}")
        return b""

    def close(self) -> None:
        self._proc.kill()
        self._proc.wait()
        self._feeder.join(5)  # it ends once the wire does: the caller closes the channel on failure
        for pipe in (self._stdout, self._stderr):
            pipe.close()


def _member_reader(tar: tarfile.TarFile, stream: _Reader, member: tarfile.TarInfo) -> Callable[[int], bytes]:
    """Reads of a regular file's data. Straight from our reader, which stands at the file's data:
    each chunk as it came (tarfile's stream mode copied every byte three more times: a quarter of
    our CPU in a pull, benchmarks/README.md). A sparse file through tarfile's `extractfile`."""
    if member.sparse is None and stream.tell() == member.offset_data:
        left = member.size

        def read(size: int) -> bytes:
            nonlocal left
            if left <= 0:
                return b""
            data = stream.read_some(min(size, left))
            if not data:
                raise tarfile.ReadError("unexpected end of data")
            left -= len(data)
            return data
        return read
    source = tar.extractfile(member)
    assert source is not None  # a regular file (see Staging._filter): extractfile gives it a reader
    return source.read


def outside(name: str) -> bool:
    """Whether a relative name of the host's leads out of the folder it is read in: absolute, or
    climbing with `..`. What a pull refuses, and what a manifest's names are checked against."""
    return name.startswith("/") or ".." in PurePosixPath(name).parts


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale_staging(local_dir: Path) -> None:
    """Staging folders a killed pull left beside `local_dir` (`.NAME.pull-*`): never a result."""
    for stale in Path(local_dir).parent.glob(f".{Path(local_dir).name}.pull-*"):
        shutil.rmtree(stale, ignore_errors=True)


class Staging:
    """A temporary directory beside `local_dir` that a tar stream is extracted into.

        with Staging(local_dir, label="gpu-01:/tmp/run") as staging:
            staging.extract(read_chunk)
            pulled = staging.commit()   # only now does anything appear under local_dir

    Each file is fsynced by a thread of its own while the next one streams in; `extract` returns once
    all are. Nothing is hashed here: a pull holds its host, and the sha256 of what came back is the
    run's to compute (`lifecycle.run.finish`: for a profiled run once the host is free; a sixth of a
    pull's CPU here, benchmarks/README.md).
    """

    def __init__(self, local_dir: Path, *, label: str, max_bytes: int | None = None):
        self.local_dir = Path(local_dir)
        self.label = label
        self.max_bytes = max_bytes
        self.skipped: list[str] = []
        self._skipped_more = 0   # entries left out past SKIPPED_MAX
        self._total = 0
        self._files: dict[str, int] = {}  # relative path -> size
        self._unchecked = 0   # bytes written since the local disk's free space was last looked at
        self._syncer: _Syncer | None = None
        self.tmp: Path | None = None

    def __enter__(self) -> Staging:
        self.local_dir.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.local_dir.name}.pull-", dir=self.local_dir.parent))
        return self

    @property
    def _dir(self) -> Path:
        """The staging directory, which __enter__ makes."""
        assert self.tmp is not None, "a Staging is used inside its with block"
        return self.tmp

    def __exit__(self, *exc: object) -> None:
        if self._syncer is not None:
            with contextlib.suppress(OSError):
                self._syncer.finish()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def extract(self, read: Callable[[], bytes], *, announced: bool = False) -> None:
        """Extract the stream that `read` yields chunk by chunk (b"" at its end) into the staging dir:
        plain tar, or tar compressed with zstd (what we ask for), gzip, bzip2 or xz (found out here).
        What the host sent is not trusted: whatever it makes go wrong is a Refused pull (a failed
        collect), never an exception of ours; only a full local disk is left as the OSError it is.
        `announced`: the stream is `tar_command(announce=True)`'s: the size line, then an archive
        whose first entry is the folder itself (`./`, what `tar -C DIR -cf - .` writes first). Every
        file is on the disk (fsync) when this returns."""
        wire = _Reader(read)
        try:
            if announced:
                self._expect(wire.line(32))
                wire.restart()
            head = wire.peek(6)
            if inflater := next((make for magic, make in _INFLATERS.items() if head.startswith(magic)), None):
                self._extract(_Reader(_Inflated(wire, inflater()).read), root=announced)
                return
            if not head.startswith(_ZSTD_MAGIC):
                self._extract(wire, root=announced)
                return
            if ZSTD is None:   # we never ask for zstd without having it: the host sent it unasked
                raise Refused(f"pulling {self.label}: the host sent a zstd stream, and zstd is not installed here")
            unzstd = _Unzstd(wire)
            try:
                self._extract(_Reader(unzstd.read), root=announced)
            finally:
                unzstd.close()
        except OSError as e:
            if isinstance(e, TimeoutError) or e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise   # our own deadline, or our own disk: not the host's doing
            raise Refused(f"pulling {self.label}: cannot extract what the host sent ({e})") from e
        except (ValueError, OverflowError, EOFError, UnicodeError) as e:
            raise Refused(f"pulling {self.label}: cannot extract what the host sent ({e})") from e

    def _expect(self, size: bytes | None) -> None:
        """Refuse, before a byte of it is written, a pull the local disk cannot hold. The host's word
        is only a first check: the sizes in the stream are checked again as they arrive."""
        if size is None or not size.isdigit():
            return   # du failed on the host (or printed something else): the stream's own checks remain
        free = shutil.disk_usage(self._dir).free
        if int(size) > free - LOCAL_RESERVE:
            raise TooLarge(f"the files of {self.label} take {_size(int(size))} and {self.local_dir.parent} "
                           f"has {_size(free)} free, of which {_size(LOCAL_RESERVE)} stay free for the sweep's "
                           "own records: make room")

    def _extract(self, stream: _Reader, *, root: bool = False) -> None:
        """Only directories and regular files, each through `_filter`; nothing here creates a link,
        so no path can lead outside the staging directory once `_filter` has checked its name.
        `root`: the first entry must be the folder itself (`./`)."""
        members = 0
        self._syncer = _Syncer()
        with self._open(stream) as tar:
            while (member := tar.next()) is not None:
                # tarfile keeps every entry it has read (`members`, for getmembers; typeshed leaves it
                # out): a pull looks at each once, and a host's entries may carry megabytes each
                tar.members.clear()  # type: ignore[attr-defined]
                members += 1
                if members > MAX_MEMBERS:
                    raise Refused(f"pulling {self.label}: more than {MAX_MEMBERS} entries")
                if root and members == 1 and not (member.isdir() and member.name == "."):
                    raise Refused(f"pulling {self.label}: the archive begins with {_clip(member.name)!r}, not "
                                  "with the folder itself (./): not what tar sends of a folder")
                if (member := self._filter(member, str(self._dir))) is None:
                    continue
                path = self._dir / member.name
                if member.isdir():
                    path.mkdir(parents=True, exist_ok=True)
                else:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    self._write(_member_reader(tar, stream, member), path, member)
        if root and not members:   # a zero block first reads as an archive with nothing in it
            raise Refused(f"pulling {self.label}: the archive is empty, without even the folder itself (./)")
        if stream.short:   # tarfile ends quietly where the stream does, between two entries
            raise tarfile.ReadError("the archive ends without its end blocks: cut short after "
                                    f"{members} entries")
        trailer = 0
        while chunk := stream.read(_CHUNK):  # the archive's zero padding and the compressor's trailer
            trailer += len(chunk)
            if trailer > TRAILER_MAX:
                raise Refused(f"pulling {self.label}: data goes on after the end of the archive")
        self._syncer.finish()

    def _open(self, stream: _Reader) -> tarfile.TarFile:
        """tarfile over our reader, its first header read. The tar stream is read as a file that only
        goes forward: tarfile's stream mode copied every byte again, and read a header whole however
        large it said it was. A stream with nothing in it is left to tarfile ("empty file"): the
        remote tar wrote nothing, and its exit status says why; anything else that is no archive is
        the host's doing."""
        empty = not stream.peek(1)
        try:
            # typeshed's fileobj protocol asks for write too; reading never calls it
            return tarfile.open(fileobj=stream, mode="r:")  # type: ignore[call-overload]
        except tarfile.ReadError as e:
            if empty:
                raise
            raise Refused(f"pulling {self.label}: what the host sent is not a tar archive ({e})") from e

    def _write(self, read: Callable[[int], bytes], path: Path, member: tarfile.TarInfo) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(os.dup(fd), "wb") as out:
                while chunk := read(_TAR_BUFFER):
                    out.write(chunk)
                    self._unchecked += len(chunk)
                    if self._unchecked >= 64 << 20:  # every 64 MB: the host's word on sizes is not ours
                        self._check_room()
            os.fchmod(fd, member.mode)
            if math.isfinite(member.mtime):  # a pax header can say mtime=nan
                os.utime(fd, (member.mtime, member.mtime))
        except BaseException:
            os.close(fd)
            raise
        assert self._syncer is not None, "_write runs inside _extract"
        self._syncer.put(fd)   # on the disk before extract returns, and so before the run is journaled
        self._files[path.relative_to(self._dir).as_posix()] = member.size

    def _filter(self, member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
        why = None
        if member.issym() or member.islnk():
            why = f"link to {_clip(member.linkname)}"
        elif not (member.isreg() or member.isdir()):
            why = "special file"
        elif outside(member.name):
            why = "outside the directory"
        if why:
            self._skip(member.name, why)
            return None
        self._total += member.size
        if self.max_bytes is not None and self._total > self.max_bytes:
            raise TooLarge(f"pulling {self.label} exceeds max_bytes={self.max_bytes}")
        if member.size > (1 << 24):
            self._check_room(member.size)
        return tarfile.data_filter(member, dest)

    def _skip(self, name: str, why: str) -> None:
        """Note an entry left out: SKIPPED_MAX of them by name, each name cut short; the rest counted."""
        if len(self.skipped) < SKIPPED_MAX:
            self.skipped.append(f"{_clip(name)} ({why})")
        else:
            self._skipped_more += 1

    def _check_room(self, coming: int = 0) -> None:
        self._unchecked = 0
        free = shutil.disk_usage(self._dir).free
        if free - coming < LOCAL_RESERVE:
            raise TooLarge(f"pulling {self.label}: {self._dir.parent} has {_size(free)} free, too little for "
                           f"what is coming ({_size(coming)} more) and the {_size(LOCAL_RESERVE)} that stay free "
                           "for the sweep's own records: make room")

    def commit(self) -> Pulled:
        """Move the extracted tree into `local_dir` (merging if it exists), the renames on the disk.
        A file of the host's where a folder is here, or a folder where a file is, is refused before
        anything moves, so a refused merge leaves `local_dir` as it was."""
        if not self.local_dir.exists():
            os.rename(self._dir, self.local_dir)
            _fsync_dir(self.local_dir.parent)
        else:
            self._check_merge()
            for rel in self._files:
                dest = self.local_dir / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                os.replace(self._dir / rel, dest)
            for folder in {(self.local_dir / rel).parent for rel in self._files}:
                _fsync_dir(folder)
        more = (f"... {self._skipped_more} more",) if self._skipped_more else ()
        return Pulled(sizes=dict(self._files), skipped=(*self.skipped, *more))

    def _check_merge(self) -> None:
        """Refuse a merge that would put a file where `local_dir` has a folder, or need a folder where
        it has a file (or a link to nothing): the moves would fail halfway through."""
        folders: set[PurePosixPath] = set()
        for rel in self._files:
            dest = self.local_dir / rel
            if dest.is_dir() and not dest.is_symlink():
                raise Refused(f"pulling {self.label}: the host sent {_clip(rel)!r} as a file, and {dest} is a "
                              "folder here; nothing was moved")
            folders.update(PurePosixPath(rel).parents)
        for folder in sorted(folders):
            path = self.local_dir / folder
            if os.path.lexists(path) and not path.is_dir():
                raise Refused(f"pulling {self.label}: the host sent {_clip(str(folder))!r} as a folder, and "
                              f"{path} is a file here; nothing was moved")


def _size(n: int) -> str:
    """Bytes as a message gives them: `12.3 kB`, `1.9 MB`, `268 MB`, `2.31 GB`."""
    if n >= 1e9:
        return f"{n / 1e9:.2f} GB"
    return f"{n / 1e6:.3g} MB" if n >= 1e6 else f"{n / 1e3:.3g} kB"


def _clip(name: str) -> str:
    """A name of the host's as a message or the manifest may hold it: at most SKIPPED_CHARS characters,
    and bytes that are no UTF-8 (tarfile keeps them as lone surrogates) shown as `?`."""
    if len(name) > SKIPPED_CHARS:
        name = name[:SKIPPED_CHARS - 3] + "..."
    return name.encode("utf-8", "replace").decode("utf-8")
