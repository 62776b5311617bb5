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

import polars as pl
from trajwh.dedup.features import EpisodeFeatures
from trajwh.dedup.frame import feature_frame, nonblank

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


def _group_split(gid: str, cfg: SplitConfig, eligible: bool, missing: bool) -> tuple[str, str, bool]:
    """Rule 1 for one group: ``eligible`` when every episode's issue and generation are after the
    cutoff, ``missing`` when an episode lacks either time."""
    u = unit_hash(f"{cfg.salt}:{gid}")
    if cfg.cutoff is None:
        split = "train" if u < cfg.train else "valid" if u < cfg.train + cfg.valid else "test"
        return split, f"hash {u:.4f} by fractions {cfg.train}/{cfg.valid}/{cfg.test}", True
    if eligible and cfg.valid + cfg.test > 0:
        share = cfg.valid / (cfg.valid + cfg.test)
        return ("valid" if u < share else "test"), f"issue and generation after cutoff {cfg.cutoff.date()}; hash {u:.4f}", True
    reason = ("no usable times: not eligible for evaluation" if missing else
              f"issue or generation on/before cutoff {cfg.cutoff.date()}")
    return "train", reason, eligible


_FLAGS = pl.List(pl.String)


def _hold_out(rows: pl.DataFrame, which: pl.DataFrame, reason: pl.Expr, flag: str) -> pl.DataFrame:
    """``rows`` with the episodes of ``which`` (trajectory_key and what ``reason`` reads) held out."""
    which = which.select("trajectory_key", reason.alias("_reason"), pl.lit(True).alias("_out"))
    return (rows.join(which, on="trajectory_key", how="left", maintain_order="left")
            .with_columns(pl.when("_out").then(pl.lit(HELD_OUT)).otherwise("split").alias("split"),
                          pl.when("_out").then("_reason").otherwise("reason").alias("reason"),
                          pl.when("_out").then(pl.col("flags").list.concat(pl.lit([flag], dtype=_FLAGS)))
                          .otherwise("flags").alias("flags"))
            .drop("_reason", "_out"))


def split_frame(df: pl.DataFrame, cfg: SplitConfig = SplitConfig(), leaks: dict[str, list[str]] | None = None,
                cut_keys: set[str] | None = None) -> pl.DataFrame:
    """One row per episode (trajectory_key, group_id, split, reason, eligible_for_eval, flags),
    by group id then key. ``df``: a ``dedup.frame`` with the group's columns (group_id,
    repository: normalized, for rule 5; keys: grouping keys, for rule 4); ``leaks``: leak
    evidence per trajectory key (rule 3); ``cut_keys``: the weak keys left spanning groups."""
    cfg.validate()
    leaks, cut_keys = leaks or {}, cut_keys or set()
    c = cfg.cutoff
    issue, started = pl.col("issue_created_at"), pl.col("started_at")
    after = issue.is_not_null() & (issue > c) if c is not None else pl.lit(False)
    per_group = df.group_by("group_id").agg(
        ((issue > c) & (started > c)).fill_null(False).all().alias("eligible") if c is not None else pl.lit(True).alias("eligible"),
        (issue.is_null() | started.is_null()).any().alias("missing"),
        after.any().alias("any_after"), after.all().alias("all_after"))
    decided = [(gid, *_group_split(gid, cfg, eligible, missing), any_after and not all_after)
               for gid, eligible, missing, any_after, all_after in per_group.iter_rows()]
    groups = pl.DataFrame(decided, schema={"group_id": pl.String, "split": pl.String, "reason": pl.String,
                                           "eligible_for_eval": pl.Boolean, "mixed": pl.Boolean}, orient="row")
    groups = groups.with_columns((pl.col("mixed") & (pl.col("split") == "train") & pl.lit(c is not None)).alias("mixed"))
    flag_exprs = []
    if c is not None:
        flag_exprs = [pl.when(issue.is_not_null() & (issue <= c) & pl.col("fix_merged_at").is_not_null()
                              & (pl.col("fix_merged_at") > c)).then(pl.lit(["fix_after_cutoff"], dtype=_FLAGS))
                      .otherwise(pl.lit([], dtype=_FLAGS)),
                      pl.when(issue.is_null() | started.is_null()).then(pl.lit(["no_usable_times"], dtype=_FLAGS))
                      .otherwise(pl.lit([], dtype=_FLAGS))]
    rows = (df.join(groups, on="group_id", how="left", maintain_order="left")
            .with_columns((pl.concat_list(flag_exprs) if flag_exprs else pl.lit([], dtype=_FLAGS)).alias("flags"),
                          after.alias("after")))
    # rule 2: post-cutoff tasks of a mixed group
    if c is not None:
        rows = _hold_out(rows, rows.filter(pl.col("mixed") & pl.col("after")), pl.lit(
            f"held out: post-cutoff task in a group that also holds tasks from on/before cutoff {c.date()} (mixed group)"),
            "mixed_group_post_cutoff")
    # rule 3: leak-flagged episodes never enter an evaluation split
    if cfg.hold_out_leaks and leaks:
        evidence = pl.DataFrame({"trajectory_key": list(leaks), "evidence": [", ".join(sorted(v)) for v in leaks.values()]},
                                schema={"trajectory_key": pl.String, "evidence": pl.String}).filter(pl.col("evidence") != "")
        leaked = (rows.filter(pl.col("split").is_in(EVAL_SPLITS) & ~(pl.col("mixed") & pl.col("after")))
                  .join(evidence, on="trajectory_key"))
        rows = _hold_out(rows, leaked, pl.format("held out of {}: leak flag {}", "split", "evidence"), "leak_held_out")
    rows = _hold_out_weak_links(rows, cut_keys)
    rows = _hold_out_future_states(rows)
    return rows.sort(["group_id", "trajectory_key"]).select(
        "trajectory_key", "group_id", "split", "reason", "eligible_for_eval", "flags")


