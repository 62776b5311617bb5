"""OpenAI Codex CLI rollouts (``~/.codex/sessions/YYYY/MM/DD/rollout-*.jsonl``).

One file is one session. Line types: ``session_meta`` (id, cli version, cwd, instructions),
``response_item`` (the model-visible history: ``message``, ``reasoning``, ``function_call``,
``function_call_output``, ``custom_tool_call(_output)``, ``local_shell_call``, web search),
``event_msg`` (UI events that repeat messages, and token counts), ``turn_context`` (model and
policies per turn), ``compacted``. Steps come from ``response_item`` only, so messages that
``event_msg`` repeats are not counted twice (the duplicated-history quirk); token usage comes
from the last ``token_count`` event.

Authorship: assistant messages and calls are ``model``; ``developer``/``system`` messages and the
user-role context blocks Codex injects (AGENTS.md instructions, ``<environment_context>``,
``<user_instructions>``) are ``harness``; other user messages are ``human``; call outputs are
``environment``.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from trajwh.ingest.adapters.base import JsonlSessionAdapter, ParsedEpisode, RecordContext
from trajwh.ingest.adapters.common import (
    decode_json_string,
    episode,
    link_observations,
    number_steps,
    step,
    text_of,
    tool_call,
    ts,
)

_INJECTED = ("<environment_context>", "# AGENTS.md instructions", "<user_instructions>", "<INSTRUCTIONS>")


_EXIT_CODE = re.compile(r"^(?:Process exited with code|Exit code:)\s*(-?\d+)", re.M)


def _output(payload: dict[str, Any]) -> tuple[str | None, int | None]:
    """Output text and exit code: from the JSON form's metadata, else from the text form's
    'Exit code: N' / 'Process exited with code N' line (newer CLIs write text)."""
    out = decode_json_string(payload.get("output"))
    if isinstance(out, dict):
        meta = out.get("metadata") or {}
        return (out.get("output") if isinstance(out.get("output"), str) else text_of(out.get("output"))), meta.get("exit_code")
    text = out if isinstance(out, str) else text_of(out)
    m = _EXIT_CODE.search(text or "")
    return text, int(m.group(1)) if m else None


def _keep_event_only_turns(steps: list[dict[str, Any]], typed: list[tuple[int, str, Any]]) -> None:
    """A user turn some CLI versions write only as an ``event_msg`` (no ``response_item``
    message) is still the person's turn: insert it where it came, unless a human message with
    the same text is already there (the usual duplicate)."""
    seen = Counter((s.get("text") or "").strip() for s in steps if s["author"] == "human")
    inserted = 0
    for position, text, when in typed:
        if seen[text.strip()]:
            seen[text.strip()] -= 1
            continue
        steps.insert(position + inserted, step("user", "human", text=text, started_at=when,
                                               metadata={"from": "event_msg"}))
        inserted += 1


class CodexAdapter(JsonlSessionAdapter):
    name = "codex"
    version = "1.1.0"
    description = "OpenAI Codex CLI rollout JSONL (one session per file)"
    grows = True

    def sniff(self, path: str, head: bytes) -> bool:
        first = head.lstrip().split(b"\n", 1)[0]
        return first[:1] == b"{" and (b'"type":"session_meta"' in first or b'"type": "session_meta"' in first)

    def check_record(self, obj: Any) -> str | None:
        if not any(e.get("type") == "session_meta" for e in obj.get("entries", [])):
            return "no session_meta line"
        return None

    def parse(self, obj: dict[str, Any], ctx: RecordContext) -> list[ParsedEpisode]:
        steps: list[dict[str, Any]] = []
        meta: dict[str, Any] = {}
        models, other = [], Counter()
        usage: dict[str, Any] = {}
        typed: list[tuple[int, str, Any]] = []  # user turns as event_msg: (position, text, time)
        for e in obj["entries"]:
            kind, p = e.get("type"), e.get("payload") if isinstance(e.get("payload"), dict) else {}
            when = ts(e.get("timestamp"))
            if kind == "session_meta":
                meta = p
            elif kind == "turn_context":
                if p.get("model"):
                    models.append(p["model"])
            elif kind == "event_msg":
                if p.get("type") == "token_count" and isinstance(p.get("info"), dict):
                    usage = p["info"].get("total_token_usage") or usage
                elif p.get("type") == "user_message" and isinstance(p.get("message"), str):
                    typed.append((len(steps), p["message"], when))
                other[f"event_msg:{p.get('type')}"] += 1
            elif kind == "response_item":
                self._item(p, when, steps)
            elif kind == "compacted":  # the CLI replaced the history with this summary
                steps.append(step("user", "harness", text=p.get("message") or text_of(p.get("replacement_history")),
                                  started_at=when, metadata={"context_compression": True}))
            else:
                other[kind or "untyped"] += 1
        _keep_event_only_turns(steps, typed)
        counts = link_observations(steps)
        times = [s["started_at"] for s in steps if s.get("started_at")]
        first_human = next((s["text"] for s in steps if s["author"] == "human"), None)
        git = meta.get("git") if isinstance(meta.get("git"), dict) else {}
        ep = episode(
            source_episode_id=meta.get("id"), task_text=first_human, harness_name="codex",
            repository=git.get("repository_url") or None, base_commit=git.get("commit_hash") or None,
            harness_version=meta.get("cli_version"), policy_name=models[0] if models else None,
            started_at=ts(meta.get("timestamp")) or (min(times) if times else None),
            ended_at=max(times) if times else None,
            tokens_in=usage.get("input_tokens"), tokens_out=usage.get("output_tokens"),
            metadata={"originator": meta.get("originator"), "cwd": meta.get("cwd"),
                      "model_provider": meta.get("model_provider"), "models": sorted(set(models)) or None,
                      "git_branch": git.get("branch"),
                      "cached_input_tokens": usage.get("cached_input_tokens"),
                      "reasoning_output_tokens": usage.get("reasoning_output_tokens"),
                      "other_lines": dict(other) or None, "bad_lines": obj["bad_lines"] or None, **counts},
        )
        return [ParsedEpisode(ep, number_steps(steps))]

    @staticmethod
    def _item(p: dict[str, Any], when: Any, steps: list[dict[str, Any]]) -> None:
        kind = p.get("type")
        if kind == "message":
            role, text = p.get("role"), text_of(p.get("content"))
            if role == "assistant":
                steps.append(step("assistant", "model", text=text, started_at=when))
            elif role in ("developer", "system") or (text or "").lstrip().startswith(_INJECTED):
                steps.append(step("system" if role != "user" else "user", "harness", text=text, started_at=when))
            else:
                steps.append(step("user", "human", text=text, started_at=when))
        elif kind == "reasoning":
            summary = text_of(p.get("summary"))
            steps.append(step("assistant", "model", text=None, started_at=when,
                              metadata={"reasoning": summary, "encrypted": bool(p.get("encrypted_content"))}))
        elif kind in ("function_call", "custom_tool_call"):
            args = p.get("arguments") if kind == "function_call" else {"input": p.get("input")}
            steps.append(step("assistant", "model", tool_calls=[tool_call(p.get("name", "unknown"), args, p.get("call_id"))],
                              started_at=when))
        elif kind == "local_shell_call":
            action = p.get("action") or {}
            steps.append(step("assistant", "model", started_at=when,
                              tool_calls=[tool_call("local_shell", {"command": action.get("command")}, p.get("call_id"))]))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            text, code = _output(p)
            steps.append(step("tool", "environment", observation=text, exit_code=code,
                              tool_call_id=p.get("call_id"), started_at=when))
        elif kind == "web_search_call":
            steps.append(step("assistant", "model", started_at=when,
                              tool_calls=[tool_call("web_search", p.get("action"), p.get("id"))]))
        else:
            steps.append(step("assistant", "harness", text=None, started_at=when, metadata={"unhandled_item": kind}))


