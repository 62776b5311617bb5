"""Claude Code session transcripts (``~/.claude/projects/<project>/<session>.jsonl``).

One file is one session (one episode). Lines of several types: ``user`` and ``assistant``
messages (content as text or blocks: ``text``, ``thinking``, ``tool_use``, ``tool_result``),
``system``, ``summary``, and bookkeeping (``queue-operation``, ``last-prompt``, ...), which is
counted in the episode metadata rather than turned into steps.

Authorship: assistant text and tool calls are ``model``; a user message typed by the person is
``human``; ``tool_result`` blocks are ``environment``; meta messages (``isMeta``, slash-command
wrappers, local command output, caveats), compaction summaries (``isCompactSummary``), task and
bash notifications and system lines are ``harness``. A subagent transcript (``agent-<id>.jsonl``,
every line ``isSidechain``) is its own episode, linked to its parent by ``parent_session_id``
(source episode id ``<session>/agent-<id>``); its first user message is the parent's Task prompt
(``harness``). Token usage counts each streamed message once (one line per content block repeats
the message's usage) and includes cache reads and writes in the input.

Headless runs (``claude -p --output-format stream-json``, the Agent SDK, and claude-code-action's
execution log, which is the same messages as one JSON array) write the same messages without times
or uuids, under ``session_id``: the ``system`` ``init`` line gives the model, the tools and the
working folder (not a step); messages of a subagent carry the ``parent_tool_use_id`` of the Task
call that started it; the ``result`` line ends the run: its ``subtype`` is the exit status
(``success``, ``error_max_turns``: a budget, ``error_during_execution``), its cost and turns go to
the episode.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import orjson
from trajwh.ingest.adapters.base import JsonlSessionAdapter, ParsedEpisode, RecordContext
from trajwh.ingest.adapters.common import (
    count_of,
    episode,
    file_stem,
    link_observations,
    number_steps,
    step,
    text_of,
    tool_call,
    ts,
)

#: a headless run's lines: the init line, or a message of the stream (``parent_tool_use_id``)
_HEADLESS = re.compile(rb'"subtype"\s*:\s*"init"|"parent_tool_use_id"\s*:')
_HARNESS_PREFIXES = ("<command-name>", "<command-message>", "<local-command-stdout>", "Caveat:",
                     "<system-reminder>", "[Request interrupted", "<task-notification>", "<bash-notification>",
                     "<user-prompt-submit-hook>", "This session is being continued from a previous conversation")


def _usage(msg: dict[str, Any]) -> dict[str, int | None]:
    """Token counts of a message line. Input counts cache reads and cache writes (they are input the
    model read)."""
    usage = msg.get("usage") if isinstance(msg.get("usage"), dict) else {}
    if not usage:
        return {"tokens_in": None, "tokens_out": None, "cache_read": None, "cache_write": None}

    def count(key: str) -> int | None:  # a count, or nothing (a damaged line may hold text); a count too big
        v = usage.get(key)  # for 64 bits (orjson reads it as a float) stays one, for the value guard to refuse
        return count_of(int(v) if isinstance(v, float) and v.is_integer() else v)

    cache_read, cache_write = count("cache_read_input_tokens") or 0, count("cache_creation_input_tokens") or 0
    fresh = count("input_tokens")
    return {"tokens_in": None if fresh is None else fresh + cache_read + cache_write,
            "tokens_out": count("output_tokens"), "cache_read": cache_read or None, "cache_write": cache_write or None}


def _count_once(steps_of: dict[str, tuple[dict[str, Any], dict[str, int | None]]], mid: Any, row: dict[str, Any],
                usage: dict[str, int | None]) -> dict[str, int | None]:
    """A streamed message's tokens counted once, on its first step: Claude Code writes one line per
    content block, each with the message's usage so far (a headless stream's first block says 3 tokens
    out, its last the whole count), so the largest count of the message is kept. Returns the counts to
    add to the episode's cache totals (the first time only)."""
    if not mid:
        row["tokens_in"], row["tokens_out"] = usage["tokens_in"], usage["tokens_out"]
        return usage
    if mid not in steps_of:
        steps_of[mid] = (row, usage)
        row["tokens_in"], row["tokens_out"] = usage["tokens_in"], usage["tokens_out"]
        return usage
    first, had = steps_of[mid]
    if (usage["tokens_out"] or 0) > (first["tokens_out"] or 0):
        first["tokens_out"] = usage["tokens_out"]
    if (usage["tokens_in"] or 0) > (first["tokens_in"] or 0):
        first["tokens_in"] = usage["tokens_in"]
    return {"tokens_in": None, "tokens_out": None, "cache_read": None, "cache_write": None}


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _result(result: dict[str, Any]) -> tuple[str | None, str | None, float | None]:
    """A headless run's exit status, termination reason and cost from its ``result`` line."""
    if not result:
        return None, None, None
    subtype = result.get("subtype") if isinstance(result.get("subtype"), str) else None
    cost = result.get("total_cost_usd", result.get("cost_usd"))
    cost = float(cost) if isinstance(cost, int | float) and not isinstance(cost, bool) else None
    if subtype == "error_max_turns":
        return subtype, f"max turns reached ({result.get('num_turns')} turns): error_max_turns", cost
    if subtype and subtype != "success" or result.get("is_error") is True:
        said = result.get("result") if isinstance(result.get("result"), str) else ""
        return subtype or "error", f"{subtype or 'error'}: {said.strip()}"[:300].rstrip(": "), cost
    return subtype, None, cost


