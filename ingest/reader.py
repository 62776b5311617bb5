"""Finding input files and cutting them into records, streaming, with bounded memory.

Gzip, zstd, xz and bzip2 are read transparently (detected by their magic bytes, not the
name). Offsets and line numbers refer to the decompressed stream. A Parquet file (Hugging
Face's native format, also told by its magic bytes) is read as its rows rendered as JSON lines,
one row per line, a row group at a time: line numbers are row numbers and offsets refer to that
rendering. A record longer than the limit is not held in memory: its first ``keep`` bytes, its
length and its sha256 are kept for the quarantine.
"""

from __future__ import annotations

import base64
import bz2
import gzip
import hashlib
import io
import json
import lzma
import os
import re
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import orjson
from trajwh.schemas.errors import ConfigError

GZIP_MAGIC = b"\x1f\x8b"
PARQUET_MAGIC = b"PAR1"
ZIP_MAGIC = b"PK\x03\x04"
PARQUET_ROWS = 64  # rows rendered at a time (a row group is read at a time)
HEAD_BYTES = 65536
CHUNK = 1 << 20


class DamagedContainer(EOFError):
    """A container (a Parquet file) stopped being readable; its message is the whole explanation."""


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


#: hidden files that are trajectories (a folder walk skips other hidden files)
AGENT_HIDDEN_FILES = frozenset({".aider.chat.history.md"})


