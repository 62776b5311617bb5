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

The rules run as one relational plan (``split_frame``): the aggregates per group and rules 2 to 5
are SQL that DuckDB and Daft both run (``dedup.engines``, the engine the curate step is given), so
the joins over every episode and its grouping keys go where the near-duplicate graph goes; rule 1's
draw per group and the reasons' words are made in this process. Both engines give the same rows
(``tests/test_dedup.py``).

``held_out`` episodes are in no split a trainer or an evaluator reads; the audit counts them by
reason. Episodes with no usable times are not eligible for evaluation (flag ``no_usable_times``);
a task whose issue predates the cutoff but whose fix merged after it is flagged
``fix_after_cutoff``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import polars as pl
import pyarrow as pa
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


def assign_splits(features: list[EpisodeFeatures], group_of: dict[str, str], cfg: SplitConfig = SplitConfig(),
                  *, repository_of: dict[str, str | None] | None = None,
                  leaks: dict[str, list[str]] | None = None, keys_of: dict[str, list[str]] | None = None,
                  cut_keys: set[str] | None = None, engine: str | None = None) -> list[SplitRow]:
    """``split_frame`` of a list of features. ``repository_of``: normalized repository per
    trajectory key (rule 5); ``leaks``: leak evidence per trajectory key (rule 3); ``keys_of`` and
    ``cut_keys``: grouping keys per episode and the weak keys left spanning groups (rule 4);
    ``engine``: what runs the plan (``dedup.engines``)."""
    repository_of, keys_of = repository_of or {}, keys_of or {}
    df = feature_frame(features)
    keys = df["trajectory_key"].to_list()
    df = df.with_columns(pl.Series("group_id", [group_of[k] for k in keys], dtype=pl.String),
                         pl.Series("repository", [repository_of.get(k) for k in keys], dtype=pl.String),
                         pl.Series("keys", [keys_of.get(k, []) for k in keys], dtype=_FLAGS))
    return [SplitRow(*r) for r in split_frame(df, cfg, leaks, cut_keys, engine).iter_rows()]




# ---- the split rules as one relational plan (``dedup.engines``: DuckDB or Daft run the same text) ----
# Times are microseconds since the epoch (integers: both engines compare them alike, where their
# timestamp literals and casts differ); a rule's reason is written from the fields it returns.
# Daft reads ``t.c`` as a struct field: every joined column is named apart.
_PER_GROUP_SQL = """SELECT group_id AS pg,
  min(CASE WHEN {eligible} THEN 1 ELSE 0 END) AS eligible,
  max(CASE WHEN issue IS NULL OR started IS NULL THEN 1 ELSE 0 END) AS missing,
  max(CASE WHEN {after} THEN 1 ELSE 0 END) AS any_after,
  min(CASE WHEN {after} THEN 1 ELSE 0 END) AS all_after
FROM ep GROUP BY group_id"""
# rules 2 (a mixed group's post-cutoff tasks) and 3 (leak flags keep an episode out of evaluation)
_RULES_2_3_SQL = """SELECT trajectory_key, group_id, issue, base_at, fix_at, repository, task, gsplit, greason,
  eligible_for_eval, evidence,
  CASE WHEN mixed AND {after} THEN 2 WHEN gsplit IN ('valid', 'test') AND evidence IS NOT NULL THEN 3 ELSE 0 END AS rule
FROM ep JOIN grp ON group_id = gg LEFT JOIN lk ON trajectory_key = lk_key"""
_SPLIT_SO_FAR = "CASE WHEN rule > 0 THEN 'held_out' ELSE gsplit END"
# rule 4: a train episode holding a cut key that an evaluation episode holds too
_CUT_HELD_SQL = """SELECT DISTINCT hk, {split} AS hsplit, issue AS hissue, coalesce(base_at, issue) AS hstate, key
FROM (SELECT trajectory_key AS hk, unnest(keys) AS key FROM ep) JOIN cut ON key = ck JOIN a ON hk = trajectory_key"""
_CUT_EVAL_SQL = """SELECT key AS ek, min(hissue) AS issued, count(*) - count(hissue) AS unknown, min(hk) AS eval_key
FROM held WHERE hsplit IN ('valid', 'test') GROUP BY key"""
_CUT_SHARED_SQL = """SELECT hk AS sk, key AS skey, eval_key FROM held JOIN ev ON key = ek
WHERE hsplit = 'train' AND (starts_with(key, 'cluster:') OR unknown > 0 OR issued IS NULL OR hstate IS NULL
                            OR hstate >= issued)"""
