"""Re-scan the redacted layer: nothing the detector recognizes may be left in it."""

from __future__ import annotations

from typing import Any

from trajwh.lineage.catalog import Warehouse
from trajwh.redaction.engine import Detector

_FIELDS = ("text", "observation", "action_object", "action_command")


def rescan_sample(wh: Warehouse, sample: int = 2000, seed: int = 7) -> dict[str, Any]:
    """Detector findings left in a sample of redacted steps: every step that had a replacement
    plus a reproducible random sample of the rest. Passes when ``secret_violations`` is 0."""
    rows = wh.query(f"""
        WITH touched AS (SELECT DISTINCT step_id FROM redaction_events WHERE step_id IS NOT NULL)
        SELECT step_id, {", ".join(_FIELDS)}, tool_calls FROM redacted_steps
        WHERE step_id IN (SELECT step_id FROM touched)
        UNION ALL
        SELECT * FROM (SELECT step_id, {", ".join(_FIELDS)}, tool_calls FROM redacted_steps
                       ORDER BY hash(step_id || '{seed}') LIMIT {int(sample)})
    """).to_pylist()
    detector = Detector()
    left: list[dict[str, Any]] = []
    for r in rows:
        texts = [(f, r[f]) for f in _FIELDS] + [(f"tool_calls[{i}].{k}", c.get(k))
                                               for i, c in enumerate(r["tool_calls"] or [])
                                               for k in ("arguments", "executed")]
        for name, value in texts:
            for f in detector.find(value or ""):
                left.append({"step_id": r["step_id"], "field": name, "entity": f.entity, "detector": f.detector})
    return {"steps_scanned": len(rows), "secret_violations": len(left), "examples": left[:5]}
