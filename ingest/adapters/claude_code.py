"""Claude Code session transcripts (``~/.claude/projects/<project>/<session>.jsonl``).

One file is one session (one episode). Lines of several types: ``user`` and ``assistant``
messages (content as text or blocks: ``text``, ``thinking``, ``tool_use``, ``tool_result``),
``system``, ``summary``, and bookkeeping (``queue-operation``, ``last-prompt``, ...), which is
counted in the episode metadata rather than turned into steps.

Authorship: assistant text and tool calls are ``model``; a user message typed by the person is
``human``; ``tool_result`` blocks are ``environment``; meta messages (``isMeta``, slash-command
wrappers, local command output, caveats) and system lines are ``harness``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from ingest.adapters.base import JsonlSessionAdapter, ParsedEpisode, RecordContext
from ingest.adapters.common import (
    episode,
    link_observations,
    number_steps,
    step,
    text_of,
    tool_call,
    ts,
)

_HARNESS_PREFIXES = ("<command-name>", "<command-message>", "<local-command-stdout>", "Caveat:",
                     "<system-reminder>", "[Request interrupted")


class ClaudeCodeAdapter(JsonlSessionAdapter):
    name = "claude-code"
    version = "1.0.0"
    description = "Claude Code session JSONL (one session per file)"

    def sniff(self, path: str, head: bytes) -> bool:
        return head.lstrip()[:1] == b"{" and b'"sessionId"' in head and (
            b'"type":"user"' in head or b'"type":"queue-operation"' in head or b'"type":"summary"' in head
            or b'"type": "user"' in head)

    def check_record(self, obj: Any) -> str | None:
        entries = obj.get("entries", [])
        if not any(e.get("type") in ("user", "assistant") for e in entries):
            return "no user or assistant lines"
        return None

    def parse(self, obj: dict[str, Any], ctx: RecordContext) -> list[ParsedEpisode]:
        steps: list[dict[str, Any]] = []
        other = Counter()
        model = version = session = cwd = None
        for e in obj["entries"]:
            kind = e.get("type")
            session = session or e.get("sessionId")
            version = version or e.get("version")
            cwd = cwd or e.get("cwd")
            when = ts(e.get("timestamp"))
            meta = {"uuid": e.get("uuid"), "sidechain": e.get("isSidechain") or None}
            msg = e.get("message") if isinstance(e.get("message"), dict) else {}
            if kind == "assistant":
                model = model or msg.get("model")
                blocks = msg.get("content") if isinstance(msg.get("content"), list) else []
                text = text_of([b for b in blocks if isinstance(b, dict) and b.get("type") == "text"]) or (
                    msg.get("content") if isinstance(msg.get("content"), str) else None)
                thinking = [b.get("thinking") for b in blocks if isinstance(b, dict) and b.get("type") == "thinking"]
                calls = [tool_call(b.get("name", "unknown"), b.get("input"), b.get("id"))
                         for b in blocks if isinstance(b, dict) and b.get("type") == "tool_use"]
                usage = msg.get("usage") or {}
                steps.append(step("assistant", "model", text=text, tool_calls=calls, started_at=when,
                                  tokens_in=usage.get("input_tokens"), tokens_out=usage.get("output_tokens"),
                                  metadata={**meta, "thinking": "\n".join(t for t in thinking if t) or None,
                                            "stop_reason": msg.get("stop_reason")}))
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
                    author = "harness" if e.get("isMeta") or text.lstrip().startswith(_HARNESS_PREFIXES) else "human"
                    steps.append(step("user", author, text=text, started_at=when, metadata=meta))
            elif kind == "system":
                steps.append(step("system", "harness", text=e.get("content") or text_of(msg.get("content")),
                                  started_at=when, metadata={**meta, "subtype": e.get("subtype")}))
            else:
                other[kind or "untyped"] += 1
        counts = link_observations(steps)
        times = [s["started_at"] for s in steps if s.get("started_at")]
        first_human = next((s["text"] for s in steps if s["author"] == "human"), None)
        ep = episode(
            source_episode_id=session, task_text=first_human, harness_name="claude-code", harness_version=version,
            policy_name=model, started_at=min(times) if times else None, ended_at=max(times) if times else None,
            tokens_in=sum(s["tokens_in"] or 0 for s in steps) or None,
            tokens_out=sum(s["tokens_out"] or 0 for s in steps) or None,
            metadata={"cwd": cwd, "other_lines": dict(other) or None, "bad_lines": obj["bad_lines"] or None, **counts},
        )
        return [ParsedEpisode(ep, number_steps(steps))]


