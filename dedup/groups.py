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
import re
import textwrap
from dataclasses import dataclass, field

from dedup.components import components_sql
from dedup.features import EpisodeFeatures
from schemas import ids
from schemas.repository import normalize_repository

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

    def describe(self) -> str:
        return (f"{','.join(self.keys)}:{self.repository_fallback}:{self.whole_repository}:"
                f"cap={self.max_key_share:g}/{self.min_key_tasks}")


def patch_symbols(patch: str | None) -> list[str]:
    """Functions and classes a diff modifies: for Python files, parsed from each hunk's code with
    ``ast`` (plus the enclosing definition named in the hunk header); for other languages, the
    hunk headers' context."""
    if not patch:
        return []
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
        keys += [f"symbol:{scope}:{s}" for s in patch_symbols(f.patch)]
    if "near_dup" in cfg.keys and cluster:
        keys.append(f"cluster:{cluster}")
    if repo and (cfg.whole_repository or (cfg.repository_fallback and not (task or f.base_commit))):
        keys.append(f"repo:{repo}")
    return keys


def assign_groups(features: list[EpisodeFeatures], cfg: GroupConfig = GroupConfig(),
                  clusters: dict[str, str] | None = None) -> GroupResult:
    clusters = clusters or {}
    keys_of, flags_of, repo_of = {}, {}, {}
    edges = []
    for f in features:
        repo = normalize_repository(f.repository, f.instance_id)
        repo_of[f.key] = repo
        keys_of[f.key] = episode_keys(f, repo, cfg, clusters.get(f.key))
    drop = weak_keys_to_drop(features, keys_of, repo_of, cfg)
    dropped: dict[str, int] = {}
    for k in drop:
        kind = k.split(":", 1)[0]
        dropped[kind] = dropped.get(kind, 0) + 1
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
        edges += [(f"ep:{f.key}", f"key:{k}") for k in keys]
    nodes = [f"ep:{f.key}" for f in features] + [b for _, b in edges]
    label = components_sql(nodes, edges)
    # a group's id: digest of its smallest member key (independent of input order)
    members: dict[str, list[str]] = {}
    for f in features:
        members.setdefault(label[f"ep:{f.key}"], []).append(f.key)
    group_of = {}
    for keys in members.values():
        gid = "g-" + ids.digest(min(keys))[:16]
        for k in keys:
            group_of[k] = gid
    return GroupResult(group_of, keys_of, flags_of, repo_of, dropped)
