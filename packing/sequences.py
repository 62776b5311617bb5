"""Packed sequences put together: a pack's layout (its segments) over its units' token rows.

A ``packs`` row is a layout: which units' tokens, in which order, make the sequence. The tokens
are the ``pack_tokens`` rows of the pack set (each unit's rendering once); a piece ``k`` of a unit
split by the over-length policy is its tokens from ``k * seq_len``. This module gives the
sequences a trainer reads: token ids, loss mask and position ids (restarting at 0 per segment),
one query (DuckDB puts the slices together, spilling what does not fit its memory limit).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from trajwh.lineage.catalog import Warehouse
from trajwh.lineage.parallel import duckdb_memory
from trajwh.packing.pack import positions

#: each pack of ``where`` (over ``p``, the packs) with its tokens and mask, in pack id order
SEQUENCES_SQL = """
    WITH s AS (SELECT p.pack_id, p.pack_set, p.seq_len, unnest(p.segments) AS seg, generate_subscripts(p.segments, 1) AS i
               FROM packs p WHERE {where}),
    t AS (SELECT s.pack_id, s.i,
                 k.input_ids[coalesce(seg.piece, 0) * s.seq_len + 1 : coalesce(seg.piece, 0) * s.seq_len
                             + (seg['end'] - seg.start)] AS ids,
                 k.loss_mask[coalesce(seg.piece, 0) * s.seq_len + 1 : coalesce(seg.piece, 0) * s.seq_len
                             + (seg['end'] - seg.start)] AS mask
          FROM s JOIN pack_tokens k ON k.pack_set = s.pack_set AND k.unit_id = split_part(seg.fragment_id, '#', 1)),
    a AS (SELECT pack_id AS apid, flatten(list(ids ORDER BY i)) AS input_ids, flatten(list(mask ORDER BY i)) AS loss_mask
          FROM t GROUP BY pack_id)
    SELECT p.*, a.input_ids, a.loss_mask FROM packs p JOIN a ON a.apid = p.pack_id WHERE {where} ORDER BY p.pack_id"""


def pack_sequences(wh: Warehouse, where: str = "true", params: list[Any] | None = None, *,
                   batch_rows: int = 64) -> Iterator[list[dict[str, Any]]]:
    """Batches of packs (``where`` over ``p``, the packs table; ``params`` for its ``?``, used twice)
    as dicts with ``input_ids``, ``loss_mask`` and ``position_ids`` put together, in pack id order."""
    params = list(params or [])
    for batch in wh.stream(SEQUENCES_SQL.format(where=where), params * 2, batch_rows=batch_rows,
                           memory_limit=duckdb_memory(512), threads=1):
        for p in batch:
            p["input_ids"] = p["input_ids"] or []
            p["loss_mask"] = p["loss_mask"] or []
            p["position_ids"] = positions(((s["start"], s["end"]) for s in p["segments"]),
                                           len(p["input_ids"])).tolist()
        yield batch


def sequences_of(wh: Warehouse, where: str = "true", params: list[Any] | None = None) -> list[dict[str, Any]]:
    """Every pack of ``where`` put together (a small set: tests, tracing one pack)."""
    return [p for batch in pack_sequences(wh, where, params) for p in batch]
