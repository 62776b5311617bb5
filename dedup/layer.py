"""Build the curated layer: ``near_dup_clusters``, ``task_groups``, ``splits``, ``leak_flags``.

These are global steps (a cluster or a group spans batches), so the four tables are rebuilt
together from the redacted layer and swapped in one commit; a run whose inputs and parameters
did not change is skipped. Order of the input never matters: features are read sorted by
trajectory key, component labels are component minima, group and cluster ids are digests of
their smallest member, and split draws are hashes of group ids.

Near duplicates are clusters, not deletions: every member is kept with a weight (1 / cluster
size by default), and one representative per cluster is chosen by: resolved first, then the
fewest steps, then the earliest start, then the trajectory key.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import polars as pl
import pyarrow as pa
from trajwh.dedup.clusters import ClusterInfo, ClusterState, cluster_frame
from trajwh.dedup.engines import DEFAULT_ENGINE, band_keys
from trajwh.dedup.features import EpisodeFeatures, action_shingles, stream_features, text_shingles
from trajwh.dedup.frame import conform, feature_frame, sig_bytes
from trajwh.dedup.groups import GroupConfig, group_frame, patch_symbols
from trajwh.dedup.leaks import RULE_VERSION, LeakFlag, episode_leaks
from trajwh.dedup.minhash import MinHashParams, signatures
from trajwh.dedup.splits import SPLIT_VERSION, SplitConfig, split_frame
from trajwh.lineage.catalog import Warehouse, now_utc, write_table_file
from trajwh.lineage.parallel import (
    PARALLEL_MIN_ITEMS,
    duckdb_memory,
    run_parts,
    scaled_mb,
    workers_wanted,
    workers_within,
)
from trajwh.lineage.rebuild import (
    TableSetWriter,
    batch_fingerprints,
    chosen_batches,
    inputs_fingerprint,
    is_current,
    mark_running,
    run_row,
)
from trajwh.schemas import ids
from trajwh.schemas.arrow import arrow_schema
from trajwh.schemas.tables import (
    EpisodeFeatureRow,
    LeakFlagRow,
    NearDupClusterRow,
    SplitRow,
    TaskGroupRow,
)

TRANSFORM = "curate"
CURATE_VERSION = "2.2.0"  # 2.2: clusters keep their links, updated from the last state; 2.0: capped weak merges, held-out rules; 2.1: group id from its first task


@dataclass(frozen=True)
class CurateConfig:
    minhash: MinHashParams = MinHashParams()
    action_k: int = 3
    text_k: int = 5
    min_actions: int = 3  # shorter action sequences are too generic to call two rollouts duplicates
    weight: str = "inverse_size"  # or "one"
    groups: GroupConfig = GroupConfig()
    splits: SplitConfig = SplitConfig()
    digest: str | None = None  # of the trajwh.toml the settings came from, recorded on the run
    engine: str = DEFAULT_ENGINE  # runs the global graph steps (dedup.engines); not in the version: engines agree

    def version(self) -> str:
        s = self.splits
        return (f"{TRANSFORM}@{CURATE_VERSION};{self.minhash.describe()};k={self.action_k}/{self.text_k};"
                f"weight={self.weight};groups={self.groups.describe()};splits={SPLIT_VERSION}:{s.train}/{s.valid}/{s.test}:"
                f"{s.cutoff.isoformat() if s.cutoff else 'none'}:leaks-held-out={s.hold_out_leaks};leaks={RULE_VERSION}")


@dataclass
class Clusters:
    cluster_of: dict[str, str]
    linked_by: dict[str, set[str]] = field(default_factory=dict)
    similarity: dict[str, float] = field(default_factory=dict)


def sign(features: list[EpisodeFeatures], cfg: CurateConfig = CurateConfig()) -> None:
    """Fill what near-duplicate search and grouping need from an episode's text, once: the exact
    digest, the MinHash signatures of its action and text shingles and their LSH band keys, the
    patch's symbols. The curate stage stores them per batch (``episode_features``), so a new batch
    signs only itself."""
    todo = [f for f in features if not f.signed]
    bands, rows = cfg.minhash.bands
    for f in todo:
        f.exact = ids.digest([f.actions, f.text]) if f.actions or f.text else None
        if f.symbols is None:
            f.symbols = patch_symbols(f.patch)
    for attr, docs in (
        ("action_sig", [action_shingles(f.actions, cfg.action_k) if len(f.actions) >= cfg.min_actions else []
                        for f in todo]),
        ("text_sig", [text_shingles(f.text, cfg.text_k) for f in todo]),
    ):
        present = [i for i, d in enumerate(docs) if d]  # empty documents are nobody's duplicate
        sigs = signatures([docs[i] for i in present], cfg.minhash)
        keys = band_keys(sigs, bands, rows) if len(present) else np.empty((0, bands), dtype=np.int64)
        for row, i in enumerate(present):
            setattr(todo[i], attr, sigs[row])
            setattr(todo[i], attr.replace("_sig", "_bands"), keys[row].astype("<i8").tobytes())
    for f in todo:
        f.signed = True


def near_duplicates(features: list[EpisodeFeatures], cfg: CurateConfig = CurateConfig()) -> Clusters:
    """Exact duplicates, near-duplicate action sequences and near-duplicate text, as clusters."""
    sign(features, cfg)
    rows = cluster_frame(feature_frame(features), cfg)[0]
    clusters = Clusters(dict(zip(rows["trajectory_key"].to_list(), rows["cluster_id"].to_list(), strict=True)))
    for key, linked, sim in rows.select("trajectory_key", "linked_by", "max_similarity").iter_rows():
        if linked:
            clusters.linked_by[key] = set(linked)
            clusters.similarity[key] = sim
    return clusters


def _leak_evidence(leaks: list[LeakFlag]) -> dict[str, list[str]]:
    leaked: dict[str, list[str]] = {}
    for leak in leaks:
        leaked.setdefault(leak.trajectory_key, []).append(f"{leak.kind}@{leak.step_index}")
    return leaked


def curate_frames(df: pl.DataFrame, leaks: list[LeakFlag], cfg: CurateConfig, state: ClusterState | None = None,
                  info: ClusterInfo | None = None) -> dict[str, pl.DataFrame]:
    """The four tables (without lineage columns) from a ``dedup.frame`` of every episode and the
    leak flags: clusters (updated from ``state`` when given: ``dedup.clusters``; how it went in
    ``info``), then groups (a cluster is a grouping key), then splits."""
    clusters, how = cluster_frame(df, cfg, state)
    if info is not None:
        info.__dict__.update(how.__dict__)
    groups = group_frame(df, cfg.groups, clusters["cluster_id"], cutoff=cfg.splits.cutoff, engine=cfg.engine)
    g = groups.rows
    splits = split_frame(df.with_columns(g["group_id"], g["repository"], g["keys"]), cfg.splits, _leak_evidence(leaks),
                         groups.cut_keys, engine=cfg.engine)
    splits = splits.join(clusters.select("trajectory_key", "cluster_id"), on="trajectory_key", how="left",
                         maintain_order="left").select("trajectory_key", "group_id", "cluster_id", "split", "reason",
                                                       "eligible_for_eval", "flags")
    leak_schema = {"trajectory_key": pl.String, "step_id": pl.String, "step_index": pl.Int64, "kind": pl.String,
                   "evidence": pl.String}
    flagged = pl.DataFrame([(x.trajectory_key, x.step_id, x.step_index, x.kind, x.evidence) for x in leaks],
                           schema=leak_schema, orient="row")
    late_fix = splits.filter(pl.col("flags").list.contains("fix_after_cutoff")).select(
        "trajectory_key", pl.lit(None, dtype=pl.String).alias("step_id"), pl.lit(None, dtype=pl.Int64).alias("step_index"),
        pl.lit("fix_after_cutoff").alias("kind"), pl.lit("issue created before the cutoff, fix merged after it").alias("evidence"))
    return {"near_dup_clusters": clusters,
            "task_groups": g.select("trajectory_key", "group_id", "group_size", "repository", "keys", "flags"),
            "splits": splits,
            "leak_flags": pl.concat([flagged, late_fix]).with_columns(pl.lit(RULE_VERSION).alias("rule_version"))}


def _lineage(cfg: CurateConfig, run_id: str) -> dict[str, str]:
    return {"_run_id": run_id, "_transform": TRANSFORM, "_transform_version": cfg.version()}


def _with_lineage(frame: pl.DataFrame, table: str, lineage: dict[str, Any]) -> pa.Table:
    schema = arrow_schema(_MODELS[table])
    data = frame.with_columns([pl.lit(v, dtype=pl.String).alias(k) for k, v in lineage.items()]).to_arrow()
    return data.select(schema.names).cast(schema)


def curate(features: list[EpisodeFeatures], leaks: list, cfg: CurateConfig, run_id: str) -> dict[str, list[dict]]:
    """All four tables' rows from a list of features (a pure function: the tests call it)."""
    sign(features, cfg)
    lineage = _lineage(cfg, run_id)
    return {t: _with_lineage(f, t, lineage).to_pylist() for t, f in curate_frames(feature_frame(features), leaks, cfg).items()}


