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

from trajwh.dedup.components import components_sql
from trajwh.dedup.features import EpisodeFeatures
from trajwh.schemas import ids
from trajwh.schemas.repository import normalize_repository

DEFAULT_KEYS = ("repository_task", "base_commit", "task", "failing_test", "touched_file", "patch_symbol", "near_dup")


#: keys that name one task (or the whole repository on purpose) are never capped; the others can
#: be shared by unrelated tasks (README.md, conftest.py, a common test, a generic action pattern)
WEAK_KEY_PREFIXES = ("commit:", "test:", "file:", "symbol:", "cluster:")


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


def _task_of(f: EpisodeFeatures) -> str:
    return f.instance_id or f.task_id or f"episode:{f.key}"


def weak_keys_to_drop(features: list[EpisodeFeatures], keys_of: dict[str, list[str]], repo_of: dict[str, str | None],
                      cfg: GroupConfig) -> set[str]:
    """Weak keys shared by more than ``max_key_share`` of the tasks of the repositories they
    appear in (and by more than ``min_key_tasks`` tasks)."""
    repo_tasks: dict[str | None, set[str]] = {}
    key_tasks: dict[str, set[str]] = {}
    key_repos: dict[str, set[str | None]] = {}
    for f in features:
        task, repo = _task_of(f), repo_of[f.key]
        repo_tasks.setdefault(repo, set()).add(task)
        for k in keys_of[f.key]:
            if k.startswith(WEAK_KEY_PREFIXES):
                key_tasks.setdefault(k, set()).add(task)
                key_repos.setdefault(k, set()).add(repo)
    drop = set()
    for k, tasks in key_tasks.items():
        total = sum(len(repo_tasks[r]) for r in key_repos[k])
        if len(tasks) > cfg.min_key_tasks and len(tasks) > cfg.max_key_share * total:
            drop.add(k)
    return drop


def episode_keys(f: EpisodeFeatures, repo: str | None, cfg: GroupConfig, cluster: str | None) -> list[str]:
    scope = repo or "no-repository"
    keys = []
    task = f.instance_id or f.task_id
    if "repository_task" in cfg.keys and repo and task:
        keys.append(f"repo-task:{repo}:{task}")
    if "task" in cfg.keys and task:
        keys.append(f"task:{task}")
    if "base_commit" in cfg.keys and f.base_commit:
        keys.append(f"commit:{f.base_commit}")
    if "failing_test" in cfg.keys:
        keys += [f"test:{scope}:{t}" for t in f.failing_tests]
    if "touched_file" in cfg.keys:
        keys += [f"file:{scope}:{p}" for p in f.touched_files]
    if "patch_symbol" in cfg.keys:
        keys += [f"symbol:{scope}:{s}" for s in (f.symbols if f.symbols is not None else patch_symbols(f.patch))]
    if "near_dup" in cfg.keys and cluster:
        keys.append(f"cluster:{cluster}")
    if repo and (cfg.whole_repository or (cfg.repository_fallback and not (task or f.base_commit))):
        keys.append(f"repo:{repo}")
    return keys


def _merge_weak(strong: dict[str, str], task_of: dict[str, str], keys_of: dict[str, list[str]], cap: int,
                era_of: dict[str, str]) -> tuple[dict[str, str], set[str]]:
    """Union strong groups through weak keys, most specific key first, never past ``cap`` tasks
    and never across eras (before / after the cutoff); returns the final label per strong group
    and the keys left spanning groups."""
    tasks: dict[str, set[str]] = {}
    era: dict[str, frozenset[str]] = {}
    for ep, g in strong.items():
        tasks.setdefault(g, set()).add(task_of[ep])
        era[g] = era.get(g, frozenset()) | {era_of.get(ep, "")}
    size = {g: len(t) for g, t in tasks.items()}  # a task is one strong group: the sets are disjoint
    key_groups: dict[str, set[str]] = {}
    for ep, keys in keys_of.items():
        for k in keys:
            if k.startswith(WEAK_KEY_PREFIXES):
                key_groups.setdefault(k, set()).add(strong[ep])
    parent = {g: g for g in size}

    def find(g: str) -> str:
        while parent[g] != g:
            parent[g] = parent[parent[g]]
            g = parent[g]
        return g

    # a key of one strong group merges nothing and spans nothing: only the shared ones are walked
    key_groups = {k: gs for k, gs in key_groups.items() if len(gs) > 1}
    for k in sorted(key_groups, key=lambda k: (len(key_groups[k]), k)):
        members = sorted(key_groups[k])
        for g in members[1:]:
            a, b = find(members[0]), find(g)
            if a != b and size[a] + size[b] <= cap and era[a] == era[b]:
                a, b = min(a, b), max(a, b)
                parent[b] = a
                size[a] += size[b]
    label = {g: find(g) for g in parent}
    cut = {k for k, gs in key_groups.items() if len({label[g] for g in gs}) > 1}
    return label, cut


