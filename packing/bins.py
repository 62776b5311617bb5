"""Bin assignment on an engine: the packer run per window where the build's engine runs it.

A pack build's layouts step is a relational plan over the units of the windows to pack (their
lengths, trainable counts per piece and segment fields): group them by window, run the packer on
each group (``layer.window_rows``, a pure function of the window's units), gather the layout rows.
The packer itself is sequential within a window (each sequence is filled from what the ones
before it left) but windows are independent, so the groups are the unit of distribution:

- ``duckdb`` (default): the units stream from DuckDB sorted by window and each window is packed
  here as its last unit passes (``layer.pack_stream``), one window in memory at a time;
- ``daft``: the units are a Daft frame grouped by window, and a UDF packs each group on Daft's
  workers (its local runner here, Ray across machines: docs/scale.md). The layouts come back to
  the build, which writes and commits them. The frame is made in the build's process from the
  units' lengths and segment fields (about 200 bytes a unit: 10 MB for the 51,000 units of
  107,000 episodes); at many millions of units it would be read from files the workers can reach.

Both give the same rows (``tests/test_packing.py``): the packer breaks ties by unit id, the units of
a window go to it in the same order (trajectory key, unit: what the stream's sort gives), and the
window's rows are made by the same function.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import orjson
import pyarrow as pa
from trajwh.packing.layer import (
    PackConfig,
    PackSummary,
    _add_window,
    _count_known_drop,
    _known_segment,
    pack_stream,
    segment_meta,
    window_rows,
)
from trajwh.packing.pack import Segment
from trajwh.schemas.config import ENGINES
from trajwh.schemas.errors import ConfigError


def pack_windows(engine: str, units: Iterable[tuple[dict, list[dict]]], cfg: PackConfig, tok: Any,
                 summary: PackSummary, write: Callable[[list[dict]], None], lineage: dict[str, str]) -> None:
    """The windows of ``units`` (in window order, each with its lengths: ``known``, or marked
    ``drop``) packed on ``engine``; each window's layout rows go to ``write``, counts to
    ``summary`` (as ``layer.pack_stream``)."""
    if engine == "duckdb":
        pack_stream(units, cfg, tok, summary, write, lineage)
    elif engine == "daft":
        _pack_on_daft(units, cfg, tok, summary, write, lineage)
    else:
        raise ConfigError(f"unknown engine {engine!r}", valid=", ".join(ENGINES))


def _pack_on_daft(units: Iterable[tuple[dict, list[dict]]], cfg: PackConfig, tok: Any, summary: PackSummary,
                  write: Callable[[list[dict]], None], lineage: dict[str, str]) -> None:
    rows = []
    for u, _ in units:
        split = u["split"] or "unsplit"
        if u.get("drop"):
            _count_known_drop(summary, u, split, cfg)
            continue
        if u.get("known") is None:
            raise ValueError(f"unit {u['unit_id']} has no stored lengths: an engine packs layouts over stored tokens")
        seg, removed = _known_segment(summary, u, split)
        summary.fragments += 1
        rows.append({"window_id": u["window_id"], "window_digest": u.get("window_digest"), "unit_id": u["unit_id"],
                     "n": seg.n, "trainable": list(seg.trainable or ()),
                     "meta": orjson.dumps(segment_meta(u, split, removed)).decode()})
    if not rows:
        return
    from trajwh.dedup.engines import DaftEngine

    daft = DaftEngine().daft
    col = daft.col
    packed = _window_udf(daft, cfg, (tok.id, tok.template_id), summary.pack_set, lineage)
    frame = (daft.from_arrow(pa.Table.from_pylist(rows))
             .groupby("window_id", "window_digest")
             .agg(col("unit_id").agg_list(), col("n").agg_list(), col("trainable").agg_list(), col("meta").agg_list()))
    out = (frame.with_column("result", packed(col("window_id"), col("window_digest"), col("unit_id"), col("n"),
                                              col("trainable"), col("meta")))
           .select("window_id", "result").sort("window_id").to_arrow())
    for result in out.column("result").to_pylist():
        r = orjson.loads(result)
        _add_window(summary, r["split"], r["counts"], r["drops"])
        if r["rows"]:
            write(r["rows"])


def _window_udf(daft: Any, cfg: PackConfig, tok_ids: tuple[str, str], pack_set: str, lineage: dict[str, str]) -> Any:
    """A Daft UDF: per window group, its layout rows, counts and drops (``layer.window_rows``) as JSON."""

    @daft.udf(return_dtype=daft.DataType.string())
    def packed(window_ids, digests, units, lengths, trainables, metas):  # noqa: ANN001, ANN202 - Daft's UDF columns
        out = []
        for window_id, digest, us, ns, ts, ms in zip(*(c.to_pylist() for c in (window_ids, digests, units, lengths,
                                                                                trainables, metas)), strict=True):
            metas_ = [orjson.loads(m) for m in ms]
            segs = sorted(((Segment(u, None, None, n, tuple(t)), m) for u, n, t, m in zip(us, ns, ts, metas_, strict=True)),
                          key=lambda sm: (sm[1]["trajectory_key"], sm[0].fragment_id))  # the stream's order
            rows, counts, drops = window_rows(segs, window_id, digest, cfg, tok_ids, pack_set, lineage)
            out.append(orjson.dumps({"split": segs[0][1]["split"], "rows": rows, "counts": counts,
                                     "drops": drops}).decode())
        return out

    return packed
