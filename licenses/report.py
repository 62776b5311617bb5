"""Counts by license, eligibility and reason, and opt-outs applied: for `trajwh status`,
`trajwh licenses` and the data card. Counts only: never a value an opt-out matched on."""

from __future__ import annotations

from typing import Any

from licenses.eligibility import reason_class
from lineage.catalog import Warehouse


def license_report(wh: Warehouse) -> dict[str, Any]:
    """Empty lists when the eligibility step has not run yet (``built`` says so)."""
    built = bool(wh.query("SELECT count(*) FROM table_files WHERE table_name = 'eligibility'").column(0)[0].as_py())
    out: dict[str, Any] = {"built": built, "licenses": [], "eligibility": [], "reasons": [], "opt_outs": []}
    if built:
        out["licenses"] = wh.query("""
            SELECT kind, coalesce(expression, status) AS license, status, count(*) AS episodes FROM license_facts
            GROUP BY ALL ORDER BY kind, episodes DESC, license""").to_pylist()
        out["eligibility"] = wh.query("""
            SELECT eligibility, train, release, count(*) AS episodes FROM eligibility
            GROUP BY ALL ORDER BY episodes DESC, eligibility""").to_pylist()
        reasons: dict[str, int] = {}
        for r in wh.query("SELECT unnest(reasons) AS reason, count(*) AS n FROM eligibility GROUP BY 1").to_pylist():
            key = reason_class(r["reason"])
            reasons[key] = reasons.get(key, 0) + r["n"]
        out["reasons"] = [{"reason": k, "episodes": v} for k, v in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))]
    out["opt_outs"] = wh.query(f"""
        WITH hit AS ({'SELECT unnest(opt_out_ids) AS opt_out_id, trajectory_key FROM eligibility' if built
                      else 'SELECT NULL::VARCHAR AS opt_out_id, NULL::VARCHAR AS trajectory_key WHERE false'})
        SELECT o.kind, count(DISTINCT o.opt_out_id) AS opt_outs, count(DISTINCT h.trajectory_key) AS episodes_excluded
        FROM opt_outs o LEFT JOIN hit h USING (opt_out_id) WHERE o.status = 'active'
        GROUP BY 1 ORDER BY 1""").to_pylist()
    return out
