"""Pulling a directory as one tar stream, extracted safely and committed atomically.

One stream over one exec channel, not per-file SFTP: SFTP `get` ran slower than `ssh host cat` here
and leaves a partial file at the final path when the connection dies (RELIABILITY.md). The stream
lands in a temporary directory beside the destination and moves into place only once the remote tar
has exited 0, so a pull cut short leaves nothing at the final path.

The remote host is not trusted: only regular files and directories are extracted, never links,
devices or fifos, and never a name that is absolute or climbs with `..`; `tarfile.data_filter` then
checks what is left (PEP 706). Names with newlines or a leading `-` are ordinary files.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from harness.errors import RemoteError
from harness.transport.base import Pulled, shell_path


class TooLarge(RemoteError):
    """The pulled tree is larger than the caller allowed."""

    kind = "collect"


def tar_command(remote_dir: str, *, compress: bool) -> str:
    """The command that writes `remote_dir` to stdout as a tar stream.

    GNU tar exits 1 when a file changed while it was read (a log still being written); the archive
    holds what it read, which is what we want, so 1 counts as success. gzip -1 because most of what
    we pull (Kineto JSON traces, logs) shrinks several times and costs the host little CPU; traces
    already gzipped just pass through.
    """
    tar = f"{{ tar -C {shell_path(remote_dir)} -cf - . || [ $? -eq 1 ]; }}"
    return f"set -o pipefail; {tar} | gzip -1" if compress else tar


class _Reader:
    """A file-like view of a chunk source for tarfile's stream mode, which needs whole reads: it
    detects compression from the first read, and a chunk from the wire may be a single byte."""

    def __init__(self, read: Callable[[], bytes]):
        self._next = read
        self._buf = bytearray()

    def read(self, size: int) -> bytes:
        while len(self._buf) < size and (chunk := self._next()):
            self._buf += chunk
        data = bytes(self._buf[:size])
        del self._buf[:size]
        return data


class Staging:
    """A temporary directory beside `local_dir` that a tar stream is extracted into.

        with Staging(local_dir, label="gpu-01:/tmp/run") as staging:
            staging.extract(read_chunk)
            pulled = staging.commit()   # only now does anything appear under local_dir
    """

    def __init__(self, local_dir: Path, *, label: str, max_bytes: int | None = None):
        self.local_dir = Path(local_dir)
        self.label = label
        self.max_bytes = max_bytes
        self.skipped: list[str] = []
        self._total = 0
        self.tmp: Path | None = None

    def __enter__(self) -> Staging:
        self.local_dir.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.local_dir.name}.pull-", dir=self.local_dir.parent))
        return self

    def __exit__(self, *exc) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def extract(self, read: Callable[[], bytes]) -> None:
        """Extract the stream that `read` yields chunk by chunk (b"" at its end) into the staging dir."""
        with tarfile.open(fileobj=_Reader(read), mode="r|*") as tar:
            tar.extractall(self.tmp, filter=self._filter)
        while read():  # the archive's zero padding and the gzip trailer
            pass

    def _filter(self, member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
        why = None
        if member.issym() or member.islnk():
            why = f"link to {member.linkname}"
        elif not (member.isreg() or member.isdir()):
            why = "special file"
        elif member.name.startswith("/") or ".." in PurePosixPath(member.name).parts:
            why = "outside the directory"
        if why:
            self.skipped.append(f"{member.name} ({why})")
            return None
        self._total += member.size
        if self.max_bytes is not None and self._total > self.max_bytes:
            raise TooLarge(f"pulling {self.label} exceeds max_bytes={self.max_bytes}")
        return tarfile.data_filter(member, dest)

    def commit(self) -> Pulled:
        """Hash every extracted file, then move the tree into `local_dir` (merging if it exists)."""
        sha256: dict[str, str] = {}
        size = 0
        for root, _dirs, files in os.walk(self.tmp):
            for name in files:
                path = Path(root, name)
                with open(path, "rb") as f:
                    sha256[path.relative_to(self.tmp).as_posix()] = hashlib.file_digest(f, "sha256").hexdigest()
                size += path.stat().st_size
        if not self.local_dir.exists():
            os.rename(self.tmp, self.local_dir)
        else:
            for rel in sha256:
                dest = self.local_dir / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                os.replace(self.tmp / rel, dest)
        return Pulled(files=len(sha256), bytes=size, sha256=sha256, skipped=tuple(self.skipped))
