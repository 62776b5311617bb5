"""Every episode's features as one columnar frame: what the global curation steps read.

Clusters, groups and splits are global: they run over every episode of the warehouse on each
build that changed anything. As Python objects, 107,000 episodes took 4 s to build and the steps
over them 15 s of loops; as a polars frame (one row per episode, sorted by trajectory key, the
columns of ``episode_features``) they are joins and group-bys, and the signatures stay one
``uint32`` matrix per signal. The row index is the episode's number in the global steps: with
the frame sorted by key, "smallest member" and "smallest index" are the same thing, so labels
and ids do not depend on input order.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
from trajwh.dedup.features import EpisodeFeatures

_TIME = pl.Datetime("us", "UTC")
SCHEMA = {
    "trajectory_key": pl.String, "repository": pl.String, "base_commit": pl.String, "base_commit_at": _TIME,
    "task_id": pl.String, "instance_id": pl.String, "failing_tests": pl.List(pl.String),
    "touched_files": pl.List(pl.String), "patch_symbols": pl.List(pl.String), "issue_created_at": _TIME,
    "fix_merged_at": _TIME, "started_at": _TIME, "resolved": pl.Boolean, "n_steps": pl.Int64,
    "exact_digest": pl.String, "action_signature": pl.Binary, "text_signature": pl.Binary,
    "action_bands": pl.Binary, "text_bands": pl.Binary,
}


def sig_bytes(sig: object) -> bytes | None:
    return None if sig is None else np.asarray(sig, dtype="<u4").tobytes()


def feature_frame(features: Iterable[EpisodeFeatures]) -> pl.DataFrame:
    """The frame of signed features (``dedup.layer.sign`` first), sorted by trajectory key."""
    from trajwh.dedup.groups import patch_symbols

    cols: dict[str, list] = {c: [] for c in SCHEMA}
    for f in features:
        for c, v in (("trajectory_key", f.key), ("repository", f.repository), ("base_commit", f.base_commit),
                     ("base_commit_at", f.base_commit_at), ("task_id", f.task_id), ("instance_id", f.instance_id),
                     ("failing_tests", list(f.failing_tests)), ("touched_files", list(f.touched_files)),
                     ("patch_symbols", f.symbols if f.symbols is not None else patch_symbols(f.patch)),
                     ("issue_created_at", f.issue_created_at), ("fix_merged_at", f.fix_merged_at),
                     ("started_at", f.started_at), ("resolved", f.resolved), ("n_steps", f.n_steps),
                     ("exact_digest", f.exact), ("action_signature", sig_bytes(f.action_sig)),
                     ("text_signature", sig_bytes(f.text_sig)), ("action_bands", f.action_bands),
                     ("text_bands", f.text_bands)):
            cols[c].append(v)
    return conform(pl.DataFrame(cols, schema=SCHEMA))


def conform(df: pl.DataFrame) -> pl.DataFrame:
    """``df`` with the frame's columns and types, sorted by trajectory key; one row per key."""
    df = df.select([pl.col(c).cast(t) for c, t in SCHEMA.items()]).sort("trajectory_key")
    if df.height and df["trajectory_key"].is_duplicated().any():
        dup = df.filter(pl.col("trajectory_key").is_duplicated())["trajectory_key"][0]
        raise ValueError(f"episode features: trajectory key {dup!r} appears more than once (one row per episode)")
    return df


def nonblank(col: str) -> pl.Expr:
    """The column with empty strings as missing (``x or y`` in Python treats both alike)."""
    return pl.when(pl.col(col) == "").then(None).otherwise(pl.col(col))


def signature_matrix(df: pl.DataFrame, col: str, num_perm: int) -> tuple[np.ndarray, np.ndarray]:
    """(row numbers that have a signature in ``col``, their signatures as an ``uint32`` matrix)."""
    present = np.flatnonzero(df[col].is_not_null().to_numpy())
    return present, fixed_matrix(df, col, present, num_perm, "<u4", f"{num_perm} permutations")


def fixed_matrix(df: pl.DataFrame, col: str, rows: np.ndarray, width: int, dtype: str, what: str) -> np.ndarray:
    """The binary values of ``col`` at ``rows`` (none missing), each ``width`` numbers of ``dtype``, as
    one matrix (rows x width); a clear error naming the episode when a value has another length."""
    size = np.dtype(dtype).itemsize * width
    # the values' bytes as Arrow holds them, one after the other (no Python object per episode)
    arr = df[col].gather(rows).to_arrow()
    arr = (pa.concat_arrays(arr.chunks) if isinstance(arr, pa.ChunkedArray) else arr).cast(pa.large_binary())
    lengths = pc.binary_length(arr).to_numpy(zero_copy_only=False)
    wrong = np.flatnonzero(lengths != size)
    if len(wrong):
        row = int(rows[wrong[0]])
        raise ValueError(f"episode features: the {col} of {df['trajectory_key'][row]!r} holds {int(lengths[wrong[0]])} "
                         f"bytes, not {size} ({what}): features of another MinHash setting; "
                         f"rebuild them with `trajwh build --full`")
    if not len(rows):
        return np.empty((0, width), dtype=np.dtype(dtype).newbyteorder("="))
    start = int(np.frombuffer(arr.buffers()[1], dtype=np.int64)[arr.offset])
    data = np.frombuffer(arr.buffers()[2], dtype=np.uint8)[start:start + size * len(rows)]
    return data.view(dtype).reshape(len(rows), width).astype(np.dtype(dtype).newbyteorder("="))
