"""OpenHands V1 (software-agent-sdk) events: typed objects with a ``kind``.

V0 events carry ``action``/``observation`` as strings and ``args``/``extras`` beside them. V1
events (the SDK's ``Event`` models, as written to evaluation ``output.jsonl`` histories and to
``events/`` folders) carry a ``kind`` naming the event class, and an ``action`` or
``observation`` that is itself an object with its own ``kind`` (``ExecuteBashAction``,
``FileEditorObservation``, ...). The LLM-visible kinds become steps:

- ``SystemPromptEvent`` -> system, ``harness``;
- ``MessageEvent`` -> user (the first one is the task prompt the evaluation harness wrote:
  ``harness`` in output files, ``human`` in a person's session) or assistant (``model``);
- ``ActionEvent`` -> assistant with its ``tool_call`` (the arguments as the model emitted them),
  the ``thought`` blocks as text; ``model``;
- ``ObservationEvent`` -> tool result linked by ``tool_call_id``, ``environment``;
- ``AgentErrorEvent`` -> the harness's reply to a call it could not run, ``harness``;
- ``UserRejectObservation`` -> a person rejected the call, ``human``;
- ``CondensationSummaryEvent`` -> the condenser's summary, ``harness``.

Internal events (``ConversationStateUpdateEvent``, ``Condensation``, ``CondensationRequest``,
``PauseEvent``) are not shown to the model: they are counted in the episode metadata, not
turned into steps. An event of a kind this adapter does not know is kept as a ``harness`` step
with its kind in the metadata, so nothing is dropped silently.
"""

from __future__ import annotations

from typing import Any

from trajwh.ingest.adapters.common import json_text, step, text_of, tool_call, ts

V1_KINDS = frozenset({"SystemPromptEvent", "MessageEvent", "ActionEvent", "ObservationEvent", "AgentErrorEvent",
                      "UserRejectObservation", "CondensationSummaryEvent", "ConversationStateUpdateEvent",
                      "Condensation", "CondensationRequest", "PauseEvent"})
_INTERNAL = {"ConversationStateUpdateEvent", "Condensation", "CondensationRequest", "PauseEvent"}
_OBS_TEXT_KEYS = ("output", "content", "text", "message", "error")


def is_v1(events: list[Any]) -> bool:
    """True when the history holds SDK events (a ``kind`` naming an event class)."""
    return any(isinstance(e, dict) and e.get("kind") in V1_KINDS for e in events[:20])


def _observation_text(obs: dict[str, Any]) -> str | None:
    for key in _OBS_TEXT_KEYS:
        value = obs.get(key)
        if value not in (None, "", []):
            return text_of(value)
    return None


def _exit_code(obs: dict[str, Any]) -> int | None:
    code = obs.get("exit_code")
    if not isinstance(code, int):
        code = (obs.get("metadata") or {}).get("exit_code") if isinstance(obs.get("metadata"), dict) else None
    return code if isinstance(code, int) and code != -1 else None


def _action_step(e: dict[str, Any], when: Any, meta: dict[str, Any]) -> dict[str, Any]:
    action = e.get("action") if isinstance(e.get("action"), dict) else {}
    call = e.get("tool_call") if isinstance(e.get("tool_call"), dict) else {}
    name = call.get("name") or e.get("tool_name") or action.get("kind") or "unknown"
    arguments = call.get("arguments") if "arguments" in call else {k: v for k, v in action.items() if k != "kind"}
    thought = text_of(e.get("thought")) or None
    usage = ((e.get("metrics") or {}).get("usage") or {}) if isinstance(e.get("metrics"), dict) else {}
    executed = {k: v for k, v in action.items() if k != "kind"} if "arguments" in call and action else None
    return step("assistant", "model", text=thought, tool_calls=[tool_call(name, arguments, call.get("id")
                                                                          or e.get("tool_call_id"), executed=executed)],
                started_at=when, tokens_in=usage.get("prompt_tokens"), tokens_out=usage.get("completion_tokens"),
                metadata={**meta, "action": action.get("kind"), "reasoning": bool(e.get("reasoning_content"))})


def v1_events_to_steps(events: list[dict[str, Any]], *, first_user_is_harness: bool) -> tuple[list[dict[str, Any]],
                                                                                                dict[str, int]]:
    """Steps from SDK events, and counts of the internal and unknown events seen."""
    steps: list[dict[str, Any]] = []
    counts = {"internal_events": 0, "unknown_events": 0}
    seen_task = False
    for i, e in enumerate(events):
        kind = e.get("kind")
        when = ts(e.get("timestamp"))
        meta = {"event": e.get("id", i), "kind": kind}
        if kind == "SystemPromptEvent":
            steps.append(step("system", "harness", text=text_of(e.get("system_prompt")), started_at=when,
                              metadata={**meta, "tools": len(e.get("tools") or [])}))
        elif kind == "MessageEvent":
            message = e.get("llm_message") if isinstance(e.get("llm_message"), dict) else {}
            text = text_of(message.get("content"))
            if e.get("source") == "agent" or message.get("role") == "assistant":
                steps.append(step("assistant", "model", text=text, started_at=when, metadata=meta))
            else:
                author = "harness" if first_user_is_harness and not seen_task else "human"
                seen_task = True
                steps.append(step("user", author, text=text, started_at=when, metadata=meta))
        elif kind == "ActionEvent":
            steps.append(_action_step(e, when, meta))
        elif kind == "ObservationEvent":
            obs = e.get("observation") if isinstance(e.get("observation"), dict) else {}
            steps.append(step("tool", "environment", observation=_observation_text(obs),
                              tool_call_id=e.get("tool_call_id"), exit_code=_exit_code(obs), started_at=when,
                              metadata={**meta, "observation": obs.get("kind"), "error": obs.get("error")}))
        elif kind == "AgentErrorEvent":
            steps.append(step("user", "harness", text=text_of(e.get("error")), started_at=when,
                              metadata={**meta, "tool_call_id": e.get("tool_call_id")}))
        elif kind == "UserRejectObservation":
            steps.append(step("user", "human", text=text_of(e.get("rejection_reason")), started_at=when,
                              metadata={**meta, "tool_call_id": e.get("tool_call_id")}))
        elif kind == "CondensationSummaryEvent":  # the condenser replaced earlier events with this summary
            steps.append(step("user", "harness", text=text_of(e.get("summary")), started_at=when,
                              metadata={**meta, "context_compression": True}))
        elif kind in _INTERNAL:
            counts["internal_events"] += 1
        else:
            counts["unknown_events"] += 1
            steps.append(step("user", "harness", text=json_text(e), started_at=when, metadata={**meta, "unknown": True}))
    return steps, counts
