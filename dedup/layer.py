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

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
from trajwh.dedup.components import components_uf
from trajwh.dedup.features import EpisodeFeatures, action_shingles, stream_features, text_shingles
from trajwh.dedup.groups import GroupConfig, assign_groups, patch_symbols
from trajwh.dedup.leaks import RULE_VERSION, LeakFlag, episode_leaks
from trajwh.dedup.minhash import MinHashParams, lsh_pairs, signatures
from trajwh.dedup.splits import SPLIT_VERSION, SplitConfig, assign_splits
from trajwh.lineage.catalog import Warehouse, now_utc, write_table_file
from trajwh.lineage.parallel import PARALLEL_MIN_ITEMS, run_parts, workers_wanted
from trajwh.lineage.rebuild import (
    batch_fingerprints,
    inputs_fingerprint,
    is_current,
    mark_running,
    replace_tables,
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
CURATE_VERSION = "2.1.0"  # 2.0: capped weak merges, held-out rules; 2.1: group id from its first task
TABLES = ("near_dup_clusters", "task_groups", "splits", "leak_flags")


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
    digest, the MinHash signatures of its action and text shingles, the patch's symbols. The
    curate stage stores them per batch (``episode_features``), so a new batch signs only itself."""
    todo = [f for f in features if not f.signed]
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
        for row, i in enumerate(present):
            setattr(todo[i], attr, sigs[row])
    for f in todo:
        f.signed = True


def near_duplicates(features: list[EpisodeFeatures], cfg: CurateConfig = CurateConfig()) -> Clusters:
    """Exact duplicates, near-duplicate action sequences and near-duplicate text, as clusters."""
    sign(features, cfg)
    keys = [f.key for f in features]
    edges: list[tuple[str, str, str, float]] = []
    exact: dict[str, list[str]] = {}
    for f in features:
        if f.exact:
            exact.setdefault(f.exact, []).append(f.key)
    for group in exact.values():
        edges += [(group[0], k, "exact", 1.0) for k in group[1:]]
    for signal, attr in (("actions", "action_sig"), ("text", "text_sig")):
        present = [i for i, f in enumerate(features) if getattr(f, attr) is not None]
        if len(present) < 2:
            continue
        sigs = np.stack([getattr(features[i], attr) for i in present])
        for i, j in lsh_pairs(sigs, cfg.minhash):
            sim = float((sigs[i] == sigs[j]).mean())
            edges.append((keys[present[i]], keys[present[j]], signal, sim))
    label = components_uf(keys, [(a, b) for a, b, _, _ in edges])
    clusters = Clusters({k: "c-" + ids.digest(label[k])[:16] for k in keys})
    for a, b, signal, sim in edges:
        for k in (a, b):
            clusters.linked_by.setdefault(k, set()).add(signal)
            clusters.similarity[k] = max(clusters.similarity.get(k, 0.0), sim)
    return clusters


def _representatives(features: list[EpisodeFeatures], cluster_of: dict[str, str]) -> dict[str, str]:
    far = datetime.max.replace(tzinfo=UTC)
    best: dict[str, tuple[Any, ...]] = {}
    for f in features:
        rank = (0 if f.resolved else 1, f.n_steps, f.started_at or far, f.key)
        c = cluster_of[f.key]
        if c not in best or rank < best[c]:
            best[c] = rank
    return {c: r[-1] for c, r in best.items()}


def curate(features: list[EpisodeFeatures], leaks: list, cfg: CurateConfig, run_id: str) -> dict[str, list[dict]]:
    """All four tables' rows from the features (a pure function: the tests call it directly)."""
    version = cfg.version()
    lineage = {"_run_id": run_id, "_transform": TRANSFORM, "_transform_version": version}
    clusters = near_duplicates(features, cfg)
    size = {}
    for c in clusters.cluster_of.values():
        size[c] = size.get(c, 0) + 1
    reps = _representatives(features, clusters.cluster_of)
    groups = assign_groups(features, cfg.groups, clusters.cluster_of, cutoff=cfg.splits.cutoff)
    gsize = {}
    for g in groups.group_of.values():
        gsize[g] = gsize.get(g, 0) + 1
    leaked: dict[str, list[str]] = {}
    for leak in leaks:
        leaked.setdefault(leak.trajectory_key, []).append(f"{leak.kind}@{leak.step_index}")
    splits = assign_splits(features, groups.group_of, cfg.splits, repository_of=groups.repository_of, leaks=leaked,
                           keys_of=groups.keys_of, cut_keys=groups.cut_keys)
    rows: dict[str, list[dict]] = {t: [] for t in TABLES}
    for f in features:
        c = clusters.cluster_of[f.key]
        rows["near_dup_clusters"].append({
            "trajectory_key": f.key, "cluster_id": c, "cluster_size": size[c], "is_representative": reps[c] == f.key,
            "weight": 1.0 / size[c] if cfg.weight == "inverse_size" else 1.0,
            "linked_by": sorted(clusters.linked_by.get(f.key, set())),
            "max_similarity": clusters.similarity.get(f.key), **lineage})
        g = groups.group_of[f.key]
        rows["task_groups"].append({
            "trajectory_key": f.key, "group_id": g, "group_size": gsize[g], "repository": groups.repository_of[f.key],
            "keys": groups.keys_of[f.key], "flags": groups.flags_of[f.key], **lineage})
    for s in splits:
        rows["splits"].append({"trajectory_key": s.trajectory_key, "group_id": s.group_id,
                               "cluster_id": clusters.cluster_of[s.trajectory_key], "split": s.split, "reason": s.reason,
                               "eligible_for_eval": s.eligible_for_eval, "flags": s.flags, **lineage})
    for leak in leaks:
        rows["leak_flags"].append({"trajectory_key": leak.trajectory_key, "step_id": leak.step_id,
                                   "step_index": leak.step_index, "kind": leak.kind, "evidence": leak.evidence,
                                   "rule_version": RULE_VERSION, **lineage})
    for s in splits:
        for flag in s.flags:
            if flag == "fix_after_cutoff":
                rows["leak_flags"].append({"trajectory_key": s.trajectory_key, "step_id": None, "step_index": None,
                                           "kind": flag, "evidence": "issue created before the cutoff, fix merged after it",
                                           "rule_version": RULE_VERSION, **lineage})
    return rows


_FEATURE_SCHEMA = arrow_schema(EpisodeFeatureRow)
_MODELS = {"near_dup_clusters": NearDupClusterRow, "task_groups": TaskGroupRow, "splits": SplitRow,
           "leak_flags": LeakFlagRow}


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


FEATURES_VERSION = "1.0.0"


def features_version(cfg: CurateConfig) -> str:
    """What a stored ``episode_features`` file was computed with (its batch's inputs are added)."""
    return (f"features@{FEATURES_VERSION};{cfg.minhash.describe()};k={cfg.action_k}/{cfg.text_k};"
            f"min_actions={cfg.min_actions};leaks={RULE_VERSION}")


def _sig_bytes(sig: Any) -> bytes | None:
    return None if sig is None else np.asarray(sig, dtype="<u4").tobytes()


def feature_row(f: EpisodeFeatures, leaks: list[LeakFlag], lineage: dict[str, Any]) -> dict[str, Any]:
    return {"trajectory_key": f.key, "repository": f.repository, "base_commit": f.base_commit,
            "base_commit_at": f.base_commit_at, "task_id": f.task_id, "instance_id": f.instance_id,
            "failing_tests": f.failing_tests, "touched_files": f.touched_files, "patch_symbols": f.symbols or [],
            "issue_created_at": f.issue_created_at, "fix_merged_at": f.fix_merged_at, "started_at": f.started_at,
            "resolved": f.resolved, "n_steps": f.n_steps, "exact_digest": f.exact,
            "action_signature": _sig_bytes(f.action_sig), "text_signature": _sig_bytes(f.text_sig),
            "leaks": orjson.dumps([[x.step_id, x.step_index, x.kind, x.evidence] for x in leaks]).decode()
            if leaks else None, **lineage}


def stored_features(wh: Warehouse) -> tuple[list[EpisodeFeatures], list[LeakFlag]]:
    """Every episode's stored features (signed, without text) and leak flags, by trajectory key."""
    features: list[EpisodeFeatures] = []
    leaks: list[LeakFlag] = []
    for rb in wh.stream("SELECT * EXCLUDE (_batch_id, _run_id, _transform, _transform_version) "
                        "FROM episode_features ORDER BY trajectory_key", batch_rows=5_000, arrow=True):
        # column by column: a dict per row cost 2.5 of the 4.3 s at 107,000 episodes
        c = {name: rb.column(name).to_pylist() for name in rb.schema.names}
        for (key, repository, base_commit, base_commit_at, task_id, instance_id, failing_tests, touched_files,
             issue_created_at, fix_merged_at, started_at, resolved, n_steps, symbols, exact, action_sig, text_sig,
             leak_json) in zip(
                c["trajectory_key"], c["repository"], c["base_commit"], c["base_commit_at"], c["task_id"],
                c["instance_id"], c["failing_tests"], c["touched_files"], c["issue_created_at"], c["fix_merged_at"],
                c["started_at"], c["resolved"], c["n_steps"], c["patch_symbols"], c["exact_digest"],
                c["action_signature"], c["text_signature"], c["leaks"], strict=True):
            f = EpisodeFeatures(
                key, repository=repository, base_commit=base_commit, base_commit_at=base_commit_at, task_id=task_id,
                instance_id=instance_id, failing_tests=failing_tests, touched_files=touched_files,
                issue_created_at=issue_created_at, fix_merged_at=fix_merged_at, started_at=started_at,
                resolved=resolved, n_steps=n_steps, symbols=symbols, exact=exact, signed=True)
            if action_sig is not None:
                f.action_sig = np.frombuffer(action_sig, dtype="<u4")
            if text_sig is not None:
                f.text_sig = np.frombuffer(text_sig, dtype="<u4")
            features.append(f)
            if leak_json:
                leaks += [LeakFlag(key, *x) for x in orjson.loads(leak_json)]
    return features, leaks


def _feature_files(wh: Warehouse, batch_id: str, lineage: dict[str, Any], cfg: CurateConfig,
                   part: tuple[int, int] | None = None, chunk: int = 2_000) -> tuple[list[Any], int]:
    """The features of a batch's episodes (of one ``part``), signed, written a file per ``chunk``
    episodes (not yet visible: the session commits them), so memory holds one chunk; and how
    many episodes."""
    files: list[Any] = []
    pending: list[tuple[EpisodeFeatures, list[LeakFlag]]] = []
    episodes = 0

    def write() -> None:
        sign([f for f, _ in pending], cfg)
        rows = [feature_row(f, lk, lineage) for f, lk in pending]
        files.append(write_table_file(wh, "episode_features", pa.Table.from_pylist(rows, schema=_FEATURE_SCHEMA)))
        pending.clear()

    for f, steps in stream_features(wh, batch_id, part):
        pending.append((f, episode_leaks(f.key, steps)))
        episodes += 1
        if len(pending) >= chunk:
            write()
    if pending or not files:
        write()
    return files, episodes


def _feature_part(t: dict[str, Any]) -> tuple[list[Any], int]:
    """The feature files of one part of a batch (in the build's process or a worker)."""
    return _feature_files(Warehouse(t["root"]), t["batch_id"], t["lineage"], t["cfg"], t["part"])


def _batch_features(wh: Warehouse, batch_id: str, lineage: dict[str, Any], cfg: CurateConfig,
                    n_episodes: int) -> tuple[list[Any], int]:
    """A batch's feature files: a big batch in parts (episodes by the hash of their key), this
    process and worker processes one each, reading the warehouse itself (per-batch work on every core, as
    normalize and redact); the same rows either way."""
    n = min(workers_wanted(), 8) if n_episodes >= PARALLEL_MIN_ITEMS else 1
    if n == 1:
        return _feature_files(wh, batch_id, lineage, cfg)
    tasks = [{"root": str(wh.root), "batch_id": batch_id, "lineage": lineage, "cfg": cfg, "part": (i, n)}
             for i in range(n)]
    files: list[Any] = []
    episodes = 0
    for written, count in run_parts(_feature_part, tasks):
        files += written
        episodes += count
    return files, episodes


def _featurize(wh: Warehouse, session: Any, cfg: CurateConfig, run_id: str, full: bool,
               progress: Callable[[str], None] | None) -> tuple[int, int]:
    """Compute and store ``episode_features`` for every redacted batch that is new or changed
    since its features were stored (all with ``full``); drop those of batches that are gone.
    Streams each batch's episodes in key order and writes a file per ``chunk`` episodes, so
    memory holds one chunk. Returns (batches featurized, episodes)."""
    fv = features_version(cfg)
    sources = batch_fingerprints(wh, ["redacted_episodes", "redacted_steps"])
    built = {r["batch_id"]: r["v"] for r in wh.query(
        "SELECT batch_id, any_value(transform_version) AS v FROM table_files WHERE table_name = 'episode_features' "
        "GROUP BY batch_id").to_pylist()}
    gone = [b for b in built if b not in sources]
    if gone:
        session.commit(removed=[wh.root / p for p in wh.query(
            "SELECT path FROM table_files WHERE table_name = 'episode_features' AND list_contains(?, batch_id)",
            [gone]).column(0).to_pylist()], run_id=run_id)
    done = episodes = 0
    sizes = {r["batch_id"]: r["n"] for r in wh.manifest_query(
        "SELECT batch_id, sum(rows) AS n FROM table_files WHERE table_name = 'redacted_episodes' GROUP BY 1").to_pylist()}
    for batch_id, src in sorted(sources.items()):
        version = f"{fv};inputs={src}"
        if not full and built.get(batch_id) == version:
            continue
        if progress:
            progress(f"features of batch {batch_id}")
        lineage = {"_batch_id": batch_id, "_run_id": run_id, "_transform": "features", "_transform_version": version}
        files, n = _batch_features(wh, batch_id, lineage, cfg, sizes.get(batch_id, 0))
        episodes += n
        old = [wh.root / p for p in wh.query("SELECT path FROM table_files WHERE table_name = 'episode_features' "
                                            "AND batch_id = ?", [batch_id]).column(0).to_pylist()]
        session.commit(files, removed=old, batch_id=batch_id, run_id=run_id, transform_version=version)
        done += 1
    return done, episodes


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
        version = f"{cfg.version()};inputs={inputs_fingerprint(wh, ['episode_features'])}"
        if not full and is_current(wh, "splits", version):
            summary.skipped = True
            session.upsert_rows("runs", [run_row(run_id, "curate", started, params={"version": version, "skipped": True},
                                                 counts=summary.__dict__, code_version=f"{TRANSFORM}@{CURATE_VERSION}")])
            return summary
        if progress:
            progress("reading stored features")
        features, leaks = stored_features(wh)
        if progress:
            progress("clustering, grouping, splitting")
        rows = curate(features, leaks, cfg, run_id)
        del features
        summary.moved = count_moves(_previous_splits(wh), {r["trajectory_key"]: r["split"] for r in rows["splits"]})
        replace_tables(session, rows, _MODELS, run_id=run_id, version=version)
        summary.episodes = len(rows["splits"])
        summary.clusters = len({r["cluster_id"] for r in rows["near_dup_clusters"]})
        summary.duplicates = sum(1 for r in rows["near_dup_clusters"] if r["cluster_size"] > 1)
        summary.groups = len({r["group_id"] for r in rows["task_groups"]})
        summary.largest_group = max((r["group_size"] for r in rows["task_groups"]), default=0)
        summary.weak_key_episodes = sum("weak_key_dropped" in r["flags"] for r in rows["task_groups"])
        summary.held_out = sum(r["split"] == "held_out" for r in rows["splits"])
        for r in rows["splits"]:
            summary.splits[r["split"]] = summary.splits.get(r["split"], 0) + 1
        summary.leaks = len(rows["leak_flags"])
        sp = cfg.splits
        requested = {"fractions": {"train": sp.train, "valid": sp.valid, "test": sp.test},
                     "cutoff": sp.cutoff.isoformat() if sp.cutoff else None, "hold_out_leaks": sp.hold_out_leaks,
                     "max_group_share": cfg.groups.max_group_share, "config_digest": cfg.digest}
        session.upsert_rows("runs", [run_row(run_id, "curate", started, params={"version": version, "requested": requested},
                                             counts=summary.__dict__, code_version=f"{TRANSFORM}@{CURATE_VERSION}")])
    return summary
