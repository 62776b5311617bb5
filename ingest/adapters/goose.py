"""Goose sessions (Block's agent): the JSON lines it kept per session, and ``goose session export``.

Before sessions moved into SQLite (1.10), Goose wrote ``~/.local/share/goose/sessions/<id>.jsonl``:
a first line of the session's metadata (``working_dir``, ``description``, ``schedule_id``,
``message_count``, ``total_tokens``, ``input_tokens``, ``output_tokens``, their ``accumulated_``
counts), then a message per line. An export (``goose session export --format json``) is one JSON
object: the session's metadata (``id``, ``working_dir``, ``name`` / ``description``,
``created_at``, the token counts) and its ``conversation`` (the messages).

A message is ``{"id", "role": "user" | "assistant", "created": <Unix seconds>, "content": [...],
"metadata": {"userVisible", "agentVisible"}}``; its content items are tagged by ``type``:
``text``, ``image`` (named, never kept), ``toolRequest`` (``id`` and ``toolCall``: ``{"status":
"success", "value": {"name", "arguments"}}``, or ``{"status": "error", "error": ...}``: a call the
model wrote badly, kept as an ``invalid_tool_call`` so its error answers it), ``toolResponse``
(``id`` and ``toolResult``: the content items the tool gave, as a list or under ``content`` with
``isError``, or an error; an item whose ``audience`` leaves out the assistant was the person's
alone and is left out), ``thinking`` / ``redactedThinking``
(the model's reasoning), ``toolConfirmationRequest``, ``actionRequired``, ``frontendToolRequest``,
``systemNotification``, ``contextLengthExceeded``, ``summarizationRequested`` (the harness's; a
session whose last word is ``contextLengthExceeded`` ended out of context: a budget).
A user message's text is the person's (the first, the task); its tool responses are the
environment's, linked to their calls by id. A message the agent alone sees (``userVisible``
false) is the harness's. Tool names carry their extension (``developer__shell``): the action is
classified by the tool's own name.
"""

from __future__ import annotations

import re
from pathlib import PurePath
from typing import Any

import orjson
from trajwh.ingest.adapters.base import Adapter, ParsedEpisode, RecordContext
from trajwh.ingest.adapters.common import (
    count_of,
    decode_jsonl_document,
    episode,
    id_text,
    json_text,
    link_observations,
    number_steps,
    step,
    tool_call,
    ts,
)

_META_LINE = re.compile(rb'\A\s*\{[^\n]*"working_dir"\s*:')
_HARNESS_ITEMS = {"toolConfirmationRequest", "actionRequired", "frontendToolRequest", "systemNotification",
                  "contextLengthExceeded", "summarizationRequested"}


def _image(c: dict[str, Any]) -> str:
    """An image item named, never kept."""
    return f"[image {c.get('mimeType') or ''}]".replace(" ]", "]")


def _content_text(items: Any) -> str | None:
    """The text of MCP content items (text; a resource's text; an image named)."""
    out = []
    for c in items if isinstance(items, list) else []:
        if not isinstance(c, dict):
            continue
        audience = (c.get("annotations") or {}).get("audience") if isinstance(c.get("annotations"), dict) else None
        if isinstance(audience, list) and "assistant" not in audience:  # shown to the person only, not the model
            continue
        if c.get("type") == "text" and isinstance(c.get("text"), str):
            out.append(c["text"])
        elif c.get("type") == "image":
            out.append(_image(c))
        elif c.get("type") == "resource" and isinstance(c.get("resource"), dict):
            res = c["resource"]
            out.append(res["text"] if isinstance(res.get("text"), str) else f"[resource {res.get('uri') or ''}]")
    return "\n".join(out) or None


def _result(value: Any) -> tuple[str | None, bool]:
    """(output, is_error) of a ``toolResult``."""
    if not isinstance(value, dict):
        return None, False
    if value.get("status") == "error":
        return str(value.get("error") or "error"), True
    inner = value.get("value")
    if isinstance(inner, dict):  # CallToolResult: {"content": [...], "isError": bool}
        return _content_text(inner.get("content")), inner.get("isError") is True
    return _content_text(inner), False


def _message_steps(m: dict[str, Any]) -> list[dict[str, Any]]:
    role, when = m.get("role"), ts(m.get("created"))
    items = [c for c in m.get("content") or [] if isinstance(c, dict)]
    meta = m.get("metadata") if isinstance(m.get("metadata"), dict) else {}
    hidden = meta.get("userVisible") is False  # written for the agent alone: the harness's
    out: list[dict[str, Any]] = []
    texts, calls, reasoning, bad_calls = [], [], [], 0
    for c in items:
        kind = c.get("type")
        if kind == "text" and isinstance(c.get("text"), str):
            texts.append(c["text"])
        elif kind == "image":
            texts.append(_image(c))
        elif kind == "toolRequest":
            call = c.get("toolCall") if isinstance(c.get("toolCall"), dict) else {}
            value = call.get("value") if isinstance(call.get("value"), dict) else None
            if call.get("status") == "success" and value is not None:
                calls.append(tool_call(str(value.get("name") or "unknown"), value.get("arguments"), id_text(c.get("id"))))
            else:  # a call the model wrote that Goose could not read: kept as a call, so its error answers it
                calls.append(tool_call("invalid_tool_call", {"error": call.get("error") or json_text(call)}, id_text(c.get("id"))))
                bad_calls += 1
        elif kind == "toolResponse":
            output, error = _result(c.get("toolResult"))
            out.append(step("tool", "environment", observation=output, tool_call_id=id_text(c.get("id")), started_at=when,
                            metadata={"is_error": True} if error else None))
        elif kind in ("thinking", "redactedThinking"):
            said = c.get("thinking") if isinstance(c.get("thinking"), str) else "[redacted thinking]"
            reasoning.append(said)
        elif kind in _HARNESS_ITEMS:
            said = c.get("msg") or c.get("message") or c.get("prompt") or json_text(c)
            out.append(step("system", "harness", text=str(said), started_at=when, metadata={"goose_item": kind}))
    text = "\n".join(texts) or None
    if role == "assistant":
        if text or calls or reasoning:
            extra = {k: v for k, v in (("reasoning", "\n".join(reasoning)), ("invalid_calls", bad_calls)) if v}
            out.insert(0, step("assistant", "model", text=text, tool_calls=calls, started_at=when, metadata=extra))
    elif text:  # what the person typed (the first: the task), unless written for the agent alone
        out.insert(0, step("user", "harness" if hidden else "human", text=text, started_at=when))
    return out