_CUT_FIRST_SQL = """SELECT sk AS tk4, skey AS key4, eval_key AS eval_key4 FROM shared
JOIN (SELECT sk AS fk, min(skey) AS fkey FROM shared GROUP BY sk) ON sk = fk AND skey = fkey"""
_RULE_4_SQL = """SELECT trajectory_key, group_id, issue, base_at, fix_at, repository, task, gsplit, greason,
  eligible_for_eval, evidence, key4, eval_key4, CASE WHEN rule = 0 AND tk4 IS NOT NULL THEN 4 ELSE rule END AS rule
FROM a LEFT JOIN r4 ON trajectory_key = tk4"""
# rule 5: a train episode whose repository state is later than the first fix of an evaluation task
# of its repository (the earliest fix, then the smallest task)
_FIXES_SQL = """SELECT repository AS fr, coalesce(fix_at, issue) AS fixed_at, task AS ftask FROM b
WHERE {split} IN ('valid', 'test') AND repository IS NOT NULL AND coalesce(fix_at, issue) IS NOT NULL"""
_FIRST_FIX_SQL = """SELECT fr AS xr, fixed_at AS xfix, min(ftask) AS xtask FROM fixes
JOIN (SELECT fr AS mr, min(fixed_at) AS mfix FROM fixes GROUP BY fr) ON fr = mr AND fixed_at = mfix
GROUP BY fr, fixed_at"""
_RULE_5_SQL = """SELECT trajectory_key, group_id, gsplit, greason, eligible_for_eval, evidence, key4, eval_key4,
  CASE WHEN rule = 0 AND xr IS NOT NULL AND {split} = 'train' AND coalesce(base_at, issue) > xfix THEN 5 ELSE rule END
    AS rule,
  xfix, xtask, coalesce(base_at, issue) AS state5, repository
FROM b LEFT JOIN fix ON repository = xr"""

_RULE_FLAGS = {2: "mixed_group_post_cutoff", 3: "leak_held_out", 4: "weak_link_to_eval", 5: "state_after_eval_fix"}
def split_frame(df: pl.DataFrame, cfg: SplitConfig = SplitConfig(), leaks: dict[str, list[str]] | None = None,
                cut_keys: set[str] | None = None, engine: str | None = None) -> pl.DataFrame:
    """One row per episode (trajectory_key, group_id, split, reason, eligible_for_eval, flags),
    by group id then key. ``df``: a ``dedup.frame`` with the group's columns (group_id,
    repository: normalized, for rule 5; keys: grouping keys, for rule 4); ``leaks``: leak
    evidence per trajectory key (rule 3); ``cut_keys``: the weak keys left spanning groups.
    ``engine`` (``dedup.engines``) runs the plan: the aggregates per group, then rules 2 to 5 as
    joins; rule 1's draw per group (a salted hash of its id) and the reasons' text are made here."""
    from trajwh.dedup.engines import engine as make_engine

    cfg.validate()
    leaks, cut_keys = leaks or {}, cut_keys or set()
    c = cfg.cutoff
    cut_us = None if c is None else (c - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1)
    after = "1 = 0" if cut_us is None else f"issue > {cut_us}"
    eligible = "1 = 1" if cut_us is None else f"issue > {cut_us} AND started > {cut_us}"
    ep = df.select(
        "trajectory_key", "group_id", pl.col("issue_created_at").dt.epoch("us").alias("issue"),
        pl.col("started_at").dt.epoch("us").alias("started"), pl.col("base_commit_at").dt.epoch("us").alias("base_at"),
        pl.col("fix_merged_at").dt.epoch("us").alias("fix_at"), nonblank("repository").alias("repository"),
        pl.coalesce(nonblank("instance_id"), nonblank("task_id"), "trajectory_key").alias("task"),
        pl.col("keys").cast(_FLAGS)).to_arrow()
    evidence = {k: ", ".join(sorted(v)) for k, v in leaks.items()} if cfg.hold_out_leaks else {}
    lk = pa.table({"lk_key": [k for k, v in evidence.items() if v], "evidence": [v for v in evidence.values() if v]},
                  schema=pa.schema([("lk_key", pa.large_string()), ("evidence", pa.large_string())]))
    cut = pa.table({"ck": sorted(cut_keys)}, schema=pa.schema([("ck", pa.large_string())]))
    eng = make_engine(engine)
    try:
        per_group = eng.arrow(eng.sql(_PER_GROUP_SQL.format(eligible=eligible, after=after), ep=ep)).to_pylist()
        decided = []
        for g in sorted(per_group, key=lambda r: r["pg"]):
            split, reason, elig = _group_split(g["pg"], cfg, bool(g["eligible"]), bool(g["missing"]))
            mixed = c is not None and split == "train" and bool(g["any_after"]) and not g["all_after"]
            decided.append((g["pg"], split, reason, elig, mixed))
        grp = pa.table(list(zip(*decided, strict=True)) if decided else [[], [], [], [], []],
                       schema=pa.schema([("gg", pa.large_string()), ("gsplit", pa.large_string()),
                                         ("greason", pa.large_string()), ("eligible_for_eval", pa.bool_()),
                                         ("mixed", pa.bool_())]))
        a = eng.sql(_RULES_2_3_SQL.format(after=after), ep=ep, grp=grp, lk=lk)
        held = eng.sql(_CUT_HELD_SQL.format(split=_SPLIT_SO_FAR), ep=ep, a=a, cut=cut)
        ev = eng.sql(_CUT_EVAL_SQL, held=held)
        shared = eng.sql(_CUT_SHARED_SQL, held=held, ev=ev)
        r4 = eng.sql(_CUT_FIRST_SQL, shared=shared)
        b = eng.sql(_RULE_4_SQL, a=a, r4=r4)
        fixes = eng.sql(_FIXES_SQL.format(split=_SPLIT_SO_FAR), b=b)
        fix = eng.sql(_FIRST_FIX_SQL, fixes=fixes)
        out = pl.from_arrow(eng.arrow(eng.sql(_RULE_5_SQL.format(split=_SPLIT_SO_FAR), b=b, fix=fix)))
        for done in (a, held, ev, shared, r4, b, fixes, fix):
            eng.drop(done)
    finally:
        eng.close()
    return _with_reasons(out, df, c)


