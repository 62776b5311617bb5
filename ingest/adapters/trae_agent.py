"""Trae Agent trajectories (``trae-cli run --trajectory-file``; ``trajectories/trajectory_<time>.json``).

One file is one run (one episode): ``task``, ``start_time`` / ``end_time``, ``provider``, ``model``,
``max_steps``, ``llm_interactions`` (every call to the model: the messages sent that turn and the
response), ``agent_steps`` (the agent's loop: each step's response, tool calls, tool results,
reflection and error), ``success`` (the agent called ``task_done``: its own claim, not a verdict),
``final_result`` and ``execution_time``. Pywen and other forks of Trae write the same file.

The model keeps its history itself, so each interaction's ``input_messages`` are only what is new
that turn: the conversation is every interaction's input messages, then its response. A message's
``tool_result`` (``call_id``, ``success``, ``result``, ``error``) is an environment step linked to
its call, a failure flagged; the system prompt and the task are the harness's, like the reflections
the agent sends back after a failed tool; the response is the model's (its ``tool_calls`` with
``call_id``, ``name`` and ``arguments``; its tokens). The results of the last step's calls, which no
later call carries, come from the last agent step. A file with no interactions (an older recorder)
is read from its agent steps. Running out of steps is the termination reason in the words the
outcome rules read as a budget; a step's error ends the run when it is the last.
"""

from __future__ import annotations

import re
from pathlib import PurePath
from typing import Any

