"""Ingest: files in, one append-only batch of raw records out, bad records quarantined.

The whole call is one batch under the warehouse write lock. Records stream through a buffer
that is flushed to immutable Parquet files every ``flush_bytes`` (so memory stays bounded
whatever the corpus size); the batch becomes visible in one catalog commit at the end. A crash
before that commit leaves nothing visible and the same ingest can simply be run again; a
record already in the warehouse (same ``record_id``) is counted as a duplicate, never stored
twice.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
from trajwh.ingest.adapters.base import Adapter
from trajwh.ingest.adapters.registry import detect, framing_for, get_adapter, known_formats
from trajwh.ingest.reader import (
    CONTAINERS,
    FileRecord,
    TruncatedInput,
    container_contents,
    container_unreadable,
    display_path,
    find_input_files,
    iter_array_elements,
    iter_lines,
    open_input,
    read_document,
    read_head,
    stream_damage,
)
from trajwh.licenses.optout import mark_opt_outs
from trajwh.licenses.spdx import require_valid
from trajwh.lineage.catalog import Warehouse, WriteSession, json_text, now_utc
from trajwh.lineage.storage import WrittenFile
from trajwh.schemas import ids
from trajwh.schemas.arrow import arrow_schema
from trajwh.schemas.errors import ConfigError
from trajwh.schemas.tables import QuarantineRow, RawRecord

INGEST_VERSION = "1.0.0"
#: files a dataset folder carries beside its trajectories: skipped with a note when no adapter reads them
_DOC_NAME = re.compile(r"^(README|READ_ME|LICEN[CS]E|COPYING|NOTICE|CHANGELOG|CHANGES|AUTHORS|CONTRIBUTING|"
                       r"CITATION|SOURCES|MANIFEST)([._-].*)?$", re.I)
#: images and video by their first bytes (PNG, JPEG, GIF, WebP, MP4 / QuickTime, WebM / Matroska): the
#: screenshots and screen recordings that web and computer-use agents leave beside their trajectories
_MEDIA = re.compile(rb"\A(?:\x89PNG\r\n\x1a\n|\xff\xd8\xff|GIF8[79]a|RIFF....WEBP|....ftyp|\x1a\x45\xdf\xa3)", re.S)
INGEST_TRANSFORM = f"ingest@{INGEST_VERSION}"
_SOURCE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:/\-]{0,127}$")
_BATCH_ID = re.compile(r"^[0-9a-f]{32}$")


@dataclass
class IngestOptions:
    source: str = "local"
    license: str | None = None
    format: str | None = None  # force an adapter instead of detecting
    max_record_bytes: int = 32 << 20
    flush_bytes: int = 64 << 20
    quarantine_keep_bytes: int = 1 << 20
    lock_timeout: float = 60.0
    allow_forgotten: bool = False  # take records a deletion request removed (refused and counted otherwise)
    stdin: Any = None  # the binary stream a path "-" reads (standard input when None)
    #: the batch's id, chosen by the caller (a Dagster partition added before the run that ingests
    #: it); made here when None. 32 lowercase hex digits, the form of the ids made here
    batch_id: str | None = None

    def validate(self) -> None:
        if self.batch_id is not None and not _BATCH_ID.match(self.batch_id):
            raise ConfigError(f"batch id {self.batch_id!r} is not usable", valid="32 lowercase hexadecimal digits")
        if not _SOURCE.match(self.source):
            raise ConfigError(f"source name {self.source!r} is not usable",
                              valid="1-128 characters of letters, digits and _ . : / -, starting with a letter or digit")
        if self.license is not None:  # checked against the SPDX list, and stored normalized
            self.license = require_valid(self.license, "--license")
        if self.format is not None:
            get_adapter(self.format)
        if self.max_record_bytes <= 0 or self.flush_bytes <= 0:
            raise ConfigError("max_record_bytes and flush_bytes must be positive")


@dataclass
class FileSummary:
    path: str
    size: int
    format: str | None
    compression: str | None
    n_records: int = 0
    n_new: int = 0
    n_duplicate: int = 0
    n_quarantined: int = 0
    n_forgotten: int = 0  # records a deletion request removed: refused (docs/forget.md)
    sha256: str = ""
    error: str | None = None  # the file could not be (fully) read: why; its records read before stand


@dataclass
class IngestSummary:
    batch_id: str
    run_id: str
    source: str
    files: list[FileSummary] = field(default_factory=list)
    bytes_read: int = 0
    quarantine_reasons: dict[str, int] = field(default_factory=dict)
    opted_out: dict[str, int] = field(default_factory=dict)  # opt-out kind -> new records it matches
    recorded: bool = True  # False: nothing new, so no batch was recorded
    skipped: list[str] = field(default_factory=list)  # documentation files (README, LICENSE, ...), images, videos passed over

    @property
    def n_new(self) -> int:
        return sum(f.n_new for f in self.files)

    @property
    def n_duplicate(self) -> int:
        return sum(f.n_duplicate for f in self.files)

    @property
    def n_quarantined(self) -> int:
        return sum(f.n_quarantined for f in self.files)

    @property
    def n_forgotten(self) -> int:
        return sum(f.n_forgotten for f in self.files)

    @property
    def n_records(self) -> int:
        return sum(f.n_records for f in self.files)

    @property
    def nothing_ingested(self) -> bool:
        return self.n_new == 0 and self.n_duplicate == 0


ProgressFn = Callable[[int], None]


class _BatchWriter:
    """Buffers raw and quarantine rows of one batch and flushes them as Parquet files."""

    def __init__(self, session: WriteSession, opts: IngestOptions, batch_id: str, run_id: str):
        self.session, self.opts, self.batch_id, self.run_id = session, opts, batch_id, run_id
        self.raw: list[dict[str, Any]] = []
        self.raw_bytes = 0
        self.quarantine: list[dict[str, Any]] = []
        self.quarantine_bytes = 0
        self.files: list[WrittenFile] = []
        self.started = now_utc()
        self.seen_records = _known(session.wh, "raw_records", "record_id")
        self.seen_quarantine = _known(session.wh, "quarantine", "quarantine_id")
        from trajwh.lineage.forget import forgotten_digests

        self.forgotten = set() if opts.allow_forgotten else forgotten_digests(session.wh)

    def add_raw(self, row: dict[str, Any]) -> None:
        self.raw.append(row)
        self.raw_bytes += row["byte_length"]
        if self.raw_bytes >= self.opts.flush_bytes:
            self.flush()

    def add_quarantine(self, row: dict[str, Any]) -> bool:
        if row["quarantine_id"] in self.seen_quarantine:
            return False
        self.seen_quarantine.add(row["quarantine_id"])
        self.quarantine.append(row)
        self.quarantine_bytes += len(row["payload"] or b"") + 512
        if self.quarantine_bytes >= min(self.opts.flush_bytes, 16 << 20):  # bounded like good records
            self.flush_quarantine()
        return True

    def flush(self) -> None:
        if self.raw:
            table = pa.Table.from_pylist(self.raw, schema=arrow_schema(RawRecord))
            self.files.append(self.session.write("raw_records", table))
            self.raw, self.raw_bytes = [], 0

    def flush_quarantine(self) -> None:
        if self.quarantine:
            table = pa.Table.from_pylist(self.quarantine, schema=arrow_schema(QuarantineRow))
            self.files.append(self.session.write("quarantine", table))
            self.quarantine, self.quarantine_bytes = [], 0

    def finish(self) -> None:
        self.flush()
        self.flush_quarantine()


def _known(wh: Warehouse, table: str, column: str) -> set[str]:
    return set(wh.query(f"SELECT {column} FROM {table}").column(0).to_pylist())


def quarantine_row(*, batch_id: str, run_id: str, stage: str, source: str, file_path: str,
                   line_no: int | None, offset: int | None, fmt: str | None, reason_code: str,
                   reason: str, payload: bytes, size: int | None = None, sha256: str | None = None,
                   record_id: str | None = None, keep: int = 1 << 20) -> dict[str, Any]:
    """One quarantine row; its id is stable for the same bytes, place and reason."""
    sha = sha256 or ids.sha256_hex(payload)
    size = len(payload) if size is None else size
    return {
        "quarantine_id": ids.short_id(source, stage, file_path, str(line_no), str(offset), reason_code, sha),
        "batch_id": batch_id,
        "stage": stage,
        "source": source,
        "file_path": file_path,
        "line_no": line_no,
        "byte_offset": offset,
        "record_id": record_id,
        "format": fmt,
        "reason_code": reason_code,
        "reason": reason,
        "payload": payload[:keep],
        "payload_size": size,
        "payload_sha256": sha,
        "payload_truncated": size > min(len(payload), keep),
        "quarantined_at": now_utc(),
        "_run_id": run_id,
    }


class DuplicateKeyError(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise DuplicateKeyError(k)
            seen.add(k)
    return out


def _check_record(rec: FileRecord, adapter: Adapter, opts: IngestOptions) -> tuple[str, str] | None:
    """(reason_code, reason) when the record cannot enter ``raw``, else None."""
    if rec.oversize:
        return ("record_too_large",
                f"record of {rec.size / 1e6:.1f} MB exceeds the {opts.max_record_bytes / 1e6:.1f} MB limit "
                f"(raise it with --max-record-mb if such records are expected)")
    try:
        if type(adapter).decode is Adapter.decode:  # plain JSON: also refuse duplicate keys
            obj = json.loads(rec.data, object_pairs_hook=_no_duplicate_keys)
        else:
            obj = adapter.decode(rec.data)  # JSON decoding validates UTF-8 too; decode only to explain
    except DuplicateKeyError as exc:
        return "duplicate_keys", (f"an object repeats the key {exc.key!r}: JSON readers disagree on which value "
                                  f"wins, so the record is kept here instead of guessing")
    except Exception as exc:  # noqa: BLE001 - any decoder failure quarantines the record
        try:
            rec.data.decode("utf-8")
        except UnicodeDecodeError as uexc:
            return "invalid_utf8", f"invalid UTF-8 at byte {uexc.start} of the record: {uexc.reason}"
        return "malformed_json", f"cannot be decoded as {adapter.name} ({exc}); a truncated record looks like this"
    problem = adapter.check_record(obj)
    if problem:
        return "not_a_record", f"not a {adapter.name} record: {problem}"
    return None


def _own_file(wh: Warehouse, path: Path) -> bool:
    """The warehouse's own files are never ingested, except its landing folder."""
    return wh.root in path.parents and (wh.root / "landing") not in path.parents


