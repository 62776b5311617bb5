"""Stable packing windows and the plan of an incremental pack build.

Units are packed window by window (memory is bounded by a window, not the layer). A window is
a fixed part of the data, never a position in a stream: the units of one split and one ingest
batch whose trajectory key's digest falls in one of ``2**bits`` equal ranges, where ``2**bits`` is
the smallest power of two that gives ``window`` units or fewer per range on average. So a new
batch makes windows of its own, a unit that comes or goes changes only its own window, and the
ranges of a (split, batch) move only when its unit count crosses a power of two.

A full build and an incremental build pack the same windows, so they give the same packs. The
incremental build compares each window's packing inputs (``window_digest``: its units and their
token keys) with the stored set's:

- same digest: the window's packs are copied as stored (the packer is deterministic); only the
  segment fields that are not packing inputs (dedup weight, cluster) are brought up to date;
- otherwise the window is packed again; a unit whose token key is unchanged takes its tokens from
  the stored packs of its window (render and tokenize are the cost of a pack build, the packer a
  small part), the others are rendered.

A unit's token key is what its rendering is made from: the unit (its id names the episode and
the span), its steps and trained span, its tool definitions, and the version of its batch's
redacted layer (a batch is re-redacted only when that version changes; a forget removes rows
without touching the others).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from trajwh.lineage.catalog import Warehouse
from trajwh.lineage.parallel import duckdb_memory
from trajwh.lineage.storage import WrittenFile, data_root, ensure_dir, write_bytes_atomic
from trajwh.schemas import ids

#: units per token chunk on average: a chunk is one ``pack_tokens`` file, what a unit that comes,
#: goes or changes its token key costs to write again (a unit that changes split keeps its row)
CHUNK = 64
#: units in chunk order with their window (``bits``: ranges per split and batch, as a power of two)
#: and their token chunk (``cbits``: ranges per batch: the chunk does not depend on the split); the
#: rows are spooled in this order, which the token parts read without a sort (``ord_key`` is the
#: packing order, which the layouts sort by, on small columns). ``exclude``: ``EXCLUDE (step_ids,
#: span_step_ids)`` when few units will be rendered (``packing.layer._windowed``)
WINDOWED_SQL = """
    WITH u AS (
        SELECT u.*, coalesce(u.split, 'unsplit') AS pack_split, e.tool_schema_digest, e._batch_id AS batch_id,
               ('0x' || left(sha256(u.trajectory_key), 8))::UBIGINT AS key_bits,
               left(sha256(concat_ws(chr(31), u.unit_id, u.trajectory_key, coalesce(array_to_string(u.step_ids, chr(30)), chr(1)),
                                     coalesce(array_to_string(u.span_step_ids, chr(30)), chr(1)),
                                     coalesce(e.tool_schema_digest, chr(1)), coalesce(e._batch_id, chr(1)),
                                     coalesce(v.version, chr(1)))), 24) AS token_key
        FROM ({units}) u LEFT JOIN redacted_episodes e USING (trajectory_key)
        LEFT JOIN (SELECT unnest(?::VARCHAR[]) AS version_batch, unnest(?::VARCHAR[]) AS version) v
          ON v.version_batch = e._batch_id
        WHERE {dedup}),
    n AS (SELECT *, CAST(ceil(log2(greatest(1, ceil(count(*) OVER (PARTITION BY pack_split, batch_id) / {window}))))
                         AS INTEGER) AS bits,
                    CAST(ceil(log2(greatest(1, ceil(count(*) OVER (PARTITION BY batch_id) / {chunk}))))
                         AS INTEGER) AS cbits FROM u),
    w AS (SELECT * EXCLUDE (bits, cbits, key_bits), pack_split || '/' || coalesce(batch_id, '-') || '/' || lpad(CAST(
              CASE WHEN bits = 0 THEN 0 ELSE key_bits >> (32 - bits) END AS VARCHAR), 10, '0') AS window_id,
              coalesce(batch_id, '-') || '/' || lpad(CAST(CASE WHEN cbits = 0 THEN 0 ELSE key_bits >> (32 - cbits) END
                                                           AS VARCHAR), 10, '0') AS chunk_id FROM n)
    SELECT * {exclude}, window_id || '|' || trajectory_key AS ord_key,
           chunk_id || '|' || trajectory_key AS chunk_key FROM w {where}
    ORDER BY chunk_key, unit_id"""
#: the steps of the trajectories to render, in order (``k``: trajectory key -> order key; ``steps``: where
#: they are, ``Warehouse.rows_of``)
RENDER_STEPS_SQL = """
    SELECT k.ord_key AS chunk_key, s.trajectory_key, s.step_id, s.step_index, s.author, s.role, s.text, s.observation, s.tool_calls,
      s.metadata
    FROM {steps} s JOIN (SELECT unnest(?::VARCHAR[]) AS trajectory_key, unnest(?::VARCHAR[]) AS ord_key) k
    USING (trajectory_key) ORDER BY k.ord_key, s.step_index"""
_REDACTED = ["redacted_episodes", "redacted_steps", "redacted_tool_schemas"]


def batch_versions(wh: Warehouse) -> dict[str, str]:
    """Batch -> the transform versions of its redacted files (what its redacted rows were made by)."""
    rows = wh.query("SELECT batch_id, string_agg(DISTINCT transform_version, ',' ORDER BY transform_version) AS v "
                    "FROM table_files WHERE list_contains(?, table_name) GROUP BY 1", [_REDACTED]).to_pylist()
    return {r["batch_id"]: r["v"] for r in rows}


def window_digest(window_id: str, units: list[tuple[str, str]]) -> str:
    """The packing inputs of a window: its id and its (unit, token key) pairs in packing order."""
    return ids.digest([window_id, units])[:24]


@dataclass
class Plan:
    """What an incremental pack build does with each window and each token chunk (module docstring)."""

    copy: dict[str, str] = field(default_factory=dict)  # window id -> digest: layouts copied as stored
    meta: dict[str, tuple[float | None, str | None]] = field(default_factory=dict)  # unit -> (weight, cluster) there
    copy_units: dict[str, set[str]] = field(default_factory=dict)  # window id -> its units (for drop counts)
    repack: set[str] = field(default_factory=set)  # stored windows packed again (from lengths)
    digests: dict[str, str] = field(default_factory=dict)  # window id -> digest, every window
    keys: dict[str, str] = field(default_factory=dict)  # unit -> token key, every unit
    known: dict[str, tuple[int, tuple[int, ...], list[str]]] = field(default_factory=dict)  # unit -> stored (n, trainable per piece, cut steps)
    dropped: set[str] = field(default_factory=set)  # units a build dropped before with the same token key
    render: dict[str, str] = field(default_factory=dict)  # trajectory key -> chunk order key: steps to read
    rendering: set[str] = field(default_factory=set)  # units to render
    chunks: dict[str, str] = field(default_factory=dict)  # chunk id -> digest, every chunk
    write: set[str] = field(default_factory=set)  # chunks written (new or changed)
    chunk_units: dict[str, int] = field(default_factory=dict)  # chunk id -> its units (to deal chunks by cost)
    units: int = 0

    @property
    def rendered_units(self) -> int:
        return len(self.rendering)


@dataclass
class StoredSet:
    """What an incremental build reads of the stored set, once: per pack its file, window, split,
    token counts and segments, in the layout files the manifest lists; per unit its token row's
    key, chunk, lengths and file."""

    files: list[dict[str, Any]]  # manifest rows of the layouts: path, sha256, rows, bytes
    table: pa.Table | None = None  # filename, window_id, window_digest, split, n_tokens, n_trainable
    segments: list[list[dict[str, Any]]] = field(default_factory=list)  # per pack, as Python
    token_files: list[dict[str, Any]] = field(default_factory=list)  # manifest rows of pack_tokens
    tokens: dict[str, dict[str, Any]] = field(default_factory=dict)  # unit -> its token row's meta and file
    chunks: dict[str, str] = field(default_factory=dict)  # chunk id -> digest
    file_chunks: dict[str, str] = field(default_factory=dict)  # manifest path -> the chunk its file holds
    #: the set's staged token rows (``pack_tokens_staged``: a ``pack_tokens`` partition run without the
    #: layouts): unit -> its row's meta and file, and manifest path -> (chunk, digest) of each staged file
    staged: dict[str, dict[str, Any]] = field(default_factory=dict)
    staged_files: dict[str, tuple[str, str]] = field(default_factory=dict)


_TOKEN_META = ("SELECT filename, unit_id, token_key, chunk_id, chunk_digest, n_tokens, piece_trainable, removed_step_ids "
               "FROM read_parquet(?, union_by_name = true, filename = true) WHERE pack_set = ?")


def read_stored(wh: Warehouse, pack_set: str, files: list[dict[str, Any]], token_files: list[dict[str, Any]],
                staged_files: list[dict[str, Any]] | None = None) -> StoredSet:
    """The stored set's layouts (``StoredSet``) from its ``files``, its token rows' meta (no
    tokens) from ``token_files`` and its staged token rows' meta from ``staged_files``."""
    out = StoredSet(files, token_files=token_files)
    for path, r in _token_meta(wh, pack_set, staged_files or []):
        out.staged[r["unit_id"]] = r
        out.staged_files[path] = (r["chunk_id"], r["chunk_digest"])
    if files:
        data = wh.query("SELECT filename, window_id, window_digest, split, n_tokens, n_trainable, segments FROM "
                        "read_parquet(?, union_by_name = true, filename = true) WHERE pack_set = ?",
                        [[str(wh.data / r["path"]) for r in files], pack_set])
        out.table, out.segments = data.drop_columns(["segments"]), data.column("segments").to_pylist()
    for path, r in _token_meta(wh, pack_set, token_files, cache=True):
        out.tokens[r["unit_id"]] = r
        out.chunks[r["chunk_id"]] = r["chunk_digest"]
        out.file_chunks[path] = r["chunk_id"]
    return out


