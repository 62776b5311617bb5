"""Tables rebuilt whole by global steps (curation, fragments): skip when current, else swap.

A global step's version string carries its parameters and a fingerprint of its input files; a
run whose version equals the one recorded on the table's files has nothing to do. Otherwise
the new files of every output table replace the old ones in one catalog commit.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
from pydantic import BaseModel
from trajwh.lineage.catalog import Warehouse, WriteSession, json_text, now_utc
from trajwh.schemas import ids
from trajwh.schemas.arrow import arrow_schema


def inputs_fingerprint(wh: Warehouse, tables: list[str], where: str = "", con: Any = None) -> str:
    """Digest of the content hashes of every file of ``tables`` (any change -> a new digest);
    ``where``: a further condition on ``table_files`` rows (e.g. only one stage's edges); ``con``:
    a catalog connection to read through (a transaction's, seeing its own changes)."""
    shas = _manifest(wh, "SELECT string_agg(sha256, ',' ORDER BY sha256) FROM table_files WHERE list_contains(?, table_name)"
                     + (f" AND ({where})" if where else ""), [tables], con).column(0)[0].as_py() or ""
    return ids.digest(shas)[:16]


def batch_fingerprints(wh: Warehouse, tables: list[str], where: str = "", con: Any = None) -> dict[str, str]:
    """Per ingest batch, the digest of the content hashes of its files of ``tables`` (``where``,
    ``con``: as for ``inputs_fingerprint``)."""
    rows = _manifest(wh, "SELECT batch_id, string_agg(sha256, ',' ORDER BY sha256) AS shas FROM table_files "
                     "WHERE list_contains(?, table_name)" + (f" AND ({where})" if where else "")
                     + " GROUP BY batch_id", [tables], con).to_pylist()
    return {r["batch_id"]: ids.digest(r["shas"])[:16] for r in rows}


def _manifest(wh: Warehouse, sql: str, params: list[Any], con: Any) -> pa.Table:
    return wh.manifest_query(sql, params) if con is None else con.sql(sql, params=params).to_arrow_table()


def joined_by_key(outer: Iterator[list[dict[str, Any]]], inner: Iterator[list[dict[str, Any]]],
                  key: str = "trajectory_key") -> Iterator[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """Two streams of row batches, both ordered by ``key``: each outer row with the inner rows of
    its key (consecutive outer rows of one key share them), one key's rows in memory at a time.
    Inner rows of keys the outer stream lacks are skipped."""
    rows = (r for batch in inner for r in batch)
    pending = next(rows, None)
    current, mine = None, []
    for batch in outer:
        for row in batch:
            if row[key] != current:
                current, mine = row[key], []
                while pending is not None and pending[key] < current:
                    pending = next(rows, None)
                while pending is not None and pending[key] == current:
                    mine.append(pending)
                    pending = next(rows, None)
            yield row, mine


def is_current(wh: Warehouse, table: str, version: str) -> bool:
    return wh.manifest_query("SELECT DISTINCT transform_version FROM table_files WHERE table_name = ?",
                    [table]).column(0).to_pylist() == [version]


class TableSetWriter:
    """Rows of a set of tables written file by file as they come (bounded memory), then swapped in
    for the tables' old files in one catalog commit; a crash before it leaves the old tables."""

    def __init__(self, session: WriteSession, models: dict[str, type[BaseModel]], flush_rows: int = 10_000):
        self.session, self.models, self.flush_rows = session, models, flush_rows
        self.buffers: dict[str, list[dict[str, Any]]] = {t: [] for t in models}
        self.files: list[Any] = []
        self.written: set[str] = set()

    def add(self, table: str, rows: list[dict[str, Any]] | dict[str, Any]) -> None:
        buf = self.buffers[table]
        if isinstance(rows, dict):
            buf.append(rows)
        else:
            buf.extend(rows)
        if len(buf) >= self.flush_rows:
            self._flush(table)

    def add_arrow(self, table: str, data: pa.Table | pa.RecordBatch) -> None:
        """Rows already in Arrow (kept rows of an incremental rebuild): written as they are."""
        if data.num_rows:
            data = data if isinstance(data, pa.Table) else pa.Table.from_batches([data])
            self.files.append(self.session.write(table, data))
            self.written.add(table)

    def add_written(self, table: str, files: list[Any]) -> None:
        """Files of ``table`` written elsewhere (``write_table_file``: another thread or process)."""
        self.files += files
        if files:
            self.written.add(table)

    def _flush(self, table: str) -> None:
        buf = self.buffers[table]
        if buf or table not in self.written:  # every table gets at least one (maybe empty) file
            schema = arrow_schema(self.models[table])
            self.files.append(self.session.write(table, pa.Table.from_pylist(buf, schema=schema)))
            self.written.add(table)
        self.buffers[table] = []

    def flush_written(self) -> None:
        """Write what is buffered (a part of a stage, whose files another writer commits)."""
        for table in self.models:
            if self.buffers[table]:
                self._flush(table)

    def commit(self, *, run_id: str, version: str) -> None:
        for table in self.models:
            if self.buffers[table] or table not in self.written:
                self._flush(table)
        wh = self.session.wh
        old = [wh.data / p for p in wh.query("SELECT path FROM table_files WHERE list_contains(?, table_name)",
                                            [list(self.models)]).column(0).to_pylist()]
        self.session.commit(self.files, removed=old, run_id=run_id, transform_version=version)


def mark_running(session: WriteSession, run_id: str, job: str, started: Any) -> None:
    """Record a stage run as ``running`` before it does anything (with the process that runs it),
    so a run that is killed or fails shows as such, never as succeeded; the stage's final
    ``run_row`` replaces it. ``lineage.status.run_state`` tells an interrupted run from a live one."""
    session.upsert_rows("runs", [{
        "run_id": run_id, "job": job, "started_at": started, "finished_at": None, "status": "running",
        "params": json_text({"pid": os.getpid(), "host": socket.gethostname()}), "counts": json_text({}),
        "code_version": "", "error": None}])


def run_row(run_id: str, job: str, started: Any, *, params: dict[str, Any], counts: dict[str, Any],
            code_version: str) -> dict[str, Any]:
    """A succeeded run's row for the ``runs`` table."""
    return {"run_id": run_id, "job": job, "started_at": started, "finished_at": now_utc(), "status": "succeeded",
            "params": json_text(params), "counts": json_text(counts), "code_version": code_version, "error": None}


def committed_batches(wh: Warehouse) -> list[str]:
    """Every committed ingest batch, in commit order (the order of the per-batch partitions)."""
    return wh.query("SELECT batch_id FROM batches WHERE status = 'committed' ORDER BY committed_at, batch_id"
                    ).column(0).to_pylist()


def chosen_batches(wh: Warehouse, todo: list[tuple[str, Any]], chosen: Sequence[str]) -> list[tuple[str, Any]]:
    """The (batch, version) pairs of ``todo`` (what a build of every batch would do) that are in
    ``chosen`` (a Dagster partition run: one partition per ingest batch); a chosen batch that is
    not a committed one is an error naming it."""
    from trajwh.schemas.errors import ConfigError

    order = committed_batches(wh)
    unknown = sorted(set(chosen) - set(order))
    if unknown:
        recent = ", ".join(order[-5:]) or "none yet: ingest first"
        raise ConfigError(f"batch {unknown[0]} is not a committed batch of this warehouse",
                          valid=f"a committed batch id (the latest: {recent}; `trajwh status` lists them)")
    picked = set(chosen)
    return [t for t in todo if t[0] in picked]
