"""Leak-free, time-aware train / valid / test assignment of groups, and the episodes held out.

Rules, in order (each episode's ``reason`` says which one decided; docs/dedup.md):

1. Group level. With a cutoff, evaluation holds only groups all of whose episodes have an issue
   created after the cutoff *and* were generated after it; a hash of the group id decides valid vs
   test by the configured fractions (deterministic, input order never matters). Every other group
   goes to train. Without a cutoff the group hash alone decides, by the fractions.
2. Mixed groups. A train group that also holds tasks from after the cutoff (issue created after
   it) keeps its pre-cutoff members in train; its post-cutoff members are **held out**: they are
   the evaluation period's tasks and are trained on by no one.
3. Leaks act. An episode whose agent saw the future (a leak flag) never enters an evaluation
   split: it is held out (``SplitConfig.hold_out_leaks``).
4. Weak links. Groups merge through weak keys only up to a size (``dedup.groups``); a weak key
   left spanning groups (a *cut* key: a shared file, test, symbol or near-duplicate cluster) must
   not join train to evaluation either: a train episode that holds a cut key also held by an
   evaluation episode is held out (``weak_link_to_eval``), unless its repository state predates
   the evaluation task's issue (it cannot have seen that task; with a cutoff this is the common
   case). A shared near-duplicate cluster is held out whatever the times (contamination).
5. Repository state. No train episode may work on a repository state (base commit time, else
   issue time) later than the fix of any evaluation task of the same repository (fix merge time,
   else the issue time as the earliest the fix can be): such a state may already contain the
   fix. Those train episodes are held out, with the evaluation task named in the reason.

``held_out`` episodes are in no split a trainer or an evaluator reads; the audit counts them by
reason. Episodes with no usable times are not eligible for evaluation (flag ``no_usable_times``);
a task whose issue predates the cutoff but whose fix merged after it is flagged
``fix_after_cutoff``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import UTC, datetime

from trajwh.dedup.features import EpisodeFeatures

SPLIT_VERSION = "2.0.1"  # 2.0: mixed groups, leak flags, weak links and repository state hold episodes out; 2.0.1: a weak link's reason names the evaluation episode
EVAL_SPLITS = ("valid", "test")
HELD_OUT = "held_out"


@dataclass(frozen=True)
class SplitConfig:
    train: float = 0.8
    valid: float = 0.1
    test: float = 0.1
    cutoff: datetime | None = datetime(2025, 6, 1, tzinfo=UTC)
    salt: str = "trajwh-splits-v1"
    hold_out_leaks: bool = True  # leak-flagged episodes never enter an evaluation split

    def validate(self) -> None:
        from trajwh.schemas.errors import ConfigError

        total = self.train + self.valid + self.test
        if min(self.train, self.valid, self.test) < 0 or abs(total - 1) > 1e-9:
            raise ConfigError(f"split fractions {self.train}/{self.valid}/{self.test} do not sum to 1",
                              valid="three non-negative fractions that sum to 1, e.g. 0.8/0.1/0.1")


def unit_hash(text: str) -> float:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2**64


@dataclass
class SplitRow:
    trajectory_key: str
    group_id: str
    split: str
    reason: str
    eligible_for_eval: bool
    flags: list[str]


def state_time(f: EpisodeFeatures) -> datetime | None:
    """When the repository state the agent worked on was made: base commit time, else issue time."""
    return f.base_commit_at or f.issue_created_at


def fix_time(f: EpisodeFeatures) -> datetime | None:
    """When the task's fix entered the repository: merge time, else the issue time (the earliest
    the fix can be, so an unknown merge time errs on the side of holding train episodes out)."""
    return f.fix_merged_at or f.issue_created_at


def _after_cutoff(f: EpisodeFeatures, cutoff: datetime) -> bool:
    return f.issue_created_at is not None and f.issue_created_at > cutoff


def _group_split(eps: list[EpisodeFeatures], gid: str, cfg: SplitConfig) -> tuple[str, str, bool]:
    u = unit_hash(f"{cfg.salt}:{gid}")
    if cfg.cutoff is None:
        split = "train" if u < cfg.train else "valid" if u < cfg.train + cfg.valid else "test"
        return split, f"hash {u:.4f} by fractions {cfg.train}/{cfg.valid}/{cfg.test}", True
    eligible = all(f.issue_created_at and f.started_at and f.issue_created_at > cfg.cutoff
                   and f.started_at > cfg.cutoff for f in eps)
    if eligible and cfg.valid + cfg.test > 0:
        share = cfg.valid / (cfg.valid + cfg.test)
        return ("valid" if u < share else "test"), f"issue and generation after cutoff {cfg.cutoff.date()}; hash {u:.4f}", True
    missing = any(f.issue_created_at is None or f.started_at is None for f in eps)
    reason = ("no usable times: not eligible for evaluation" if missing else
              f"issue or generation on/before cutoff {cfg.cutoff.date()}")
    return "train", reason, eligible


def assign_splits(features: list[EpisodeFeatures], group_of: dict[str, str], cfg: SplitConfig = SplitConfig(),
                  *, repository_of: dict[str, str | None] | None = None,
                  leaks: dict[str, list[str]] | None = None, keys_of: dict[str, list[str]] | None = None,
                  cut_keys: set[str] | None = None) -> list[SplitRow]:
    """One row per episode. ``repository_of``: normalized repository per trajectory key (rule 5);
    ``leaks``: leak evidence per trajectory key (rule 3); ``keys_of`` and ``cut_keys``: grouping
    keys per episode and the weak keys left spanning groups (rule 4)."""
    cfg.validate()
    repository_of, leaks = repository_of or {}, leaks or {}
    members: dict[str, list[EpisodeFeatures]] = {}
    for f in features:
        members.setdefault(group_of[f.key], []).append(f)
    rows: dict[str, SplitRow] = {}
    feats = {f.key: f for f in features}
    for gid in sorted(members):
        eps = members[gid]
        split, reason, eligible = _group_split(eps, gid, cfg)
        mixed = (cfg.cutoff is not None and split == "train" and any(_after_cutoff(f, cfg.cutoff) for f in eps)
                 and not all(_after_cutoff(f, cfg.cutoff) for f in eps))
        for f in eps:
            flags = []
            if cfg.cutoff and f.issue_created_at and f.issue_created_at <= cfg.cutoff and f.fix_merged_at \
                    and f.fix_merged_at > cfg.cutoff:
                flags.append("fix_after_cutoff")
            if cfg.cutoff and (f.issue_created_at is None or f.started_at is None):
                flags.append("no_usable_times")
            row = SplitRow(f.key, gid, split, reason, eligible, flags)
            if mixed and _after_cutoff(f, cfg.cutoff):
                row.split, row.reason = HELD_OUT, (f"held out: post-cutoff task in a group that also holds tasks from "
                                                   f"on/before cutoff {cfg.cutoff.date()} (mixed group)")
                row.flags.append("mixed_group_post_cutoff")
            elif split in EVAL_SPLITS and cfg.hold_out_leaks and leaks.get(f.key):
                row.split, row.reason = HELD_OUT, f"held out of {split}: leak flag {', '.join(sorted(leaks[f.key]))}"
                row.flags.append("leak_held_out")
            rows[f.key] = row
    _hold_out_weak_links(rows, feats, keys_of or {}, cut_keys or set())
    _hold_out_future_states(rows, feats, repository_of)
    return [rows[k] for k in sorted(rows, key=lambda k: (rows[k].group_id, k))]


def _hold_out_weak_links(rows: dict[str, SplitRow], feats: dict[str, EpisodeFeatures], keys_of: dict[str, list[str]],
                         cut_keys: set[str]) -> None:
    """Rule 4: a train episode holding a cut key that an evaluation episode also holds, unless
    the train episode's repository state predates that evaluation task's issue (it cannot have
    seen the task: a shared file or test is not a leak then). A near-duplicate cluster is
    contamination whatever the times: always held out."""
    in_eval: dict[str, tuple[datetime | None, str]] = {}  # key -> (earliest issue, None if unknown; episode)
    for key, row in sorted(rows.items()):
        if row.split not in EVAL_SPLITS:
            continue
        issued = feats[key].issue_created_at
        for k in keys_of.get(key, []):
            if k in cut_keys:
                known = in_eval.get(k, (issued, key))
                earliest = None if known[0] is None or issued is None else min(known[0], issued)
                in_eval[k] = (earliest, known[1])

    def leaks(train_key: str, k: str) -> bool:
        issued, state = in_eval[k][0], state_time(feats[train_key])
        return k.startswith("cluster:") or issued is None or state is None or state >= issued

    for key, row in rows.items():
        if row.split != "train":
            continue
        shared = sorted(k for k in keys_of.get(key, []) if k in in_eval and leaks(key, k))
        if shared:
            row.split = HELD_OUT
            row.reason = f"held out of train: shares {shared[0]} with evaluation episode {in_eval[shared[0]][1][:12]}"
            row.flags.append("weak_link_to_eval")


def _hold_out_future_states(rows: dict[str, SplitRow], feats: dict[str, EpisodeFeatures],
                            repository_of: dict[str, str | None]) -> None:
    """Rule 5: a train episode whose repository state is later than the earliest fix of an
    evaluation task of the same repository is held out."""
    earliest: dict[str, tuple[datetime, str]] = {}
    for key, row in rows.items():
        repo, f = repository_of.get(key), feats[key]
        t = fix_time(f)
        if row.split in EVAL_SPLITS and repo and t is not None:
            task = f.instance_id or f.task_id or key
            if repo not in earliest or (t, task) < earliest[repo]:
                earliest[repo] = (t, task)
    for key, row in rows.items():
        repo = repository_of.get(key)
        if row.split != "train" or repo not in earliest:
            continue
        t = state_time(feats[key])
        fixed_at, task = earliest[repo]
        if t is not None and t > fixed_at:
            row.split = HELD_OUT
            row.reason = (f"held out of train: repository state {t.date()} is later than the fix of evaluation task "
                          f"{task} ({fixed_at.date()}) of {repo}")
            row.flags.append("state_after_eval_fix")
