"""Repository and task groups: episodes that must land on the same side of every split.

Two episodes share a group when they share any grouping key (union-find over the bipartite
episode-key graph, ``dedup.components``): the upstream repository with its task (forks and URL
spellings normalized to one), the base commit, the task / instance id, a failing test, a touched
file, a function or class the patch modifies, and a near-duplicate cluster. Keys are scoped by
repository so that ``src/utils.py`` in two repositories is two keys.

Conservative handling of missing fields: no repository -> grouped by task / instance id; nothing
to group by -> a group of its own, flagged ``no_grouping_key``; a repository whose episodes carry
no task-level key (task id, instance id, base commit) cannot be told apart, so with the default
``repository_fallback`` the whole repository becomes one group.
"""

from __future__ import annotations

import ast
import math
import re
import textwrap
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
from trajwh.dedup.components import find_root
from trajwh.dedup.engines import Engine, star_components
from trajwh.dedup.engines import engine as make_engine
from trajwh.dedup.features import EpisodeFeatures
from trajwh.dedup.frame import feature_frame, nonblank
from trajwh.schemas import ids
from trajwh.schemas.repository import normalize_repository

DEFAULT_KEYS = ("repository_task", "base_commit", "task", "failing_test", "touched_file", "patch_symbol", "near_dup")




@dataclass(frozen=True)
class GroupConfig:
    keys: tuple[str, ...] = DEFAULT_KEYS
    repository_fallback: bool = True  # a repository whose episodes cannot be told apart is one group
    whole_repository: bool = False  # put every repository in one group (the most conservative split)
    # a weak key shared by more than this share of its repositories' tasks (and by more than
    # min_key_tasks tasks) links unrelated tasks: it is dropped, not unioned. Measured on the
    # synthetic corpus at 30,000 episodes: with every key kept 98.8 % of episodes sat in one group.
    max_key_share: float = 0.2
    min_key_tasks: int = 3
    max_group_share: float = 0.25  # the audit warns when one group holds more of the episodes
    # weak keys merge groups up to max(min_merge_tasks, max_merge_share of all tasks) tasks
    max_merge_share: float = 0.02
    min_merge_tasks: int = 8

    def describe(self) -> str:
        return (f"{','.join(self.keys)}:{self.repository_fallback}:{self.whole_repository}:"
                f"cap={self.max_key_share:g}/{self.min_key_tasks};merge={self.max_merge_share:g}/{self.min_merge_tasks}")


def patch_symbols(patch: str | None) -> list[str]:
    """Functions and classes a diff modifies: for Python files, parsed from each hunk's code with
    ``ast`` (plus the enclosing definition named in the hunk header); for other languages, the
    hunk headers' context."""
    if not patch:
        return []
    patch = patch.replace("\r\n", "\n")  # a CRLF patch names the same files and symbols
    out: set[str] = set()
    for file_block in re.split(r"^diff --git ", patch, flags=re.M)[1:]:
        m = re.match(r"a/(\S+) b/(\S+)", file_block)
        path = m.group(2) if m else "?"
        for hunk in re.split(r"^@@", file_block, flags=re.M)[1:]:
            header, _, body = hunk.partition("\n")
            context = header.split("@@", 1)[-1].strip()
            if path.endswith(".py"):
                name = re.match(r"(?:async\s+)?(?:def|class)\s+(\w+)", context)
                if name:
                    out.add(f"{path}::{name.group(1)}")
                lines = [ln[1:] for ln in body.splitlines() if ln[:1] in (" ", "+")]
                try:
                    tree = ast.parse(textwrap.dedent("\n".join(lines)))
                except SyntaxError:
                    tree = None
                if tree is not None:
                    out.update(f"{path}::{n.name}" for n in ast.walk(tree)
                               if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef))
            elif context:
                out.add(f"{path}::{context[:80]}")
    return sorted(out)


