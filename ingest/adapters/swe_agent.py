"""SWE-agent ``.traj`` files, old (0.x) and new (1.x) schema.

A ``.traj`` holds the same episode twice: ``history`` (the messages the model saw, demos and
all) and ``trajectory`` (one entry per action: thought, action, observation, timing). The
message list is the canonical sequence here; ``trajectory`` adds execution times to the
observations. Schema differences:

- 0.x: actions are text (``action``), observations are ``user`` messages, demonstrations are
  ``user`` messages flagged ``is_demo``; no replay config.
- 1.x: ``message_type`` on every message, function calling (``tool_calls`` with JSON-in-string
  arguments, ``tool`` messages with ``tool_call_ids``), ``replay_config`` with the model,
  sampling and repository.

Authorship: system prompt, demonstrations and the task prompt are ``harness``; observations are
``environment``; assistant messages are ``model``, except the harness's own "Exit due to ..."
messages written in the model's turn when it stops a run (``harness``). 1.x files store
``replay_config`` as an object or as JSON text: both are read (model and sampling, repository,
base commit, instance id).
"""

from __future__ import annotations

import re
from pathlib import PurePath
from typing import Any

from trajwh.ingest.adapters.base import Adapter, ParsedEpisode, RecordContext
from trajwh.ingest.adapters.common import (
    decode_json_string,
    episode,
    file_stem,
    github_repo,
    link_observations,
    number_steps,
    step,
    tool_call,
    tool_schema_info,
)
from trajwh.ingest.adapters.swebench import patch_digest, verdict_for
from trajwh.schemas.errors import InputFormatError

#: messages the harness writes in the model's turn when it stops the run ("Exit due to cost limit",
#: "Exit due to context window", "Exit due to unknown error: ...")
_HARNESS_EXIT = re.compile(r"^\s*Exit due to\b")


def _issue_text(prompt: str) -> str:
    m = re.search(r"ISSUE:\s*\n(.*?)\n\s*INSTRUCTIONS:", prompt, re.S)
    return m.group(1).strip() if m else prompt