def _token_meta(wh: Warehouse, pack_set: str, files: list[dict[str, Any]], *, cache: bool = False
                ) -> Iterator[tuple[str, dict[str, Any]]]:
    """(manifest path, row meta) of the set's token rows in ``files`` (manifest rows): no tokens read.
    ``cache``: the rows of the files the set's meta cache holds (``META_DIR``) are taken from it,
    the others read, and the cache written again with the rows of ``files`` only."""
    if not files:
        return
    name_of = {str(r["sha256"]): str(wh.data / r["path"]) for r in files}
    path_of = {str(wh.data / r["path"]): str(r["path"]) for r in files}
    every = _cached_meta(wh, pack_set) if cache else None
    cached = _of_files(every, list(name_of)) if every is not None else None
    have = set(cached.column("sha256").to_pylist()) if cached is not None else set()
    missing = [name for sha, name in name_of.items() if sha not in have]
    read = wh.query(_TOKEN_META, [missing, pack_set]) if missing else None
    stale = cached is not None and cached.num_rows < every.num_rows  # (rows of files no longer listed)
    if cache and (read is not None and read.num_rows or stale):  # written again: the rows of ``files`` only
        sha_by_name = {name: sha for sha, name in name_of.items()}
        parts = [cached] if cached is not None else []
        if read is not None:
            parts.append(read.append_column("sha256", pa.array([sha_by_name[f] for f in read.column("filename")
                                                                .to_pylist()], type=pa.string())).drop_columns(["filename"]))
        _write_meta(wh, pack_set, pa.concat_tables([t.select(_META_COLUMNS) for t in parts],
                                                    promote_options="permissive"))
    if cached is not None:
        for r in cached.to_pylist():
            name = name_of[r.pop("sha256")]
            yield path_of[name], {"filename": name, **r}
    for r in read.to_pylist() if read is not None else []:
        yield path_of.get(r["filename"], r["filename"]), r


