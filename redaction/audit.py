"""Re-scan the redacted layer: nothing the detector recognizes may be left in it."""

from __future__ import annotations

from typing import Any

from trajwh.lineage.catalog import Warehouse
from trajwh.lineage.checks import cached_per_batch, combined
from trajwh.lineage.parallel import parts_within, run_parts, workers_wanted
from trajwh.redaction.engine import POLICY_VERSION, Detector

_FIELDS = ("text", "observation", "action_object", "action_command")
#: the files a batch's rescan reads (its result is reused while they are unchanged)
RESCAN_INPUTS = ["redacted_steps", "redaction_events"]


def rescan_sample(wh: Warehouse, sample: int = 2000, seed: int = 7, batch_id: str | None = None,
                  part: tuple[int, int] = (0, 1)) -> dict[str, Any]:
    """Detector findings left in a sample of redacted steps: every step that had a replacement
    plus a reproducible random sample of ``sample`` of the rest; with ``batch_id``, of that ingest
    batch's files alone (the other batches' are not opened). Passes when ``secret_violations`` is 0.
    ``part`` = (i, n): the touched steps whose id hashes to i modulo n, and the sample when i is 0
    (the n parts together scan what one does)."""
    steps, events, params = "redacted_steps", "redaction_events", []
    if batch_id is not None:
        step_files = [str(p) for p in wh.files("redacted_steps", batch_id=batch_id)]
        event_files = [str(p) for p in wh.files("redaction_events", batch_id=batch_id)]
        if not step_files:
            return {"steps_scanned": 0, "secret_violations": 0, "examples": []}
        steps, params = "read_parquet(?, union_by_name = true)", [step_files]
        events = "(SELECT NULL::VARCHAR AS step_id WHERE false)"
        if event_files:
            events, params = "read_parquet(?, union_by_name = true)", [event_files, step_files]
    rows = wh.stream(f"""
        WITH touched AS (SELECT DISTINCT step_id FROM {events} WHERE step_id IS NOT NULL),
        s AS NOT MATERIALIZED (SELECT step_id, {", ".join(_FIELDS)}, tool_calls FROM {steps})
        SELECT * FROM s WHERE step_id IN (SELECT step_id FROM touched) AND hash(step_id) % {int(part[1])} = {int(part[0])}
        UNION ALL
        SELECT * FROM (SELECT * FROM s ORDER BY hash(step_id || '{seed}') LIMIT {int(sample) if part[0] == 0 else 0})
    """, params, batch_rows=2_000)  # streamed: every touched step of a big batch is too many to hold
    # (``s`` is read twice, not materialized: DuckDB would otherwise hold, and at the design's scale
    # spill, every step's text before either half ran: 6.2 s of a 10 s rescan)
    detector = Detector()
    left: list[dict[str, Any]] = []
    scanned = 0
    for r in (r for batch in rows for r in batch):
        scanned += 1
        texts = [(f, r[f]) for f in _FIELDS] + [(f"tool_calls[{i}].{k}", c.get(k))
                                               for i, c in enumerate(r["tool_calls"] or [])
                                               for k in ("arguments", "executed")]
        for name, value in texts:
            for f in detector.find(value or ""):
                left.append({"step_id": r["step_id"], "field": name, "entity": f.entity, "detector": f.detector})
    return {"steps_scanned": scanned, "secret_violations": len(left), "examples": left[:5]}


#: a batch with at least this many redacted steps is rescanned in parts (``parallel.run_parts``): the
#: detector is the cost (107,000 episodes: 6.7 s in one process), a worker's start about a second
PARALLEL_MIN_STEPS = 200_000
#: what a rescan part holds beyond its process's libraries: a stream's batch of steps and the detector
PART_MB = 200


def _rescan_part(task: tuple[str, int, int, str, tuple[int, int]]) -> dict[str, Any]:
    root, sample, seed, batch_id, part = task
    return rescan_sample(Warehouse(root), sample, seed, batch_id=batch_id, part=part)


def rescan_batch(wh: Warehouse, batch_id: str, steps: int, seed: int = 7) -> dict[str, Any]:
    """``rescan_sample`` of one batch, in parts on the machine's cores when the batch is big."""
    sample = batch_sample(steps)
    n = parts_within(workers_wanted(), PART_MB) if steps >= PARALLEL_MIN_STEPS else 1
    if n == 1:
        return rescan_sample(wh, sample, seed, batch_id=batch_id)
    return combined(run_parts(_rescan_part, [(str(wh.root), sample, seed, batch_id, (i, n)) for i in range(n)]))


def batch_sample(steps: int, per_million: int = 1_000, least: int = 200) -> int:
    """How many of a batch's ``steps`` the per-batch rescan samples besides its touched ones: 1 in
    1,000 (the 2,000 of the former whole-layer sample at the design's 2.2 M steps), at least ``least``."""
    return max(least, -(-steps * per_million // 1_000_000))


def rescan_by_batch(wh: Warehouse, seed: int = 7) -> dict[str, Any]:
    """``rescan_sample`` batch by batch, each batch's result reused while its redacted steps and
    events are unchanged (``lineage.checks.cached_per_batch``): an incremental build rescans its
    new batch, not the whole layer."""
    sizes = {r["batch_id"]: r["n"] for r in wh.manifest_query(
        "SELECT batch_id, sum(rows) AS n FROM table_files WHERE table_name = 'redacted_steps' GROUP BY 1").to_pylist()}
    return cached_per_batch(wh, f"rescan:{POLICY_VERSION}:{seed}", RESCAN_INPUTS,
                            lambda b: rescan_batch(wh, b, sizes.get(b, 0), seed),
                            zero={"steps_scanned": 0, "secret_violations": 0, "examples": []})