def find_input_files(paths: Iterable[str | os.PathLike[str]],
                     problems: list[tuple[Path, str]] | None = None) -> list[Path]:
    """Files under ``paths`` (recursively, sorted), skipping hidden files and folders (``.git``,
    ``.venv``, ...) but not the hidden files harnesses write their trajectories to
    (``AGENT_HIDDEN_FILES``: Aider's ``.aider.chat.history.md`` in a repository's root).

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
                if not name.startswith(".") or name in AGENT_HIDDEN_FILES:
                    found.append(_resolved(Path(dirpath, name), problems))
    return [p for p in dict.fromkeys(found) if p is not None]


def _resolved(path: Path, problems: list[tuple[Path, str]] | None) -> Path | None:
    try:
        return path.resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop
        if problems is not None:
            problems.append((path.absolute(), f"cannot resolve: {exc}"))
        return None


#: compressed streams by their first bytes (bzip2: its header, a block size, then a block's magic number)
_COMPRESSED = (("gzip", re.compile(re.escape(GZIP_MAGIC))), ("zstd", re.compile(re.escape(b"\x28\xb5\x2f\xfd"))),
               ("xz", re.compile(re.escape(b"\xfd7zXZ\x00"))), ("bz2", re.compile(rb"BZh[1-9]1AY&SY")))


def compression_of(path: Path) -> str | None:
    """``gzip``, ``zstd``, ``xz``, ``bz2``, ``parquet`` or ``zip`` (containers of rows, read as JSON
    lines: a Parquet file's rows, an Inspect AI .eval archive's samples) or None (plain bytes)."""
    with open(path, "rb") as f:
        magic = f.read(10)
    if magic[:4] == PARQUET_MAGIC:
        return "parquet"
    if magic[:4] == ZIP_MAGIC:
        return "zip"
    return next((name for name, pattern in _COMPRESSED if pattern.match(magic)), None)


class _ArrowStream(io.RawIOBase):
    """A pyarrow input stream (zstd decompression) as a raw Python stream."""

    def __init__(self, stream: Any):
        self._stream = stream

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        try:
            data = self._stream.read(min(len(buffer), 1 << 16))  # small reads: a cut stream keeps what came before
        except Exception as exc:  # noqa: BLE001 (pyarrow's ArrowInvalid / OSError): damaged or cut short
            raise EOFError(f"zstd: {exc}") from exc
        n = len(data)
        buffer[:n] = data
        return n

    def close(self) -> None:
        self._stream.close()
        super().close()


def _json_default(value: Any) -> Any:
    """Arrow values orjson has no form for: bytes as text when they are UTF-8 (else base64, marked),
    decimals and durations as text."""
    if isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return {"$base64": base64.b64encode(data).decode("ascii")}
    return str(value)


class _RenderedRows(io.RawIOBase):
    """A container's rows rendered as JSON lines, a row at a time (``_render``). A container that
    cannot be read on (a damaged part, the end cut off) raises ``DamagedContainer`` naming the row it
    stopped at: the rows rendered before it stand."""

    kind = "container"

    def __init__(self, path: Path):
        self._path = path
        self._rows: Iterator[bytes] | None = None
        self._pending = b""
        self._row = 0
        self._error: Exception | None = None

    def readable(self) -> bool:
        return True

    def _render(self) -> Iterator[bytes]:
        raise NotImplementedError

    def readinto(self, buffer: Any) -> int:
        if self._rows is None:
            self._rows = self._render()
        parts, size = [self._pending], len(self._pending)
        while size < len(buffer) and self._error is None:
            try:
                row = next(self._rows, None)
            except Exception as exc:  # noqa: BLE001 (the container library's: ArrowInvalid, BadZipFile, ...)
                self._error = exc
                break
            if row is None:
                break
            parts.append(row)
            size += len(row)
        pending = b"".join(parts)
        if not pending and self._error is not None:
            raise DamagedContainer(f"not a readable {self.kind} after row {self._row}: {self._error}")
        n = min(len(buffer), len(pending))
        buffer[:n] = pending[:n]
        self._pending = pending[n:]
        return n


class ParquetRows(_RenderedRows):
    """A Parquet file's rows as JSON lines (``{"column": value, ...}``, columns in the file's order),
    rendered ``PARQUET_ROWS`` at a time; page checksums are verified where the writer wrote them."""

    kind = "Parquet file"

    def _render(self) -> Iterator[bytes]:
        import pyarrow.parquet as pq

        option = orjson.OPT_NON_STR_KEYS | orjson.OPT_APPEND_NEWLINE
        f = pq.ParquetFile(self._path, page_checksum_verification=True)  # checksums are verified where written
        for group in range(f.num_row_groups):  # a row group at a time: a damaged one stops after the rows before it
            for batch in f.read_row_group(group).to_batches(max_chunksize=PARQUET_ROWS):
                for row in batch.to_pylist():
                    yield orjson.dumps(row, default=_json_default, option=option)
                    self._row += 1


#: the members of an Inspect AI ``.eval`` archive: its header (a finished run's, else the start
#: journal's) and one member per sample
EVAL_HEADERS = ("header.json", "_journal/start.json")
#: the key of the header in each rendered sample line (``ingest.adapters.inspect_ai`` reads it)
EVAL_HEADER_KEY = "inspect_header"
_EVAL_SAMPLE = re.compile(r"samples/[^/]+\.json")


def eval_members(path: Path) -> tuple[str | None, list[str], list[str]]:
    """A zip archive's Inspect header member (None: not an .eval log), its sample members in the
    archive's order, and all its member names."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        names = z.namelist()
    header = next((h for h in EVAL_HEADERS if h in names), None)
    return header, [n for n in names if _EVAL_SAMPLE.fullmatch(n)], names


class EvalSamples(_RenderedRows):
    """An Inspect AI ``.eval`` archive's samples as JSON lines: ``{"inspect_header": <header>,
    "sample": <member>}``, one per sample member in the archive's order (each member's CRC is
    checked as it is read); an archive that is not an Inspect log renders nothing."""

    kind = "zip archive"

    def _render(self) -> Iterator[bytes]:
        import zipfile

        header_name, samples, _ = eval_members(self._path)
        if header_name is None:
            return
        with zipfile.ZipFile(self._path) as z:
            header = inspect_json(z.read(header_name))
            for name in samples:
                try:
                    line = {EVAL_HEADER_KEY: header, "sample": inspect_json(z.read(name))}
                except ValueError as exc:  # not JSON (its CRC held): this sample is quarantined, the others read
                    line = {EVAL_HEADER_KEY: header, "unreadable_member": name, "error": str(exc)}
                yield orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE)
                self._row += 1


