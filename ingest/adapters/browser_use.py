"""browser-use agent histories (``AgentHistoryList.save_to_file``: ``{"history": [...]}``, or the
list of steps saved alone).

browser-use drives a browser with a model: each step the model sees the page (its URL, title,
tabs, the interactive elements and, with vision, a screenshot) and answers with its state of mind
and a list of actions (``{"click_element_by_index": {"index": 12}}``, ``{"go_to_url": {...}}``,
``{"done": {"text": ..., "success": ...}}``), which the controller runs, one result each. A
history file is one run (one episode); each item is one step:

- ``state``: the page the model was shown (``url``, ``title``, ``tabs``, ``interacted_element``,
  and a screenshot: ``screenshot`` as base64 in versions before 0.5, ``screenshot_path`` since).
  Read as the environment's observation before the model's step; a screenshot is named, never kept
  (the raw record keeps its bytes).
- ``model_output``: the model's answer. Before 0.5 its thoughts sit under ``current_state``
  (``evaluation_previous_goal``, ``memory``, ``next_goal``), since then beside ``action`` with an
  optional ``thinking`` (kept as the step's reasoning). Each action is a tool call named by its
  key; its id is made from the step and its place, so its result links to it. ``null`` when the
  model's answer could not be used (the step's result then carries the error).
- ``result``: one ``ActionResult`` per action run (``extracted_content``, ``long_term_memory``,
  ``error``; ``is_done`` and ``success`` on the last: the agent's own claim, never a verdict).
  A result without its action (no usable model output) is the harness's error message.
- ``metadata``: the step's start and end (Unix seconds), its number and, before 0.5, the input
  tokens the message manager counted. A list dumped whole (``model_dump_json``) also has the run's
  ``usage`` (prompt and completion tokens, cost, the model when it is one).

The last result's ``judgement`` (browser-use's judge, from 0.8) is a model's verdict: it is the
episode's verdict with ``verifier_name`` ``browser-use-judge`` (read as an LLM judge's evidence),
and a task the judge calls impossible, or a captcha, is the environment's failure, not the
policy's. The file does not hold the task or a run id (nor the model, unless its usage names
one): the file's name (or its folder's, for a generic name such as ``history.json``) is the
episode id.
"""

from __future__ import annotations

import re
from pathlib import PurePath
from typing import Any

from trajwh.ingest.adapters.base import Adapter, ParsedEpisode, RecordContext
from trajwh.ingest.adapters.common import (
    count_of,
    episode,
    json_text,
    link_observations,
    number_steps,
    step,
    tool_call,
    ts,
)

_HEAD = re.compile(rb'\A\s*\{\s*"history"\s*:\s*\[')
_BARE = re.compile(rb'\A\s*\[\s*\{\s*"(?:model_output|state|result|metadata)"\s*:')
_BRAIN = (("evaluation_previous_goal", "Evaluation of the previous goal"), ("memory", "Memory"), ("next_goal", "Next goal"))
#: names a run's history file is saved under that say nothing about the run
_GENERIC = {"history", "agent_history", "agenthistory", "agent-history", "trajectory", "run", "output", "result"}


def _actions(output: dict[str, Any]) -> list[tuple[str, Any]]:
    """(name, parameters) of each action of a model output (an action is ``{name: params}``)."""
    out = []
    for a in output.get("action") or []:
        if isinstance(a, dict):
            names = [k for k in a if k != "interacted_element"]
            if names:
                out.append((str(names[0]), a[names[0]]))
    return out


def _brain(output: dict[str, Any]) -> tuple[str | None, str | None]:
    """The model's stated thoughts (evaluation, memory, next goal) as text, and its thinking."""
    state = output.get("current_state") if isinstance(output.get("current_state"), dict) else output
    parts = [f"{label}: {state[key].strip()}" for key, label in _BRAIN if isinstance(state.get(key), str) and state[key].strip()]
    thinking = state.get("thinking") if isinstance(state.get("thinking"), str) else output.get("thinking")
    return "\n".join(parts) or None, thinking if isinstance(thinking, str) and thinking.strip() else None


