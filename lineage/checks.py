"""Integrity checks over the catalog, as plain functions (the Dagster asset checks call them).

Each returns a dict of counts; a check passes when every ``*_violations`` count is zero.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from trajwh.lineage.catalog import Warehouse
from trajwh.lineage.rebuild import batch_fingerprints, inputs_fingerprint
from trajwh.lineage.storage import ensure_dir

_LINEAGE_COLS = ("_record_id", "_batch_id", "_run_id", "_transform", "_transform_version")


def lineage_gaps(wh: Warehouse, table: str, batch_id: str | None = None) -> dict[str, Any]:
    """Rows of ``table`` (episodes or steps, normalized or redacted) missing a lineage column, a
    raw parent, or an edge; of one ingest batch's files when ``batch_id`` is given (its rows come
    from that batch's raw records, and the stage that made them wrote their edges in that batch)."""
    id_col = {"episodes": "trajectory_key", "steps": "step_id", "redacted_episodes": "trajectory_key",
              "redacted_steps": "step_id"}[table]
    null_any = " OR ".join(f"t.{c} IS NULL" for c in _LINEAGE_COLS)
    sources, params = {"t": table, "r": "raw_records", "e": "lineage_edges"}, []
    if batch_id is not None:
        files = {k: [str(p) for p in wh.files(t, batch_id=batch_id)] for k, t in sources.items()}
        if not files["t"]:
            return {"rows": 0, "missing_column_violations": 0, "missing_raw_parent_violations": 0,
                    "missing_edge_violations": 0}
        empty = {"r": "(SELECT NULL::VARCHAR AS record_id WHERE false)",
                 "e": "(SELECT NULL::VARCHAR AS child_id, NULL::VARCHAR AS child_table WHERE false)"}
        sources = {k: "read_parquet(?, union_by_name = true)" if files[k] else empty[k] for k in sources}
        params = [files[k] for k in ("t", "r", "e") if files[k]]
    row = wh.query(f"""
        SELECT
          count(*) AS rows,
          count(*) FILTER (WHERE {null_any}) AS missing_column_violations,
          count(*) FILTER (WHERE r.record_id IS NULL) AS missing_raw_parent_violations,
          count(*) FILTER (WHERE e.child_id IS NULL) AS missing_edge_violations
        FROM {sources["t"]} t
        LEFT JOIN (SELECT DISTINCT record_id FROM {sources["r"]}) r ON r.record_id = t._record_id
        LEFT JOIN (SELECT DISTINCT child_id FROM {sources["e"]} WHERE child_table = '{table}') e
               ON e.child_id = t.{id_col}
    """, params).to_pylist()[0]
    return row


def reconcile_normalized(wh: Warehouse, companion_formats: list[str] | None = None) -> dict[str, Any]:
    """Every raw record of a built batch became episodes, was quarantined, or is a companion
    (verdicts, metrics: facts about episodes); step counts agree; ids are unique. Batch by batch
    (``reconcile_batch``, each result reused while the batch's files are unchanged: a new batch is
    checked alone, 1.0-1.6 s -> 0.2 s at 107,000 + 1 %), plus one scan of every episode's key
    for a key two batches share."""
    companions = sorted(companion_formats or [])
    per_batch = cached_per_batch(wh, f"reconcile:{','.join(companions)}", _RECONCILE_INPUTS,
                                 lambda b: reconcile_batch(wh, b, companions) if b else _NOT_BUILT, zero=_NOT_BUILT)
    across = cached(wh, "reconcile:keys", ["episodes"], lambda: {"keys_across_batches": scalar(
        wh, "SELECT count(*) - count(DISTINCT trajectory_key) FROM episodes")})
    out = {**per_batch, "cached": per_batch["cached"] and across["cached"]}
    out["duplicate_key_violations"] += across["keys_across_batches"]
    return out


_RECONCILE_INPUTS = ["raw_records", "episodes", "steps", "quarantine"]
_NOT_BUILT = {"raw_records": 0, "episodes": 0, "unaccounted_record_violations": 0, "step_count_violations": 0,
              "duplicate_key_violations": 0, "duplicate_step_violations": 0, "step_id_violations": 0}


def scalar(wh: Warehouse, sql: str, params: list[Any] | None = None) -> Any:
    """The one value a one-row, one-column query gives."""
    return wh.query(sql, params).column(0)[0].as_py()