_FEATURE_SCHEMA = arrow_schema(EpisodeFeatureRow)
_MODELS = {"near_dup_clusters": NearDupClusterRow, "task_groups": TaskGroupRow, "splits": SplitRow,
           "leak_flags": LeakFlagRow}
#: the tables a curation writes whole
CURATED_TABLES = tuple(_MODELS)


@dataclass
class CurateSummary:
    run_id: str
    skipped: bool = False
    episodes: int = 0
    clusters: int = 0
    duplicates: int = 0
    groups: int = 0
    largest_group: int = 0
    weak_key_episodes: int = 0  # episodes that lost a weak grouping key to the cap
    held_out: int = 0
    splits: dict[str, int] = field(default_factory=dict)
    leaks: int = 0
    batches_featurized: int = 0
    episodes_featurized: int = 0
    moved: dict[str, int] = field(default_factory=dict)  # "train->test": episodes that changed side
    clusters_incremental: bool = False  # the clusters updated from the last curation's (dedup.clusters)
    pairs_verified: int = 0  # candidate pairs whose signatures were compared
    links_kept: int = 0  # earlier links between unchanged episodes that a bucket still makes


FEATURES_VERSION = "1.2.0"  # 1.2: LSH band keys stored; 1.1: a redaction placeholder is its type, not its digest (features.typed_placeholders)