@dataclass
class GroupResult:
    group_of: dict[str, str]
    keys_of: dict[str, list[str]]
    flags_of: dict[str, list[str]] = field(default_factory=dict)
    repository_of: dict[str, str | None] = field(default_factory=dict)
    dropped_keys: dict[str, int] = field(default_factory=dict)  # per key kind: weak keys dropped
    cut_keys: set[str] = field(default_factory=set)  # weak keys left spanning groups (size cap)


@dataclass
class GroupFrame:
    """Groups of a ``dedup.frame``: ``rows`` has one row per episode in the frame's order
    (trajectory_key, group_id, group_size, repository, keys, flags, task)."""
    rows: pl.DataFrame
    dropped_keys: dict[str, int]
    cut_keys: set[str]


# key kinds are numbered in the order an episode lists its keys: repository + task 0, task 1,
# then the weak ones, and the whole repository 7. Keys that name one task (or the whole
# repository on purpose) are strong: unioned without limit, never capped. The weak ones can be
# shared by unrelated tasks (README.md, conftest.py, a common test, a generic action pattern).
_STRONG = {0, 1, 7}
_WEAK_NAME = {2: "commit", 3: "test", 4: "file", 5: "symbol", 6: "cluster"}


def _repositories(df: pl.DataFrame) -> pl.Series:
    """Each episode's normalized repository (``normalize_repository`` of each distinct pair once)."""
    pairs = df.select("repository", "instance_id").unique()
    normal = [normalize_repository(u, i) for u, i in pairs.iter_rows()]
    return (df.select("repository", "instance_id")
            .join(pairs.with_columns(pl.Series("repo", normal, dtype=pl.String)),
                  on=["repository", "instance_id"], how="left", nulls_equal=True, maintain_order="left")["repo"])


def _episode_keys(ep: pl.DataFrame, cfg: GroupConfig) -> pl.DataFrame:
    """Every episode's grouping keys, long: (i, kind, key), in the order an episode lists them."""
    parts = []

    def scalar(kind: int, cond: pl.Expr, key: pl.Expr) -> None:
        parts.append(ep.filter(cond).select("i", pl.lit(kind, dtype=pl.Int8).alias("kind"), key.alias("key")))

    def listed(kind: int, col: str, prefix: str) -> None:
        parts.append(ep.select("i", "scope", col).explode(col).drop_nulls(col).select(
            "i", pl.lit(kind, dtype=pl.Int8).alias("kind"), pl.format(prefix + ":{}:{}", "scope", col).alias("key")))

    has_task = pl.col("task").is_not_null()
    if "repository_task" in cfg.keys:
        scalar(0, pl.col("repo_ok") & has_task, pl.format("repo-task:{}:{}", "repo", "task"))
    if "task" in cfg.keys:
        scalar(1, has_task, pl.format("task:{}", "task"))
    if "base_commit" in cfg.keys:
        scalar(2, pl.col("commit").is_not_null(), pl.format("commit:{}", "commit"))
    for kind, name, col, prefix in ((3, "failing_test", "failing_tests", "test"), (4, "touched_file", "touched_files", "file"),
                                    (5, "patch_symbol", "patch_symbols", "symbol")):
        if name in cfg.keys:
            listed(kind, col, prefix)
    if "near_dup" in cfg.keys:
        scalar(6, pl.col("cluster").is_not_null() & (pl.col("cluster") != ""), pl.format("cluster:{}", "cluster"))
    whole = pl.lit(cfg.whole_repository) | (pl.lit(cfg.repository_fallback) & ~has_task & pl.col("commit").is_null())
    scalar(7, pl.col("repo_ok") & whole, pl.format("repo:{}", "repo"))
    return pl.concat(parts).sort(["i", "kind"], maintain_order=True)


