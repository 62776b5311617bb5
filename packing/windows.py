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

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from trajwh.lineage.catalog import Warehouse
from trajwh.lineage.parallel import duckdb_memory
from trajwh.lineage.storage import WrittenFile, data_root, ensure_dir, write_bytes_atomic
from trajwh.schemas import ids

#: units in packing order with their window (``bits``: ranges per split and batch, as a power of two)
WINDOWED_SQL = """
    WITH u AS (
        SELECT u.*, coalesce(u.split, 'unsplit') AS pack_split, e.tool_schema_digest, e._batch_id AS batch_id
        FROM ({units}) u LEFT JOIN redacted_episodes e USING (trajectory_key) WHERE {dedup}),
    n AS (SELECT *, CAST(ceil(log2(greatest(1, ceil(count(*) OVER (PARTITION BY pack_split, batch_id) / {window}))))
                         AS INTEGER) AS bits FROM u),
    w AS (SELECT * EXCLUDE (bits), pack_split || '/' || coalesce(batch_id, '-') || '/' || lpad(CAST(
              CASE WHEN bits = 0 THEN 0 ELSE ('0x' || left(sha256(trajectory_key), 8))::UBIGINT >> (32 - bits) END
              AS VARCHAR), 10, '0') AS window_id FROM n)
    SELECT *, window_id || '|' || trajectory_key AS ord_key FROM w {where}
    ORDER BY ord_key, unit_id"""
#: the steps of the trajectories to render, in packing order (``k``: trajectory key -> order key)
RENDER_STEPS_SQL = """
    SELECT k.ord_key, s.trajectory_key, s.step_id, s.step_index, s.author, s.role, s.text, s.observation, s.tool_calls
    FROM redacted_steps s JOIN (SELECT unnest(?::VARCHAR[]) AS trajectory_key, unnest(?::VARCHAR[]) AS ord_key) k
    USING (trajectory_key) ORDER BY k.ord_key, s.step_index"""
_REDACTED = ["redacted_episodes", "redacted_steps", "redacted_tool_schemas"]


def batch_versions(wh: Warehouse) -> dict[str, str]:
    """Batch -> the transform versions of its redacted files (what its redacted rows were made by)."""
    rows = wh.query("SELECT batch_id, string_agg(DISTINCT transform_version, ',' ORDER BY transform_version) AS v "
                    "FROM table_files WHERE list_contains(?, table_name) GROUP BY 1", [_REDACTED]).to_pylist()
    return {r["batch_id"]: r["v"] for r in rows}


def token_key(u: dict[str, Any], versions: dict[str, str]) -> str:
    return ids.digest([u["unit_id"], u["trajectory_key"], u["step_ids"], u["span_step_ids"], u["tool_schema_digest"],
                       u["batch_id"], versions.get(u["batch_id"])])[:24]


def window_digest(window_id: str, units: list[tuple[str, str]]) -> str:
    """The packing inputs of a window: its id and its (unit, token key) pairs in packing order."""
    return ids.digest([window_id, units])[:24]


@dataclass
class Plan:
    """What an incremental pack build does with each window (see the module docstring)."""

    copy: dict[str, str] = field(default_factory=dict)  # window id -> digest: packs copied as stored
    meta: dict[str, tuple[float | None, str | None]] = field(default_factory=dict)  # unit -> (weight, cluster) there
    copy_units: dict[str, set[str]] = field(default_factory=dict)  # window id -> its units (for drop counts)
    repack: set[str] = field(default_factory=set)  # windows packed again, some units' tokens from the stored packs
    reuse: set[str] = field(default_factory=set)  # units whose stored tokens are taken
    render: dict[str, str] = field(default_factory=dict)  # trajectory key -> order key: steps to read
    keys: dict[str, str] = field(default_factory=dict)  # unit -> token key, units of windows not copied
    digests: dict[str, str] = field(default_factory=dict)  # window id -> digest, every window
    dropped: set[str] = field(default_factory=set)  # units a build dropped before with the same token key
    units: int = 0

    @property
    def rendered_units(self) -> int:
        return self.units - len(self.reuse) - len(self.meta) - len(self.dropped)


@dataclass
class StoredSet:
    """What an incremental build reads of the stored set, once: per pack its file, window, split,
    token counts and segments (no tokens), in the files the manifest lists."""

    files: list[dict[str, Any]]  # manifest rows: path, sha256, rows, bytes
    table: pa.Table | None = None  # filename, window_id, window_digest, split, n_tokens, n_trainable
    segments: list[list[dict[str, Any]]] = field(default_factory=list)  # per pack, as Python


def read_stored(wh: Warehouse, pack_set: str, files: list[dict[str, Any]]) -> StoredSet:
    """The stored set's table entries (``StoredSet``) from its ``files``."""
    if not files:
        return StoredSet(files)
    data = wh.query("SELECT filename, window_id, window_digest, split, n_tokens, n_trainable, segments FROM "
                    "read_parquet(?, union_by_name = true, filename = true) WHERE pack_set = ?",
                    [[str(wh.data / r["path"]) for r in files], pack_set])
    return StoredSet(files, data.drop_columns(["segments"]), data.column("segments").to_pylist())


