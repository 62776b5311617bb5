"""Finding input files and cutting them into records, streaming, with bounded memory.

Gzip is read transparently (detected by its magic bytes, not the name). Offsets and line
numbers refer to the decompressed stream. A record longer than the limit is not held in
memory: its first ``keep`` bytes, its length and its sha256 are kept for the quarantine.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import re
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from trajwh.schemas.errors import ConfigError

GZIP_MAGIC = b"\x1f\x8b"
HEAD_BYTES = 65536
CHUNK = 1 << 20


class TruncatedInput(Exception):
    """The compressed stream ended early or is corrupt; records read before it stand."""

    def __init__(self, offset: int, detail: str):
        super().__init__(detail)
        self.offset = offset
        self.detail = detail


@dataclass
class FileRecord:
    line_no: int | None
    offset: int
    data: bytes  # the whole record, or its first bytes when ``oversize``
    size: int
    oversize: bool = False
    sha256: str | None = None  # set when ``oversize`` (the kept bytes are only a prefix)


def display_path(path: str | os.PathLike[str]) -> str:
    """A path as text that any table can store: bytes that are not UTF-8 (a file name from
    another system) are shown as backslash escapes instead of breaking the write."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def find_input_files(paths: Iterable[str | os.PathLike[str]],
                     problems: list[tuple[Path, str]] | None = None) -> list[Path]:
    """Files under ``paths`` (recursively, sorted), skipping hidden files and folders.

    An entry that cannot be resolved (a symlink loop) is reported in ``problems`` and skipped;
    everything else is listed, readable or not: opening is the ingest's business, per file."""
    found: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if not path.exists() and not path.is_symlink():
            raise ConfigError(f"input path {display_path(raw)!r} does not exist", valid="existing files or folders")
        if not path.is_dir():
            found.append(_resolved(path, problems))
            continue
        for dirpath, dirnames, filenames in os.walk(path, onerror=lambda e: problems is not None and problems.append(
                (Path(e.filename or "?"), f"cannot list folder: {e.strerror or e}"))):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in sorted(filenames):
                if not name.startswith("."):
                    found.append(_resolved(Path(dirpath, name), problems))
    return [p for p in dict.fromkeys(found) if p is not None]


def _resolved(path: Path, problems: list[tuple[Path, str]] | None) -> Path | None:
    try:
        return path.resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop
        if problems is not None:
            problems.append((path.absolute(), f"cannot resolve: {exc}"))
        return None


def compression_of(path: Path) -> str | None:
    with open(path, "rb") as f:
        return "gzip" if f.read(2) == GZIP_MAGIC else None


class HashingReader(io.RawIOBase):
    """Reads a file, hashing the on-disk bytes and reporting progress as it goes."""

    def __init__(self, path: Path, progress: Callable[[int], None] | None = None):
        self._f = open(path, "rb")
        self.sha = hashlib.sha256()
        self.consumed = 0
        self._progress = progress

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = self._f.readinto(buffer)
        if n:
            self.sha.update(memoryview(buffer)[:n])
            self.consumed += n
            if self._progress:
                self._progress(n)
        return n or 0

    def finish_hash(self) -> str:
        """Hash the rest of the file (records may stop early) and return the sha256."""
        while self.read(CHUNK):
            pass
        return self.sha.hexdigest()

    def close(self) -> None:
        self._f.close()
        super().close()


def open_input(path: Path, progress: Callable[[int], None] | None = None) -> tuple[BinaryIO, str | None, HashingReader]:
    """A decompressed stream over ``path`` and the hashing reader under it."""
    comp = compression_of(path)
    raw = HashingReader(path, progress)
    buffered = io.BufferedReader(raw, buffer_size=CHUNK)
    if comp == "gzip":
        return gzip.GzipFile(fileobj=buffered, mode="rb"), comp, raw  # type: ignore[return-value]
    return buffered, None, raw  # type: ignore[return-value]


BOM = b"\xef\xbb\xbf"


def read_head(path: Path) -> bytes:
    stream, _, raw = open_input(path)
    try:
        head = stream.read(HEAD_BYTES)
        return head[3:] if head.startswith(BOM) else head
    except (EOFError, OSError, zlib.error):
        return b""
    finally:
        stream.close()
        raw.close()


def _read(stream: BinaryIO, offset: int) -> bytes:
    try:
        # read1: one underlying read at a time, so a truncated gzip loses only its last piece
        read = getattr(stream, "read1", stream.read)
        return read(CHUNK)
    except (EOFError, gzip.BadGzipFile, zlib.error, OSError) as exc:
        raise TruncatedInput(offset, f"compressed stream ends early or is corrupt: {exc}") from exc


_BLANK_LINES = re.compile(rb"(?:[ \t\r\f\v]*\n)+")


def iter_lines(stream: BinaryIO, max_bytes: int, keep: int) -> Iterator[FileRecord]:
    """JSONL framing: one record per line; CRLF tolerated; blank lines skipped."""
    line_no = 0
    offset = 0  # offset of the start of the current (partial) line
    pos = 0  # bytes consumed
    parts: list[bytes] = []
    hasher = None
    size = 0

    def finish() -> FileRecord | None:
        nonlocal parts, hasher, size, offset
        data = b"".join(parts)
        if line_no == 1 and data.startswith(BOM):  # a UTF-8 byte-order mark is not part of the record
            data, offset = data[3:], offset + 3
        if hasher is not None:
            rec = FileRecord(line_no, offset, data[:keep], size, True, hasher.hexdigest())
        else:
            stripped = data[:-1] if data.endswith(b"\r") else data
            rec = FileRecord(line_no, offset, stripped, len(stripped)) if stripped.strip() else None
        parts, hasher, size = [], None, 0
        return rec

    while True:
        chunk = _read(stream, pos)
        if not chunk:
            break
        start = 0
        while start < len(chunk):
            if not parts and hasher is None:  # between records: skip a run of blank lines at once
                blank = _BLANK_LINES.match(chunk, start)
                if blank:
                    line_no += blank.group(0).count(b"\n")
                    start = blank.end()
                    offset = pos + start
                    continue
            nl = chunk.find(b"\n", start)
            piece = chunk[start:] if nl < 0 else chunk[start:nl]
            size += len(piece)
            if hasher is not None:
                hasher.update(piece)
            elif size > max_bytes:
                hasher = hashlib.sha256(b"".join(parts))
                hasher.update(piece)
                parts = [(b"".join(parts) + piece)[:keep]]
            else:
                parts.append(piece)
            if nl < 0:
                break
            line_no += 1
            rec = finish()
            if rec is not None:
                yield rec
            start = nl + 1
            offset = pos + start
        pos += len(chunk)
    if parts or hasher is not None:
        line_no += 1
        rec = finish()
        if rec is not None:
            yield rec


def read_document(stream: BinaryIO, max_bytes: int, keep: int) -> FileRecord:
    """Document framing: the whole file is one record."""
    parts: list[bytes] = []
    size = 0
    hasher = None
    while True:
        chunk = _read(stream, size)
        if not chunk:
            break
        size += len(chunk)
        if hasher is not None:
            hasher.update(chunk)
            continue
        parts.append(chunk)
        if size > max_bytes:
            data = b"".join(parts)
            hasher = hashlib.sha256(data)
            parts = [data[:keep]]
    data = b"".join(parts)
    if hasher is not None:
        return FileRecord(None, 0, data, size, True, hasher.hexdigest())
    if data.startswith(BOM):  # a UTF-8 byte-order mark is not part of the record
        return FileRecord(None, 3, data[3:], size - 3)
    return FileRecord(None, 0, data, size)
