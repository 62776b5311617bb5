"""``trajwh trace``: walk back from any id to the raw bytes it came from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trajwh.lineage.catalog import Warehouse
from trajwh.schemas.errors import ConfigError

_MIN_PREFIX = 8


@dataclass
class Trace:
    kind: str  # fragment | step | episode | raw_record
    id: str
    fragment: dict[str, Any] | None = None
    step: dict[str, Any] | None = None
    episode: dict[str, Any] | None = None
    record: dict[str, Any] | None = None
    batch: dict[str, Any] | None = None
    edges: list[dict[str, Any]] = field(default_factory=list)


def _one(wh: Warehouse, sql: str, value: str, what: str) -> dict[str, Any] | None:
    rows = wh.query(sql, [value + "%"]).to_pylist()
    if len(rows) > 1:
        raise ConfigError(f"id prefix {value!r} matches {len(rows)} {what}s", valid="a longer prefix or the full id")
    return rows[0] if rows else None


def _has_rows(wh: Warehouse, table: str) -> bool:
    return bool(wh.manifest_query("SELECT count(*) FROM table_files WHERE table_name = ?", [table]).column(0)[0].as_py())


def trace(wh: Warehouse, ident: str) -> Trace:
    """Resolve a fragment id, step id, trajectory key or record id (or a unique 8+ character prefix):
    fragment -> its first step -> episode -> raw record (file, line, byte offset) and lineage edges."""
    ident = ident.strip().lower()
    if len(ident) < _MIN_PREFIX:
        raise ConfigError(f"id {ident!r} is too short", valid=f"at least {_MIN_PREFIX} hex characters of an id")
    fragment = None
    if _has_rows(wh, "fragments"):
        fragment = _one(wh, """SELECT fragment_id, trajectory_key, kind, context_start, start_step, end_step, step_ids,
                                      span_step_ids, context_step_ids, context_reasons, context_dropped, context_chars,
                                      phases, evidence_source, confidence, verdict_reward, progress_score, trainable,
                                      split, dedup_weight, selection_reason, _run_id, _transform_version
                               FROM fragments WHERE fragment_id LIKE ? LIMIT 2""", ident, "fragment")
    step = _one(wh, """SELECT step_id, trajectory_key, step_index, role, author, _record_id, _batch_id, _run_id,
                              _transform, _transform_version FROM steps WHERE step_id LIKE ? LIMIT 2""",
                fragment["step_ids"][0] if fragment and fragment["step_ids"] else ident, "step")
    episode_key = fragment["trajectory_key"] if fragment else step["trajectory_key"] if step else ident
    episode = _one(wh, """SELECT trajectory_key, source_episode_id, task_id, policy_name, harness_name, attempt,
                                 n_steps, key_fields, _record_id, _record_index, _batch_id, _run_id, _transform,
                                 _transform_version FROM episodes WHERE trajectory_key LIKE ? LIMIT 2""",
                   episode_key, "episode")
    record_ref = (step or episode or {}).get("_record_id") or ident
    record = _one(wh, """SELECT record_id, source, license, batch_id, file_path, compression, line_no, byte_offset,
                                byte_length, format, ingested_at FROM raw_records WHERE record_id LIKE ? LIMIT 2""",
                  record_ref, "raw record")
    if not (step or episode or record):
        raise ConfigError(f"no step, episode or raw record has id {ident!r}",
                          valid="a step_id, trajectory_key or record_id from `trajwh sql`")
    kind = "fragment" if fragment else "step" if step else "episode" if episode else "raw_record"
    t = Trace(kind, (fragment or step or episode or record or {}).get(
        {"fragment": "fragment_id", "step": "step_id", "episode": "trajectory_key", "raw_record": "record_id"}[kind]),
        fragment=fragment, step=step, episode=episode, record=record)
    if record:
        rows = wh.query("SELECT batch_id, source, license, committed_at FROM batches WHERE batch_id = ?",
                        [record["batch_id"]]).to_pylist()
        t.batch = rows[0] if rows else None
    ids = [x for x in (step and step["step_id"], episode and episode["trajectory_key"]) if x]
    if ids:
        t.edges = wh.query("SELECT child_id, child_table, parent_id, parent_table, transform, transform_version, run_id "
                           "FROM lineage_edges WHERE list_contains(?, child_id)", [ids]).to_pylist()
    return t