def inspect_json(data: bytes) -> Any:
    """JSON as Inspect AI writes it: Python's ``json``, which writes ``NaN`` and ``Infinity`` (a
    metric of one sample, a score that could not be computed); they are read as floats and written
    again (orjson) as null."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


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


#: compressions that are containers of rows rendered as JSON lines (a row is a record)
CONTAINERS = ("parquet", "zip")


def container_unreadable(path: Path, comp: str | None, head: bytes) -> str | None:
    """Why a container cannot be read at all (a Parquet file without its footer or with its first
    row group damaged, when no row could be rendered into ``head``; a zip archive without its
    central directory: cut short), or None."""
    try:
        if comp == "parquet":
            import pyarrow.parquet as pq

            if not pq.read_metadata(path).num_rows or head:
                return None
            pq.ParquetFile(path, page_checksum_verification=True).read_row_group(0)
        elif comp == "zip" and not head:
            eval_members(path)
    except Exception as exc:  # noqa: BLE001 (pyarrow's and zipfile's errors)
        kind = "Parquet file" if comp == "parquet" else "zip archive"
        return f"a {kind} that cannot be read: {' '.join(str(exc).split())}"
    return None


def container_contents(path: Path, comp: str | None) -> str:
    """What a readable container holds, as the quarantine's reason names it when no format takes it."""
    if comp == "parquet":
        import pyarrow.parquet as pq

        return f"a Parquet file of rows with columns {', '.join(pq.read_schema(path).names) or 'none'}"
    header, samples, names = eval_members(path)
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    if header is None:
        return (f"a zip archive that is not an Inspect AI .eval log (no {' or '.join(EVAL_HEADERS)}; "
                f"members: {shown or 'none'})")
    return f"an Inspect AI .eval archive with {len(samples)} sample members (members: {shown})"


def stream_damage(path: Path) -> str | None:
    """Why a compressed file cannot be read to its end (cut short, corrupt), or None: for a stream
    that gave nothing to read before the damage (a zstd or bzip2 block cut short yields no bytes)."""
    stream, _, raw = open_input(path)
    offset = 0
    try:
        while chunk := _read(stream, offset):
            offset += len(chunk)
    except TruncatedInput as exc:
        return exc.detail
    finally:
        stream.close()
        raw.close()
    return None


def open_input(path: Path, progress: Callable[[int], None] | None = None) -> tuple[BinaryIO, str | None, HashingReader]:
    """A decompressed stream over ``path`` and the hashing reader under it."""
    comp = compression_of(path)
    raw = HashingReader(path, progress)
    if comp == "parquet":  # read by pyarrow; ``raw`` hashes the file's bytes at the end
        return io.BufferedReader(ParquetRows(path), buffer_size=CHUNK), comp, raw  # type: ignore[return-value]
    if comp == "zip":  # an Inspect .eval archive's samples, read by zipfile; hashed the same way
        return io.BufferedReader(EvalSamples(path), buffer_size=CHUNK), comp, raw  # type: ignore[return-value]
    buffered = io.BufferedReader(raw, buffer_size=CHUNK)
    if comp == "gzip":
        return gzip.GzipFile(fileobj=buffered, mode="rb"), comp, raw  # type: ignore[return-value]
    if comp == "xz":
        return lzma.LZMAFile(buffered, mode="rb"), comp, raw  # type: ignore[return-value]
    if comp == "bz2":
        return bz2.BZ2File(buffered, mode="rb"), comp, raw  # type: ignore[return-value]
    if comp == "zstd":  # pyarrow's codec: no other library needed
        import pyarrow as pa

        native = pa.CompressedInputStream(pa.PythonFile(buffered, mode="r"), "zstd")
        return io.BufferedReader(_ArrowStream(native), buffer_size=CHUNK), comp, raw  # type: ignore[return-value]
    return buffered, None, raw  # type: ignore[return-value]


BOM = b"\xef\xbb\xbf"


def read_head(path: Path) -> bytes:
    stream, _, raw = open_input(path)
    parts, size = [], 0
    try:  # piece by piece: what was read before a damaged part stands
        while size < HEAD_BYTES and (piece := stream.read1(HEAD_BYTES - size)):
            parts.append(piece)
            size += len(piece)
    except (EOFError, OSError, zlib.error, lzma.LZMAError):
        pass
    finally:
        head = b"".join(parts)
        stream.close()
        raw.close()
    return head[3:] if head.startswith(BOM) else head


