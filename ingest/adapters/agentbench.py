"""AgentBench runs (THUDM's benchmark of LLMs as agents: OS, DB, knowledge graph, card game,
lateral thinking, householding (ALFWorld), web shopping (WebShop), web browsing (Mind2Web)).

Its assigner writes ``<output>/<agent>/<task>/runs.jsonl`` (finished samples) and
``error.jsonl`` (samples whose run failed), a line per sample: ``index``, ``error``, ``info``,
``output`` (a ``TaskOutput``: ``index``, ``status``, ``result`` and ``history``, the conversation
as ``{"role": "user" | "agent", "content": text}``) and ``time`` (``timestamp`` in ms, when the
line was written). The model acts in text (``Act: bash`` and a fenced command, ``Action:
Operation`` and SQL, ``Act: answer(...)``) and the task's replies come back as user turns, so
the conversation is read as the generic message rows read a text-acting model (``chat_messages``):
the first user turn is the task prompt, later ones the environment's output.

The verdict is the task's ``result``: a boolean ``result`` / ``is_correct`` / ``correct`` /
``success``, else a ``reward`` or ``score`` (resolved at 1). ``status`` is the exit status
(``completed``; ``task limit reached`` and ``agent context limit`` are budgets, ``task error``
the task server's failure, an invalid action the policy's); a line of ``error.jsonl`` ends with
its ``error`` and ``info``, the task client's failure (the task server, the network, the model's
API; a rate limit is the provider's quota): never the policy's. The folders give the agent (the
policy) and the task; the episode id is ``<agent>/<task>#<index>``. Some tasks put their one-shot
example into the history as turns of the agent's: they are read as the conversation holds them.
"""

from __future__ import annotations

import re
from pathlib import PurePath
from typing import Any

import orjson
from trajwh.ingest.adapters.base import Adapter, ParsedEpisode, RecordContext
from trajwh.ingest.adapters.chat_messages import ChatMessagesAdapter
from trajwh.ingest.adapters.common import RATE_LIMIT, json_text, ts

_HEAD = re.compile(rb'\A\s*\{\s*"index"\s*:')
#: AgentBench's sample statuses, as the outcome rules read them
_STATUS = {"task limit reached": "max turns reached (AgentBench: task limit reached)",
           "agent context limit": "context length exceeded (AgentBench: agent context limit)",
           "task error": "environment: the task server failed (AgentBench: task error)"}
_VERDICT_KEYS = ("result", "is_correct", "correct", "success")


def _verdict(result: Any) -> tuple[bool | None, float | None]:
    """(resolved, reward) from a task's result."""
    if isinstance(result, bool):
        return result, None
    if not isinstance(result, dict):
        return None, None
    for key in _VERDICT_KEYS:
        if isinstance(result.get(key), bool):
            return result[key], None
    for key in ("reward", "score"):
        value = result.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return value >= 1, float(value)
    return None, None


class AgentBenchAdapter(Adapter):
    name = "agentbench"
    version = "1.0.1"  # 1.0.1: an error naming a quota is the provider's too (common.RATE_LIMIT)
    framing = "jsonl"
    description = "AgentBench runs.jsonl / error.jsonl (a sample per line: its status, result and user/agent history)"

    def sniff(self, path: str, head: bytes) -> bool:
        return bool(_HEAD.match(head)) and b'"output"' in head and (b'"history"' in head or b'"error"' in head) \
            and (b'"role": "agent"' in head or b'"role":"agent"' in head or PurePath(path).name in ("runs.jsonl", "error.jsonl"))

    def check_record(self, obj: Any) -> str | None:
        if not isinstance(obj, dict) or "index" not in obj:
            return "expected an AgentBench sample line (index, error, info, output)"
        output = obj.get("output")
        if not isinstance(output, dict) or not isinstance(output.get("history"), list) or not output["history"]:
            why = f": {obj.get('error')} {obj.get('info') or ''}".rstrip() if obj.get("error") else ""
            return f"an AgentBench sample without a history (nothing was run{why})"
        return None

    def parse(self, obj: dict[str, Any], ctx: RecordContext) -> list[ParsedEpisode]:
        output = obj["output"]
        messages = [{"role": "assistant" if m.get("role") == "agent" else m.get("role"), "content": m.get("content")}
                    for m in output["history"] if isinstance(m, dict)]
        folder = PurePath(ctx.file_path).parent
        task, agent = folder.name or None, folder.parent.name or None
        index = output.get("index", obj.get("index"))
        [parsed] = ChatMessagesAdapter().parse({"messages": messages}, ctx)
        resolved, reward = _verdict(output.get("result"))
        status = output.get("status") if isinstance(output.get("status"), str) else None
        termination = _STATUS.get(status or "")
        if obj.get("error"):  # the task client's failure (starting, the network, the model's API): not the policy's
            status, info = "error", str(obj.get("info") or "")
            kind = "provider quota" if RATE_LIMIT.search(info) else "infrastructure"
            termination = f"{kind} ({obj['error']}): {info}".rstrip(": ")[:300]
        when = obj.get("time") if isinstance(obj.get("time"), dict) else {}
        ep = parsed.episode
        meta = {**(orjson.loads(ep["metadata"]) if ep.get("metadata") else {}), "result": json_text(output.get("result")),
                "agentbench_status": output.get("status")}
        ep.update(source_episode_id=f"{agent}/{task}#{index}" if agent and task else f"{task or ''}#{index}",
                  task_id=f"{task}#{index}" if task else str(index), instance_id=str(index), harness_name="agentbench",
                  policy_name=agent, resolved=resolved, reward=reward, exit_status=status, termination_reason=termination,
                  verifier_name=f"agentbench:{task}" if resolved is not None and task else None,
                  ended_at=ts(when.get("timestamp")) or ep.get("ended_at"),
                  metadata=json_text({k: v for k, v in meta.items() if v is not None}))
        return [ParsedEpisode(ep, parsed.steps)]