def reconcile_batch(wh: Warehouse, batch_id: str, companion_formats: list[str]) -> dict[str, Any]:
    """``reconcile_normalized`` for one ingest batch's files: its raw records (not companions)
    each became episodes or a quarantine row of normalize; its episodes' step counts agree with its
    steps; no key or step id twice in it; every step id is the one its (episode, index) names (so
    a step id two batches share would mean a key they share, which the caller counts). A batch not
    normalized yet (no episode files) is not counted."""
    files = {t: [str(p) for p in wh.files(t, batch_id=batch_id)] for t in _RECONCILE_INPUTS}
    if not files["episodes"]:
        return dict(_NOT_BUILT)
    src = {t: "read_parquet(?, union_by_name = true)" for t in _RECONCILE_INPUTS if files[t]}
    src.setdefault("raw_records", "(SELECT NULL::VARCHAR AS record_id, NULL::VARCHAR AS format WHERE false)")
    src.setdefault("steps", "(SELECT NULL::VARCHAR AS trajectory_key, NULL::VARCHAR AS step_id, "
                            "NULL::BIGINT AS step_index WHERE false)")
    src.setdefault("quarantine", "(SELECT NULL::VARCHAR AS record_id, NULL::VARCHAR AS stage WHERE false)")
    params = [files[t] for t in _RECONCILE_INPUTS if files[t]]
    return wh.query(f"""
        WITH raw_all AS (SELECT * FROM {src["raw_records"]}), ep AS (SELECT * FROM {src["episodes"]}),
        st AS (SELECT * FROM {src["steps"]}), q AS (SELECT * FROM {src["quarantine"]}),
        raw AS (SELECT record_id FROM raw_all WHERE NOT list_contains(?, format)),
        used AS (SELECT DISTINCT _record_id AS record_id FROM ep
                 UNION SELECT DISTINCT record_id FROM q WHERE stage = 'normalize'),
        counts AS (SELECT e.trajectory_key, any_value(e.n_steps) AS n, count(s.step_id) AS got
                   FROM ep e LEFT JOIN st s USING (trajectory_key) GROUP BY 1)
        SELECT
          (SELECT count(*) FROM raw) AS raw_records,
          (SELECT count(*) FROM ep) AS episodes,
          (SELECT count(*) FROM raw WHERE record_id NOT IN (SELECT record_id FROM used))
              AS unaccounted_record_violations,
          (SELECT count(*) FROM counts WHERE n <> got) AS step_count_violations,
          (SELECT count(*) - count(DISTINCT trajectory_key) FROM ep) AS duplicate_key_violations,
          (SELECT count(*) - count(DISTINCT step_id) FROM st) AS duplicate_step_violations,
          (SELECT count(*) FROM st WHERE step_id IS DISTINCT FROM left(sha256(trajectory_key || ':' || step_index), 32))
              AS step_id_violations
    """, [*params, companion_formats]).to_pylist()[0]


def passed(result: dict[str, Any]) -> bool:
    return all(v == 0 for k, v in result.items() if k.endswith("_violations"))


#: each check's last result, a file per check (``<warehouse>/_cache/checks/<name>.json``): storing one
#: rewrites only its own (one file for all took a second per build at 107,000 episodes: the split
#: audit's entry alone is 2 MB)
CHECKS_DIR = "checks"


#: the longest file-name stem a check's cache takes as it is (a file name holds 255 bytes at most, and a
#: name such as the reconcile check's, which lists the companion formats, grows with the formats)
_MAX_STEM = 150


def _cache_path(wh: Warehouse, name: str) -> Path:
    """The cache file of a check: its name, quoted; a long name's first characters and the digest
    of the whole (the start stays readable, and ``stored_result`` still finds it by a prefix)."""
    stem = quote(name, safe="")
    if len(stem) > _MAX_STEM:
        stem = f"{quote(name[:60], safe='')}~{hashlib.sha256(name.encode()).hexdigest()[:16]}"
    return wh.root / "_cache" / CHECKS_DIR / f"{stem}.json"


def _read_entry(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _read_cache(wh: Warehouse, name: str) -> Any:
    return _read_entry(_cache_path(wh, name))


def _store_cache(wh: Warehouse, name: str, entry: dict[str, Any]) -> None:
    path = _cache_path(wh, name)
    ensure_dir(path.parent, restricted=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(entry, default=str))
    os.replace(tmp, path)


def cached(wh: Warehouse, name: str, tables: list[str], compute: Callable[[], dict[str, Any]],
           where: str = "") -> dict[str, Any]:
    """``compute()``, or the result it gave last time if no file of ``tables`` changed since (a
    check is a function of the files it reads: a no-op build at 107,000 episodes need not re-scan
    millions of rows). Results (counts and ids, never values) live in ``<warehouse>/_cache/``,
    next to nothing else; a lost or unreadable cache only means computing again."""
    key = inputs_fingerprint(wh, tables, where)
    hit = _read_cache(wh, name)
    if isinstance(hit, dict) and hit.get("inputs") == key:
        return {**hit["result"], "cached": True}
    result = compute()
    _store_cache(wh, name, {"inputs": key, "result": result})
    return {**result, "cached": False}


def cached_per_batch(wh: Warehouse, name: str, tables: list[str], compute: Callable[[str], dict[str, Any]],
                     examples: int = 5, where: str = "", zero: dict[str, Any] | None = None) -> dict[str, Any]:
    """A check made of one result per ingest batch (``compute(batch_id)`` reads only that batch's
    files of ``tables``), each reused while the batch's files of ``tables`` are unchanged: a new
    batch costs what the batch costs, not what the warehouse holds. The results add up: numbers
    are summed, lists joined (the first ``examples`` items kept); ``batches_cached`` says how many
    batches were not computed again. ``zero``: the result of no batch at all (a warehouse whose
    every record was quarantined has no files of ``tables``), so its keys are always there."""
    current = batch_fingerprints(wh, tables, where)
    hit = _read_cache(wh, name)
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
    total = combined([*([zero] if zero else []), *(e["result"] for e in kept.values())], examples)
    return {**total, "batches_cached": n_cached, "cached": bool(current) and n_cached == len(current)}


def combined(results: list[dict[str, Any]], examples: int = 5) -> dict[str, Any]:
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
    folder = wh.root / "_cache" / CHECKS_DIR
    names = sorted(p for p in folder.glob("*.json") if unquote(p.stem).startswith(prefix)) if folder.is_dir() else []
    hit = _read_entry(names[0]) if names else None
    if not isinstance(hit, dict):
        return None
    if isinstance(hit.get("batches"), dict):
        return combined([e["result"] for e in hit["batches"].values() if isinstance(e, dict) and "result" in e])
    return hit.get("result") if isinstance(hit.get("result"), dict) else None