def _page(state: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """The page the model was shown, as text (title, URL, the other tabs), and what was left out."""
    lines = [str(v) for v in (state.get("title"), state.get("url")) if isinstance(v, str) and v]
    tabs = [t for t in state.get("tabs") or [] if isinstance(t, dict)]
    if len(tabs) > 1:
        lines += [f"tab: {t.get('title') or ''} {t.get('url') or ''}".rstrip() for t in tabs]
    meta: dict[str, Any] = {"browser_state": True}
    if state.get("screenshot"):  # base64 bytes (before 0.5): named, not kept
        meta["screenshot"] = "inline"
        lines.append("[screenshot]")
    elif isinstance(state.get("screenshot_path"), str) and state["screenshot_path"]:
        meta["screenshot"] = state["screenshot_path"]
        lines.append(f"[screenshot] {PurePath(state['screenshot_path']).name}")
    return "\n".join(lines) or None, meta


def _result_text(r: dict[str, Any]) -> str | None:
    said = [r[k] for k in ("extracted_content", "long_term_memory") if isinstance(r.get(k), str) and r[k].strip()]
    if len(said) == 2 and said[1] in said[0]:
        said = said[:1]
    error = r.get("error") if isinstance(r.get("error"), str) and r["error"].strip() else None
    return "\n".join([*said, *([error] if error else [])]) or None


def _history(obj: Any) -> list[Any] | None:
    """The steps of a record: ``history`` of a dumped list, or the list saved alone."""
    if isinstance(obj, dict):
        return obj["history"] if isinstance(obj.get("history"), list) else None
    return obj if isinstance(obj, list) else None


def _episode_id(path: str) -> str | None:
    p = PurePath(path)
    stem = p.name.split(".", 1)[0]
    if stem.startswith("<") or not stem:
        return None
    if stem.lower() in _GENERIC and p.parent.name:
        return f"{p.parent.name}/{stem}"
    return stem


class BrowserUseAdapter(Adapter):
    name = "browser-use"
    version = "1.0.0"
    framing = "document"
    description = "browser-use agent history (AgentHistoryList.save_to_file: history of model_output, result, state)"

    def sniff(self, path: str, head: bytes) -> bool:
        if _HEAD.match(head):
            return (b'"model_output"' in head or b'"interacted_element"' in head) and (
                b'"result"' in head or b'"state"' in head)
        # the history's list saved alone (``history.model_dump()["history"]``)
        return bool(_BARE.match(head)) and b'"model_output"' in head and b'"interacted_element"' in head

    def check_record(self, obj: Any) -> str | None:
        items = _history(obj)
        if items is None:
            return "expected a browser-use history object with a 'history' list (or the list of its steps)"
        if not items:
            return "a browser-use history with no steps"
        if not all(isinstance(h, dict) and ("model_output" in h or "result" in h) for h in items):
            return "a browser-use history whose items are not steps (each has 'model_output' and 'result')"
        return None

    def parse(self, obj: Any, ctx: RecordContext) -> list[ParsedEpisode]:
        items = [h for h in _history(obj) or [] if isinstance(h, dict)]
        steps: list[dict[str, Any]] = []
        errors = 0
        urls: list[str] = []
        for n, h in enumerate(items):
            meta = h.get("metadata") if isinstance(h.get("metadata"), dict) else {}
            started, ended = ts(meta.get("step_start_time")), ts(meta.get("step_end_time"))
            state = h.get("state") if isinstance(h.get("state"), dict) else {}
            page, page_meta = _page(state)
            if isinstance(state.get("url"), str) and state["url"]:
                urls.append(state["url"])
            if page:
                steps.append(step("user", "environment", observation=page, started_at=started, metadata=page_meta))
            output = h.get("model_output") if isinstance(h.get("model_output"), dict) else None
            actions = _actions(output) if output else []
            ids = [f"step-{n}.{i}" for i in range(len(actions))]
            if output:
                text, thinking = _brain(output)
                extra = {k: v for k, v in (("reasoning", thinking), ("plan_update", output.get("plan_update")),
                                           ("current_plan_item", output.get("current_plan_item")),
                                           ("step_number", meta.get("step_number"))) if v is not None}
                steps.append(step("assistant", "model", text=text, started_at=started, ended_at=ended,
                                  tool_calls=[tool_call(name, params, cid) for (name, params), cid in zip(actions, ids, strict=True)],
                                  tokens_in=count_of(meta.get("input_tokens")), metadata=extra))
            for i, r in enumerate(x for x in h.get("result") or [] if isinstance(x, dict)):
                text = _result_text(r)
                error = isinstance(r.get("error"), str) and bool(r["error"].strip())
                errors += error
                flags = {k: v for k, v in (("is_error", error or None), ("is_done", r.get("is_done") or None),
                                           ("agent_reported_success", r.get("success")),
                                           ("attachments", r.get("attachments"))) if v is not None}
                if i < len(ids):
                    steps.append(step("tool", "environment", observation=text, tool_call_id=ids[i], ended_at=ended,
                                      metadata=flags))
                elif text:  # no action of the model's to answer: the harness's message (a failed step)
                    steps.append(step("system", "harness", text=text, ended_at=ended, metadata={**flags, "agent_error": True}))
        counts = link_observations(steps)
        number_steps(steps)
        last = [r for r in (items[-1].get("result") or []) if isinstance(r, dict)] if items else []
        final = last[-1] if last else {}
        judgement = final.get("judgement") if isinstance(final.get("judgement"), dict) else None
        exit_status = termination = None
        if final.get("is_done") is True:
            exit_status = "submitted"  # the agent's done action: its own claim
        elif isinstance(final.get("error"), str) and final["error"].strip():
            exit_status, termination = "error", final["error"].strip().splitlines()[0][:300]
        resolved = verifier = None
        if judgement is not None and isinstance(judgement.get("verdict"), bool):
            resolved, verifier = judgement["verdict"], "browser-use-judge"
            if not resolved and (judgement.get("impossible_task") or judgement.get("reached_captcha")):
                why = "a captcha" if judgement.get("reached_captcha") else "an impossible task"
                termination = (f"environment: the judge found {why}: "
                               f"{str(judgement.get('failure_reason') or '').strip()}").strip()[:300]
        # the run's usage, when the list was dumped with it (``AgentHistoryList.usage``, 0.6+: a ``UsageSummary``)
        usage = obj.get("usage") if isinstance(obj, dict) and isinstance(obj.get("usage"), dict) else {}
        cost = usage.get("total_cost")
        first = next((s["started_at"] for s in steps if s.get("started_at")), None)
        ends = [s["ended_at"] for s in steps if s.get("ended_at")]
        ep = episode(
            source_episode_id=_episode_id(ctx.file_path), harness_name="browser-use",
            policy_name=next(iter(usage["by_model"]), None) if isinstance(usage.get("by_model"), dict) and len(
                usage["by_model"]) == 1 else None,
            started_at=first, ended_at=max(ends) if ends else None, exit_status=exit_status,
            termination_reason=termination, resolved=resolved, verifier_name=verifier,
            # every call's input, a call whose answer could not be used too
            tokens_in=count_of(usage.get("total_prompt_tokens")) or sum(
                count_of(h["metadata"].get("input_tokens")) or 0 for h in items if isinstance(h.get("metadata"), dict)) or None,
            tokens_out=count_of(usage.get("total_completion_tokens")),
            cost_usd=float(cost) if isinstance(cost, int | float) and not isinstance(cost, bool) and cost >= 0 else None,
            metadata={"agent_reported_success": final.get("success") if final.get("is_done") else None,
                      "final_result": final.get("extracted_content") if final.get("is_done") else None,
                      "judge": json_text(judgement) if judgement else None, "history_steps": len(items),
                      "action_errors": errors or None, "pages": len(dict.fromkeys(urls)) or None, **counts},
        )
        return [ParsedEpisode(ep, steps)]