def assign_groups(features: list[EpisodeFeatures], cfg: GroupConfig = GroupConfig(),
                  clusters: dict[str, str] | None = None, cutoff: datetime | None = None) -> GroupResult:
    """Groups in two passes. Strong keys (task, repository + task, a whole repository when asked
    or when nothing else tells its tasks apart) are unioned without limit, in SQL. Weak keys then
    merge those groups, the most specific key first, as long as the merged group holds at most
    ``max(min_merge_tasks, max_merge_share x tasks)`` tasks: unioning
    every weak link chains a repository's tasks into one group (percolation: 20 small corpora
    became one group of 79 %). A weak key left spanning groups is *cut*; the split step holds out
    the train episodes that share a cut key with an evaluation episode, so no train / evaluation
    pair shares a key either way. With a ``cutoff``, a weak key never merges a group of tasks from
    before it with one from after it: the merge would make the later tasks a mixed group's
    held-out members (evaluation is the scarce side), while a cut costs only the train episodes
    that share the key."""
    clusters = clusters or {}
    keys_of, flags_of, repo_of = {}, {}, {}
    for f in features:
        repo = normalize_repository(f.repository, f.instance_id)
        repo_of[f.key] = repo
        keys_of[f.key] = episode_keys(f, repo, cfg, clusters.get(f.key))
    drop = weak_keys_to_drop(features, keys_of, repo_of, cfg)
    dropped: dict[str, int] = {}
    for k in drop:
        kind = k.split(":", 1)[0]
        dropped[kind] = dropped.get(kind, 0) + 1
    edges = []
    for f in features:
        keys = [k for k in keys_of[f.key] if k not in drop]
        lost = len(keys) < len(keys_of[f.key])
        keys_of[f.key] = keys
        flags = ["weak_key_dropped"] if lost else []
        if not repo_of[f.key]:
            flags.append("no_repository")
        if not [k for k in keys if not k.startswith("cluster:")]:
            flags.append("no_grouping_key")
        flags_of[f.key] = flags
        edges += [(f"ep:{f.key}", f"key:{k}") for k in keys if not k.startswith(WEAK_KEY_PREFIXES)]
    nodes = [f"ep:{f.key}" for f in features] + [b for _, b in edges]
    label = components_sql(nodes, edges)
    strong = {f.key: label[f"ep:{f.key}"] for f in features}
    task_of = {f.key: _task_of(f) for f in features}
    cap = max(cfg.min_merge_tasks, math.ceil(cfg.max_merge_share * len(set(task_of.values()))))
    era_of = {f.key: "post" if cutoff and f.issue_created_at and f.issue_created_at > cutoff else "pre"
              for f in features}
    merged, cut = _merge_weak(strong, task_of, keys_of, cap, era_of)
    for f in features:
        if any(k in cut for k in keys_of[f.key]):
            flags_of[f.key].append("weak_link_cut")
    # a group's id: digest of its smallest task (independent of input order, and stable when new
    # attempts of its tasks arrive: only a merge with a task that sorts first renames a group);
    # groups that would share it (tasks that are not a grouping key) take their smallest member too
    group_of = {}
    members = list(_members({k: merged[g] for k, g in strong.items()}).values())
    first_task = [min(task_of[k] for k in keys) for keys in members]
    taken: dict[str, int] = {}
    for t in first_task:
        taken[t] = taken.get(t, 0) + 1
    for keys, t in zip(members, first_task, strict=True):
        gid = "g-" + ids.digest(t if taken[t] == 1 else f"{t}\x1f{min(keys)}")[:16]
        for k in keys:
            group_of[k] = gid
    return GroupResult(group_of, keys_of, flags_of, repo_of, dropped, cut)


def _members(label_of: dict[str, str]) -> dict[str, list[str]]:
    members: dict[str, list[str]] = {}
    for key, label in label_of.items():
        members.setdefault(label, []).append(key)
    return members
