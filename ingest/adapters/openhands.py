"""OpenHands: evaluation ``output.jsonl``, resolver ``output.jsonl``, exported event streams.

All three carry OpenHands events. An action event (``action``: run, read, edit, run_ipython,
browse, think, finish, message, system, recall, ...) is one step; its observation (``observation``
with ``cause`` = the action's id, or ``tool_call_metadata.tool_call_id``) is the next. The
function-calling tool call of an agent action comes from ``tool_call_metadata`` (function name
and JSON arguments); older events without it keep the action type as the tool name and its
args as arguments.

Authorship: the agent's actions are ``model``; ``system`` prompts, ``recall`` (workspace context
the harness retrieves by itself), agent-state changes and error observations are ``harness``;
tool output is ``environment``. The first user message is the task prompt the evaluation or
resolver harness wrote (``harness``) in output files; in an exported UI stream user messages
come from a person (``human``).
"""

from __future__ import annotations

import re
from typing import Any

import orjson
from trajwh.ingest.adapters.base import Adapter, ParsedEpisode, RecordContext
from trajwh.ingest.adapters.common import (
    episode,
    github_repo,
    json_text,
    link_observations,
    number_steps,
    step,
    tool_call,
    tool_schema_info,
    ts,
)
from trajwh.ingest.adapters.openhands_v1 import V1_KINDS, is_v1, v1_events_to_steps
from trajwh.schemas.errors import InputFormatError

_HARNESS_ACTIONS = {"system", "recall", "change_agent_state"}
_HARNESS_OBS = {"recall", "agent_state_changed", "error", "null", "user_rejected"}


_NOT_REQUEST = ("thought", "is_confirmed", "action_risk", "keep_prompt", "kernel_init_code",
                "security_risk", "confirmation_state", "hidden", "impl_source")


def _request(args: dict[str, Any]) -> dict[str, Any]:
    """An action's args as the request the harness executed, without its bookkeeping fields."""
    return {k: v for k, v in args.items() if k not in _NOT_REQUEST}