#: a set's token rows' meta (ids, token keys, chunk digests, lengths: no tokens, no content), by the
#: sha256 of the file that holds them: an incremental build reads it instead of every token file's
#: (108,070 + 1 %: 1,024 files, 0.66 s)
META_DIR = "pack_token_meta"
_META_COLUMNS = ["sha256", "unit_id", "token_key", "chunk_id", "chunk_digest", "n_tokens", "piece_trainable",
                 "removed_step_ids"]


def _meta_path(wh: Warehouse, pack_set: str) -> Path:
    return wh.root / "_cache" / META_DIR / f"{pack_set}.parquet"


def _cached_meta(wh: Warehouse, pack_set: str) -> pa.Table | None:
    """The set's cached meta rows; None when there is no cache (a lost or unreadable one only means
    reading the files again)."""
    try:
        return pq.read_table(_meta_path(wh, pack_set)).select(_META_COLUMNS)
    except (OSError, pa.ArrowException, KeyError):
        return None


def _of_files(meta: pa.Table, shas: list[str]) -> pa.Table:
    """The meta rows of the files ``shas``."""
    return meta.filter(pc.is_in(meta.column("sha256"), value_set=pa.array(shas, type=pa.string())))


def _write_meta(wh: Warehouse, pack_set: str, table: pa.Table) -> None:
    import io

    path = _meta_path(wh, pack_set)
    ensure_dir(path.parent, restricted=True)
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    write_bytes_atomic(buf.getvalue(), path, restricted=True)