def features_version(cfg: CurateConfig) -> str:
    """What a stored ``episode_features`` file was computed with (its batch's inputs are added)."""
    return (f"features@{FEATURES_VERSION};{cfg.minhash.describe()};k={cfg.action_k}/{cfg.text_k};"
            f"min_actions={cfg.min_actions};leaks={RULE_VERSION}")


def feature_row(f: EpisodeFeatures, leaks: list[LeakFlag], lineage: dict[str, Any]) -> dict[str, Any]:
    return {"trajectory_key": f.key, "repository": f.repository, "base_commit": f.base_commit,
            "base_commit_at": f.base_commit_at, "task_id": f.task_id, "instance_id": f.instance_id,
            "failing_tests": f.failing_tests, "touched_files": f.touched_files, "patch_symbols": f.symbols or [],
            "issue_created_at": f.issue_created_at, "fix_merged_at": f.fix_merged_at, "started_at": f.started_at,
            "resolved": f.resolved, "n_steps": f.n_steps, "exact_digest": f.exact,
            "action_signature": sig_bytes(f.action_sig), "text_signature": sig_bytes(f.text_sig),
            "action_bands": f.action_bands, "text_bands": f.text_bands,
            "leaks": orjson.dumps([[x.step_id, x.step_index, x.kind, x.evidence] for x in leaks]).decode()
            if leaks else None, **lineage}


def stored_frame(wh: Warehouse) -> tuple[pl.DataFrame, list[LeakFlag]]:
    """Every episode's stored features as a ``dedup.frame`` and their leak flags, by trajectory key."""
    data = pl.from_arrow(wh.query("SELECT * EXCLUDE (_batch_id, _run_id, _transform, _transform_version) "
                                  "FROM episode_features ORDER BY trajectory_key"))
    leaks = [LeakFlag(key, *x) for key, text in data.select("trajectory_key", "leaks").drop_nulls("leaks").iter_rows()
             for x in orjson.loads(text)]
    return conform(data), leaks


