"""Near-duplicate clusters, computed in full or updated from the last curation's state.

A cluster is a connected component of three kinds of link: exact duplicates (the same digest of
actions and text), near-duplicate action sequences and near-duplicate text (MinHash signatures
whose LSH bands share a bucket, verified by their estimated Jaccard similarity). Every verified
LSH link is kept with the episode (``near_dup_clusters.links``), so a user can ask why two
episodes share a cluster, and so the next build need not find them again.

**The incremental update** (issue 14). Each episode's band keys are computed once, with its
signatures, and stored per batch (``episode_features``). A later curation starts from the earlier
one's links, the big buckets it saw (``BIG_BUCKET``: over 64 members, linked as a star on their
smallest member) and the features version of each batch it read. A bucket's candidate pairs
depend on its members alone, so:

- the buckets holding an episode that is new or whose features changed, and the big buckets whose
  size or smallest member changed (members removed: a forget, a batch gone), are *touched*: their
  candidate pairs are made again from all their members and the new ones verified;
- every other bucket has the members it had, so it makes the pairs it made, whose verification is
  known: an earlier link between two unchanged episodes is kept if some bucket still makes the
  pair (a bucket that grew past 64 members makes only its star);
- exact duplicates are regrouped from the stored digests (a group-by), the components found again
  over all links (a fraction of a second), the representatives elected as before.

So the links equal what a full computation finds (tested: random additions and removals, big
buckets included, on both engines), and so do the clusters. A state that does not fit (another
configuration, a table written by another run, ``trajwh build --full``) gives the full computation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
from trajwh.dedup.engines import (
    BIG_BUCKET,
    Engine,
    band_keys,
    band_rows,
    big_buckets,
    bucket_candidates,
    engine,
    star_components,
    touched_rows,
)
from trajwh.dedup.frame import fixed_matrix, signature_matrix
from trajwh.dedup.minhash import pair_similarity
from trajwh.schemas import ids

SIGNALS = ("actions", "exact", "text")  # what links two episodes, coded in the order of the names
#: the LSH signals: (code, signature column, band-key column)
_LSH = ((SIGNALS.index("actions"), "action_signature", "action_bands"),
        (SIGNALS.index("text"), "text_signature", "text_bands"))


@dataclass
class ClusterState:
    """What an update starts from: the earlier curation's links (``trajectory_key``, ``links``: every
    episode it clustered), the big buckets it saw per signal (``[band, key, size, digest of the
    smallest member's key]``), and the rows of the current frame whose features changed since (new
    episodes, re-featurized batches); episodes of the earlier population that are not in the frame
    were removed."""

    links: pl.DataFrame
    big: dict[str, list[list[Any]]]
    changed: np.ndarray  # bool per row of the frame


@dataclass
class ClusterInfo:
    """How a clustering went: ``incremental``, and per signal the candidate pairs it verified and the
    earlier links it kept; ``big``: the big buckets to store for the next update."""

    incremental: bool = False
    verified: int = 0
    kept: int = 0
    big: dict[str, list[list[Any]]] = field(default_factory=dict)


def _hub_digests(keys: pl.Series, hubs: np.ndarray) -> list[str]:
    return [d[:16] for d in ids.text_digests(keys.gather(hubs).to_list())]


def _keys_matrix(df: pl.DataFrame, col: str, present: np.ndarray, sigs: np.ndarray, bands: int, rows: int
                 ) -> np.ndarray:
    """The stored band keys of the rows ``present`` (documents x bands); computed from the signatures
    when a frame has none (``curate``'s in-memory frames)."""
    if col not in df.columns or not len(present) or df[col].gather(present).null_count():
        return band_keys(sigs, bands, rows)
    return fixed_matrix(df, col, present, bands, "<i8", f"{bands} band keys")


def _old_links(state: ClusterState, df: pl.DataFrame, signal: str, present: np.ndarray) -> tuple[np.ndarray, ...]:
    """The earlier links of ``signal`` between two episodes of the frame that did not change, as
    document numbers of ``present`` (a < b) with their similarity."""
    local = np.full(df.height, -1, dtype=np.int64)
    local[present] = np.arange(len(present), dtype=np.int64)
    local[state.changed] = -1
    rows = pl.DataFrame({"k": df["trajectory_key"], "row": np.arange(df.height, dtype=np.int64)})
    links = (state.links.lazy().select(pl.col("trajectory_key").alias("a_key"), "links").explode("links")
             .drop_nulls("links").unnest("links").rename({"trajectory_key": "b_key"})
             .filter((pl.col("signal") == signal) & (pl.col("a_key") < pl.col("b_key")))
             .join(rows.lazy().rename({"k": "a_key", "row": "a"}), on="a_key")
             .join(rows.lazy().rename({"k": "b_key", "row": "b"}), on="b_key")
             .select("a", "b", "similarity").collect())
    a, b = local[links["a"].to_numpy()], local[links["b"].to_numpy()]
    ok = (a >= 0) & (b >= 0)
    return a[ok], b[ok], links["similarity"].to_numpy()[ok]


def _bucket_arrays(buckets: Any) -> tuple[np.ndarray, np.ndarray]:
    """(bands, keys) of an iterable of (band, key) buckets."""
    pairs = list(buckets)
    return (np.array([b for b, _ in pairs], dtype=np.int64), np.array([k for _, k in pairs], dtype=np.int64))


def _still_made(keys: np.ndarray, a: np.ndarray, b: np.ndarray, big: pa.Table) -> np.ndarray:
    """Whether a bucket still makes each pair (a, b): the two share a band's key, in a bucket of at
    most ``BIG_BUCKET`` documents or a big one whose smallest document is a or b."""
    same = keys[a] == keys[b]  # pairs x bands
    if big.num_rows:
        hub_of = {(int(bd), int(k)): int(h) for bd, k, h in zip(big["band"].to_numpy(), big["key"].to_numpy(),
                                                                big["hub"].to_numpy(), strict=True)}
        big_keys = np.fromiter((k for _, k in hub_of), dtype=np.int64, count=len(hub_of))
        for p, band in zip(*np.nonzero(same & np.isin(keys[a], big_keys)), strict=True):
            hub = hub_of.get((int(band), int(keys[a[p], band])))
            if hub is not None and hub != a[p] and hub != b[p]:
                same[p, band] = False
    return same.any(axis=1)


def _signal_links(df: pl.DataFrame, cfg: Any, eng: Engine, code: int, sig_col: str, band_col: str,
                  state: ClusterState | None, info: ClusterInfo) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The verified links of one LSH signal as frame rows (a < b) and similarities; the big buckets
    for the next update go to ``info``."""
    signal = SIGNALS[code]
    present, sigs = signature_matrix(df, sig_col, cfg.minhash.num_perm)
    bands, rows = cfg.minhash.bands
    empty = (np.empty(0, dtype=np.int64),) * 2 + (np.empty(0),)
    if len(present) < 2:
        info.big[signal] = []
        return empty
    keys = _keys_matrix(df, band_col, present, sigs, bands, rows)
    table = band_rows(keys)
    changed = np.flatnonzero(state.changed[present]) if state is not None else None
    before = {(bd, k): (m, d) for bd, k, m, d in state.big.get(signal, [])} if state is not None else {}
    # in an update, the rows of the buckets of changed episodes and of those big before: the big buckets
    # of now are among them, and so are the buckets whose pairs are made again (one scan of the table)
    rows_in = table if state is None else touched_rows(eng, table, changed, _bucket_arrays(before))
    big = big_buckets(eng, rows_in)
    hubs = big["hub"].to_numpy()
    info.big[signal] = [[int(bd), int(k), int(m), d] for bd, k, m, d in zip(
        big["band"].to_numpy(), big["key"].to_numpy(), big["m"].to_numpy(),
        _hub_digests(df["trajectory_key"], present[hubs]) if len(hubs) else [], strict=True)]
    if state is None:
        candidates = bucket_candidates(eng, table)
        kept = empty
    else:
        now = {(bd, k): (m, d) for bd, k, m, d in info.big[signal]}
        moved = [bk for bk, v in now.items() if before.get(bk) != v] + [bk for bk in before if bk not in now]
        rows = touched_rows(eng, rows_in, changed, _bucket_arrays(moved))
        candidates = bucket_candidates(eng, rows)
        for done in (rows, rows_in):
            eng.drop(done)
        a, b, sim = _old_links(state, df, signal, present)
        keep = _still_made(keys, a, b, big)
        kept = a[keep], b[keep], sim[keep]
        info.kept += int(keep.sum())
        if len(candidates) and len(kept[0]):  # pairs already linked need no second look
            known = set(zip(kept[0].tolist(), kept[1].tolist(), strict=True))
            fresh = np.fromiter(((int(x), int(y)) not in known for x, y in candidates), dtype=bool, count=len(candidates))
            candidates = candidates[fresh]
    sim = pair_similarity(sigs, candidates)
    info.verified += len(candidates)
    ok = sim >= cfg.minhash.threshold
    a = np.concatenate([kept[0], candidates[ok, 0]])
    b = np.concatenate([kept[1], candidates[ok, 1]])
    return present[a], present[b], np.concatenate([kept[2], sim[ok]])


def cluster_frame(df: pl.DataFrame, cfg: Any, state: ClusterState | None = None) -> tuple[pl.DataFrame, ClusterInfo]:
    """Exact duplicates, near-duplicate action sequences and near-duplicate text, as clusters: one
    row per episode of ``df`` (a ``dedup.frame``), in its order, with the cluster's id and size,
    whether the episode is its representative, its weight, the signals that linked it, its highest
    similarity to a linked episode and its LSH links. The banding and the components run on the
    engine ``cfg.engine`` (``dedup.engines``); the candidate pairs are verified on the signatures
    here. With ``state``, an update of the earlier clusters (module docstring); the same rows."""
    eng = engine(cfg.engine)
    try:
        return _cluster_frame(df, cfg, eng, state)
    finally:
        eng.close()


def _cluster_frame(df: pl.DataFrame, cfg: Any, eng: Engine, state: ClusterState | None
                   ) -> tuple[pl.DataFrame, ClusterInfo]:
    n = df.height
    info = ClusterInfo(incremental=state is not None)
    exact = (df.select(pl.int_range(n, dtype=pl.Int64).alias("i"), "exact_digest").drop_nulls("exact_digest")
             .with_columns(pl.col("i").min().over("exact_digest").alias("first")).filter(pl.col("i") != pl.col("first")))
    a_parts, b_parts = [exact["first"].to_numpy()], [exact["i"].to_numpy()]
    signal_parts = [np.full(exact.height, SIGNALS.index("exact"), dtype=np.int8)]
    sim_parts = [np.ones(exact.height)]
    lsh_a, lsh_b, lsh_signal, lsh_sim = [], [], [], []
    for code, sig_col, band_col in _LSH:
        a, b, sim = _signal_links(df, cfg, eng, code, sig_col, band_col, state, info)
        for parts, v in ((a_parts, a), (b_parts, b), (sim_parts, sim), (lsh_a, a), (lsh_b, b), (lsh_sim, sim)):
            parts.append(v)
        for parts in (signal_parts, lsh_signal):
            parts.append(np.full(len(a), code, dtype=np.int8))
    a, b = np.concatenate(a_parts).astype(np.int64), np.concatenate(b_parts).astype(np.int64)
    root = star_components(eng, n, a, b)[0]
    keys = df["trajectory_key"]
    roots = np.unique(root)
    cluster_of_root = pl.DataFrame({"root": roots, "cluster_id": ["c-" + d[:16] for d in
                                                                   ids.text_digests(keys.gather(roots).to_list())]})
    ends = np.concatenate([a, b])
    signals = np.tile(np.concatenate(signal_parts), 2)
    sims = np.tile(np.concatenate(sim_parts), 2)
    # per episode: the signals that linked it (a bit each) and its highest similarity, in array calls
    mask = np.zeros(n, dtype=np.int8)
    np.bitwise_or.at(mask, ends, (1 << signals).astype(np.int8))
    best = np.full(n, np.nan)
    if len(ends):
        np.fmax.at(best, ends, sims)
    by_mask = pl.DataFrame({"mask": np.arange(1 << len(SIGNALS), dtype=np.int8),
                            "linked_by": [[name for c, name in enumerate(SIGNALS) if m >> c & 1]  # in name order
                                          for m in range(1 << len(SIGNALS))]})
    out = (df.select("trajectory_key", "resolved", "n_steps", "started_at")
           .with_columns(pl.int_range(n, dtype=pl.Int64).alias("i"), pl.Series("root", root), pl.Series("mask", mask),
                         pl.Series("max_similarity", best, nan_to_null=True))
           .join(cluster_of_root, on="root", how="left")
           .join(by_mask, on="mask", how="left", maintain_order="left"))
    # the representative: resolved first, then the fewest steps, then the earliest start, then the key
    rep = (out.sort([pl.col("resolved").fill_null(False).not_(), "n_steps", "started_at", "trajectory_key"],
                    nulls_last=True)
           .group_by("root").agg(pl.col("i").first().alias("rep")))
    out = out.join(rep, on="root", how="left").sort("i").with_columns(pl.len().over("root").alias("cluster_size"))
    frame = out.select(
        "trajectory_key", "cluster_id", "cluster_size", (pl.col("i") == pl.col("rep")).alias("is_representative"),
        (1.0 / pl.col("cluster_size") if cfg.weight == "inverse_size" else pl.lit(1.0)).cast(pl.Float64).alias("weight"),
        "linked_by", "max_similarity")
    return frame.with_columns(pl.Series("links", _links(keys, np.concatenate(lsh_a), np.concatenate(lsh_b),
                                                        np.concatenate(lsh_signal), np.concatenate(lsh_sim), n))), info


def _links(keys: pl.Series, a: np.ndarray, b: np.ndarray, signal: np.ndarray, sim: np.ndarray, n: int) -> pa.Array:
    """Each episode's LSH links as a list array (row i: the links of episode i), by signal then the
    other's key (rows are in key order, so by its number), built from offsets without a group-by."""
    i, other = np.concatenate([a, b]).astype(np.int64), np.concatenate([b, a]).astype(np.int64)
    signal, sim = np.tile(signal, 2), np.tile(sim, 2)
    order = np.lexsort((other, signal, i))
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(np.bincount(i, minlength=n), out=offsets[1:])
    names = pa.array(SIGNALS, pa.string())
    values = pa.StructArray.from_arrays(
        [keys.to_arrow().take(pa.array(other[order])), names.take(pa.array(signal[order].astype(np.int64))),
         pa.array(sim[order], pa.float64())], names=["trajectory_key", "signal", "similarity"])
    return pa.ListArray.from_arrays(pa.array(offsets), values)


__all__ = ["BIG_BUCKET", "ClusterInfo", "ClusterState", "SIGNALS", "cluster_frame"]