def _ingest_one(path: Path, writer: _BatchWriter, opts: IngestOptions, summary: IngestSummary,
                progress: ProgressFn | None, shown: str | None = None) -> FileSummary:
    """One file; a file that cannot be read is a per-file error, the rest of the call lands.
    ``shown``: the name recorded for it (``<stdin>`` for standard input), else its path."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        return _file_error(path, f"cannot read: {exc.strerror or exc}", writer, opts, summary, shown=shown)
    if not stat.S_ISREG(mode):
        kind = ("a named pipe (FIFO)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
        return _file_error(path, f"skipped: {kind}, not a file", writer, opts, summary, code="not_a_file",
                           shown=shown)
    try:
        return _ingest_file(path, writer, opts, summary, progress, shown)
    except OSError as exc:  # deleted, unreadable or failing mid-read: what was read before stands
        return _file_error(path, f"cannot read: {exc.strerror or exc}", writer, opts, summary, shown=shown)


def _file_error(path: Path, reason: str, writer: _BatchWriter, opts: IngestOptions, summary: IngestSummary,
                code: str = "file_error", shown: str | None = None) -> FileSummary:
    shown = shown or display_path(path)
    writer.add_quarantine(quarantine_row(
        batch_id=writer.batch_id, run_id=writer.run_id, stage="ingest", source=opts.source, file_path=shown,
        line_no=None, offset=None, fmt=None, reason_code=code, reason=reason, payload=b""))
    summary.quarantine_reasons[code] = summary.quarantine_reasons.get(code, 0) + 1
    return FileSummary(shown, 0, None, None, n_quarantined=1, error=reason)


def _ingest_file(path: Path, writer: _BatchWriter, opts: IngestOptions, summary: IngestSummary,
                 progress: ProgressFn | None, shown: str | None = None) -> FileSummary:
    size = path.stat().st_size
    head = read_head(path)
    adapter = get_adapter(opts.format) if opts.format else detect(str(path), head)
    stream, compression, raw = open_input(path, progress)
    fs = FileSummary(shown or display_path(path), size, adapter.name if adapter else None, compression)
    common = dict(batch_id=writer.batch_id, run_id=writer.run_id, source=opts.source,
                  file_path=fs.path, keep=opts.quarantine_keep_bytes)

    def quarantine(rec_line: int | None, offset: int | None, code: str, reason: str, payload: bytes,
                   size_: int | None = None, sha: str | None = None) -> None:
        row = quarantine_row(stage="ingest", line_no=rec_line, offset=offset, fmt=fs.format,
                             reason_code=code, reason=reason, payload=payload, size=size_, sha256=sha, **common)
        fs.n_quarantined += 1
        summary.quarantine_reasons[code] = summary.quarantine_reasons.get(code, 0) + 1
        writer.add_quarantine(row)

    try:
        if adapter is None and _DOC_NAME.match(path.name):  # a folder's README or LICENSE: not a bad record
            fs.error = "skipped: a documentation file, not a trajectory"
            summary.skipped.append(fs.path)
            return fs
        if adapter is None and compression is None and _MEDIA.match(head):  # a screenshot or a screen recording
            fs.error = "skipped: an image or a video (a screenshot or a recording beside trajectories), not a trajectory"
            summary.skipped.append(fs.path)
            return fs
        if compression in CONTAINERS and (broken := container_unreadable(path, compression, head)):
            whole = "Parquet file" if compression == "parquet" else "zip archive (an Inspect .eval log)"
            quarantine(None, 0, "truncated_file", f"{broken}; nothing of it was kept (valid: a whole {whole}, "
                       "as written)", head, size_=size)
            return fs
        if adapter is None and not head and compression not in (None, *CONTAINERS) and (
                damage := stream_damage(path)):  # cut short before its first block: nothing to read
            quarantine(None, 0, "truncated_file", f"{damage}, before anything could be read; nothing of it was kept "
                       f"(valid: a whole {compression} stream)", b"", size_=size)
            return fs
        if adapter is None:
            seen = head[:80].decode("utf-8", "replace").replace("\n", "\\n")
            what = (f"first bytes: {seen!r}" if compression not in CONTAINERS
                    else container_contents(path, compression) + (f"; its rows begin {seen!r}" if head else ""))
            quarantine(None, 0, "unknown_format",
                       f"not a trajectory file of any known format ({what}); "
                       f"known formats: {known_formats()}", head, size_=size)
            return fs
        records = (iter_lines(stream, opts.max_record_bytes, opts.quarantine_keep_bytes)
                   if compression in CONTAINERS or framing_for(adapter, head) == "jsonl"  # a row is a record
                   else _document(path, stream, adapter, opts))
        try:
            for rec in records:
                fs.n_records += 1
                problem = _check_record(rec, adapter, opts)
                if problem:
                    quarantine(rec.line_no, rec.offset, *problem, rec.data, rec.size, rec.sha256)
                    continue
                rid = ids.record_id(opts.source, rec.data)
                if writer.forgotten and hashlib.sha256(rec.data).hexdigest() in writer.forgotten:
                    fs.n_forgotten += 1  # counted, never stored (not even in the quarantine)
                    continue
                if rid in writer.seen_records:
                    fs.n_duplicate += 1
                    continue
                writer.seen_records.add(rid)
                fs.n_new += 1
                writer.add_raw({
                    "record_id": rid, "source": opts.source, "license": opts.license,
                    "batch_id": writer.batch_id, "file_path": fs.path, "compression": compression,
                    "line_no": rec.line_no, "byte_offset": rec.offset, "byte_length": rec.size,
                    "format": adapter.name, "ingested_at": writer.started, "payload": rec.data,
                })
        except TruncatedInput as exc:
            quarantine(None, exc.offset, "truncated_file",
                       f"{exc.detail}; the {fs.n_records} records before it were kept", b"")
    finally:
        try:
            fs.sha256 = raw.finish_hash()
        finally:
            stream.close()
            raw.close()
    return fs


def _document(path: Path, stream: Any, adapter: Adapter, opts: IngestOptions) -> Iterator[FileRecord]:
    """A document's one record; but an array of rows too large to be one record, in a format that
    reads rows (``row_arrays``), is read again as a record per row, when its first element is one."""
    rec = read_document(stream, opts.max_record_bytes, opts.quarantine_keep_bytes)
    if not (rec.oversize and adapter.row_arrays and rec.data.lstrip()[:1] == b"["):
        yield rec
        return
    rows_stream, _, raw = open_input(path)
    try:
        elements = iter_array_elements(rows_stream, opts.max_record_bytes, opts.quarantine_keep_bytes)
        first = next(elements, None)
        if first is None or _check_record(first, adapter, opts) is not None:
            yield rec  # not rows (one conversation, say): the whole document, refused as too large
            return
        yield first
        yield from elements
    finally:
        rows_stream.close()
        raw.close()


def ingest_paths(wh: Warehouse, paths: Iterable[str | os.PathLike[str]], opts: IngestOptions | None = None,
                 *, run_id: str | None = None, progress: ProgressFn | None = None,
                 on_files: Callable[[list[Path]], None] | None = None) -> IngestSummary:
    """Ingest files or folders into a new batch of ``raw_records`` (+ ``quarantine``). A path
    ``-`` reads standard input (``opts.stdin``), recorded as the file ``<stdin>``."""
    opts = opts or IngestOptions()
    opts.validate()
    with _standard_input(list(paths), opts) as (paths, names):
        return _ingest_paths(wh, paths, names, opts, run_id, progress, on_files)


STDIN_NAME = "<stdin>"


@contextmanager
def _standard_input(paths: list[str | os.PathLike[str]], opts: IngestOptions) -> Iterator[
        tuple[list[str | os.PathLike[str]], dict[Path, str]]]:
    """``-`` among the paths: standard input copied (streamed, any size) to a private temporary
    file, so it is framed, detected, hashed and traced like any file; removed afterwards."""
    if not any(os.fspath(p) == "-" for p in paths):
        yield paths, {}
        return
    if sum(os.fspath(p) == "-" for p in paths) > 1:
        raise ConfigError("standard input ('-') is given more than once", valid="'-' at most once")
    tmp = Path(tempfile.mkdtemp(prefix="trajwh-stdin-"))  # owner-only
    try:
        spooled = tmp / "stdin"
        with open(spooled, "wb") as f:
            shutil.copyfileobj(opts.stdin if opts.stdin is not None else sys.stdin.buffer, f, 1 << 20)
        yield [spooled if os.fspath(p) == "-" else p for p in paths], {spooled.resolve(): STDIN_NAME}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _ingest_paths(wh: Warehouse, paths: list[str | os.PathLike[str]], names: dict[Path, str], opts: IngestOptions,
                  run_id: str | None, progress: ProgressFn | None,
                  on_files: Callable[[list[Path]], None] | None) -> IngestSummary:
    problems: list[tuple[Path, str]] = []
    files = [f for f in find_input_files(paths, problems) if not _own_file(wh, f)]
    if on_files:
        on_files(files)
    started = now_utc()
    batch_id = opts.batch_id or ids.short_id(opts.source, started.isoformat(), str(os.getpid()), uuid.uuid4().hex)
    run_id = run_id or f"ingest-{batch_id[:16]}"
    summary = IngestSummary(batch_id, run_id, opts.source)
    with wh.write_session("ingest", timeout=opts.lock_timeout) as session:
        if opts.batch_id is not None and wh.query("SELECT count(*) FROM batches WHERE batch_id = ?",
                                                  [batch_id]).column(0)[0].as_py():
            raise ConfigError(f"batch {batch_id} exists already in {wh.root}",
                              valid="a new batch id (or none: one is made)")
        writer = _BatchWriter(session, opts, batch_id, run_id)
        for path, reason in problems:
            summary.files.append(_file_error(path, reason, writer, opts, summary))
        for path in files:
            fs = _ingest_one(path, writer, opts, summary, progress, names.get(path))
            summary.files.append(fs)
            summary.bytes_read += fs.size
        writer.finish()
        formats = sorted({f.format for f in summary.files if f.format})
        if not writer.files and not summary.n_new and not summary.n_quarantined:
            # nothing new (every record already present, or forgotten): no empty batch, only the run
            summary.recorded = False
            session.commit(rows={"runs": [_run_row(summary, opts, started)]})
            return summary
        batch = _batch_row(summary, opts, [names.get(f, f) for f in files], formats, started)
        session.commit(
            writer.files,
            rows={"batches": [batch], "ingested_files": [_file_row(batch_id, f) for f in summary.files],
                  "runs": [_run_row(summary, opts, started)]},
            batch_id=batch_id, run_id=run_id, transform_version=INGEST_TRANSFORM,
        )
        if summary.n_new:  # marked on arrival: the next build keeps them out of training and release
            summary.opted_out = mark_opt_outs(wh, session, batch_id, opts.source)
    return summary


def _batch_row(s: IngestSummary, opts: IngestOptions, files: list[Path | str], formats: list[str],
               started: datetime) -> dict[str, Any]:
    return {
        "batch_id": s.batch_id, "source": opts.source, "license": opts.license, "status": "committed",
        "started_at": started, "committed_at": now_utc(), "paths": json_text([display_path(p) for p in files]),
        "n_files": len(s.files), "n_records": s.n_records, "n_new": s.n_new,
        "n_duplicate": s.n_duplicate, "n_quarantined": s.n_quarantined, "bytes_read": s.bytes_read,
        "formats": json_text(formats), "host": socket.gethostname(), "pid": os.getpid(),
    }


def _file_row(batch_id: str, f: FileSummary) -> dict[str, Any]:
    return {
        "batch_id": batch_id, "file_path": f.path, "file_size": f.size,
        "file_sha256": f.sha256,
        "compression": f.compression, "format": f.format, "n_records": f.n_records, "n_new": f.n_new,
        "n_duplicate": f.n_duplicate, "n_quarantined": f.n_quarantined, "error": f.error,
    }


def _run_row(s: IngestSummary, opts: IngestOptions, started: datetime) -> dict[str, Any]:
    return {
        "run_id": s.run_id, "job": "ingest", "started_at": started, "finished_at": now_utc(),
        "status": "succeeded",
        "params": json_text({"source": opts.source, "license": opts.license, "format": opts.format,
                             "max_record_bytes": opts.max_record_bytes}),
        "counts": json_text({"batch_id": s.batch_id, "files": len(s.files), "records": s.n_records,
                             "new": s.n_new, "duplicate": s.n_duplicate, "quarantined": s.n_quarantined,
                             "forgotten_refused": s.n_forgotten}),
        "code_version": INGEST_TRANSFORM, "error": None,
    }
