"""``trajwh status``: what the warehouse holds, per layer and table, and how it got there."""

from __future__ import annotations

import json
import os
import socket
from typing import Any

from trajwh.lineage.catalog import Warehouse
from trajwh.schemas.arrow import CATALOG_TABLES, PARQUET_TABLES, TABLE_LAYERS


def run_state(run: dict[str, Any]) -> str:
    """A run's status, telling a run that is still going from one whose process is gone (killed,
    crashed): ``running`` rows record the pid and host of the process (``lineage.rebuild.mark_running``)."""
    if run.get("status") != "running":
        return run.get("status") or "unknown"
    try:
        params = json.loads(run.get("params") or "{}")
    except ValueError:
        return "running"
    pid, host = params.get("pid"), params.get("host")
    if not pid or host != socket.gethostname():
        return "running"
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return "interrupted"
    except PermissionError:
        return "running"
    return "running"


def warehouse_status(wh: Warehouse) -> dict[str, Any]:
    from trajwh.licenses.report import license_report

    tables = []
    files = {r["table_name"]: r for r in wh.query(
        "SELECT table_name, count(*) AS files, sum(bytes) AS bytes FROM table_files GROUP BY 1").to_pylist()}
    for table in PARQUET_TABLES:
        rows = wh.query(f"SELECT count(*) AS n FROM {table}").column(0)[0].as_py()
        f = files.get(table, {})
        tables.append({"layer": TABLE_LAYERS[table], "table": table, "rows": rows,
                       "files": f.get("files", 0), "bytes": f.get("bytes") or 0})
    for table in CATALOG_TABLES:
        rows = wh.query(f"SELECT count(*) FROM {table}").column(0)[0].as_py()
        tables.append({"layer": "catalog", "table": table, "rows": rows, "files": 0, "bytes": 0})
    return {
        "warehouse": str(wh.root),
        "data": str(wh.data),  # the folder itself, or the object store's prefix (docs/scale.md)
        "tables": tables,
        "batches": wh.query("SELECT batch_id, source, committed_at, n_files, n_new, n_duplicate, n_quarantined, "
                            "bytes_read FROM batches ORDER BY committed_at DESC LIMIT 5").to_pylist(),
        "runs": [{**{k: v for k, v in r.items() if k != "params"}, "status": run_state(r)} for r in wh.query(
            "SELECT run_id, job, status, started_at, finished_at, params FROM runs "
            "ORDER BY started_at DESC LIMIT 5").to_pylist()],
        "quarantine": wh.query("SELECT stage, reason_code, count(*) AS n FROM quarantine "
                               "GROUP BY ALL ORDER BY n DESC").to_pylist(),
        "licenses": license_report(wh),
        "totals": wh.query("""SELECT (SELECT count(*) FROM episodes) AS episodes,
                                     (SELECT count(*) FROM steps) AS steps,
                                     (SELECT count(DISTINCT task_id) FROM episodes) AS tasks,
                                     (SELECT coalesce(sum(byte_length), 0) FROM raw_records) AS raw_bytes,
                                     (SELECT count(*) FROM quarantine) AS quarantined""").to_pylist()[0],
    }


def format_status(wh: Warehouse) -> list[dict[str, Any]]:
    """Per input format: files, raw records, episodes, steps, quarantined records; the share of
    model steps that carry an action kind (and of those, the share the classifier could only call
    ``other``), steps by author, and episodes with a verdict from the source (and how many resolved)."""
    return wh.query("""
        WITH f AS (SELECT coalesce(format, '(unknown)') AS format, count(DISTINCT file_path) AS files
                   FROM ingested_files GROUP BY 1),
        r AS (SELECT format, count(*) AS records FROM raw_records GROUP BY 1),
        e AS (SELECT format, count(*) AS episodes, sum(n_steps)::BIGINT AS steps,
                     count(resolved) AS verdicts, count(*) FILTER (WHERE resolved) AS resolved FROM episodes GROUP BY 1),
        s AS (SELECT e.format, count(*) FILTER (WHERE s.author = 'model') AS model_steps,
                     count(*) FILTER (WHERE s.author = 'model' AND s.action_kind IS NOT NULL) AS acting,
                     count(*) FILTER (WHERE s.author = 'model' AND s.action_kind = 'other') AS other_kind
              FROM steps s JOIN episodes e USING (trajectory_key) GROUP BY 1),
        a AS (SELECT format, string_agg(author || ' ' || n, ', ' ORDER BY n DESC, author) AS authors
              FROM (SELECT e.format, s.author, count(*) AS n FROM steps s JOIN episodes e USING (trajectory_key)
                    GROUP BY 1, 2) GROUP BY 1),
        q AS (SELECT coalesce(format, '(unknown)') AS format, count(*) AS quarantined FROM quarantine GROUP BY 1)
        SELECT format, coalesce(files, 0) AS files, coalesce(records, 0) AS records,
               coalesce(episodes, 0) AS episodes, coalesce(steps, 0) AS steps,
               coalesce(quarantined, 0) AS quarantined, coalesce(model_steps, 0) AS model_steps,
               round(acting / nullif(model_steps, 0), 3) AS action_share,
               round(other_kind / nullif(acting, 0), 3) AS other_share, authors,
               coalesce(verdicts, 0) AS verdicts, coalesce(resolved, 0) AS resolved
        FROM f FULL JOIN r USING (format) FULL JOIN e USING (format) FULL JOIN q USING (format)
             LEFT JOIN s USING (format) LEFT JOIN a USING (format)
        ORDER BY format
    """).to_pylist()