def _with_reasons(out: pl.DataFrame, df: pl.DataFrame, c: datetime | None) -> pl.DataFrame:
    """The plan's rows with each episode's split, reason and flags in words."""
    def day(col: str) -> pl.Expr:
        return pl.from_epoch(pl.col(col), "us").dt.date()

    rule = pl.col("rule")
    mixed = (f"held out: post-cutoff task in a group that also holds tasks from on/before cutoff {c.date()} (mixed group)"
             if c is not None else "")
    reason = (pl.when(rule == 2).then(pl.lit(mixed))
              .when(rule == 3).then(pl.format("held out of {}: leak flag {}", "gsplit", "evidence"))
              .when(rule == 4).then(pl.format("held out of train: shares {} with evaluation episode {}", "key4",
                                              pl.col("eval_key4").str.slice(0, 12)))
              .when(rule == 5).then(pl.format("held out of train: repository state {} is later than the fix of "
                                              "evaluation task {} ({}) of {}", day("state5"), "xtask", day("xfix"),
                                              "repository"))
              .otherwise("greason"))
    none = pl.lit([], dtype=_FLAGS)
    base = df.select("trajectory_key", *([
        pl.when(pl.col("issue_created_at").is_not_null() & (pl.col("issue_created_at") <= c)
                & pl.col("fix_merged_at").is_not_null() & (pl.col("fix_merged_at") > c))
        .then(pl.lit(["fix_after_cutoff"], dtype=_FLAGS)).otherwise(none).alias("f1"),
        pl.when(pl.col("issue_created_at").is_null() | pl.col("started_at").is_null())
        .then(pl.lit(["no_usable_times"], dtype=_FLAGS)).otherwise(none).alias("f2")] if c is not None else [
        none.alias("f1"), none.alias("f2")]))
    held = pl.lit(None, dtype=_FLAGS)
    for code, flag in _RULE_FLAGS.items():
        held = pl.when(rule == code).then(pl.lit([flag], dtype=_FLAGS)).otherwise(held)
    return (out.join(base, on="trajectory_key", how="left")
            .with_columns(pl.when(rule > 0).then(pl.lit(HELD_OUT)).otherwise("gsplit").alias("split"),
                          reason.alias("reason"),
                          pl.concat_list("f1", "f2", held.fill_null(none)).alias("flags"))
            .sort(["group_id", "trajectory_key"])
            .select("trajectory_key", "group_id", "split", "reason", "eligible_for_eval", "flags"))