def prune_token_meta(wh: Warehouse) -> None:
    """Keep in each set's meta cache only the rows of the files the set still lists (a forget:
    the rewritten files' rows go with the forgotten units); a cache of a set that is gone goes."""
    from trajwh.packing.verify import set_files  # (verify imports this module)

    folder = wh.root / "_cache" / META_DIR
    for path in sorted(folder.glob("*.parquet")) if folder.is_dir() else []:
        listed = [sha for _, sha in set_files(wh, path.stem)]
        every = _cached_meta(wh, path.stem)
        kept = _of_files(every, listed) if every is not None else None
        if kept is None or not kept.num_rows:
            path.unlink(missing_ok=True)
        elif kept.num_rows < every.num_rows:
            _write_meta(wh, path.stem, kept)


def remove_token_meta(wh: Warehouse, pack_set: str) -> None:
    """Forget a set's meta cache (the set is gone)."""
    _meta_path(wh, pack_set).unlink(missing_ok=True)


def stored_windows(stored: StoredSet) -> dict[str, str]:
    """The stored set's windows: id -> digest."""
    if stored.table is None:
        return {}
    return {w: d for w, d in zip(stored.table.column("window_id").to_pylist(),
                                 stored.table.column("window_digest").to_pylist(), strict=True) if w is not None}


def chunk_digest(chunk_id: str, units: list[tuple[str, str]]) -> str:
    """The token inputs of a chunk: its id and its (unit, token key) pairs, sorted."""
    return ids.digest([chunk_id, sorted(units)])[:24]


def plan_windows(rows: Iterator[dict[str, Any]], stored: StoredSet, dropped: dict[str, str] | None = None) -> Plan:
    """Walk the units once, in chunk order (no steps, no tokens), and decide per window and per
    chunk. ``dropped``: unit -> token key of the units an earlier build of the set dropped as too
    long (``read_drops``): whether a unit fits depends on its rendering alone, so one with the same
    token key is dropped again without rendering it. A unit whose stored row has another token key
    (or none) and whose staged row (``StoredSet.staged``) has its key takes the staged row as its
    stored one (``stored.tokens`` is updated): its lengths are known and its row is copied."""
    dropped = dropped or {}
    windows = stored_windows(stored)
    plan = Plan()
    in_window: dict[str, list[tuple[str, str, str, float | None, str | None]]] = {}
    in_chunk: dict[str, list[tuple[str, str]]] = {}
    for u in rows:  # in chunk order
        plan.units += 1
        key = plan.keys[u["unit_id"]] = u["token_key"]
        in_chunk.setdefault(u["chunk_id"], []).append((u["unit_id"], key))
        in_window.setdefault(u["window_id"], []).append((u["ord_key"], u["unit_id"], key, u["dedup_weight"],
                                                         u["cluster_id"]))
        row = stored.tokens.get(u["unit_id"])
        if row is None or row["token_key"] != key:
            staged = stored.staged.get(u["unit_id"])
            if staged is not None and staged["token_key"] == key:  # rendered ahead: its staged row stands in
                row = stored.tokens[u["unit_id"]] = staged  # (copied from its file like a stored row)
        if row is not None and row["token_key"] == key:
            plan.known[u["unit_id"]] = (row["n_tokens"], tuple(row["piece_trainable"]), row["removed_step_ids"] or [])
        elif dropped.get(u["unit_id"]) == key:
            plan.dropped.add(u["unit_id"])
        else:
            plan.rendering.add(u["unit_id"])
            plan.render[u["trajectory_key"]] = u["chunk_key"]
    for window, members in in_window.items():
        members.sort()  # packing order: (order key, unit)
        digest = plan.digests[window] = window_digest(window, [(m[1], m[2]) for m in members])
        if windows.get(window) == digest:
            plan.copy[window] = digest
            plan.copy_units[window] = {m[1] for m in members}
            for _, unit, _, weight, cluster in members:
                plan.meta[unit] = (weight, cluster)
        elif window in windows:
            plan.repack.add(window)
    for chunk, pairs in in_chunk.items():
        digest = plan.chunks[chunk] = chunk_digest(chunk, pairs)
        plan.chunk_units[chunk] = len(pairs)
        if stored.chunks.get(chunk) != digest:
            plan.write.add(chunk)
    return plan


DROPS_DIR = "pack_drops"


def _drops_path(wh: Warehouse, pack_set: str) -> Path:
    return wh.root / "_cache" / DROPS_DIR / f"{pack_set}.json"


