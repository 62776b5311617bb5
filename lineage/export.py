"""Writing query results out of the warehouse: CSV, JSON lines or Parquet."""

from __future__ import annotations

import base64
import csv
import sys
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from schemas.errors import ConfigError

FORMATS = ("csv", "json", "parquet")


def _text_safe(data: pa.Table) -> pa.Table:
    """Binary columns as base64 text (CSV and JSON have no bytes type)."""
    for i, f in enumerate(data.schema):
        if pa.types.is_binary(f.type) or pa.types.is_large_binary(f.type):
            values = [None if v is None else base64.b64encode(v).decode() for v in data.column(i).to_pylist()]
            data = data.set_column(i, f.name, pa.array(values, pa.string()))
    return data


def _default(value: Any) -> Any:
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    return str(value)


def write_result(data: pa.Table, fmt: str, out: str | None) -> None:
    """Write ``data`` as ``fmt`` to the file ``out`` (stdout when None, except for parquet)."""
    if fmt not in FORMATS:
        raise ConfigError(f"unknown output format {fmt!r}", valid=", ".join(FORMATS))
    if fmt == "parquet":
        if not out:
            raise ConfigError("--format parquet needs --out FILE", valid="--out result.parquet")
        pq.write_table(data, out, compression="zstd")
        return
    if fmt == "json":
        opts = orjson.OPT_UTC_Z | orjson.OPT_NAIVE_UTC | orjson.OPT_SERIALIZE_NUMPY
        lines = b"".join(orjson.dumps(row, default=_default, option=opts) + b"\n" for row in data.to_pylist())
        if out:
            with open(out, "wb") as f:
                f.write(lines)
        else:
            sys.stdout.buffer.write(lines)
            sys.stdout.flush()
        return
    data = _text_safe(data)
    handle = open(out, "w", newline="", encoding="utf-8") if out else sys.stdout
    try:
        writer = csv.writer(handle, lineterminator="\n")  # quotes only where needed
        writer.writerow(data.column_names)
        for batch in data.to_batches(max_chunksize=4096):
            for row in batch.to_pylist():
                writer.writerow([_cell(v) for v in row.values()])
    finally:
        if out:
            handle.close()
        else:
            handle.flush()


def _cell(value: Any) -> Any:
    """CSV cells hold JSON text for lists and structs, ISO text for times, '' for null."""
    if value is None:
        return ""
    if isinstance(value, list | dict):
        return orjson.dumps(value, default=_default).decode()
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return value