def _feature_files(wh: Warehouse, batch_id: str, lineage: dict[str, Any], cfg: CurateConfig,
                   part: tuple[int, int] | None = None, chunk: int | None = None) -> tuple[list[Any], int]:
    """The features of a batch's episodes (of one ``part``), signed, written a file per ``chunk``
    episodes (not yet visible: the session commits them), so memory holds one chunk; and how
    many episodes. ``chunk``: 1,000 episodes at the default memory budget, scaled to the build's
    (``scaled_mb``; about 100 KB an episode)."""
    chunk = chunk or scaled_mb(1_000, floor=250)
    files: list[Any] = []
    pending: list[tuple[EpisodeFeatures, list[LeakFlag]]] = []
    episodes = 0

    def write() -> None:
        sign([f for f, _ in pending], cfg)
        rows = [feature_row(f, lk, lineage) for f, lk in pending]
        files.append(write_table_file(wh, "episode_features", pa.Table.from_pylist(rows, schema=_FEATURE_SCHEMA)))
        pending.clear()

    # a part's sort of its steps: one thread in a bounded memory (two workers side by side)
    limits = {} if part is None else {"memory_limit": duckdb_memory(_FEATURE_STREAM_MB), "threads": 1}
    for f, steps in stream_features(wh, batch_id, part, **limits):
        pending.append((f, episode_leaks(f.key, steps)))
        episodes += 1
        if len(pending) >= chunk:
            write()
    if pending or not files:
        write()
    return files, episodes


#: a features worker at most: libraries, numba's compiler and kernels (about 190 MB: what the
#: build's process would keep to its end if it computed signatures itself), its stream of steps
#: (``_FEATURE_STREAM_MB``) and a chunk of episodes' features. Measured at 20,000 episodes,
#: default budget: 399-488 MB; at 107,000, with DuckDB's default stream memory and threads: 760 MB
_FEATURE_WORKER_MB = 600
#: a features part's DuckDB memory for both its streams, MB at the default budget
_FEATURE_STREAM_MB = 192


def _feature_part(t: dict[str, Any]) -> tuple[list[Any], int]:
    """The feature files of one part of a batch (in the build's process or a worker)."""
    return _feature_files(Warehouse(t["root"]), t["batch_id"], t["lineage"], t["cfg"], t["part"])


def _batch_features(wh: Warehouse, batch_id: str, lineage: dict[str, Any], cfg: CurateConfig,
                    n_episodes: int) -> tuple[list[Any], int]:
    """A batch's feature files: a big batch in parts (episodes by the hash of their key), as many as
    fit the memory budget, this process and worker processes one each (one part: a worker), each
    reading the warehouse itself (per-batch work on every core, as normalize and redact); a small one
    in this process; the same rows either way."""
    if n_episodes < PARALLEL_MIN_ITEMS:
        return _feature_files(wh, batch_id, lineage, cfg)
    n = workers_within(min(workers_wanted(), 8), _FEATURE_WORKER_MB)
    tasks = [{"root": str(wh.root), "batch_id": batch_id, "lineage": lineage, "cfg": cfg, "part": (i, n)}
             for i in range(n)]
    files: list[Any] = []
    episodes = 0
    # parts side by side: this process takes one (numba's compiler then stays in it, and there is room
    # for it); one part only (a tight budget): it runs in a worker, and the compiler goes with it
    for written, count in run_parts(_feature_part, tasks, here=n > 1):
        files += written
        episodes += count
    return files, episodes