def tool_schemas_of(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The tools of the system event (V0 ``action: system`` args, V1 ``SystemPromptEvent``)."""
    for e in events[:5]:
        if e.get("action") == "system" and isinstance(e.get("args"), dict) and e["args"].get("tools"):
            return tool_schema_info(e["args"]["tools"], "openhands:system.args.tools")
        if e.get("kind") == "SystemPromptEvent" and e.get("tools"):
            return tool_schema_info(e["tools"], "openhands:SystemPromptEvent.tools")
    return None


def _calls_from_metadata(event: dict[str, Any], args: dict[str, Any]) -> list[dict[str, Any]]:
    meta = event.get("tool_call_metadata") or {}
    wanted = meta.get("tool_call_id")
    try:
        calls = meta["model_response"]["choices"][0]["message"].get("tool_calls") or []
    except (KeyError, IndexError, TypeError):
        calls = []
    for c in calls:
        if c.get("id") == wanted:
            return [tool_call(c["function"]["name"], c["function"].get("arguments"), c.get("id"), executed=_request(args))]
    if meta.get("function_name"):
        return [tool_call(meta["function_name"], None, wanted)]
    return []


def _usage(event: dict[str, Any]) -> tuple[int | None, int | None]:
    try:
        usage = event["tool_call_metadata"]["model_response"]["usage"]
        return usage.get("prompt_tokens"), usage.get("completion_tokens")
    except (KeyError, TypeError):
        return None, None


def events_to_steps(events: list[dict[str, Any]], *, first_user_is_harness: bool) -> list[dict[str, Any]]:
    steps: list[dict[str, Any]] = []
    seen_task = False
    for i, e in enumerate(events):
        eid = e.get("id", i)
        args = e.get("args") if isinstance(e.get("args"), dict) else {k: v for k, v in e.items()
                                                                        if k not in ("action", "observation")}
        when = ts(e.get("timestamp"))
        source = e.get("source")
        if "action" in e:
            action = e["action"]
            if not isinstance(action, str):  # an object here is a V1 event without its kind
                action = action.get("kind", "unknown") if isinstance(action, dict) else str(action)
            text = args.get("thought") or args.get("content") or e.get("message")
            if action in _HARNESS_ACTIONS:
                steps.append(step("system" if action == "system" else "user", "harness", text=args.get("content") or e.get("message"),
                                  started_at=when, metadata={"event": eid, "action": action}))
            elif action == "message" and source != "agent":
                author = "harness" if first_user_is_harness and not seen_task else "human"
                seen_task = True
                steps.append(step("user", author, text=args.get("content") or e.get("message"), started_at=when,
                                  metadata={"event": eid, "action": action}))
            elif action == "message":
                steps.append(step("assistant", "model", text=args.get("content") or e.get("message"),
                                  started_at=when, metadata={"event": eid, "action": action}))
            else:
                calls = _calls_from_metadata(e, args) or [tool_call(
                    action, {k: v for k, v in _request(args).items() if k != "is_input"}, f"event-{eid}")]
                t_in, t_out = _usage(e)
                steps.append(step("assistant", "model", text=text if isinstance(text, str) and text else None,
                                  tool_calls=calls, started_at=when, tokens_in=t_in, tokens_out=t_out,
                                  metadata={"event": eid, "action": action}))
        elif "observation" in e:
            obs = e["observation"]
            if not isinstance(obs, str):
                obs = obs.get("kind", "unknown") if isinstance(obs, dict) else str(obs)
            extras = e.get("extras") or {}
            exit_code = e.get("exit_code", (extras.get("metadata") or {}).get("exit_code"))
            meta_id = (e.get("tool_call_metadata") or {}).get("tool_call_id")
            cause = e.get("cause")
            if meta_id is None and cause is None and steps and steps[-1]["tool_calls"]:
                meta_id = steps[-1]["tool_calls"][0]["id"]  # flat histories: the result follows its action
            call_id = meta_id or (f"event-{cause}" if cause is not None else None)
            content = e.get("content") if "content" in e else e.get("message")
            author = "harness" if obs in _HARNESS_OBS else "environment"
            steps.append(step("tool" if author == "environment" else "user", author, observation=content,
                              tool_call_id=call_id if author == "environment" else None, exit_code=exit_code,
                              started_at=when, metadata={"event": eid, "observation": obs, "cause": cause,
                                                         "success": e.get("success")}))
    return steps


def _common(steps: list[dict[str, Any]]) -> dict[str, Any]:
    times = [s["started_at"] for s in steps if s.get("started_at")]
    return {"started_at": min(times) if times else None, "ended_at": max(times) if times else None,
            "tokens_in": sum(s["tokens_in"] or 0 for s in steps) or None,
            "tokens_out": sum(s["tokens_out"] or 0 for s in steps) or None}


def _model_of(events: list[dict[str, Any]]) -> str | None:
    for e in events:
        try:
            return e["tool_call_metadata"]["model_response"]["model"]
        except (KeyError, TypeError):
            continue
    return None


def _steps_of(events: list[dict[str, Any]], *, first_user_is_harness: bool) -> tuple[list[dict], dict[str, int], bool]:
    """Steps of V0 or V1 (SDK) events, the episode's link / event counts, and which it was."""
    v1 = is_v1(events)
    if v1:
        steps, counts = v1_events_to_steps(events, first_user_is_harness=first_user_is_harness)
    else:
        steps, counts = events_to_steps(events, first_user_is_harness=first_user_is_harness), {}
    counts.update(link_observations(steps))
    return steps, counts, v1


def _finished(events: list[dict[str, Any]]) -> bool:
    """The agent called finish (V0 ``action: finish``, V1 ``FinishAction``)."""
    return any(e.get("action") == "finish" or (isinstance(e.get("action"), dict)
                                               and e["action"].get("kind") == "FinishAction") for e in events)


def _finish_status(history: list[dict[str, Any]], v1: bool) -> str | None:
    """``finished`` when the run ended without an error. V0 evaluation outputs record errors in
    ``error``; a V1 history says it finished only through a ``FinishAction``, and without one
    the status is not known (left missing, not invented as finished)."""
    return "finished" if not v1 or _finished(history) else None


class OpenHandsOutputAdapter(Adapter):
    name = "openhands-output"
    version = "1.2.0"
    framing = "jsonl"
    description = "OpenHands evaluation or resolver output.jsonl (one episode per line)"

    def sniff(self, path: str, head: bytes) -> bool:
        first = head.lstrip()[:1]
        return first == b"{" and b'"history"' in head and (
            b'"agent_class"' in head or b'"issue_type"' in head or b'"instance_id"' in head and b'"instruction"' in head)

    def check_record(self, obj: Any) -> str | None:
        if not isinstance(obj, dict) or not isinstance(obj.get("history"), list):
            return "expected an object with a 'history' list of events"
        return None

    def parse(self, obj: dict[str, Any], ctx: RecordContext) -> list[ParsedEpisode]:
        history = obj["history"]
        if history and isinstance(history[0], list):  # very old outputs: [action, observation] pairs
            history = [e for pair in history for e in pair if isinstance(e, dict)]
        bad = [i for i, e in enumerate(history) if not isinstance(e, dict)]
        if bad:
            raise InputFormatError(f"history event {bad[0]} is a {type(history[bad[0]]).__name__}",
                                   where=ctx.where(), valid="event objects")
        if not history and not obj.get("error"):
            raise InputFormatError("empty history and no error: nothing says what the agent did",
                                   where=ctx.where(), valid="a history with events, or an 'error' for a failed run")
        steps, counts, v1 = _steps_of(history, first_user_is_harness=True)
        metrics = obj.get("metrics") or {}
        usage = metrics.get("accumulated_token_usage") or {}
        common = _common(steps)
        if "issue" in obj:  # resolver
            issue = obj["issue"] or {}
            repo = f"github.com/{issue.get('owner')}/{issue.get('repo')}" if issue.get("owner") else None
            ep = episode(
                task_id=f"{issue.get('owner')}/{issue.get('repo')}#{issue.get('number')}" if repo else None,
                task_text="\n\n".join(x for x in (issue.get("title"), issue.get("body")) if x) or obj.get("instruction"),
                repository=repo, base_commit=obj.get("base_commit") or None, harness_name="openhands-resolver",
                resolved=obj.get("success"), verifier_name="openhands-resolver-judge" if obj.get("success") is not None else None,
                verifier_status="ok" if obj.get("success") is not None else None,
                exit_status="error" if obj.get("error") else "finished", termination_reason=obj.get("error"),
                cost_usd=metrics.get("accumulated_cost"), **common,
                metadata={"issue_type": obj.get("issue_type"), "result_explanation": obj.get("result_explanation"),
                          "comment_success": obj.get("comment_success"), "git_patch": obj.get("git_patch"), **counts})
            return [ParsedEpisode(ep, number_steps(steps), tool_schemas_of(history))]
        meta = obj.get("metadata") or {}
        llm = meta.get("llm_config") or meta.get("llm") or {}
        instance = obj.get("instance") or {}
        error = obj.get("error")
        sampling = {k: llm[k] for k in ("temperature", "top_p", "max_output_tokens") if llm.get(k) is not None} or None
        common.update({k: v for k, v in (("tokens_in", usage.get("prompt_tokens")),
                                         ("tokens_out", usage.get("completion_tokens"))) if v})
        ep = episode(
            task_id=obj.get("instance_id"), instance_id=obj.get("instance_id"),
            task_text=instance.get("problem_statement") or obj.get("instruction"),
            repository=github_repo(f"github.com/{instance['repo']}") if instance.get("repo") else None,
            base_commit=instance.get("base_commit"), policy_name=llm.get("model") or _model_of(history),
            harness_name=f"openhands/{meta.get('agent_class')}" if meta.get("agent_class")
            else "openhands-sdk" if v1 else "openhands",
            harness_commit=meta.get("git_commit"), sampling=sampling,
            exit_status="error" if error else _finish_status(history, v1), termination_reason=error,
            cost_usd=metrics.get("accumulated_cost"), **common,
            metadata={"max_iterations": meta.get("max_iterations"), "dataset": meta.get("dataset"),
                      "start_time": meta.get("start_time"),
                      "git_patch": (obj.get("test_result") or {}).get("git_patch"),
                      "test_result": {k: v for k, v in (obj.get("test_result") or {}).items() if k != "git_patch"}
                      or None, "details": meta.get("details"),
                      "fail_to_pass": instance.get("FAIL_TO_PASS"), "pass_to_pass": instance.get("PASS_TO_PASS"), **counts})
        return [ParsedEpisode(ep, number_steps(steps), tool_schemas_of(history))]


class OpenHandsEventStreamAdapter(Adapter):
    name = "openhands-events"
    version = "1.2.0"
    framing = "document"
    description = "OpenHands exported event stream (JSON array of events)"
    grows = True

    def sniff(self, path: str, head: bytes) -> bool:
        return head.lstrip()[:1] == b"[" and b'"source"' in head and b'"timestamp"' in head and (
            b'"action"' in head or b'"observation"' in head)

    def check_record(self, obj: Any) -> str | None:
        if not isinstance(obj, list) or not all(isinstance(e, dict) for e in obj):
            return "expected a JSON array of event objects"
        if not any("action" in e or "observation" in e or e.get("kind") in V1_KINDS for e in obj):
            return "no action or observation events"
        return None

    def parse(self, obj: list[dict[str, Any]], ctx: RecordContext) -> list[ParsedEpisode]:
        if not obj:
            raise InputFormatError("empty event stream", where=ctx.where(), valid="a JSON array of OpenHands events")
        steps, counts, v1 = _steps_of(obj, first_user_is_harness=False)
        first_user = next((s["text"] for s in steps if s["author"] == "human"), None)
        ep = episode(task_text=first_user, harness_name="openhands-sdk" if v1 else "openhands", policy_name=_model_of(obj),
                     exit_status="finished" if _finished(obj) else None,
                     **_common(steps), metadata={"events": len(obj), **counts})
        return [ParsedEpisode(ep, number_steps(steps), tool_schemas_of(obj))]




_FILE_STORE_PART = re.compile(r"[/\\](?:events|event_cache)[/\\][^/\\]+\.json$")


class OpenHandsFileStoreAdapter(OpenHandsEventStreamAdapter):
    """An OpenHands ``file_store`` conversation: ``sessions/<id>/events/<n>.json`` (one event per
    file; V1: ``<id>/events/event-<n>-<uuid>.json``) and ``event_cache/<start>-<end>.json`` pages of
    25 events. Every file is a raw record of its own; the records of one conversation folder are
    assembled into one episode (events deduplicated by id, in id order), whose source episode id is
    the conversation id, so it keeps its identity as the conversation grows."""

    name = "openhands-file-store"
    version = "1.1.0"
    description = "OpenHands file_store conversation: events/<n>.json and event_cache/<a>-<b>.json (one episode)"
    grows = False
    assembled = True

    def sniff(self, path: str, head: bytes) -> bool:
        first = head.lstrip()[:1]
        return bool(_FILE_STORE_PART.search(path)) and first in (b"{", b"[") and (
            (b'"source"' in head and b'"timestamp"' in head) or b'Event"' in head)

    def decode(self, data: bytes) -> Any:
        obj = orjson.loads(data)
        return [obj] if isinstance(obj, dict) else obj  # one event file or a cache page

    def session_of(self, path: str) -> str | None:
        parts = re.split(r"[/\\]", path)
        return "/".join(parts[:-2]) if len(parts) >= 3 else None

    def combine(self, parts: list[Any]) -> list[dict[str, Any]]:
        events: dict[Any, dict[str, Any]] = {}
        for part in parts:
            for e in part if isinstance(part, list) else [part]:
                if isinstance(e, dict):
                    events.setdefault(e.get("id", len(events)), e)
        return sorted(events.values(), key=lambda e: (str(type(e.get("id"))), e.get("id") if e.get("id") is not None else 0))

    def parse(self, obj: list[dict[str, Any]], ctx: RecordContext) -> list[ParsedEpisode]:
        [pe] = super().parse(self.combine([obj]), ctx)
        session = self.session_of(ctx.file_path)
        pe.episode["source_episode_id"] = session.rsplit("/", 1)[-1] if session else None
        pe.episode["metadata"] = json_text({**orjson.loads(pe.episode["metadata"] or "{}"), "file_store": session})
        return [pe]
