"""mini-swe-agent ``.traj.json``: a plain message list; the verdict lives in companion files.

The model answers with a THOUGHT and one fenced bash block; the harness replies as ``user``
with ``<returncode>`` and ``<output>``. The first ``user`` message is the task prompt the
harness built around the issue (``<pr_description>``). The verdict comes from the SWE-bench
``report.json`` / ``results_summary.json`` of the same source, joined by instance id.
"""

from __future__ import annotations

import re
from typing import Any

from ingest.actions import command_in_text
from ingest.adapters.base import Adapter, ParsedEpisode, RecordContext
from ingest.adapters.common import episode, exit_code_in, number_steps, step, ts
from ingest.adapters.swebench import verdict_for


def _pr_description(prompt: str) -> str:
    m = re.search(r"Consider the following PR description:\s*\n(.*?)\n</pr_description>", prompt, re.S)
    return m.group(1).strip() if m else prompt


def _usage(extra: Any) -> tuple[int | None, int | None, Any]:
    response = (extra or {}).get("response") if isinstance(extra, dict) else None
    if not isinstance(response, dict):
        return None, None, None
    usage = response.get("usage") or {}
    return usage.get("prompt_tokens"), usage.get("completion_tokens"), ts(response.get("created"))


class MiniSweAgentAdapter(Adapter):
    name = "mini-swe-agent"
    version = "1.0.0"
    framing = "document"
    description = "mini-swe-agent .traj.json (+ SWE-bench report.json / results_summary.json)"
    consumes_facts = True

    def sniff(self, path: str, head: bytes) -> bool:
        return head.lstrip()[:1] == b"{" and (path.endswith(".traj.json") or b'"mini_version"' in head or b"mini-swe-agent" in head
                                             or b"minisweagent" in head)

    def check_record(self, obj: Any) -> str | None:
        if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list):
            return "expected an object with a 'messages' list"
        return None

    def parse(self, obj: dict[str, Any], ctx: RecordContext) -> list[ParsedEpisode]:
        steps: list[dict[str, Any]] = []
        task_prompt = None
        for m in obj["messages"]:
            role, content = m.get("role"), m.get("content")
            text = content if isinstance(content, str) else None
            if role == "system":
                steps.append(step("system", "harness", text=text))
            elif role == "assistant":
                t_in, t_out, created = _usage(m.get("extra"))
                steps.append(step("assistant", "model", text=text, action_command=command_in_text(text),
                                  tokens_in=t_in, tokens_out=t_out, started_at=created))
            elif task_prompt is None:
                task_prompt = text
                steps.append(step("user", "harness", text=text))
            elif text and "<returncode>" in text:
                steps.append(step("user", "environment", observation=text, exit_code=exit_code_in(text)))
            else:  # format errors and reminders the harness sends back
                steps.append(step("user", "harness", text=text))
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
            exit_status=info.get("exit_status"), termination_reason=info.get("exit_status"),
            cost_usd=stats.get("instance_cost"),
            tokens_in=sum(s["tokens_in"] or 0 for s in steps) or None,
            tokens_out=sum(s["tokens_out"] or 0 for s in steps) or None,
            started_at=min(started) if started else None, ended_at=max(started) if started else None,
            resolved=verdict.get("resolved"), verifier_status=verdict.get("verifier_status"),
            verifier_name=verdict.get("verifier_name"), test_results=verdict.get("test_results"),
            metadata={"trajectory_format": obj.get("trajectory_format"), "api_calls": stats.get("api_calls"),
                      "agent_type": config.get("agent_type"), "environment_type": config.get("environment_type"),
                      "submission": info.get("submission"), "verdict_from": verdict.get("_verdict_from")},
        )
        return [ParsedEpisode(ep, number_steps(steps))]