from trajwh.ingest.adapters.base import Adapter, ParsedEpisode, RecordContext
from trajwh.ingest.adapters.common import (
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

_FIRST_KEY = re.compile(rb'\A\s*\{\s*"task"\s*:')
_MAX_STEPS = re.compile(r"exceeded maximum steps|max(?:imum)? steps", re.I)


def _call(c: dict[str, Any]) -> dict[str, Any]:
    return tool_call(str(c.get("name") or "unknown"), c.get("arguments"), id_text(c.get("call_id") or c.get("id")))


def _result_step(r: dict[str, Any], when: Any) -> dict[str, Any]:
    ok = r.get("success")
    output = r.get("result") if isinstance(r.get("result"), str) else json_text(r.get("result"))
    error = r.get("error") if isinstance(r.get("error"), str) and r.get("error") else None
    text = "\n".join(x for x in (output, error) if x) or None
    return step("tool", "environment", observation=text, tool_call_id=id_text(r.get("call_id") or r.get("id")),
                started_at=when, metadata={"is_error": True, "error": error} if ok is False else None)


def _model_step(response: dict[str, Any], when: Any) -> dict[str, Any]:
    usage = response.get("usage") if isinstance(response.get("usage"), dict) else {}

    def count(key: str) -> int | None:
        v = usage.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    calls = [_call(c) for c in response.get("tool_calls") or [] if isinstance(c, dict)]
    meta = {k: v for k, v in (("model", response.get("model")), ("finish_reason", response.get("finish_reason")),
                              ("cache_read_tokens", count("cache_read_input_tokens")),
                              ("reasoning_tokens", count("reasoning_tokens"))) if v}
    return step("assistant", "model", text=text_of(response.get("content")) or None, tool_calls=calls,
                started_at=when, tokens_in=count("input_tokens"), tokens_out=count("output_tokens"), metadata=meta)


def _input_steps(messages: Any, when: Any, first: bool) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages if isinstance(messages, list) else []:
        if not isinstance(m, dict):
            continue
        role = m.get("role")
        if isinstance(m.get("tool_result"), dict):
            out.append(_result_step(m["tool_result"], when))
        elif role == "system":
            if first:
                out.append(step("system", "harness", text=text_of(m.get("content")), started_at=when))
        elif role == "assistant":  # (history a client sends again)
            call = [_call(m["tool_call"])] if isinstance(m.get("tool_call"), dict) else []
            out.append(step("assistant", "model", text=text_of(m.get("content")), tool_calls=call, started_at=when))
        else:  # the task, then the reflections the agent sends back: the harness's words
            out.append(step("user", "harness", text=text_of(m.get("content")), started_at=when))
    return out


class TraeAgentAdapter(Adapter):
    name = "trae-agent"
    version = "1.0.0"
    framing = "document"
    description = "Trae Agent trajectory (task, llm_interactions, agent_steps; also Pywen's)"

    def sniff(self, path: str, head: bytes) -> bool:
        return bool(_FIRST_KEY.match(head)) and (b'"llm_interactions"' in head or b'"agent_steps"' in head)

    def check_record(self, obj: Any) -> str | None:
        if not isinstance(obj, dict) or not isinstance(obj.get("task"), str):
            return "expected a Trae Agent trajectory object with a 'task'"
        if not isinstance(obj.get("llm_interactions"), list) and not isinstance(obj.get("agent_steps"), list):
            return "a Trae Agent trajectory without llm_interactions or agent_steps"
        return None

    def parse(self, obj: dict[str, Any], ctx: RecordContext) -> list[ParsedEpisode]:
        interactions = [i for i in obj.get("llm_interactions") or [] if isinstance(i, dict)]
        agent_steps = [s for s in obj.get("agent_steps") or [] if isinstance(s, dict)]
        steps: list[dict[str, Any]] = []
        if interactions:
            for n, it in enumerate(interactions):
                when = ts(it.get("timestamp"))
                steps += _input_steps(it.get("input_messages"), when, first=n == 0)
                if isinstance(it.get("response"), dict):
                    steps.append(_model_step(it["response"], when))
        else:  # an older recorder: the agent's steps alone
            for n, s in enumerate(agent_steps):
                when = ts(s.get("timestamp"))
                steps += _input_steps(s.get("llm_messages"), when, first=n == 0) if n == 0 else []
                if isinstance(s.get("llm_response"), dict):
                    steps.append(_model_step(s["llm_response"], when))
                for r in s.get("tool_results") or []:
                    if isinstance(r, dict):
                        steps.append(_result_step(r, when))
        # the last calls' results: no later model call carries them
        answered = {s["tool_call_id"] for s in steps if s.get("tool_call_id")}
        if interactions and agent_steps:
            last = agent_steps[-1]
            for r in last.get("tool_results") or []:
                if isinstance(r, dict) and id_text(r.get("call_id")) not in answered:
                    steps.append(_result_step(r, ts(last.get("timestamp"))))
        errors = [s.get("error") for s in agent_steps if isinstance(s.get("error"), str) and s.get("error")]
        if agent_steps and isinstance(agent_steps[-1].get("error"), str) and agent_steps[-1]["error"]:
            steps.append(step("system", "harness", text=agent_steps[-1]["error"], started_at=ts(agent_steps[-1].get("timestamp")),
                              metadata={"agent_error": True}))
        counts = link_observations(steps)
        number_steps(steps)
        success, final = obj.get("success"), obj.get("final_result")
        final_text = final if isinstance(final, str) else json_text(final)
        exit_status = termination = None
        if success is True:
            exit_status = "submitted"  # task_done: the agent's claim
        elif isinstance(final_text, str) and _MAX_STEPS.search(final_text):
            exit_status, termination = "max_steps", f"max steps ({obj.get('max_steps')}) reached: {final_text.strip()[:300]}"
        elif agent_steps and errors and agent_steps[-1].get("error"):
            exit_status, termination = "error", str(agent_steps[-1]["error"]).strip().splitlines()[0][:300]
        elif success is False and final_text:
            exit_status, termination = "failed", final_text.strip()[:300]
        tokens_in = sum(s["tokens_in"] or 0 for s in steps if s.get("tokens_in")) or None
        tokens_out = sum(s["tokens_out"] or 0 for s in steps if s.get("tokens_out")) or None
        tools = next((it.get("tools_available") for it in interactions if it.get("tools_available")), None)
        stem = PurePath(ctx.file_path).stem
        ep = episode(
            source_episode_id=stem if stem and not stem.startswith("<") else None,
            task_text=obj.get("task"), harness_name="trae-agent", policy_name=obj.get("model") or None,
            started_at=ts(obj.get("start_time")), ended_at=ts(obj.get("end_time")),
            exit_status=exit_status, termination_reason=termination, tokens_in=tokens_in, tokens_out=tokens_out,
            metadata={"provider": obj.get("provider"), "max_steps": obj.get("max_steps"),
                      "agent_reported_success": success, "final_result": final_text,
                      "execution_time": obj.get("execution_time"), "tools_available": tools,
                      "agent_errors": len(errors) or None, "llm_interactions": len(interactions),
                      "agent_steps": len(agent_steps), **counts},
        )
        return [ParsedEpisode(ep, steps)]
