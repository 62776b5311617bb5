"""Minimal sufficient context: what a productive or recovery fragment carries as masked input.

A span cut out of an episode teaches nothing when the model cannot see why it acts: it must see
the task and the code it is about to change. Each fragment's context is chosen, in priority
order, within a character budget (``SelectConfig.context_budget_chars``):

1. the task statement: the system prompt and the first user message (the issue text);
2. for a recovery, the mistake and the anomaly (the bad edit, the failing run): input, never loss;
3. the observation the span's first action responds to (the step right before the span);
4. localization: the searches and reads, before the span, of the files the span edits (the
   model step and its observation), the most recent first.

Every included step carries its reason; what did not fit the budget is listed as dropped, with
its reason, so nobody mistakes a cut context for a complete one. Full episodes need no context:
their span is the whole episode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from trajwh.fragments.select import Fragment


@dataclass
class Context:
    included: dict[int, str] = field(default_factory=dict)  # step index -> reason
    dropped: dict[int, str] = field(default_factory=dict)
    chars: int = 0


def _size(step: dict[str, Any]) -> int:
    return len(step.get("text") or "") + len(step.get("observation") or "")


def _mentions(step: dict[str, Any], files: set[str]) -> str | None:
    """The edited file a read or search step (or its output) names, by path or file name."""
    haystack = " ".join(x for x in (step.get("action_object"), step.get("action_command"), step.get("observation"))
                        if x)
    for f in sorted(files):
        if f in haystack or PurePosixPath(f).name in haystack:
            return f
    return None


def choose_context(f: Fragment, steps: list[dict[str, Any]], budget: int) -> Context:
    if f.kind == "full_episode" or not f.trainable:
        return Context()
    by_index = {s["step_index"]: s for s in steps}
    wanted: list[tuple[int, str]] = []
    model = [s for s in steps if s.get("author") == "model"]
    first_model = model[0]["step_index"] if model else f.start
    for s in steps:
        if s["step_index"] >= first_model:
            break
        if s.get("role") == "system":
            wanted.append((s["step_index"], "system prompt"))
        elif s.get("role") == "user":
            wanted.append((s["step_index"], "task statement"))
    for phase in ("mistake", "anomaly"):
        wanted += [(i, f"recovery {phase}") for i in f.phases.get(phase, [])]
    if f.start - 1 in by_index and f.start - 1 >= first_model:
        wanted.append((f.start - 1, "observation the span acts on"))
    edited = {s.get("action_object") for s in steps if f.start <= s["step_index"] <= f.end
              and s.get("author") == "model" and s.get("action_kind") == "edit" and s.get("action_object")}
    edited = {e.split()[-1] for e in edited}  # "git checkout -- src/a.py" names src/a.py
    for s in reversed(model):
        i = s["step_index"]
        if i >= f.start or s.get("action_kind") not in ("search", "read"):
            continue
        nxt = by_index.get(i + 1)
        hit = _mentions(s, edited) or (nxt and nxt.get("author") == "environment" and _mentions(nxt, edited))
        if hit:
            wanted.append((i, f"localization: {s.get('action_kind')} of {hit}"))
            if nxt and nxt.get("author") == "environment":
                wanted.append((i + 1, f"localization: output naming {hit}"))
    ctx = Context()
    for i, reason in wanted:
        if i in ctx.included or i in ctx.dropped or f.start <= i <= f.end or i not in by_index:
            continue
        size = _size(by_index[i])
        if ctx.chars + size > budget and reason not in ("system prompt", "task statement"):
            ctx.dropped[i] = f"{reason} (over the {budget:,}-character budget)"
            continue
        ctx.included[i] = reason
        ctx.chars += size
    ctx.included = dict(sorted(ctx.included.items()))
    return ctx
