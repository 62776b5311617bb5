"""Gemini CLI chat recordings (``~/.gemini/tmp/<project>/chats/session-*.json`` or ``.jsonl``).

One file is one session (one episode). Two layouts are read:

- **JSON** (the CLI's chat recording through 2025): ``sessionId``, ``projectHash``,
  ``startTime``, ``lastUpdated``, optional ``summary``, and ``messages``.
- **JSON lines** (later CLIs): a header line (``sessionId``, ``projectHash``, ``kind``), then
  message records and ``{"$set": {"messages": [...]}}`` records. A ``$set`` is a snapshot of the
  whole conversation so far, not an increment: the messages are the last snapshot's, then the
  message records after it, each message id once (reading both would repeat the conversation).

A message has a ``type``: ``user`` (what the person typed: ``human``), ``gemini`` (the model:
``content``, ``thoughts`` kept as reasoning in the step metadata, ``tokens``, ``model``, and
``toolCalls``), or the CLI's own ``info`` / ``warning`` / ``error`` notices (``harness``). Each
tool call carries its result: the call is on the model's step and its result (each
``functionResponse``'s output or error, then any text parts) is an ``environment`` step linked by
the call id; a call whose status is not ``success`` is flagged. A message type nobody knows is
kept as a harness step naming it, never dropped.
"""

from __future__ import annotations

from typing import Any

import orjson
from trajwh.ingest.adapters.base import Adapter, ParsedEpisode, RecordContext
from trajwh.ingest.adapters.common import (
    decode_jsonl_document,
    episode,
    id_text,
    json_text,
    link_observations,
    number_steps,
    step,
    text_of,
    tool_call,
    ts,
)

_NOTICES = {"info", "warning", "error"}


def _assemble(doc: dict[str, Any]) -> dict[str, Any]:
    """The JSON-lines layout as one session object: the header's fields, the messages of the
    last ``$set`` snapshot and the message records after it (each id once)."""
    session: dict[str, Any] = {"bad_lines": doc["bad_lines"]}
    messages: list[dict[str, Any]] = []
    for entry in doc["entries"]:
        snapshot = entry.get("$set")
        if isinstance(snapshot, dict):
            if isinstance(snapshot.get("messages"), list):
                messages = [m for m in snapshot["messages"] if isinstance(m, dict)]
            session.update({k: v for k, v in snapshot.items() if k != "messages"})
        elif "type" in entry and ("content" in entry or "toolCalls" in entry):
            messages.append(entry)
        else:  # the header (and any other session-level record)
            session.update({k: v for k, v in entry.items() if k != "messages"})
    by_id: dict[Any, dict[str, Any]] = {}  # one message per id, where it first came, as it was last written
    for n, m in enumerate(messages):
        by_id[m.get("id") or f"#{n}"] = m
    session["messages"] = list(by_id.values())
    session["layout"] = "jsonl"
    return session


def _result_text(result: Any) -> str | None:
    """A tool call's result parts: each function response's output (or error, or the whole
    response as JSON), then any text parts, one after the other."""
    if result is None or isinstance(result, str):
        return result
    parts = result if isinstance(result, list) else [result]
    out: list[str] = []
    for p in parts:
        if not isinstance(p, dict):
            continue
        fr = p.get("functionResponse")
        if isinstance(fr, dict):
            resp = fr.get("response")
            if isinstance(resp, dict) and isinstance(resp.get("output"), str):
                out.append(resp["output"])
            elif isinstance(resp, dict) and isinstance(resp.get("error"), str):
                out.append(resp["error"])
            elif resp is not None:
                out.append(json_text(resp) or "")
        elif isinstance(p.get("text"), str):
            out.append(p["text"])
    return "\n".join(out) if out else None


def _thoughts(value: Any) -> str | None:
    lines = []
    for t in value if isinstance(value, list) else []:
        if isinstance(t, dict):
            lines.append(": ".join(x for x in (t.get("subject"), t.get("description")) if isinstance(x, str) and x))
    return "\n".join(x for x in lines if x) or None