def assign_splits(features: list[EpisodeFeatures], group_of: dict[str, str], cfg: SplitConfig = SplitConfig(),
                  *, repository_of: dict[str, str | None] | None = None,
                  leaks: dict[str, list[str]] | None = None, keys_of: dict[str, list[str]] | None = None,
                  cut_keys: set[str] | None = None) -> list[SplitRow]:
    """``split_frame`` of a list of features. ``repository_of``: normalized repository per
    trajectory key (rule 5); ``leaks``: leak evidence per trajectory key (rule 3); ``keys_of`` and
    ``cut_keys``: grouping keys per episode and the weak keys left spanning groups (rule 4)."""
    repository_of, keys_of = repository_of or {}, keys_of or {}
    df = feature_frame(features)
    keys = df["trajectory_key"].to_list()
    df = df.with_columns(pl.Series("group_id", [group_of[k] for k in keys], dtype=pl.String),
                         pl.Series("repository", [repository_of.get(k) for k in keys], dtype=pl.String),
                         pl.Series("keys", [keys_of.get(k, []) for k in keys], dtype=_FLAGS))
    return [SplitRow(*r) for r in split_frame(df, cfg, leaks, cut_keys).iter_rows()]


def _hold_out_weak_links(rows: pl.DataFrame, cut_keys: set[str]) -> pl.DataFrame:
    """Rule 4: a train episode holding a cut key that an evaluation episode also holds, unless
    the train episode's repository state predates that evaluation task's issue (it cannot have
    seen the task: a shared file or test is not a leak then). A near-duplicate cluster is
    contamination whatever the times: always held out."""
    if not cut_keys:
        return rows
    cut = pl.Series(list(cut_keys), dtype=pl.String).implode()
    held = rows.select("trajectory_key", "split", "keys", "issue_created_at",
                       pl.coalesce("base_commit_at", "issue_created_at").alias("state")).explode("keys") \
        .filter(pl.col("keys").is_in(cut))
    # per cut key held in evaluation: the earliest issue (unknown if any is) and the first episode
    in_eval = (held.filter(pl.col("split").is_in(EVAL_SPLITS)).group_by("keys")
               .agg(pl.when(pl.col("issue_created_at").is_null().any()).then(None)
                    .otherwise(pl.col("issue_created_at").min()).alias("issued"),
                    pl.col("trajectory_key").min().alias("eval_key")))
    shared = (held.filter(pl.col("split") == "train").join(in_eval, on="keys")
              .filter(pl.col("keys").str.starts_with("cluster:") | pl.col("issued").is_null() | pl.col("state").is_null()
                      | (pl.col("state") >= pl.col("issued")))
              .sort(["trajectory_key", "keys"]).group_by("trajectory_key").first())
    return _hold_out(rows, shared, pl.format("held out of train: shares {} with evaluation episode {}", "keys",
                                             pl.col("eval_key").str.slice(0, 12)), "weak_link_to_eval")


def _hold_out_future_states(rows: pl.DataFrame) -> pl.DataFrame:
    """Rule 5: a train episode whose repository state is later than the earliest fix of an
    evaluation task of the same repository is held out."""
    repo_ok = pl.col("repository").fill_null("") != ""
    fixes = (rows.filter(pl.col("split").is_in(EVAL_SPLITS) & repo_ok)
             .select("repository", pl.coalesce("fix_merged_at", "issue_created_at").alias("fixed_at"),
                     pl.coalesce(nonblank("instance_id"), nonblank("task_id"), "trajectory_key").alias("task"))
             .drop_nulls("fixed_at").sort(["repository", "fixed_at", "task"]).group_by("repository").first())
    late = (rows.filter((pl.col("split") == "train") & repo_ok).join(fixes, on="repository")
            .with_columns(pl.coalesce("base_commit_at", "issue_created_at").alias("state"))
            .filter(pl.col("state") > pl.col("fixed_at")))
    return _hold_out(rows, late, pl.format("held out of train: repository state {} is later than the fix of evaluation "
                                           "task {} ({}) of {}", pl.col("state").dt.date(), "task",
                                           pl.col("fixed_at").dt.date(), "repository"), "state_after_eval_fix")