def _featurize(wh: Warehouse, session: Any, cfg: CurateConfig, run_id: str, full: bool,
               progress: Callable[[str], None] | None, batches: Sequence[str] | None = None) -> tuple[int, int]:
    """Compute and store ``episode_features`` for every redacted batch that is new or changed
    since its features were stored (all with ``full``; only those of ``batches`` when given, a run
    of their partitions); drop those of batches that are gone (not in a run of chosen batches).
    Streams each batch's episodes in key order and writes a file per ``chunk`` episodes, so
    memory holds one chunk. Returns (batches featurized, episodes)."""
    fv, sources, built = _features_state(wh, cfg)
    gone = [b for b in built if b not in sources] if batches is None else []
    if gone:
        session.commit(removed=[wh.data / p for p in wh.query(
            "SELECT path FROM table_files WHERE table_name = 'episode_features' AND list_contains(?, batch_id)",
            [gone]).column(0).to_pylist()], run_id=run_id)
    done = episodes = 0
    sizes = {r["batch_id"]: r["n"] for r in wh.manifest_query(
        "SELECT batch_id, sum(rows) AS n FROM table_files WHERE table_name = 'redacted_episodes' GROUP BY 1").to_pylist()}
    chosen = None if batches is None else set(batches)
    for batch_id, src in sorted(sources.items()):
        version = f"{fv};inputs={src}"
        if (not full and built.get(batch_id) == version) or (chosen is not None and batch_id not in chosen):
            continue
        if progress:
            progress(f"features of batch {batch_id}")
        lineage = {"_batch_id": batch_id, "_run_id": run_id, "_transform": "features", "_transform_version": version}
        files, n = _batch_features(wh, batch_id, lineage, cfg, sizes.get(batch_id, 0))
        episodes += n
        # the batch's earlier features, read in the commit's transaction (a run of the same batch may commit beside)
        session.commit(files, batch_id=batch_id, run_id=run_id, transform_version=version,
                       guard=lambda con, b=batch_id: features_outputs(wh, b, con))
        done += 1
    return done, episodes


def _features_state(wh: Warehouse, cfg: CurateConfig) -> tuple[str, dict[str, str], dict[str, str]]:
    """(the features version of ``cfg``, each redacted batch's inputs fingerprint, each batch's
    stored features version): a batch's features are current when the last is the first with the
    second (``_featurize``)."""
    return (features_version(cfg), batch_fingerprints(wh, _FEATURE_INPUTS), _feature_versions(wh))


#: what a batch's features are computed from
_FEATURE_INPUTS = ["redacted_episodes", "redacted_steps"]


def features_current(wh: Warehouse, cfg: CurateConfig) -> bool:
    """Whether every redacted batch's stored features are current, and no batch that is gone has
    any (``_featurize`` would have nothing to do)."""
    fv, sources, built = _features_state(wh, cfg)
    return set(built) <= set(sources) and all(built.get(b) == f"{fv};inputs={src}" for b, src in sources.items())


def features_outputs(wh: Warehouse, batch_id: str, con: Any) -> list[Any]:
    """The files of a batch's episode features, read through ``con`` (a commit's transaction)."""
    return [wh.data / p for (p,) in con.execute(
        "SELECT path FROM table_files WHERE table_name = 'episode_features' AND batch_id = ?", [batch_id]).fetchall()]


@dataclass
class FeaturesSummary:
    run_id: str
    batches_featurized: int = 0
    batches_unchanged: int = 0
    episodes_featurized: int = 0


def featurize_warehouse(wh: Warehouse, *, run_id: str, cfg: CurateConfig = CurateConfig(), full: bool = False,
                        lock_timeout: float = 60.0, batches: Sequence[str] | None = None,
                        progress: Callable[[str], None] | None = None) -> FeaturesSummary:
    """The per-batch half of curation: ``episode_features`` (MinHash signatures, grouping keys,
    times, leak evidence) of every batch whose redacted rows changed, or of ``batches`` only (a
    run of their Dagster partitions, holding the writers' lock shared beside runs of other
    batches). ``curate_warehouse`` then reads the stored features of every episode."""
    summary = FeaturesSummary(run_id)
    started = now_utc()
    with wh.write_session("features", timeout=lock_timeout, shared=batches is not None) as session:
        mark_running(session, run_id, "features", started)
        if batches is not None:  # a chosen batch that is not committed is an error naming it
            chosen_batches(wh, [], batches)
        summary.batches_featurized, summary.episodes_featurized = _featurize(wh, session, cfg, run_id, full, progress,
                                                                             batches)
        n = wh.manifest_query("SELECT count(DISTINCT batch_id) FROM table_files WHERE table_name = 'redacted_episodes'"
                              ).column(0)[0].as_py()
        summary.batches_unchanged = (n if batches is None else len(set(batches))) - summary.batches_featurized
        session.upsert_rows("runs", [run_row(run_id, "features", started,
                                             params={"full": full, **({"batches": list(batches)} if batches else {})},
                                             counts=summary.__dict__, code_version=f"features@{FEATURES_VERSION}")])
    return summary


