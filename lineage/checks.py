"""Integrity checks over the catalog, as plain functions (the Dagster asset checks call them).

Each returns a dict of counts; a check passes when every ``*_violations`` count is zero.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from trajwh.lineage.catalog import Warehouse
from trajwh.lineage.rebuild import inputs_fingerprint
from trajwh.lineage.storage import ensure_dir

_LINEAGE_COLS = ("_record_id", "_batch_id", "_run_id", "_transform", "_transform_version")


def lineage_gaps(wh: Warehouse, table: str) -> dict[str, Any]:
    """Rows of ``table`` (episodes or steps) missing a lineage column, a raw parent, or an edge."""
    id_col = {"episodes": "trajectory_key", "steps": "step_id", "redacted_episodes": "trajectory_key",
              "redacted_steps": "step_id"}[table]
    null_any = " OR ".join(f"t.{c} IS NULL" for c in _LINEAGE_COLS)
    row = wh.query(f"""
        SELECT
          count(*) AS rows,
          count(*) FILTER (WHERE {null_any}) AS missing_column_violations,
          count(*) FILTER (WHERE r.record_id IS NULL) AS missing_raw_parent_violations,
          count(*) FILTER (WHERE e.child_id IS NULL) AS missing_edge_violations
        FROM {table} t
        LEFT JOIN (SELECT DISTINCT record_id FROM raw_records) r ON r.record_id = t._record_id
        LEFT JOIN (SELECT DISTINCT child_id FROM lineage_edges WHERE child_table = '{table}') e
               ON e.child_id = t.{id_col}
    """).to_pylist()[0]
    return row


def reconcile_normalized(wh: Warehouse, companion_formats: list[str] | None = None) -> dict[str, Any]:
    """Every raw record of a built batch became episodes, was quarantined, or is a companion
    (verdicts, metrics: facts about episodes); step counts agree; ids are unique."""
    return wh.query("""
        WITH built AS (SELECT DISTINCT batch_id FROM table_files WHERE table_name = 'episodes'),
        raw AS (SELECT r.record_id FROM raw_records r JOIN built b USING (batch_id)
                WHERE NOT list_contains(?, r.format)),
        used AS (SELECT DISTINCT _record_id AS record_id FROM episodes
                 UNION SELECT DISTINCT record_id FROM quarantine WHERE stage = 'normalize'),
        counts AS (SELECT e.trajectory_key, any_value(e.n_steps) AS n, count(s.step_id) AS got
                   FROM episodes e LEFT JOIN steps s USING (trajectory_key) GROUP BY 1)
        SELECT
          (SELECT count(*) FROM raw) AS raw_records,
          (SELECT count(*) FROM episodes) AS episodes,
          (SELECT count(*) FROM raw WHERE record_id NOT IN (SELECT record_id FROM used))
              AS unaccounted_record_violations,
          (SELECT count(*) FROM counts WHERE n <> got) AS step_count_violations,
          (SELECT count(*) - count(DISTINCT trajectory_key) FROM episodes) AS duplicate_key_violations,
          (SELECT count(*) - count(DISTINCT step_id) FROM steps) AS duplicate_step_violations
    """, [companion_formats or []]).to_pylist()[0]


def passed(result: dict[str, Any]) -> bool:
    return all(v == 0 for k, v in result.items() if k.endswith("_violations"))


def cached(wh: Warehouse, name: str, tables: list[str], compute: Callable[[], dict[str, Any]],
           where: str = "") -> dict[str, Any]:
    """``compute()``, or the result it gave last time if no file of ``tables`` changed since (a
    check is a function of the files it reads: a no-op build at 107,000 episodes need not re-scan
    millions of rows). Results (counts and ids, never values) live in ``<warehouse>/_cache/``,
    next to nothing else; a lost or unreadable cache only means computing again."""
    key = inputs_fingerprint(wh, tables, where)
    folder = wh.root / "_cache"
    path = folder / "checks.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    hit = data.get(name)
    if isinstance(hit, dict) and hit.get("inputs") == key:
        return {**hit["result"], "cached": True}
    result = compute()
    data[name] = {"inputs": key, "result": result}
    ensure_dir(folder, restricted=True)
    tmp = folder / f".checks.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(data, default=str))
    os.replace(tmp, path)
    return {**result, "cached": False}