def _read(stream: BinaryIO, offset: int) -> bytes:
    try:
        # read1: one underlying read at a time, so a truncated gzip loses only its last piece
        read = getattr(stream, "read1", stream.read)
        return read(CHUNK)
    except (EOFError, gzip.BadGzipFile, zlib.error, lzma.LZMAError, OSError) as exc:
        raise TruncatedInput(offset, str(exc) if isinstance(exc, DamagedContainer)
                             else f"compressed stream ends early or is corrupt: {exc}") from exc


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


#: a JSON string (whole), a bracket, a comma, or a quote whose string goes on past the bytes at hand
_ARRAY_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{},"]')
_SPACE = re.compile(rb"[ \t\r\n]*")


def iter_array_elements(stream: BinaryIO, max_bytes: int, keep: int) -> Iterator[FileRecord]:
    """Array framing: the elements of a top-level JSON array, one record each (for an array of rows
    too large to be one record). A record's offset is its first byte's, its line that byte's line.
    An element longer than ``max_bytes`` is not held: its first ``keep`` bytes, its length and its
    sha256 are (``oversize``). Raises ``TruncatedInput`` at the byte where the bytes stop being an
    array (or the array is cut short); the elements before it were yielded."""
    buf = bytearray()
    base, line, eof = 0, 1, False  # offset and line of buf[0]; the stream's end was read

    def fill() -> None:
        nonlocal eof
        chunk = _read(stream, base + len(buf))
        eof = not chunk
        buf.extend(chunk)

    def drop(upto: int) -> None:  # the bytes before ``upto`` are done with
        nonlocal base, line
        line += buf.count(b"\n", 0, upto)
        del buf[:upto]
        base += upto

    while len(buf) < len(BOM) and not eof:
        fill()
    if buf.startswith(BOM):
        drop(3)
    while (i := _SPACE.match(buf).end()) == len(buf) and not eof:
        fill()
    if buf[i:i + 1] != b"[":
        raise TruncatedInput(base + i, "not a JSON array")
    drop(i + 1)
    pos, depth = 0, 0
    start: int | None = None  # the current element's first byte in buf (None: between elements)
    at = (0, 0)  # its line and offset
    big: list[Any] | None = None  # an element too long to hold: [sha256, its first bytes, bytes hashed]

    def record(begin: int, end: int) -> FileRecord:
        data = bytes(buf[begin:end])
        if big is None and len(data) > max_bytes:
            return FileRecord(at[0], at[1], data[:keep], len(data), True, hashlib.sha256(data).hexdigest())
        if big is None:
            return FileRecord(at[0], at[1], data, len(data))
        big[0].update(data)
        return FileRecord(at[0], at[1], big[1], big[2] + len(data), True, big[0].hexdigest())

    while True:
        m = _ARRAY_TOKEN.search(buf, pos)
        if m is None or (m.group(0) == b'"' and not eof):  # more bytes needed (a string may go on)
            if eof:
                raise TruncatedInput(base + len(buf), f"the JSON array is cut short at byte {base + len(buf)}")
            if start is None:  # between elements: only a bare value's first bytes can be pending
                drop(_SPACE.match(buf, pos).end())
                pos = 0
            elif big is not None or len(buf) - start > max_bytes:
                cut = m.start() if m is not None else len(buf)
                if big is None:
                    big = [hashlib.sha256(), bytes(buf[start:start + keep]), 0]
                big[0].update(buf[start:cut])
                big[2] += cut - start
                drop(cut)
                start, pos = 0, 0
            fill()
            continue
        tok = m.group(0)
        if depth == 0 and start is None:
            if tok in (b",", b"]"):  # an element's end: a bare value (number, literal) before it, or nothing
                value = _SPACE.match(buf, pos).end()
                if value < m.start():
                    at = (line + buf.count(b"\n", 0, value), base + value)
                    end = m.start()
                    while buf[end - 1] in b" \t\r\n":  # the value without the space after it
                        end -= 1
                    yield record(value, end)
                if tok == b"]":
                    return
                drop(m.end())
                pos = 0
                continue
            start = m.start()
            at = (line + buf.count(b"\n", 0, start), base + start)
        if tok in (b"[", b"{"):
            depth += 1
        elif tok in (b"]", b"}"):
            depth -= 1
        pos = m.end()
        if depth == 0:  # the element (an object, an array or a string) is whole
            yield record(start, pos)
            start, big = None, None
            drop(pos)
            pos = 0
