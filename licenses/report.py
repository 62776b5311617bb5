"""Counts by license, eligibility and reason, and opt-outs applied: for `trajwh status`,
`trajwh licenses` and the data card. Counts only: never a value an opt-out matched on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trajwh.licenses.eligibility import reason_class
from trajwh.lineage.catalog import Warehouse

Rows = Callable[[str], list[dict[str, Any]]]


def reason_counts(rows: Rows, scoped: str = "true") -> list[dict[str, Any]]:
    """Episodes per reason (opt-out ids folded into their kind), most first."""
    counts: dict[str, int] = {}
    for r in rows(f"SELECT unnest(reasons) AS reason, count(*) AS n FROM eligibility WHERE {scoped} GROUP BY 1"):
        key = reason_class(r["reason"])
        counts[key] = counts.get(key, 0) + r["n"]
    return [{"reason": k, "episodes": v} for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]


def opt_outs_applied(rows: Rows, scoped: str | None = "true") -> list[dict[str, Any]]:
    """Per opt-out kind: active opt-outs and the episodes they exclude (``scoped`` None: no
    eligibility built yet, so none excluded)."""
    hit = (f"SELECT unnest(opt_out_ids) AS opt_out_id, trajectory_key FROM eligibility WHERE {scoped}"
           if scoped is not None else "SELECT NULL::VARCHAR AS opt_out_id, NULL::VARCHAR AS trajectory_key WHERE false")
    return rows(f"""
        WITH hit AS ({hit})
        SELECT o.kind, count(DISTINCT o.opt_out_id) AS opt_outs, count(DISTINCT h.trajectory_key) AS episodes_excluded
        FROM opt_outs o LEFT JOIN hit h USING (opt_out_id) WHERE o.status = 'active'
        GROUP BY 1 ORDER BY 1""")


def license_report(wh: Warehouse) -> dict[str, Any]:
    """Empty lists when the eligibility step has not run yet (``built`` says so)."""
    def rows(sql: str) -> list[dict[str, Any]]:
        return wh.query(sql).to_pylist()

    built = bool(wh.manifest_query("SELECT count(*) FROM table_files WHERE table_name = 'eligibility'").column(0)[0].as_py())
    out: dict[str, Any] = {"built": built, "licenses": [], "eligibility": [], "reasons": []}
    if built:
        out["licenses"] = rows("""
            SELECT kind, coalesce(expression, status) AS license, status, count(*) AS episodes FROM license_facts
            GROUP BY ALL ORDER BY kind, episodes DESC, license""")
        out["eligibility"] = rows("""
            SELECT eligibility, train, release, count(*) AS episodes FROM eligibility
            GROUP BY ALL ORDER BY episodes DESC, eligibility""")
        out["reasons"] = reason_counts(rows)
    out["opt_outs"] = opt_outs_applied(rows, "true" if built else None)
    return out