# the plan's SQL (``dedup.engines``: DuckDB and Daft run the same text; every joined column named
# apart). ``long``: (li, kind, key), an episode's grouping keys; ``eps``: (xi, task_of, repo_key, era,
# strong, final), one row per episode (``repo_key``: the repository, a sentinel where there is none)
_WEAK = "kind IN (" + ", ".join(str(k) for k in _WEAK_NAME) + ")"
# weak keys shared by more than ``share`` of the tasks of the repositories they appear in and by
# more than ``min_tasks`` tasks: (key, kind)
_DROP_SQL = """WITH w AS (SELECT key, kind, task_of, repo_key FROM long JOIN eps ON li = xi WHERE """ + _WEAK + """),
rt AS (SELECT repo_key AS rr, count(DISTINCT task_of) AS repo_tasks FROM eps GROUP BY repo_key),
t AS (SELECT key AS tk, count(DISTINCT task_of) AS tasks, min(kind) AS tkind FROM w GROUP BY key),
tot AS (SELECT key AS ok, sum(repo_tasks) AS total FROM (SELECT DISTINCT key, repo_key FROM w) JOIN rt ON repo_key = rr
        GROUP BY key)
SELECT tk AS key, tkind AS kind FROM t JOIN tot ON tk = ok WHERE tasks > {min_tasks} AND tasks > {share} * total"""
# per strong group: its tasks and its eras (1: before the cutoff, 2: after, 3: both)
_STRONG_SQL = """SELECT strong AS sg, count(DISTINCT task_of) AS tasks,
  max(CASE WHEN era = 1 THEN 1 ELSE 0 END) + 2 * max(CASE WHEN era = 2 THEN 1 ELSE 0 END) AS eras
FROM eps GROUP BY strong"""
# the weak keys that more than one strong group holds, with those groups (a key of one group merges
# nothing and spans nothing)
_SHARED_SQL = """WITH ks AS (SELECT DISTINCT key, strong FROM long JOIN eps ON li = xi WHERE """ + _WEAK + """),
n AS (SELECT key AS nk, count(*) AS members FROM ks GROUP BY key)
SELECT key, strong, members FROM ks JOIN n ON key = nk WHERE members > 1"""
# per final group: what names it (its smallest task, its smallest episode) and its size
_NAMES_SQL = """SELECT final AS nf, min(task_of) AS first_task, min(trajectory_key) AS first_key, count(*) AS group_size
FROM eps GROUP BY final"""


def _weak_keys_to_drop(eng: Engine, long: pa.Table, eps: pa.Table, cfg: GroupConfig) -> pl.DataFrame:
    """Weak keys shared by more than ``max_key_share`` of the tasks of the repositories they
    appear in (and by more than ``min_key_tasks`` tasks): (key, kind)."""
    sql = _DROP_SQL.format(min_tasks=int(cfg.min_key_tasks), share=repr(float(cfg.max_key_share)))
    return pl.from_arrow(_fetch(eng, sql, long=long, eps=eps)).select("key", pl.col("kind").cast(pl.Int8))


def _fetch(eng: Engine, sql: str, **tables: Any) -> pa.Table:
    """``sql`` over ``tables`` on ``eng``, as Arrow (the result table dropped)."""
    result = eng.sql(sql, **tables)
    try:
        return eng.arrow(result)
    finally:
        eng.drop(result)


def _merge_weak(eng: Engine, long: pa.Table, eps: pa.Table, strong: np.ndarray, cap: int
                ) -> tuple[np.ndarray, set[str]]:
    """Union strong groups through weak keys, most specific key first, never past ``cap`` tasks
    and never across eras (before / after the cutoff); returns each episode's final group (named
    by its smallest strong group) and the keys left spanning groups. The tables come from the
    engine (per strong group, the shared keys); the union is a greedy walk in key order, here."""
    n = len(strong)
    per_group = pl.from_arrow(_fetch(eng, _STRONG_SQL, eps=eps))
    size = np.zeros(n, dtype=np.int64)  # a task is one strong group: the sets are disjoint
    era = np.zeros(n, dtype=np.int8)
    g = per_group["sg"].to_numpy()
    size[g] = per_group["tasks"].to_numpy()
    era[g] = per_group["eras"].to_numpy()
    shared = (pl.from_arrow(_fetch(eng, _SHARED_SQL, long=long, eps=eps))
              .sort(["members", "key", "strong"]).group_by(["members", "key"], maintain_order=True)
              .agg(pl.col("strong")).select("key", "strong"))
    parent = list(range(n))
    for members in shared["strong"].to_list():
        first = members[0]
        for other in members[1:]:
            a, b = find_root(parent, first), find_root(parent, other)
            if a != b and size[a] + size[b] <= cap and era[a] == era[b]:
                a, b = min(a, b), max(a, b)
                parent[b] = a
                size[a] += size[b]
    final = np.fromiter((find_root(parent, x) for x in range(n)), dtype=np.int64, count=n)
    cut = {k for k, members in shared.iter_rows() if len({final[m] for m in members}) > 1}
    return final[strong], cut


