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

DEFAULT_KEYS = ("repository_task", "base_commit", "task", "failing_test", "touched_file", "patch_symbol", "near_dup")


@dataclass(frozen=True)
class GroupConfig:
    keys: tuple[str, ...] = DEFAULT_KEYS
    repository_fallback: bool = True  # a repository whose episodes cannot be told apart is one group
    whole_repository: bool = False  # put every repository in one group (the most conservative split)


def normalize_repository(url: str | None, instance_id: str | None = None) -> str | None:
    """``https://github.com/Org/Repo.git``, ``git@github.com:org/repo``, ``org/repo`` ->
    ``github.com/org/repo``. A fork is mapped to its upstream when the SWE-bench-style instance
    id names it (``owner__repo-123``): the instance id, not the URL, says which project it is."""
    upstream = None
    if instance_id:
        m = re.match(r"^([A-Za-z0-9_.-]+?)__([A-Za-z0-9_.-]+)-\d+$", instance_id)
        if m:
            upstream = f"github.com/{m.group(1)}/{m.group(2)}".lower()
    if not url:
        return upstream
    u = url.strip().lower()
    u = re.sub(r"^(?:https?://|ssh://|git://)", "", u)
    u = re.sub(r"^git@([^:]+):", r"\1/", u)
    u = re.sub(r"^[^@/]+@", "", u)  # credentials or user@host
    u = u.removesuffix("/").removesuffix(".git")
    if "/" in u and "." not in u.split("/")[0]:  # "org/repo" without host
        u = "github.com/" + u
    parts = u.split("/")
    normalized = "/".join(parts[:3]) if len(parts) >= 3 else u
    if upstream and upstream.rsplit("/", 1)[-1] == normalized.rsplit("/", 1)[-1]:
        return upstream  # same project name: a fork or mirror of the upstream the instance id names
    return normalized


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
        keys = episode_keys(f, repo, cfg, clusters.get(f.key))
        keys_of[f.key] = keys
        flags = []
        if not repo:
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
    return GroupResult(group_of, keys_of, flags_of, repo_of)