class ClaudeCodeAdapter(JsonlSessionAdapter):
    name = "claude-code"
    version = "1.2.0"  # 1.2: headless runs (stream-json, the Agent SDK, claude-code-action's log)
    description = "Claude Code session JSONL (one session per file; a subagent transcript is its own episode)"
    grows = True

    def sniff(self, path: str, head: bytes) -> bool:
        start = head.lstrip()[:1]
        if start in (b"{", b"[") and b'"session_id"' in head and _HEADLESS.search(head):
            return True  # a headless run's stream-json (or its lines as one JSON array)
        return start == b"{" and b'"sessionId"' in head and (
            b'"type":"user"' in head or b'"type":"queue-operation"' in head or b'"type":"summary"' in head
            or b'"type": "user"' in head)

    def decode(self, data: bytes) -> Any:
        if data.lstrip()[:1] == b"[":  # claude-code-action's execution log: the stream's messages as one array
            value = orjson.loads(data)
            if not isinstance(value, list):
                raise ValueError("expected an array of messages")
            return {"entries": [e for e in value if isinstance(e, dict)],
                    "bad_lines": [n for n, e in enumerate(value) if not isinstance(e, dict)]}
        return super().decode(data)

    def check_record(self, obj: Any) -> str | None:
        entries = obj.get("entries", [])
        said = [e for e in entries if e.get("type") in ("user", "assistant")]
        if not said:
            return "no user or assistant lines"
        messages = [e["message"] for e in said if isinstance(e.get("message"), dict)]
        if messages and not any("content" in m for m in messages):  # read as Claude's, every message would be empty
            keys = sorted({k for m in messages for k in m})[:8]
            return (f"no user or assistant line holds a Claude message (message.content); its messages have "
                    f"{', '.join(keys)}: another harness's session lines (Qwen Code's have role and parts)")
        return None

    def parse(self, obj: dict[str, Any], ctx: RecordContext) -> list[ParsedEpisode]:
        steps: list[dict[str, Any]] = []
        other = Counter()
        model = version = session = cwd = agent = None
        seen_messages: dict[str, tuple[dict[str, Any], dict[str, int | None]]] = {}
        cache = Counter()
        entries = obj["entries"]
        # a subagent transcript (agent-<id>.jsonl): every line is a sidechain of the parent session
        subagent = bool(entries) and all(e.get("isSidechain") for e in entries if e.get("type") in ("user", "assistant"))
        task_prompt_seen = False
        init: dict[str, Any] = {}
        result: dict[str, Any] = {}
        for e in entries:
            kind = e.get("type")
            session = session or _text(e.get("sessionId")) or _text(e.get("session_id"))
            agent = agent or e.get("agentId")
            version = version or e.get("version")
            cwd = cwd or e.get("cwd")
            when = ts(e.get("timestamp"))
            meta = {"uuid": e.get("uuid"), "sidechain": e.get("isSidechain") or None,
                    "parent_tool_use_id": e.get("parent_tool_use_id")}
            msg = e.get("message") if isinstance(e.get("message"), dict) else {}
            if kind == "assistant":
                model = model or msg.get("model")
                blocks = msg.get("content") if isinstance(msg.get("content"), list) else []
                text = text_of([b for b in blocks if isinstance(b, dict) and b.get("type") == "text"]) or (
                    msg.get("content") if isinstance(msg.get("content"), str) else None)
                thinking = [b.get("thinking") for b in blocks if isinstance(b, dict) and b.get("type") == "thinking"]
                calls = [tool_call(b.get("name", "unknown"), b.get("input"), b.get("id"))
                         for b in blocks if isinstance(b, dict) and b.get("type") == "tool_use"]
                row = step("assistant", "model", text=text, tool_calls=calls, started_at=when,
                           metadata={**meta, "thinking": "\n".join(t for t in thinking if t) or None,
                                     "stop_reason": msg.get("stop_reason"), "message_id": msg.get("id")})
                counted = _count_once(seen_messages, msg.get("id"), row, _usage(msg))
                cache.update({k: counted[k] or 0 for k in ("cache_read", "cache_write")})
                steps.append(row)
            elif kind == "user":
                content = msg.get("content")
                blocks = content if isinstance(content, list) else []
                for b in blocks:
                    if isinstance(b, dict) and b.get("type") == "tool_result":
                        steps.append(step("tool", "environment", observation=text_of(b.get("content")),
                                          tool_call_id=b.get("tool_use_id"), started_at=when,
                                          metadata={**meta, "is_error": b.get("is_error")}))
                text = content if isinstance(content, str) else text_of(
                    [b for b in blocks if isinstance(b, dict) and b.get("type") == "text"])
                if text:
                    harness = (e.get("isMeta") or e.get("isCompactSummary") or e.get("isVisibleInTranscriptOnly")
                               or text.lstrip().startswith(_HARNESS_PREFIXES)
                               or (subagent and not task_prompt_seen))  # the parent's Task prompt
                    task_prompt_seen = task_prompt_seen or subagent
                    steps.append(step("user", "harness" if harness else "human", text=text, started_at=when,
                                      metadata={**meta, "context_compression": e.get("isCompactSummary") or None}))
            elif kind == "system" and e.get("subtype") == "init":  # a headless run's start: not a step
                init = e
                model = model or _text(e.get("model"))
                cwd = cwd or _text(e.get("cwd"))
                version = version or _text(e.get("claude_code_version"))
            elif kind == "result":  # a headless run's end
                result = e
            elif kind == "system":
                steps.append(step("system", "harness", text=e.get("content") or text_of(msg.get("content")),
                                  started_at=when, metadata={**meta, "subtype": e.get("subtype")}))
            else:
                other[kind or "untyped"] += 1
        counts = link_observations(steps)
        times = [s["started_at"] for s in steps if s.get("started_at")]
        first_human = next((s["text"] for s in steps if s["author"] == "human"), None)
        if subagent:  # its own episode, linked to the parent session (one session id, two transcripts)
            first_human = next((s["text"] for s in steps if s["role"] == "user" and s["text"]), None)
        exit_status, termination, cost = _result(result)
        ep = episode(
            exit_status=exit_status, termination_reason=termination, cost_usd=cost,
            source_episode_id=f"{session}/agent-{agent or file_stem(ctx.file_path, ('.jsonl',))}" if subagent
            else session, task_text=first_human, harness_name="claude-code", harness_version=version,
            policy_name=model, started_at=min(times) if times else None, ended_at=max(times) if times else None,
            tokens_in=sum(s["tokens_in"] or 0 for s in steps) or None,
            tokens_out=sum(s["tokens_out"] or 0 for s in steps) or None,
            metadata={"cwd": cwd, "other_lines": dict(other) or None, "bad_lines": obj["bad_lines"] or None,
                      "parent_session_id": session if subagent else None, "subagent": subagent or None,
                      "cache_read_tokens": cache["cache_read"] or None, "cache_write_tokens": cache["cache_write"] or None,
                      "headless": bool(init or result) or None, "tools": init.get("tools") or None,
                      "permission_mode": init.get("permissionMode"), "num_turns": result.get("num_turns"),
                      "duration_ms": result.get("duration_ms"), "final_result": result.get("result"), **counts},
        )
        return [ParsedEpisode(ep, number_steps(steps))]


