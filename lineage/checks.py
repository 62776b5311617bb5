"""Integrity checks over the catalog, as plain functions (the Dagster asset checks call them).

Each returns a dict of counts; a check passes when every ``*_violations`` count is zero.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from trajwh.lineage.catalog import Warehouse
from trajwh.lineage.rebuild import batch_fingerprints, inputs_fingerprint
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


def _read_cache(wh: Warehouse) -> dict[str, Any]:
    try:
        data = json.loads((wh.root / "_cache" / "checks.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _store_cache(wh: Warehouse, name: str, entry: dict[str, Any]) -> None:
    folder = wh.root / "_cache"
    data = _read_cache(wh)  # read again: another check may have stored its entry since
    data[name] = entry
    ensure_dir(folder, restricted=True)
    tmp = folder / f".checks.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(data, default=str))
    os.replace(tmp, folder / "checks.json")


def cached(wh: Warehouse, name: str, tables: list[str], compute: Callable[[], dict[str, Any]],
           where: str = "") -> dict[str, Any]:
    """``compute()``, or the result it gave last time if no file of ``tables`` changed since (a
    check is a function of the files it reads: a no-op build at 107,000 episodes need not re-scan
    millions of rows). Results (counts and ids, never values) live in ``<warehouse>/_cache/``,
    next to nothing else; a lost or unreadable cache only means computing again."""
    key = inputs_fingerprint(wh, tables, where)
    hit = _read_cache(wh).get(name)
    if isinstance(hit, dict) and hit.get("inputs") == key:
        return {**hit["result"], "cached": True}
    result = compute()
    _store_cache(wh, name, {"inputs": key, "result": result})
    return {**result, "cached": False}


def cached_per_batch(wh: Warehouse, name: str, tables: list[str], compute: Callable[[str], dict[str, Any]],
                     examples: int = 5) -> dict[str, Any]:
    """A check made of one result per ingest batch (``compute(batch_id)`` reads only that batch's
    files of ``tables``), each reused while the batch's files of ``tables`` are unchanged: a new
    batch costs what the batch costs, not what the warehouse holds. The results add up: numbers
    are summed, lists joined (the first ``examples`` items kept); ``batches_cached`` says how many
    batches were not computed again."""
    current = batch_fingerprints(wh, tables)
    hit = _read_cache(wh).get(name)
    stored = hit.get("batches", {}) if isinstance(hit, dict) else {}
    kept: dict[str, Any] = {}
    n_cached = 0
    for batch_id, key in sorted(current.items()):
        entry = stored.get(batch_id)
        if isinstance(entry, dict) and entry.get("inputs") == key:
            n_cached += 1
        else:
            entry = {"inputs": key, "result": compute(batch_id)}
        kept[batch_id] = entry
    if n_cached < len(current) or set(stored) != set(current):
        _store_cache(wh, name, {"batches": kept})
    total = _combined([e["result"] for e in kept.values()], examples)
    return {**total, "batches_cached": n_cached, "cached": bool(current) and n_cached == len(current)}


def _combined(results: list[dict[str, Any]], examples: int = 5) -> dict[str, Any]:
    """Per-batch results added up: numbers summed, lists joined (the first ``examples`` kept)."""
    total: dict[str, Any] = {}
    for result in results:
        for k, v in result.items():
            if isinstance(v, list):
                total[k] = (total.get(k, []) + v)[:examples]
            else:
                total[k] = total.get(k, 0) + v
    return total


def stored_result(wh: Warehouse, prefix: str) -> dict[str, Any] | None:
    """What the last run of a check whose cache name starts with ``prefix`` found (a per-batch
    check's results added up), without computing anything; None when it never ran."""
    hit = next((v for k, v in sorted(_read_cache(wh).items()) if k.startswith(prefix)), None)
    if not isinstance(hit, dict):
        return None
    if isinstance(hit.get("batches"), dict):
        return _combined([e["result"] for e in hit["batches"].values() if isinstance(e, dict) and "result" in e])
    return hit.get("result") if isinstance(hit.get("result"), dict) else None