_SIDE = {"train": "train", "valid": "eval", "test": "eval", "held_out": "held_out"}


def count_moves(before: dict[str, str], after: dict[str, str]) -> dict[str, int]:
    """Episodes that an earlier curation put on one side (train, evaluation, held out) and this
    one puts on another, by direction ("train->test"). A group merge, or a group renamed by a
    merge, can move episodes; the curate run reports them, never silently."""
    moved: dict[str, int] = {}
    for key, new in after.items():
        old = before.get(key)
        if old is not None and _SIDE.get(old, old) != _SIDE.get(new, new):
            moved[f"{old}->{new}"] = moved.get(f"{old}->{new}", 0) + 1
    return dict(sorted(moved.items()))


def cluster_version(cfg: CurateConfig) -> str:
    """What the stored links and big buckets were computed with: an update needs the same."""
    return (f"{TRANSFORM}@{CURATE_VERSION};{cfg.minhash.describe()};k={cfg.action_k}/{cfg.text_k};"
            f"min_actions={cfg.min_actions};features@{FEATURES_VERSION}")


def _feature_versions(wh: Warehouse, con: Any = None) -> dict[str, str]:
    """Each batch's ``episode_features`` version (its inputs' fingerprint included); ``con``: a
    catalog connection to read through (a transaction's)."""
    sql = ("SELECT batch_id, any_value(transform_version) AS v FROM table_files WHERE table_name = 'episode_features' "
           "GROUP BY batch_id ORDER BY batch_id")
    if con is not None:
        return dict(con.execute(sql).fetchall())
    return {r["batch_id"]: r["v"] for r in wh.manifest_query(sql).to_pylist()}


def cluster_state(wh: Warehouse, cfg: CurateConfig, df: pl.DataFrame, basis: dict[str, str]) -> ClusterState | None:
    """What the clusters of ``df`` (every episode's stored features) can be updated from: the links of
    the stored ``near_dup_clusters``, and the big buckets and batch versions that the curation which
    wrote them recorded; the rows whose features changed since (a new batch, a batch featurized
    again, an episode that had no row). None when there is nothing to update, or it was made with
    other settings or by a run without that record: the clusters are then computed in full."""
    if not wh.manifest_query("SELECT count(*) FROM table_files WHERE table_name = 'near_dup_clusters'").column(0)[0].as_py():
        return None
    made_by = wh.query("SELECT DISTINCT _run_id FROM near_dup_clusters").column(0).to_pylist()
    if len(made_by) != 1:
        return None
    params = wh.query("SELECT params FROM runs WHERE run_id = ? AND job = 'curate' AND status = 'succeeded'",
                      [made_by[0]]).column(0).to_pylist()
    near_dup = orjson.loads(params[0]).get("near_dup") if params and params[0] else None
    if not _state_fits(near_dup, cluster_version(cfg)):
        return None
    before = near_dup["basis"]
    redone = [b for b, v in basis.items() if before.get(b) != v]
    links = pl.from_arrow(wh.query("SELECT trajectory_key, links FROM near_dup_clusters"))
    keys = df["trajectory_key"]
    changed = ~keys.is_in(links["trajectory_key"].implode())
    if redone:
        again = wh.query("SELECT trajectory_key FROM episode_features WHERE list_contains(?, _batch_id)", [redone])
        changed = changed | keys.is_in(pl.from_arrow(again.column(0)).implode())
    return ClusterState(links=links, big=near_dup["big"], changed=changed.to_numpy())


def _state_fits(near_dup: Any, version: str) -> bool:
    """Whether a curate run's recorded cluster state is one this code can update from: made with
    ``version``, a batch -> features version map, and per signal a list of [band, key, size, digest]
    big buckets. Anything else (an older run, a row edited by hand) gives the full computation."""
    if not isinstance(near_dup, dict) or near_dup.get("version") != version:
        return False
    basis, big = near_dup.get("basis"), near_dup.get("big")
    return (isinstance(basis, dict) and all(isinstance(v, str) for v in basis.values()) and isinstance(big, dict)
            and all(isinstance(rows, list) and all(isinstance(r, list) and len(r) == 4
                                                   and all(isinstance(x, int) for x in r[:3]) and isinstance(r[3], str)
                                                   for r in rows) for rows in big.values()))


