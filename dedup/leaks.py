"""In-episode time leaks: the agent saw information from after its task's base commit.

Flagged, with the step that shows it: listing history beyond HEAD (``git log --all``,
``git log origin/...``, ``git reflog``), fetching or pulling upstream, checking out or showing a
remote branch or another commit, and fetching the upstream fix (a pull-request / commit URL of the
repository, ``.diff`` / ``.patch`` downloads). An observation that names a remote branch such as
``(origin/main)`` after a history command is also flagged. Rules are versioned.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from trajwh.lineage.catalog import Warehouse

RULE_VERSION = "1.1.0"  # 1.1: a local .patch/.diff file is not a fetched fix

_COMMAND_RULES = [
    ("future_git_history", re.compile(r"\bgit\s+(?:--no-pager\s+)?log\b[^\n|;&]*(?:--all|--remotes|--branches|origin/|upstream/)")),
    ("future_git_history", re.compile(r"\bgit\s+reflog\b")),
    ("fetch_upstream", re.compile(r"\bgit\s+(?:fetch|pull)\b")),
    ("future_git_history", re.compile(r"\bgit\s+(?:show|checkout|diff|cherry-pick)\b[^\n|;&]*\b(?:origin|upstream)/")),
    # the upstream fix fetched: a pull-request / commit / compare page, or a .diff/.patch URL;
    # a local file (`git diff > model.patch`, `git apply fix.patch`) is the agent's own work
    ("fix_diff", re.compile(r"https?://(?:www\.)?github\.com/[^\s/]+/[^\s/]+/(?:pull|commit|compare)/[^\s]*|"
                            r"https?://\S+\.(?:diff|patch)\b")),
]
_REMOTE_IN_OUTPUT = re.compile(r"\((?:HEAD -> [^)]*, )?(?:origin|upstream)/[\w./-]+\)")


@dataclass(frozen=True)
class LeakFlag:
    trajectory_key: str
    step_id: str
    step_index: int
    kind: str
    evidence: str


_ACTION_KINDS = ("run", "read", "search", "browse", "edit")


def episode_leaks(key: str, steps: list[dict]) -> list[LeakFlag]:
    """Leak flags of one episode from its steps (``dedup.features`` step rows, in order)."""
    out: list[LeakFlag] = []
    seen: set[tuple[int, str]] = set()
    for r in steps:
        if r["author"] == "model":
            if not (r["action_kind"] in _ACTION_KINDS or r["action_command"] is not None):
                continue
            texts = [r["action_command"] or "", r["action_object"] or "", *(a or "" for a in r["args"] or [])]
            for kind, rule in _COMMAND_RULES:
                for text in texts:
                    m = rule.search(text)
                    if m and (r["step_index"], kind) not in seen:
                        seen.add((r["step_index"], kind))
                        out.append(LeakFlag(key, r["step_id"], r["step_index"], kind, m.group(0)[:200]))
                        break
        elif r["author"] == "environment":
            m = _REMOTE_IN_OUTPUT.search(r["observation"] or "")
            if m and (r["step_index"], "future_in_output") not in seen:
                seen.add((r["step_index"], "future_in_output"))
                out.append(LeakFlag(key, r["step_id"], r["step_index"], "future_in_output", m.group(0)))
    return out


def find_leaks(wh: Warehouse) -> list[LeakFlag]:
    """Leak flags of every redacted episode (the curate stage computes them batch by batch)."""
    from trajwh.dedup.features import stream_features

    return [flag for f, steps in stream_features(wh) for flag in episode_leaks(f.key, steps)]