class GeminiCliAdapter(Adapter):
    name = "gemini-cli"
    version = "1.0.0"
    framing = "document"
    description = "Gemini CLI chat recording (session-*.json, or .jsonl with $set snapshots)"

    def sniff(self, path: str, head: bytes) -> bool:
        return head.lstrip()[:1] == b"{" and b'"sessionId"' in head and b'"projectHash"' in head

    def decode(self, data: bytes) -> Any:
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            return _assemble(decode_jsonl_document(data))

    def check_record(self, obj: Any) -> str | None:
        if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list):
            return "expected a session object with a 'messages' list (or header, message and $set lines)"
        return None

    def parse(self, obj: dict[str, Any], ctx: RecordContext) -> list[ParsedEpisode]:
        steps: list[dict[str, Any]] = []
        models: list[str] = []
        unknown: dict[str, int] = {}
        tokens_in = tokens_out = cached = 0
        for m in obj["messages"]:
            if not isinstance(m, dict):
                continue
            kind, when = m.get("type"), ts(m.get("timestamp"))
            text = text_of(m.get("content")) or None
            if kind == "user":
                steps.append(step("user", "human", text=text, started_at=when))
            elif kind == "gemini":
                raw_usage = m.get("tokens") if isinstance(m.get("tokens"), dict) else {}
                usage = {k: v for k, v in raw_usage.items() if isinstance(v, int) and not isinstance(v, bool)}
                tokens_in += usage.get("input") or 0
                tokens_out += usage.get("output") or 0
                cached += usage.get("cached") or 0
                if isinstance(m.get("model"), str):
                    models.append(m["model"])
                model = m.get("model") if isinstance(m.get("model"), str) else None
                raw_calls = m.get("toolCalls")
                calls = [c for c in raw_calls if isinstance(c, dict)] if isinstance(raw_calls, list) else []
                steps.append(step("assistant", "model", text=text, started_at=when,
                                  tool_calls=[tool_call(str(c.get("name") or "unknown"), c.get("args"), id_text(c.get("id")))
                                              for c in calls],
                                  tokens_in=usage.get("input"), tokens_out=usage.get("output"),
                                  metadata={k: v for k, v in (("reasoning", _thoughts(m.get("thoughts"))),
                                                              ("model", model),
                                                              ("thought_tokens", usage.get("thoughts"))) if v}))
                for c in calls:
                    status = c.get("status")
                    output = _result_text(c.get("result"))
                    if output is None and isinstance(c.get("resultDisplay"), str):
                        output = c["resultDisplay"]
                    steps.append(step("tool", "environment", observation=output, tool_call_id=id_text(c.get("id")),
                                      started_at=ts(c.get("timestamp")) or when,
                                      metadata={"status": status, "is_error": True} if status not in (None, "success")
                                      else {"status": status} if status else None))
            elif kind in _NOTICES:
                steps.append(step("system", "harness", text=text, started_at=when, metadata={"notice": kind}))
            else:
                unknown[str(kind)] = unknown.get(str(kind), 0) + 1
                steps.append(step("system", "harness", text=text or json_text(m), started_at=when,
                                  metadata={"unknown_type": kind}))
        counts = link_observations(steps)
        number_steps(steps)
        times = [s["started_at"] for s in steps if s.get("started_at")]
        first_user = next((s["text"] for s in steps if s["author"] == "human" and s.get("text")), None)
        ep = episode(
            source_episode_id=id_text(obj.get("sessionId")), task_text=first_user, harness_name="gemini-cli",
            policy_name=models[0] if models else None,
            started_at=ts(obj.get("startTime")) or (min(times) if times else None),
            ended_at=max([t for t in (ts(obj.get("lastUpdated")), *times) if t], default=None),
            tokens_in=tokens_in or None, tokens_out=tokens_out or None,
            metadata={"project_hash": obj.get("projectHash"), "summary": obj.get("summary"), "kind": obj.get("kind"),
                      "layout": obj.get("layout", "json"), "models": sorted(set(models)) or None,
                      "cached_tokens": cached or None, "unknown_types": unknown or None,
                      "bad_lines": obj.get("bad_lines") or None, **counts},
        )
        return [ParsedEpisode(ep, steps)]
