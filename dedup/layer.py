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

from dedup.components import components_uf
from dedup.features import EpisodeFeatures, action_shingles, load_features, text_shingles
from dedup.groups import GroupConfig, assign_groups
from dedup.leaks import RULE_VERSION, find_leaks
from dedup.minhash import MinHashParams, lsh_pairs, signatures
from dedup.splits import SPLIT_VERSION, SplitConfig, assign_splits
from lineage.catalog import Warehouse, now_utc
from lineage.rebuild import inputs_fingerprint, is_current, mark_running, replace_tables, run_row
from schemas import ids
from schemas.tables import LeakFlagRow, NearDupClusterRow, SplitRow, TaskGroupRow

TRANSFORM = "curate"
CURATE_VERSION = "2.0.0"  # 2.0: capped weak merges, held-out rules
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


def near_duplicates(features: list[EpisodeFeatures], cfg: CurateConfig = CurateConfig()) -> Clusters:
    """Exact duplicates, near-duplicate action sequences and near-duplicate text, as clusters."""
    keys = [f.key for f in features]
    edges: list[tuple[str, str, str, float]] = []
    exact: dict[str, list[str]] = {}
    for f in features:
        if f.actions or f.text:
            exact.setdefault(ids.digest([f.actions, f.text]), []).append(f.key)
    for group in exact.values():
        edges += [(group[0], k, "exact", 1.0) for k in group[1:]]
    for signal, docs in (
        ("actions", [action_shingles(f.actions, cfg.action_k) if len(f.actions) >= cfg.min_actions else [] for f in features]),
        ("text", [text_shingles(f.text, cfg.text_k) for f in features]),
    ):
        present = [i for i, d in enumerate(docs) if d]  # empty documents are nobody's duplicate
        sigs = signatures([docs[i] for i in present], cfg.minhash)
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


def curate_warehouse(wh: Warehouse, *, run_id: str, cfg: CurateConfig = CurateConfig(), full: bool = False,
                     lock_timeout: float = 60.0, progress: Callable[[str], None] | None = None) -> CurateSummary:
    summary = CurateSummary(run_id)
    started = now_utc()
    with wh.write_session("curate", timeout=lock_timeout) as session:
        mark_running(session, run_id, "curate", started)
        version = f"{cfg.version()};inputs={inputs_fingerprint(wh, ['redacted_episodes', 'redacted_steps'])}"
        if not full and is_current(wh, "splits", version):
            summary.skipped = True
            session.upsert_rows("runs", [run_row(run_id, "curate", started, params={"version": version, "skipped": True},
                                                 counts=summary.__dict__, code_version=f"{TRANSFORM}@{CURATE_VERSION}")])
            return summary
        if progress:
            progress("reading features")
        features = load_features(wh)
        if progress:
            progress("finding leaks")
        leaks = find_leaks(wh)
        if progress:
            progress("clustering, grouping, splitting")
        rows = curate(features, leaks, cfg, run_id)
        replace_tables(session, rows, _MODELS, run_id=run_id, version=version)
        summary.episodes = len(features)
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