def group_frame(df: pl.DataFrame, cfg: GroupConfig = GroupConfig(), clusters: pl.Series | None = None,
                cutoff: datetime | None = None, engine: str | None = None) -> GroupFrame:
    """Groups in two passes. Strong keys (task, repository + task, a whole repository when asked
    or when nothing else tells its tasks apart) are unioned without limit. Weak keys then
    merge those groups, the most specific key first, as long as the merged group holds at most
    ``max(min_merge_tasks, max_merge_share x tasks)`` tasks: unioning
    every weak link chains a repository's tasks into one group (percolation: 20 small corpora
    became one group of 79 %). A weak key left spanning groups is *cut*; the split step holds out
    the train episodes that share a cut key with an evaluation episode, so no train / evaluation
    pair shares a key either way. With a ``cutoff``, a weak key never merges a group of tasks from
    before it with one from after it: the merge would make the later tasks a mixed group's
    held-out members (evaluation is the scarce side), while a cut costs only the train episodes
    that share the key. ``df`` is a ``dedup.frame``; ``clusters``: each row's near-duplicate
    cluster id; ``engine`` (``dedup.engines``) runs the plan: the weak keys to drop, the components
    of the strong keys, the strong groups' tasks and eras, the weak keys that several of them share,
    and what names each final group; the merge through shared keys is a greedy walk in key order
    (each union depends on the ones before it: the cap), here, over the shared keys only."""
    n = df.height
    repo = _repositories(df)
    task = pl.coalesce(nonblank("instance_id"), nonblank("task_id"))
    ep = df.select(
        pl.int_range(n, dtype=pl.Int64).alias("i"), "trajectory_key", repo.alias("repo"),
        task.alias("task"), nonblank("base_commit").alias("commit"), "failing_tests", "touched_files", "patch_symbols",
        (pl.Series("cluster", clusters, dtype=pl.String) if clusters is not None
         else pl.lit(None, dtype=pl.String).alias("cluster")),
        pl.coalesce(task, pl.format("episode:{}", "trajectory_key")).alias("task_of"),
        (pl.when(pl.col("issue_created_at") > cutoff).then(pl.lit(2, dtype=pl.Int8)).otherwise(pl.lit(1, dtype=pl.Int8))
         if cutoff is not None else pl.lit(1, dtype=pl.Int8)).alias("era"),
    ).with_columns((pl.col("repo").fill_null("") != "").alias("repo_ok")).with_columns(
        pl.when("repo_ok").then("repo").otherwise(pl.lit("no-repository")).alias("scope"))
    long = _episode_keys(ep, cfg)
    eng = make_engine(engine)
    try:
        eps = ep.select(pl.col("i").alias("xi"), "task_of", pl.col("repo").fill_null("\x00").alias("repo_key")).to_arrow()
        drop = _weak_keys_to_drop(eng, long.select(pl.col("i").alias("li"), "kind", "key").to_arrow(), eps, cfg)
        dropped: dict[str, int] = {}
        for kind, count in sorted(drop.group_by("kind").len().iter_rows()):
            dropped[_WEAK_NAME[kind]] = count
        lost = long.join(drop.select("key"), on="key", how="semi")["i"].unique()
        long = long.join(drop.select("key"), on="key", how="anti", maintain_order="left")
        # strong groups: components of the episode-key graph over the strong keys
        strong_keys = long.filter(pl.col("kind").is_in(list(_STRONG)))
        names = strong_keys["key"].unique()
        node = strong_keys.join(pl.DataFrame({"key": names, "node": np.arange(n, n + len(names))}), on="key")
        label = star_components(eng, n + len(names), node["i"].to_numpy(), node["node"].to_numpy())[0]
        ep = ep.with_columns(pl.Series("strong", label[:n]))
        tasks = ep["task_of"].n_unique()
        cap = max(cfg.min_merge_tasks, math.ceil(cfg.max_merge_share * tasks))
        final, cut = _merge_weak(eng, long.select(pl.col("i").alias("li"), "kind", "key").to_arrow(),
                                 ep.select(pl.col("i").alias("xi"), "task_of", "era", "strong").to_arrow(),
                                 ep["strong"].to_numpy(), cap)
        ep = ep.with_columns(pl.Series("final", final))
        # a group's id: digest of its smallest task (independent of input order, and stable when new
        # attempts of its tasks arrive: only a merge with a task that sorts first renames a group);
        # groups that would share it (tasks that are not a grouping key) take their smallest member too
        named = (pl.from_arrow(_fetch(eng, _NAMES_SQL, eps=ep.select("final", "task_of", "trajectory_key").to_arrow()))
                 .rename({"nf": "final"}).with_columns(pl.len().over("first_task").alias("taken")))
    finally:
        eng.close()
    named = named.with_columns(pl.Series("group_id", [
        "g-" + ids.digest(t if taken == 1 else f"{t}\x1f{k}")[:16]
        for t, k, taken in named.select("first_task", "first_key", "taken").iter_rows()], dtype=pl.String))
    keys = long.group_by("i", maintain_order=True).agg(pl.col("key").alias("keys"))
    has_key = long.filter(pl.col("kind") != 6)["i"].unique()
    cut_eps = long.filter(pl.col("key").is_in(list(cut)))["i"].unique() if cut else pl.Series([], dtype=pl.Int64)
    rows = (ep.select("i", "trajectory_key", "final", "repo_ok", pl.col("repo").alias("repository"), "task_of")
            .join(named.select("final", "group_id", "group_size"), on="final", how="left")
            .join(keys, on="i", how="left").sort("i")
            .with_columns(pl.col("keys").fill_null(pl.lit([], dtype=pl.List(pl.String))),
                          pl.col("i").is_in(lost.implode()).alias("lost"), pl.col("i").is_in(has_key.implode()).alias("has_key"),
                          pl.col("i").is_in(cut_eps.implode()).alias("cut")))
    none = pl.lit([], dtype=pl.List(pl.String))
    rows = rows.with_columns(pl.concat_list([pl.when(on).then(pl.lit([flag], dtype=pl.List(pl.String))).otherwise(none)
                                             for flag, on in (("weak_key_dropped", pl.col("lost")),
                                                              ("no_repository", ~pl.col("repo_ok")),
                                                              ("no_grouping_key", ~pl.col("has_key")),
                                                              ("weak_link_cut", pl.col("cut")))]).alias("flags"))
    return GroupFrame(rows.select("trajectory_key", "group_id", pl.col("group_size").cast(pl.Int64), "repository", "keys",
                                  "flags", pl.col("task_of").alias("task")), dropped, cut)


def assign_groups(features: list[EpisodeFeatures], cfg: GroupConfig = GroupConfig(),
                  clusters: dict[str, str] | None = None, cutoff: datetime | None = None,
                  engine: str | None = None) -> GroupResult:
    """``group_frame`` of a list of features (``clusters``: near-duplicate cluster per key) on
    ``engine`` (``dedup.engines``)."""
    df = feature_frame(features)
    clusters = clusters or {}
    result = group_frame(df, cfg, pl.Series([clusters.get(k) for k in df["trajectory_key"].to_list()], dtype=pl.String),
                         cutoff, engine)
    r = result.rows
    keys = r["trajectory_key"].to_list()
    return GroupResult(dict(zip(keys, r["group_id"].to_list(), strict=True)),
                       dict(zip(keys, r["keys"].to_list(), strict=True)),
                       dict(zip(keys, r["flags"].to_list(), strict=True)),
                       dict(zip(keys, r["repository"].to_list(), strict=True)), result.dropped_keys, result.cut_keys)
