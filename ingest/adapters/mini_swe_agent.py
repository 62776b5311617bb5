"""mini-swe-agent ``.traj.json``: a plain message list; the verdict lives in companion files.

1.x: the model answers with a THOUGHT and one fenced bash block; the harness replies as
``user`` with ``<returncode>`` and ``<output>``. 2.x with tool calling: the assistant message
carries ``tool_calls`` (arguments as JSON text; the harness also copies the commands to
``extra.actions``) and each result is a ``role: tool`` message with its ``tool_call_id``; the
run ends with a ``role: exit`` message (the submission, written by the harness). The first
``user`` message is the task prompt the harness built around the issue (``<pr_description>``).
The verdict comes from the SWE-bench ``report.json`` / ``results_summary.json`` of the same
source, joined by instance id.
"""

from __future__ import annotations

import re
from typing import Any

from trajwh.ingest.actions import command_in_text
from trajwh.ingest.adapters.base import Adapter, ParsedEpisode, RecordContext
from trajwh.ingest.adapters.common import (
    episode,
    exit_code_in,
    link_observations,
    looks_like_jsonl,
    number_steps,
    step,
    text_of,
    tool_call,
    ts,
)
from trajwh.ingest.adapters.swebench import verdict_for
from trajwh.schemas.errors import InputFormatError


def _pr_description(prompt: str) -> str:
    m = re.search(r"Consider the following PR description:\s*\n(.*?)\n</pr_description>", prompt, re.S)
    return m.group(1).strip() if m else prompt


def _usage(extra: Any) -> tuple[int | None, int | None, Any]:
    response = (extra or {}).get("response") if isinstance(extra, dict) else None
    if not isinstance(response, dict):
        return None, None, None
    usage = response.get("usage") or {}
    return usage.get("prompt_tokens"), usage.get("completion_tokens"), ts(response.get("created"))


def _calls(message: dict[str, Any]) -> list[dict[str, Any]]:
    """2.x tool calls (OpenAI shape); else the commands the harness copied to ``extra.actions``."""
    calls = [tool_call((c.get("function") or {}).get("name") or "bash", (c.get("function") or {}).get("arguments"),
                       c.get("id")) for c in message.get("tool_calls") or [] if isinstance(c, dict)]
    if calls:
        return calls
    extra = message.get("extra") if isinstance(message.get("extra"), dict) else {}
    return [tool_call("bash", {"command": a["command"]}, a.get("tool_call_id")) for a in extra.get("actions") or []
            if isinstance(a, dict) and isinstance(a.get("command"), str)]


def _tool_result(message: dict[str, Any], text: str | None) -> dict[str, Any]:
    extra = message.get("extra") if isinstance(message.get("extra"), dict) else {}
    code = extra.get("returncode")
    return step("tool", "environment", observation=text, tool_call_id=message.get("tool_call_id"),
                exit_code=code if isinstance(code, int) else exit_code_in(text), started_at=ts(extra.get("timestamp")))


class MiniSweAgentAdapter(Adapter):
    name = "mini-swe-agent"
    version = "1.2.0"  # 1.2: 1.x commands copied to extra.actions are marked as written in the text
    framing = "document"
    description = "mini-swe-agent .traj.json (+ SWE-bench report.json / results_summary.json)"
    consumes_facts = True

    def sniff(self, path: str, head: bytes) -> bool:
        # one document: rows of JSON lines that quote its name are another format's (chat-messages)
        return head.lstrip()[:1] == b"{" and not looks_like_jsonl(head) and (
            path.endswith(".traj.json") or b'"mini_version"' in head or b"mini-swe-agent" in head or b"minisweagent" in head)

    def check_record(self, obj: Any) -> str | None:
        if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list):
            return "expected an object with a 'messages' list"
        return None

    def parse(self, obj: dict[str, Any], ctx: RecordContext) -> list[ParsedEpisode]:
        steps: list[dict[str, Any]] = []
        task_prompt = None
        exit_extra: dict[str, Any] = {}
        for m in obj["messages"]:
            if not isinstance(m, dict):
                raise InputFormatError(f"messages hold a {type(m).__name__}", where=ctx.where(),
                                       valid="objects with 'role' and 'content'")
            role, text = m.get("role"), text_of(m.get("content"))
            if role == "system":
                steps.append(step("system", "harness", text=text))
            elif role == "assistant":
                t_in, t_out, created = _usage(m.get("extra"))
                calls = _calls(m)
                # 1.x: the commands the harness copied to extra.actions are the ones the model wrote in its text
                in_text = bool(calls) and not m.get("tool_calls") and bool(text)
                steps.append(step("assistant", "model", text=text, tool_calls=calls,
                                  action_command=None if calls else command_in_text(text),
                                  tokens_in=t_in, tokens_out=t_out, started_at=created,
                                  metadata={"calls_in_text": True} if in_text else None))
            elif role == "tool":
                steps.append(_tool_result(m, text))
            elif role == "exit":  # 2.x: the harness closes the run with the submission
                exit_extra = m.get("extra") if isinstance(m.get("extra"), dict) else {}
                steps.append(step("user", "harness", text=text, metadata={"exit": True}))
            elif task_prompt is None:
                task_prompt = text
                steps.append(step("user", "harness", text=text))
            elif text and "<returncode>" in text:
                steps.append(step("user", "environment", observation=text, exit_code=exit_code_in(text)))
            else:  # format errors and reminders the harness sends back
                steps.append(step("user", "harness", text=text))
        counts = link_observations(steps)
        info = obj.get("info") or {}
        config = info.get("config") or {}
        model = config.get("model") or {}
        stats = info.get("model_stats") or {}
        iid = obj.get("instance_id")
        verdict = verdict_for(ctx, iid)
        kwargs = model.get("model_kwargs") or {}
        sampling = {k: kwargs[k] for k in ("temperature", "top_p", "max_tokens") if k in kwargs} or None
        started = [s["started_at"] for s in steps if s.get("started_at")]
        ep = episode(
            task_id=iid, instance_id=iid, task_text=_pr_description(task_prompt) if task_prompt else None,
            policy_name=model.get("model_name"), harness_name="mini-swe-agent",
            harness_version=info.get("mini_version"), sampling=sampling,
            exit_status=info.get("exit_status") or exit_extra.get("exit_status"),
            termination_reason=info.get("exit_status") or exit_extra.get("exit_status"),
            cost_usd=stats.get("instance_cost"),
            tokens_in=sum(s["tokens_in"] or 0 for s in steps) or None,
            tokens_out=sum(s["tokens_out"] or 0 for s in steps) or None,
            started_at=min(started) if started else None, ended_at=max(started) if started else None,
            resolved=verdict.get("resolved"), verifier_status=verdict.get("verifier_status"),
            verifier_name=verdict.get("verifier_name"), test_results=verdict.get("test_results"),
            metadata={"trajectory_format": obj.get("trajectory_format"), "api_calls": stats.get("api_calls"),
                      "agent_type": config.get("agent_type"), "environment_type": config.get("environment_type"),
                      "submission": info.get("submission") or exit_extra.get("submission"),
                      "verdict_from": verdict.get("_verdict_from"), **counts},
        )
        return [ParsedEpisode(ep, number_steps(steps))]