def curated_without(wh: Warehouse, cfg: CurateConfig, run_id: str, keys: Sequence[str]) -> CuratedTables:
    """The curated tables as ``curate_warehouse`` would make them once the episodes ``keys`` are
    gone, made while they are still stored (their features and clusters only read): a forget
    makes them beside its rewrite of the other layers and swaps both in at once (``swap_curated``).
    The stored features must be current (``features_current``), as the curation's would be."""
    df, leaks = stored_frame(wh)
    gone = set(keys)
    df = df.filter(~pl.col("trajectory_key").is_in(pl.Series(sorted(gone), dtype=pl.String).implode()))
    leaks = [x for x in leaks if x.trajectory_key not in gone]
    return curated_tables(wh, cfg, run_id, df, leaks, _feature_versions(wh), CurateSummary(run_id))


def swap_curated(session: Any, con: Any, curated: CuratedTables, emptied: Sequence[str], started: Any
                 ) -> tuple[set[str], list[Any], list[Any]]:
    """In a forget's swap (``WriteSession.replace_files``' ``then``, through its transaction's
    ``con``): the feature files of the batches ``emptied`` (each episode of theirs forgotten: the
    swap listed empty copies of their files) marked current for their redacted files as they are
    now, as a curation's featurize marks the empty file it would write for such a batch; then the
    curated tables' files swapped for ``curated``'s, with the version and run row the curation
    would give them. Returns (tables touched, files listed, files unlisted)."""
    wh = session.wh
    fv = features_version(curated.cfg)
    sources = batch_fingerprints(wh, _FEATURE_INPUTS, con=con)
    for batch in emptied:
        if batch in sources:  # (else the next featurize drops its features: the batch is gone)
            session.relabel(con, "episode_features", batch, f"{fv};inputs={sources[batch]}")
    version = curated_version(wh, curated.cfg, inputs_fingerprint(wh, ["episode_features"], con=con))
    old = [wh.data / p for (p,) in con.execute("SELECT path FROM table_files WHERE list_contains(?, table_name)",
                                               [list(_MODELS)]).fetchall()]
    added = [f for files in curated.files.values() for f in files]
    touched = session.list_files(con, added, old, run_id=curated.summary.run_id, transform_version=version)
    curated.basis = _feature_versions(wh, con)  # what the next update compares its batches with
    session.upsert_in(con, "runs", [curated.run_row(started, version)])
    return touched | {"episode_features"}, added, old


def _previous_splits(wh: Warehouse) -> dict[str, str]:
    if not wh.manifest_query("SELECT count(*) FROM table_files WHERE table_name = 'splits'").column(0)[0].as_py():
        return {}
    data = wh.query("SELECT trajectory_key, split FROM splits").to_pydict()
    return dict(zip(data["trajectory_key"], data["split"], strict=True))


def curate_warehouse(wh: Warehouse, *, run_id: str, cfg: CurateConfig = CurateConfig(), full: bool = False,
                     lock_timeout: float = 60.0, progress: Callable[[str], None] | None = None) -> CurateSummary:
    """Features per batch (only the batches that changed), then the global steps over the stored
    features of every episode: clusters, groups, splits and leak flags, swapped in one commit."""
    summary = CurateSummary(run_id)
    started = now_utc()
    with wh.write_session("curate", timeout=lock_timeout) as session:
        mark_running(session, run_id, "curate", started)
        summary.batches_featurized, summary.episodes_featurized = _featurize(wh, session, cfg, run_id, full, progress)
        version = curated_version(wh, cfg)
        if not full and is_current(wh, "splits", version):
            summary.skipped = True
            session.upsert_rows("runs", [run_row(run_id, "curate", started, params={"version": version, "skipped": True},
                                                 counts=summary.__dict__, code_version=f"{TRANSFORM}@{CURATE_VERSION}")])
            return summary
        if progress:
            progress("reading stored features")
        df, leaks = stored_frame(wh)
        basis = _feature_versions(wh)
        curated = curated_tables(wh, cfg, run_id, df, leaks, basis, summary, full=full, progress=progress)
        del df
        writer = TableSetWriter(session, _MODELS)
        for table, files in curated.files.items():
            writer.add_written(table, files)
        writer.commit(run_id=run_id, version=version)
        session.upsert_rows("runs", [curated.run_row(started, version)])
    return summary