def stored_state(stored: StoredSet) -> tuple[dict[str, str], dict[str, tuple[str, str]]]:
    """The stored set's windows (id -> digest) and whole units (id -> (token key, window id)): the
    pieces of a split unit are never reused (a forget may have removed the pack of one of them)."""
    windows: dict[str, str] = {}
    units: dict[str, tuple[str, str]] = {}
    if stored.table is None:
        return windows, units
    for window, digest, segs in zip(stored.table.column("window_id").to_pylist(),
                                    stored.table.column("window_digest").to_pylist(), stored.segments, strict=True):
        if window is not None:
            windows[window] = digest
        for seg in segs:
            if seg["piece"] is None:
                units[seg["fragment_id"].partition("#")[0]] = (seg["token_key"], window)
    return windows, units


def plan_windows(rows: Iterator[dict[str, Any]], versions: dict[str, str], stored_windows: dict[str, str],
                 stored_units: dict[str, tuple[str, str]], dropped: dict[str, str] | None = None) -> Plan:
    """Walk the units in packing order once (no steps, no tokens) and decide per window.
    ``dropped``: unit -> token key of the units an earlier build of the set dropped as too long
    (``read_drops``): whether a unit fits depends on its rendering alone, so one with the same
    token key is dropped again without rendering it."""
    dropped = dropped or {}
    plan = Plan()
    current: str | None = None
    members: list[dict[str, Any]] = []

    def close() -> None:
        if current is None:
            return
        pairs = [(u["unit_id"], u["token_key"]) for u in members]
        digest = plan.digests[current] = window_digest(current, pairs)
        if stored_windows.get(current) == digest:
            plan.copy[current] = digest
            plan.copy_units[current] = {u["unit_id"] for u in members}
            for u in members:
                plan.meta[u["unit_id"]] = (u["dedup_weight"], u["cluster_id"])
            return
        if current in stored_windows:
            plan.repack.add(current)
        for u in members:
            plan.keys[u["unit_id"]] = u["token_key"]
            if stored_units.get(u["unit_id"]) == (u["token_key"], current):
                plan.reuse.add(u["unit_id"])
            elif dropped.get(u["unit_id"]) == u["token_key"]:
                plan.dropped.add(u["unit_id"])
            else:
                plan.render[u["trajectory_key"]] = u["ord_key"]

    for u in rows:
        plan.units += 1
        u["token_key"] = token_key(u, versions)
        if u["window_id"] != current:
            close()
            current, members = u["window_id"], []
        members.append({k: u[k] for k in ("unit_id", "token_key", "trajectory_key", "ord_key", "dedup_weight",
                                          "cluster_id")})
    close()
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


def stored_tokens(wh: Warehouse, pack_set: str, windows: list[str]
                  ) -> Iterator[tuple[str, dict[str, tuple[np.ndarray, np.ndarray, list[str]]]]]:
    """Per window, in the order given: unit id -> (token ids, mask, removed steps) as stored
    (whole units only, as ``stored_state`` lists them). One small query finds each window's files
    (a window's packs are one file; copied windows may share one), then each window is read from
    its own files alone (a query per window over the ``packs`` view opened every file's footer:
    0.12 s a window at 107,000 episodes; sorting the whole table's token lists would not fit the
    memory bound)."""
    if not windows:
        return
    files_of: dict[str, list[str]] = {}  # a window's packs are one file (copied windows may share one)
    for r in wh.query("SELECT window_id, list(DISTINCT filename ORDER BY filename) AS files FROM "
                      "read_parquet(?, union_by_name = true, filename = true) WHERE pack_set = ? AND "
                      "list_contains(?, window_id) GROUP BY 1",
                      [[str(p) for p in wh.files("packs")], pack_set, list(windows)]).to_pylist():
        files_of[r["window_id"]] = r["files"]
    for window in windows:
        t = pa.concat_tables([pq.read_table(f, columns=["pack_set", "window_id", "input_ids", "loss_mask", "segments"],
                                            filters=[("pack_set", "=", pack_set), ("window_id", "=", window)])
                              for f in files_of.get(window, [])]) if files_of.get(window) else None
        out = {}
        if t is None:
            yield window, out
            continue
        for i, segs in enumerate(t.column("segments").to_pylist()):
            tokens = t.column("input_ids")[i].values.to_numpy(zero_copy_only=False)
            mask = t.column("loss_mask")[i].values.to_numpy(zero_copy_only=False)
            for s in segs:
                if s["piece"] is None:
                    out[s["fragment_id"]] = (tokens[s["start"]:s["end"]], mask[s["start"]:s["end"]],
                                             s["removed_step_ids"] or [])
        yield window, out


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
