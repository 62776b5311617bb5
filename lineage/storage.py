"""Immutable, content-named Parquet files written atomically.

A file is serialized in memory, named after the sha256 of its bytes, written to a temporary
name in the same folder, fsynced, renamed into place and the folder fsynced (the classic
write-rename protocol): a crash leaves either no file or a whole one, never a torn one. A file
only becomes part of a table when the catalog's manifest says so (``lineage.catalog``), so a
whole file from an uncommitted batch is invisible and is removed by the next writer.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

TMP_PREFIX = ".tmp-"
#: rows per Parquet row group: small enough for selective reads, large enough for zstd
ROW_GROUP_ROWS = 8192


@dataclass(frozen=True)
class WrittenFile:
    table: str
    path: Path
    sha256: str
    rows: int
    size: int


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def ensure_dir(path: Path, *, restricted: bool) -> None:
    path.mkdir(parents=True, exist_ok=True)
    if restricted:
        os.chmod(path, 0o700)


def write_bytes_atomic(data: bytes, final: Path, *, restricted: bool) -> None:
    tmp = final.parent / f"{TMP_PREFIX}{uuid.uuid4().hex}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    fd = os.open(tmp, flags, 0o600 if restricted else 0o644)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)
    fsync_dir(final.parent)


def write_parquet(table_name: str, table: pa.Table, folder: Path, *, restricted: bool) -> WrittenFile:
    """Write ``table`` as one content-named Parquet file under ``folder``."""
    ensure_dir(folder, restricted=restricted)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd", row_group_size=ROW_GROUP_ROWS)
    data = sink.getvalue().to_pybytes()
    sha = hashlib.sha256(data).hexdigest()
    final = folder / f"part-{sha[:32]}.parquet"
    if not final.exists():
        write_bytes_atomic(data, final, restricted=restricted)
    return WrittenFile(table_name, final, sha, table.num_rows, len(data))
