"""Qwen Code sessions (``~/.qwen/projects/<project>/chats/<session id>.jsonl``).

Qwen Code began as a fork of Gemini CLI and records its sessions its own way: a JSON line per
record (``ChatRecord``), each with ``uuid``, ``parentUuid`` (records form a tree: a rewind or a
branch starts from an earlier record), ``sessionId``, ``timestamp``, ``type`` (``user``,
``assistant``, ``tool_result``, ``system``), ``cwd``, ``version``, ``gitBranch`` and the message as
the Gemini API holds it: ``message`` = ``{role: "user" | "model", parts: [...]}``, each part a
``text`` (``thought: true``: the model's thinking), a ``functionCall`` (``id``, ``name``, ``args``)
or a ``functionResponse`` (``id``, ``name``, ``response`` with ``output`` or ``error``). An
assistant record carries ``model`` and ``usageMetadata`` (``promptTokenCount``,
``candidatesTokenCount``, ``thoughtsTokenCount``); a tool result record ``toolCallResult``
(``status``: a call that did not succeed is flagged). Its lines look like Claude Code's (``uuid``,
``parentUuid``, ``sessionId``, ``type: user``), which read them as empty messages: this adapter is
sniffed first, by the ``parts`` of the first message.

The conversation is the branch that ends at the last record: from it back to the root by
``parentUuid`` (records of abandoned branches and of subagents, ``isSidechain``, stay in the raw
record and are counted). When a parent is missing the file's order is used. What the person typed
is ``human``; a ``system`` record is the CLI's (a chat compression, which changes what the model
sees from there on, is a harness step; the others are counted by subtype).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from trajwh.ingest.adapters.base import JsonlSessionAdapter, ParsedEpisode, RecordContext
from trajwh.ingest.adapters.common import (
    count_of,
    episode,
    id_text,
    link_observations,
    number_steps,
    step,
    tool_call,
    ts,
)
from trajwh.ingest.adapters.gemini_cli import _result_text

#: a record's message as the Gemini API holds it (Claude Code's lines have "content" instead of "parts")
_GEMINI_MESSAGE = re.compile(rb'"message"\s*:\s*\{\s*"role"\s*:\s*"(?:user|model)"\s*,\s*"parts"\s*:')


def _branch(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], bool]:
    """The records of the branch that ends at the last one, root first; and whether the tree was
    whole (else: the file's order, every non-sidechain record)."""
    main = [r for r in records if not r.get("isSidechain")]
    by_id = {r["uuid"]: r for r in main if isinstance(r.get("uuid"), str)}
    if not main or len(by_id) != len(main):
        return main, False
    chain, seen = [], set()
    node: dict[str, Any] | None = main[-1]
    while node is not None and node["uuid"] not in seen:
        seen.add(node["uuid"])
        chain.append(node)
        parent = node.get("parentUuid")
        if parent is None:
            return chain[::-1], True
        node = by_id.get(parent)
    return main, False  # a parent that is not in the file, or a loop


def _parts(record: dict[str, Any]) -> list[dict[str, Any]]:
    message = record.get("message") if isinstance(record.get("message"), dict) else {}
    parts = message.get("parts")
    return [p for p in parts if isinstance(p, dict)] if isinstance(parts, list) else []


class QwenCodeAdapter(JsonlSessionAdapter):
    name = "qwen-code"
    version = "1.0.0"
    description = "Qwen Code session JSONL (chat records with Gemini-style message parts; one session per file)"
    grows = True

    def sniff(self, path: str, head: bytes) -> bool:
        return head.lstrip()[:1] == b"{" and b'"sessionId"' in head and b'"parentUuid"' in head \
            and bool(_GEMINI_MESSAGE.search(head))

    def check_record(self, obj: Any) -> str | None:
        entries = obj.get("entries", []) if isinstance(obj, dict) else []
        if not any(e.get("type") in ("user", "assistant") and _parts(e) for e in entries):
            return "no user or assistant record with message parts"
        return None

    def parse(self, obj: dict[str, Any], ctx: RecordContext) -> list[ParsedEpisode]:
        records = [e for e in obj["entries"] if isinstance(e, dict)]
        chain, whole = _branch(records)
        steps: list[dict[str, Any]] = []
        system: Counter[str] = Counter()
        task: str | None = None
        models: list[str] = []
        tokens = [0, 0]
        seen_usage = False
        for r in chain:
            kind, when = r.get("type"), ts(r.get("timestamp"))
            meta = {"uuid": r.get("uuid")}
            if kind == "system":
                subtype = str(r.get("subtype") or "system")
                system[subtype] += 1
                if subtype == "chat_compression":
                    steps.append(step("system", "harness", text="[chat compression: the earlier history was summarized]",
                                      started_at=when, metadata={**meta, "subtype": subtype}))
                continue
            parts = _parts(r)
            texts = [p["text"] for p in parts if isinstance(p.get("text"), str) and not p.get("thought")]
            thoughts = [p["text"] for p in parts if isinstance(p.get("text"), str) and p.get("thought")]
            text = "\n".join(texts) or None
            if kind == "assistant":
                calls = [tool_call(str(fc.get("name") or "unknown"), fc.get("args"), id_text(fc.get("id")))
                         for p in parts if isinstance(fc := p.get("functionCall"), dict)]
                usage = r.get("usageMetadata") if isinstance(r.get("usageMetadata"), dict) else {}
                tin = count_of(usage.get("promptTokenCount"))
                tout = count_of(usage.get("candidatesTokenCount"))
                if tout is not None and count_of(usage.get("thoughtsTokenCount")):
                    tout += count_of(usage.get("thoughtsTokenCount")) or 0
                seen_usage |= tin is not None or tout is not None
                tokens = [tokens[0] + (tin or 0), tokens[1] + (tout or 0)]
                if isinstance(r.get("model"), str) and r["model"]:
                    models.append(r["model"])
                if thoughts:
                    meta["reasoning"] = "\n".join(thoughts)
                steps.append(step("assistant", "model", text=text, tool_calls=calls, started_at=when,
                                  tokens_in=tin, tokens_out=tout, metadata=meta))
            elif kind == "tool_result" or any(isinstance(p.get("functionResponse"), dict) for p in parts):
                status = (r.get("toolCallResult") or {}).get("status") if isinstance(r.get("toolCallResult"), dict) else None
                for p in parts:
                    fr = p.get("functionResponse")
                    if not isinstance(fr, dict):
                        continue
                    response = fr.get("response") if isinstance(fr.get("response"), dict) else {}
                    failed = (status not in (None, "success")) or "error" in response
                    steps.append(step("tool", "environment", observation=_result_text([p]),
                                      tool_call_id=id_text(fr.get("id")), started_at=when,
                                      metadata={**meta, "tool": fr.get("name"),
                                                **({"is_error": True, "status": status} if failed else {})}))
                if text:  # text beside the results (an image's note, a hook's context): the CLI's
                    steps.append(step("user", "harness", text=text, started_at=when, metadata=meta))
            elif kind == "user":
                if task is None:
                    task = text
                steps.append(step("user", "human", text=text, started_at=when, metadata=meta))
            else:  # a record type nobody knows: kept as a harness step naming it, never dropped
                steps.append(step("system", "harness", text=text, started_at=when, metadata={**meta, "type": kind}))
        counts = link_observations(steps)
        number_steps(steps)
        first = next((r for r in records if isinstance(r.get("sessionId"), str)), {})
        times = [s["started_at"] for s in steps if s.get("started_at")]
        ep = episode(
            source_episode_id=first.get("sessionId"), task_text=task, harness_name="qwen-code",
            harness_version=first.get("version") if isinstance(first.get("version"), str) else None,
            policy_name=models[0] if models else None,
            started_at=min(times) if times else None, ended_at=max(times) if times else None,
            tokens_in=tokens[0] if seen_usage else None, tokens_out=tokens[1] if seen_usage else None,
            metadata={"cwd": first.get("cwd"), "git_branch": first.get("gitBranch"), "whole_tree": whole,
                      "records": len(records), "records_off_branch": sum(1 for r in records if not r.get("isSidechain")) - len(chain)
                      if whole else None, "sidechain_records": sum(1 for r in records if r.get("isSidechain")) or None,
                      "system_records": dict(system) or None, "models": sorted(set(models)) if len(set(models)) > 1 else None,
                      "bad_lines": obj.get("bad_lines") or None, **counts})
        return [ParsedEpisode(ep, steps)]