class SweAgentAdapter(Adapter):
    name = "swe-agent"
    version = "1.2.0"
    framing = "document"
    description = "SWE-agent .traj (0.x and 1.x schema)"
    consumes_facts = True

    def sniff(self, path: str, head: bytes) -> bool:
        if head.lstrip()[:1] != b"{":
            return False
        return path.endswith(".traj") or (b'"trajectory"' in head and b'"thought"' in head and b'"observation"' in head)

    def check_record(self, obj: Any) -> str | None:
        if not isinstance(obj, dict):
            return "expected a JSON object"
        if not isinstance(obj.get("history"), list) or not isinstance(obj.get("trajectory"), list):
            return "expected 'history' and 'trajectory' lists"
        return None

    def parse(self, obj: dict[str, Any], ctx: RecordContext) -> list[ParsedEpisode]:
        history = obj["history"]
        new_schema = "replay_config" in obj or any("message_type" in m for m in history)
        steps, task_prompt = self._steps(history, obj["trajectory"])
        counts = link_observations(steps)
        info = obj.get("info") or {}
        stats = info.get("model_stats") or {}
        replay = decode_json_string(obj.get("replay_config")) or {}  # real 1.x files store it as JSON text
        if not isinstance(replay, dict):
            raise InputFormatError(f"replay_config is a {type(replay).__name__}", where=ctx.where(),
                                   valid="an object, or a JSON object in a string")
        model = (replay.get("agent") or {}).get("model") or {}
        repo = (replay.get("env") or {}).get("repo") or {}
        problem = replay.get("problem_statement") or {}
        submission = info.get("submission")
        prediction = None
        if submission:  # the run's prediction file names the instance: match it by the patch
            preds = ctx.facts("dir", str(PurePath(ctx.file_path).parent)).get("predictions", {})
            prediction = preds.get(patch_digest(submission))
        instance_id = problem.get("id") or (prediction or {}).get("instance_id")
        base = repo.get("base_commit")
        sampling = {k: model[k] for k in ("temperature", "top_p", "per_instance_cost_limit") if k in model} or None
        verdict = verdict_for(ctx, instance_id)
        ep = episode(
            task_id=instance_id, instance_id=instance_id,
            task_text=_issue_text(task_prompt) if task_prompt else None,
            repository=github_repo(repo.get("github_url") or problem.get("github_url")),
            base_commit=base if base and re.fullmatch(r"[0-9a-f]{7,40}", base) else None,
            policy_name=model.get("name"), harness_name="swe-agent",
            harness_version="1.x" if new_schema else "0.x", sampling=sampling,
            exit_status=info.get("exit_status"), termination_reason=info.get("exit_status"),
            tokens_in=stats.get("tokens_sent"), tokens_out=stats.get("tokens_received"),
            cost_usd=stats.get("instance_cost"),
            resolved=verdict.get("resolved"), verifier_status=verdict.get("verifier_status"),
            verifier_name=verdict.get("verifier_name"), test_results=verdict.get("test_results"),
            metadata={"schema": "1.x" if new_schema else "0.x", "environment": obj.get("environment"),
                      "instance_id_from": "replay_config" if problem.get("id") else "prediction" if prediction else None,
                      "file_stem": file_stem(ctx.file_path, (".traj",)),
                      "base_ref": base if base and not re.fullmatch(r"[0-9a-f]{7,40}", base) else None,
                      "submission": info.get("submission"), "api_calls": stats.get("api_calls"),
                      "verdict_from": verdict.get("_verdict_from"), "prediction": prediction, **counts},
        )
        tools = (replay.get("agent") or {}).get("tools")
        return [ParsedEpisode(ep, number_steps(steps), tool_schema_info(
            tools, "swe-agent:replay_config.agent.tools", "harness_tool_config") if isinstance(tools, dict) else None)]

    @staticmethod
    def _steps(history: list[dict[str, Any]], trajectory: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str | None]:
        steps: list[dict[str, Any]] = []
        task_prompt = None
        times = [t.get("execution_time") for t in trajectory]
        n_obs = 0
        for m in history:
            role, content = m.get("role"), m.get("content")
            text = content if isinstance(content, str) else None
            kind = m.get("message_type")
            meta = {"agent": m.get("agent"), "message_type": kind}
            if role == "system":
                steps.append(step("system", "harness", text=text, metadata=meta))
            elif m.get("is_demo"):
                steps.append(step("user", "harness", text=text, metadata={**meta, "is_demo": True}))
            elif role == "assistant" and _HARNESS_EXIT.match(str(m.get("thought") or text or "")):
                steps.append(step("assistant", "harness", text=m.get("thought") or text,
                                  metadata={**meta, "harness_exit": True}))
            elif role == "assistant":
                action = m.get("action")
                calls = [tool_call(c["function"]["name"], c["function"].get("arguments"), c.get("id"),
                                   executed=action if isinstance(action, str) and action.strip() else None)
                         for c in m.get("tool_calls") or [] if isinstance(c, dict) and "function" in c]
                steps.append(step("assistant", "model", text=m.get("thought") or text, tool_calls=calls,
                                  action_command=None if calls else (action.strip() if isinstance(action, str) else None),
                                  metadata=meta))
            elif task_prompt is None and role == "user":
                task_prompt = text
                steps.append(step("user", "harness", text=text, metadata=meta))
            else:  # an observation: 'tool' (1.x function calling) or 'user' (0.x and 1.x text mode)
                ids_ = m.get("tool_call_ids") or []
                elapsed = times[n_obs] if n_obs < len(times) else None
                n_obs += 1
                steps.append(step("tool" if role == "tool" else "user", "environment", observation=text,
                                  tool_call_id=ids_[0] if ids_ else None,
                                  metadata={**meta, "execution_time": elapsed}))
        return steps, task_prompt


