"""Per-episode features for dedup, grouping and splits, read from the redacted layer only.

- ``actions``: the canonical action sequence, each model step as ``kind:object`` with paths made
  relative to the repository root (``/testbed/``, ``/workspace/<x>/``, ``/<repo>/`` prefixes
  dropped) and whitespace folded, so two rollouts that took the same path in different words
  have the same sequence;
- ``text``: the model's own words (redacted), for near-duplicate text;
- grouping keys: repository, base commit, task / instance id, failing tests, touched files and
  the functions / classes the submitted patch modifies;
- times: issue created, fix merged, generation (episode start).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from trajwh.lineage.catalog import Warehouse
from trajwh.lineage.rebuild import joined_by_key
from trajwh.redaction.detectors import PLACEHOLDER_RE

_ROOTS = re.compile(r"^(?:/testbed/|/workspace/[^/]+/|/repo/|/app/|/src/(?=[^/]+/)|/[A-Za-z0-9_.-]+__[A-Za-z0-9_.-]+/|\./)")
MAX_TEXT = 20_000


def _placeholder_type(m: re.Match) -> str:
    return f"<{m.group(0)[1:].split(':', 1)[0]}>"


def typed_placeholders(text: str) -> str:
    """``text`` with each redaction placeholder reduced to its type (``<PHONE:7a4270:ep>`` is
    ``<PHONE>``): its digest depends on the warehouse's salt and the scope, so features that kept
    it would set two copies of one trajectory apart around every redacted value (actions, files,
    text k-grams, the exact digest) and cluster the same data differently in two warehouses."""
    return PLACEHOLDER_RE.sub(_placeholder_type, text) if "<" in text else text


def normalize_object(obj: str | None) -> str:
    if not obj:
        return ""
    text = " ".join(typed_placeholders(obj).split())
    return _ROOTS.sub("", text)


@dataclass
class EpisodeFeatures:
    key: str
    actions: list[str] = field(default_factory=list)
    text: str = ""
    repository: str | None = None
    base_commit: str | None = None
    base_commit_at: datetime | None = None
    task_id: str | None = None
    instance_id: str | None = None
    failing_tests: list[str] = field(default_factory=list)
    touched_files: list[str] = field(default_factory=list)
    patch: str | None = None
    issue_created_at: datetime | None = None
    fix_merged_at: datetime | None = None
    started_at: datetime | None = None
    resolved: bool | None = None
    n_steps: int = 0
    # computed once per batch and stored (``episode_features``); ``None`` until then
    symbols: list[str] | None = None  # functions / classes the patch modifies
    exact: str | None = None  # digest of actions + text (exact duplicates); None when both are empty
    action_sig: Any = None  # MinHash signature (uint32 array) of the action shingles, or None
    text_sig: Any = None
    action_bands: bytes | None = None  # the signature's LSH band keys (``dedup.engines.band_keys``), int64 LE
    text_bands: bytes | None = None
    signed: bool = False


_PATCH = re.compile(r"diff --git a/.*", re.S)

_EPISODES_SQL = """
    SELECT trajectory_key, repository, base_commit, base_commit_at, task_id, instance_id, issue_created_at, fix_merged_at,
           started_at, resolved, n_steps, metadata,
           list_transform(list_filter(coalesce(test_results, []), lambda t: t.status <> 'passed'), lambda t: t.name)
               AS failing
    FROM redacted_episodes {where} ORDER BY trajectory_key"""
# the steps that features and time leaks read: model actions and words, submissions, and the
# observations that hold a patch or name a remote branch (their text only then)
_STEPS_SQL = """
    SELECT trajectory_key, step_id, step_index, author, action_kind, action_object, action_command, text,
           CASE WHEN observation LIKE '%diff --git%' OR observation LIKE '%origin/%' OR observation LIKE '%upstream/%'
                THEN observation END AS observation,
           list_transform(coalesce(tool_calls, []), lambda c: c.arguments) AS args
    FROM redacted_steps
    WHERE (author = 'model' OR action_kind = 'submit' OR observation LIKE '%diff --git%'
           OR (author = 'environment' AND observation LIKE '%origin/%')) {where}
    ORDER BY trajectory_key, step_index"""


def _episode_features(e: dict) -> EpisodeFeatures:
    f = EpisodeFeatures(e["trajectory_key"], repository=e["repository"], base_commit=e["base_commit"],
                        base_commit_at=e["base_commit_at"], task_id=e["task_id"], instance_id=e["instance_id"],
                        failing_tests=sorted(set(e["failing"] or [])), issue_created_at=e["issue_created_at"],
                        fix_merged_at=e["fix_merged_at"], started_at=e["started_at"], resolved=e["resolved"],
                        n_steps=e["n_steps"])
    meta = e["metadata"] or ""
    m = _PATCH.search(meta.replace("\\n", "\n")) if "diff --git" in meta else None
    if m:
        f.patch = m.group(0)
    return f


def _add_steps(f: EpisodeFeatures, steps: list[dict]) -> None:
    parts: list[str] = []
    size = 0
    for s in steps:
        if s["author"] == "model":
            if s["action_kind"]:
                obj = normalize_object(s["action_object"])
                f.actions.append(f"{s['action_kind']}:{obj}")
                if s["action_kind"] == "edit" and obj:
                    f.touched_files.append(obj)
            if s["text"] and size < MAX_TEXT:
                parts.append(s["text"])
                size += len(s["text"])
        for blob in [s["observation"] or "", *(a or "" for a in s["args"] or [])]:
            if "diff --git" in blob and f.patch is None:
                f.patch = _PATCH.search(blob.replace("\\n", "\n")).group(0)
    f.text = typed_placeholders("\n".join(parts)[:MAX_TEXT])
    f.touched_files = sorted(set(f.touched_files))


def stream_features(wh: Warehouse, batch_id: str | None = None, part: tuple[int, int] | None = None, *,
                    memory_limit: str | None = None, threads: int | None = None
                    ) -> Iterator[tuple[EpisodeFeatures, list[dict]]]:
    """(features, the steps they were read from) of every redacted episode (of one batch; of the
    ``part`` = (i, n) whose keys hash to i of n), in trajectory-key order, one episode's steps in
    memory at a time (DuckDB sorts and spills, within ``memory_limit`` on ``threads``: ``stream``'s
    defaults unless given)."""
    conds, params = [], []
    if batch_id is not None:
        conds.append("_batch_id = ?")
        params.append(batch_id)
    if part is not None:
        conds.append(f"hash(trajectory_key) % {int(part[1])} = {int(part[0])}")
    where = ("WHERE " + " AND ".join(conds)) if conds else ""
    step_where = "".join(f" AND {c}" for c in conds)
    params = params or None
    episodes = wh.stream(_EPISODES_SQL.format(where=where), params, batch_rows=2_000, memory_limit=memory_limit,
                         threads=threads)
    step_stream = wh.stream(_STEPS_SQL.format(where=step_where), params, memory_limit=memory_limit, threads=threads)
    try:
        for e, mine in joined_by_key(episodes, step_stream):
            f = _episode_features(e)
            _add_steps(f, mine)
            yield f, mine
    finally:
        step_stream.close()
        episodes.close()


def load_features(wh: Warehouse) -> list[EpisodeFeatures]:
    """Features of every redacted episode, ordered by trajectory key (input order never matters)."""
    return [f for f, _ in stream_features(wh)]


def action_shingles(actions: list[str], k: int = 3) -> list[str]:
    """k-grams of the action sequence, with start/end markers (short sequences still shingle)."""
    seq = ["^", *actions, "$"]
    if len(seq) <= k:
        return ["\x1f".join(seq)]
    return ["\x1f".join(seq[i:i + k]) for i in range(len(seq) - k + 1)]


_WORD = re.compile(r"\w+")


def text_shingles(text: str, k: int = 5) -> list[str]:
    """Word k-grams of lower-cased text (a placeholder is its type: ``_add_steps``)."""
    words = _WORD.findall(text.lower())
    if len(words) <= k:
        return [" ".join(words)] if words else []
    return [" ".join(words[i:i + k]) for i in range(len(words) - k + 1)]