def read_drops(wh: Warehouse, pack_set: str) -> dict[str, str]:
    """Unit -> token key of the units the set's last build dropped as too long (ids and digests,
    never content); a lost or unreadable file only means rendering them again."""
    try:
        data = json.loads(_drops_path(wh, pack_set).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def remove_drops(wh: Warehouse, pack_set: str) -> None:
    """Forget a set's drops (the set is gone)."""
    _drops_path(wh, pack_set).unlink(missing_ok=True)


def write_drops(wh: Warehouse, pack_set: str, drops: dict[str, str]) -> None:
    path = _drops_path(wh, pack_set)
    ensure_dir(path.parent, restricted=True)
    write_bytes_atomic(json.dumps(drops, sort_keys=True).encode(), path, restricted=True)


def stored_rows(stored: StoredSet, units: list[str]) -> pa.Table | None:
    """The stored token rows of ``units`` (whole rows, tokens too), read from the files that hold
    them (a chunk written again copies its unchanged units' rows)."""
    by_file: dict[str, list[str]] = {}
    for u in units:
        by_file.setdefault(stored.tokens[u]["filename"], []).append(u)
    tables = []
    for f, us in sorted(by_file.items()):  # (a chunk's file is small: read whole and filtered, without the
        t = pq.ParquetFile(f).read()        # dataset API's set-up, 7 -> 4 ms a file)
        tables.append(t.filter(pc.is_in(t.column("unit_id"), value_set=pa.array(us, type=pa.string()))))
    return pa.concat_tables(tables, promote_options="default") if tables else None


def _segment_updates(segments: list[list[dict[str, Any]]], plan: Plan) -> list[bool]:
    """Per pack: whether a segment's dedup weight or cluster (not packing inputs) changed; brings
    them up to date in ``segments``."""
    changed = []
    for segs in segments:
        moved = False
        for s in segs:
            weight, cluster = plan.meta[s["fragment_id"].partition("#")[0]]
            if s["dedup_weight"] != weight or s["cluster_id"] != cluster:
                s["dedup_weight"], s["cluster_id"], moved = weight, cluster, True
        changed.append(moved)
    return changed


def kept_files(wh: Warehouse, plan: Plan, stored: StoredSet
               ) -> tuple[list[tuple[WrittenFile, pa.Table, list[list[dict[str, Any]]]]], list[Path]]:
    """The stored set's files split in two: those whose every pack is of a copied window and needs
    no segment update stay as they are (same bytes, so the packs check trusts them), with their
    packs' figures (split, n_tokens, n_trainable) and segments for the summary; the paths of the
    others, whose packs of copied windows ``copied_packs`` rewrites."""
    if not plan.copy or stored.table is None:
        return [], [wh.data / r["path"] for r in stored.files]
    rows_of: dict[str, list[int]] = {}
    for i, name in enumerate(stored.table.column("filename").to_pylist()):
        rows_of.setdefault(name, []).append(i)
    windows = stored.table.column("window_id").to_pylist()
    kept, rewrite = [], []
    for r in stored.files:
        name = str(wh.data / r["path"])
        mine = rows_of.get(name, [])
        segments = [stored.segments[i] for i in mine]  # brought up to date in place: a file that changes is read again
        if mine and all(windows[i] in plan.copy for i in mine) and not any(_segment_updates(segments, plan)):
            kept.append((WrittenFile("packs", data_root(name), r["sha256"], r["rows"], r["bytes"]),
                         stored.table.take(mine).select(["split", "n_tokens", "n_trainable"]), segments))
        else:
            rewrite.append(data_root(name))
    return kept, rewrite


def copied_packs(wh: Warehouse, pack_set: str, plan: Plan, schema: pa.Schema, lineage: dict[str, str],
                 files: list[Path]) -> Iterator[tuple[pa.Table, list[dict[str, Any]]]]:
    """The stored packs of the windows copied as they are, read from ``files`` (those
    ``kept_files`` does not keep), with each segment's dedup weight and cluster brought up to date
    (rows whose segments changed take this run's lineage); yields (table, its segments as Python)
    for the summary."""
    if not plan.copy or not files:
        return
    for rb in wh.stream("SELECT * FROM read_parquet(?, union_by_name = true) WHERE pack_set = ? AND "
                        "list_contains(?, window_id)", [[str(f) for f in files], pack_set, list(plan.copy)],
                        batch_rows=256, arrow=True, memory_limit=duckdb_memory(512), threads=1):
        if not rb.num_rows:  # no empty files
            continue
        table = pa.Table.from_batches([rb]).select(schema.names).cast(schema)
        segments = table.column("segments").to_pylist()
        changed = _segment_updates(segments, plan)
        if any(changed):
            table = table.set_column(schema.get_field_index("segments"), schema.field("segments"),
                                     pa.array(segments, type=schema.field("segments").type))
            for col, value in lineage.items():
                old = table.column(col).to_pylist()
                table = table.set_column(schema.get_field_index(col), schema.field(col),
                                         pa.array([value if c else o for c, o in zip(changed, old, strict=True)],
                                                  type=schema.field(col).type))
        yield table, segments