#: items that make a step of the model's, the person's or a tool's (a later one means the session went on)
_WORK_ITEMS = {"text", "image", "toolRequest", "toolResponse", "thinking", "redactedThinking"}


def _out_of_context(messages: list[dict[str, Any]]) -> str | None:
    """The message of a ``contextLengthExceeded`` notice that no later work followed (text the agent
    alone sees is the harness's, not work), or None."""
    notice = None
    for m in messages:
        meta = m.get("metadata") if isinstance(m.get("metadata"), dict) else {}
        hidden = m.get("role") != "assistant" and meta.get("userVisible") is False
        for c in m.get("content") or []:
            kind = c.get("type") if isinstance(c, dict) else None
            if kind == "contextLengthExceeded":
                notice = str(c.get("msg") or c.get("message") or "")
            elif kind in _WORK_ITEMS and not (hidden and kind in ("text", "image")):
                notice = None
    return notice


class GooseAdapter(Adapter):
    name = "goose"
    version = "1.0.0"
    framing = "document"
    description = "Goose session (sessions/<id>.jsonl: a metadata line, then messages; or `goose session export` JSON)"

    def sniff(self, path: str, head: bytes) -> bool:
        if _META_LINE.match(head) and (b'"message_count"' in head or b'"description"' in head
                                       or b'"conversation"' in head):
            return True
        return head.lstrip()[:1] == b"{" and b'"created"' in head and (b'"toolRequest"' in head or b'"toolResponse"' in head)

    def decode(self, data: bytes) -> Any:
        try:
            return orjson.loads(data)  # an export: one object
        except orjson.JSONDecodeError:
            return decode_jsonl_document(data)

    def check_record(self, obj: Any) -> str | None:
        if not isinstance(obj, dict):
            return "expected a Goose session (JSON lines or an exported object)"
        messages = self._messages(obj)
        if not messages:
            return "a Goose session without messages"
        return None

    @staticmethod
    def _meta(obj: dict[str, Any]) -> dict[str, Any]:
        if "entries" in obj:
            first = obj["entries"][0] if obj["entries"] else {}
            return first if "working_dir" in first and "content" not in first else {}
        return obj

    def _messages(self, obj: dict[str, Any]) -> list[dict[str, Any]]:
        if "entries" in obj:
            found = obj["entries"]
        else:
            conv = obj.get("conversation")
            found = conv.get("messages") if isinstance(conv, dict) else conv or obj.get("messages")
        return [m for m in found or [] if isinstance(m, dict) and "content" in m and "role" in m]

    def parse(self, obj: dict[str, Any], ctx: RecordContext) -> list[ParsedEpisode]:
        meta = self._meta(obj)
        messages = self._messages(obj)
        steps = [s for m in messages for s in _message_steps(m)]
        counts = link_observations(steps)
        number_steps(steps)
        task = next((s["text"] for s in steps if s["author"] == "human"), None)
        times = [s["started_at"] for s in steps if s.get("started_at")]
        stem = PurePath(ctx.file_path).name.split(".", 1)[0]
        sid = meta.get("id") if isinstance(meta.get("id"), str) else (stem if stem and not stem.startswith("<") else None)
        exit_status = termination = None
        notice = _out_of_context(messages)
        if notice is not None:  # the session ran out of context
            exit_status, termination = "context_length_exceeded", f"context length exceeded: {notice}"[:300]
        ep = episode(
            source_episode_id=sid, task_text=task, harness_name="goose", exit_status=exit_status,
            termination_reason=termination,
            policy_name=next((meta[k] for k in ("model", "model_name") if isinstance(meta.get(k), str)), None),
            started_at=ts(meta.get("created_at")) or (min(times) if times else None),
            ended_at=ts(meta.get("updated_at")) or (max(times) if times else None),
            tokens_in=count_of(meta.get("accumulated_input_tokens")) or count_of(meta.get("input_tokens")),
            tokens_out=count_of(meta.get("accumulated_output_tokens")) or count_of(meta.get("output_tokens")),
            metadata={"working_dir": meta.get("working_dir"), "description": meta.get("description") or meta.get("name"),
                      "schedule_id": meta.get("schedule_id"), "message_count": meta.get("message_count"),
                      "bad_lines": len(obj.get("bad_lines") or []) or None, **counts},
        )
        return [ParsedEpisode(ep, steps)]