def curated_version(wh: Warehouse, cfg: CurateConfig, features_fingerprint: str | None = None) -> str:
    """The curated tables' transform version: the configuration's and the fingerprint of every
    ``episode_features`` file (``inputs_fingerprint``; given when the files are about to change)."""
    return f"{cfg.version()};inputs={features_fingerprint or inputs_fingerprint(wh, ['episode_features'])}"


@dataclass
class CuratedTables:
    """A curation's four tables, written as files no manifest lists yet (by table), with what its
    run row records: the summary, and the clusters' state for the next update (``cluster_state``)."""

    files: dict[str, list[Any]]
    summary: CurateSummary
    cfg: CurateConfig
    basis: dict[str, str]  # each batch's features version the clusters were made from
    big: dict[str, list[list[Any]]]

    def run_row(self, started: Any, version: str) -> dict[str, Any]:
        """The curate run's row (its params carry the state the next update starts from)."""
        sp, cfg = self.cfg.splits, self.cfg
        requested = {"fractions": {"train": sp.train, "valid": sp.valid, "test": sp.test},
                     "cutoff": sp.cutoff.isoformat() if sp.cutoff else None, "hold_out_leaks": sp.hold_out_leaks,
                     "max_group_share": cfg.groups.max_group_share, "config_digest": cfg.digest}
        near_dup = {"version": cluster_version(cfg), "basis": self.basis, "big": self.big}
        return run_row(self.summary.run_id, "curate", started,
                       params={"version": version, "requested": requested, "near_dup": near_dup},
                       counts=self.summary.__dict__, code_version=f"{TRANSFORM}@{CURATE_VERSION}")


def curated_tables(wh: Warehouse, cfg: CurateConfig, run_id: str, df: pl.DataFrame, leaks: list[LeakFlag],
                   basis: dict[str, str], summary: CurateSummary, *, full: bool = False,
                   progress: Callable[[str], None] | None = None) -> CuratedTables:
    """The global steps over ``df`` (every episode's stored features, ``stored_frame``) and its leak
    flags: clusters (updated from the stored ones unless ``full``: ``cluster_state`` with the
    batches' features versions ``basis``), groups, splits and leak flags, written as files (not yet
    listed); ``summary`` gains the figures. The stored tables are only read."""
    state = None if full else cluster_state(wh, cfg, df, basis)
    if progress:
        progress("clustering (" + ("updating the last clusters" if state else "in full") + "), grouping, splitting")
    info = ClusterInfo()
    frames = curate_frames(df, leaks, cfg, state, info)
    del state
    summary.clusters_incremental, summary.pairs_verified, summary.links_kept = info.incremental, info.verified, info.kept
    splits = frames["splits"]
    summary.moved = count_moves(_previous_splits(wh), dict(zip(splits["trajectory_key"].to_list(),
                                                               splits["split"].to_list(), strict=True)))
    lineage = _lineage(cfg, run_id)
    # the four tables' files encoded side by side (Parquet writes run outside the GIL; 108,070 episodes:
    # 0.28-0.31 -> 0.20-0.26 s, the same bytes), listed in the tables' order; a table without rows
    # gets an empty file (every table has one)
    with ThreadPoolExecutor(2) as pool:
        tables = [(t, _with_lineage(frame, t, lineage)) for t, frame in frames.items()]
        files = dict(zip([t for t, _ in tables], pool.map(lambda td: [write_table_file(wh, *td)], tables), strict=True))
    clusters, groups = frames["near_dup_clusters"], frames["task_groups"]
    summary.episodes = splits.height
    summary.clusters = clusters["cluster_id"].n_unique()
    summary.duplicates = int((clusters["cluster_size"] > 1).sum())
    summary.groups = groups["group_id"].n_unique()
    summary.largest_group = int(groups["group_size"].max() or 0)
    summary.weak_key_episodes = int(groups["flags"].list.contains("weak_key_dropped").sum())
    summary.held_out = int((splits["split"] == "held_out").sum())
    summary.splits = dict(sorted(splits["split"].value_counts().iter_rows()))
    summary.leaks = frames["leak_flags"].height
    return CuratedTables(files, summary, cfg, basis, info.big)
