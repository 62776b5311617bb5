"""Reference adapter for the native JSONL format (``docs/format.md``)."""

from __future__ import annotations

import re
from typing import Any

import orjson
from pydantic import ValidationError
from trajwh.ingest.adapters.base import Adapter, ParsedEpisode, RecordContext
from trajwh.ingest.adapters.common import tool_schema_info
from trajwh.schemas import ids
from trajwh.schemas.errors import InputFormatError
from trajwh.schemas.native import NATIVE_FORMAT, NativeEpisode, NativeStep

_FORMAT_MARK = re.compile(rb'"format"\s*:\s*"trajwh\.native"')


def describe_validation_error(exc: ValidationError, limit: int = 3) -> str:
    """Pydantic errors as ``field.path: message`` parts, most useful first."""
    parts = []
    for err in exc.errors()[:limit]:
        loc = ".".join(str(p) for p in err["loc"]) or "<record>"
        parts.append(f"{loc}: {err['msg']}")
    more = exc.error_count() - limit
    if more > 0:
        parts.append(f"and {more} more")
    return "; ".join(parts)


def _json_or_none(value: Any) -> str | None:
    if value is None:
        return None
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


def _tests(results: Any) -> list[dict[str, str]] | None:
    if results is None:
        return None
    return [{"name": t.name, "status": t.status} for t in results]


def _step_row(step: NativeStep) -> dict[str, Any]:
    calls = None
    if step.tool_calls is not None:
        calls = [
            {
                "id": c.id,
                "name": c.name,
                "arguments": c.arguments if isinstance(c.arguments, str) or c.arguments is None
                else _json_or_none(c.arguments),
                "executed": c.executed if isinstance(c.executed, str) or c.executed is None else _json_or_none(c.executed),
            }
            for c in step.tool_calls
        ]
    return {
        "step_index": step.index,
        "role": step.role,
        "author": step.author,
        "text": step.text,
        "tool_calls": calls,
        "tool_call_id": step.tool_call_id,
        "observation": step.observation,
        "exit_code": step.exit_code,
        "started_at": step.started_at,
        "ended_at": step.ended_at,
        "tokens_in": step.tokens_in,
        "tokens_out": step.tokens_out,
        "test_results": _tests(step.test_results),
        "action_command": step.command,
        "metadata": _json_or_none(step.metadata),
    }


class NativeAdapter(Adapter):
    name = "native"
    version = "1.1.0"
    framing = "jsonl"
    description = "trajwh native JSONL, one episode per line"
    exact_schema = True  # validated by schemas.native: an empty model turn is the record's own

    def sniff(self, path: str, head: bytes) -> bool:
        first = head.lstrip()[:1]
        return first in (b"{", b"[") and _FORMAT_MARK.search(head[:65536]) is not None

    def check_record(self, obj: Any) -> str | None:
        if isinstance(obj, list):  # a JSON document holding several episodes
            if not obj:
                return "an empty JSON array holds no episode"
            for i, item in enumerate(obj):
                problem = self.check_record(item) if isinstance(item, dict) else "not a JSON object"
                if problem:
                    return f"element {i}: {problem}"
            return None
        if not isinstance(obj, dict):
            return f"expected a JSON object, found {type(obj).__name__}"
        if obj.get("format") != NATIVE_FORMAT:
            return f"field 'format' is {obj.get('format')!r}, expected {NATIVE_FORMAT!r}"
        if not isinstance(obj.get("steps"), list):
            return "field 'steps' is missing or not a list"
        return None

    def parse(self, obj: Any, ctx: RecordContext) -> list[ParsedEpisode]:
        if isinstance(obj, list):
            return [pe for item in obj for pe in self.parse(item, ctx)]
        try:
            ep = NativeEpisode.model_validate(obj)
        except ValidationError as exc:
            raise InputFormatError(
                f"not a valid native episode: {describe_validation_error(exc)}",
                where=f"{ctx.file_path}:{ctx.line_no}",
                valid="an object matching docs/native-format.schema.json",
            ) from None
        indexes = [s.index for s in ep.steps]
        if indexes != list(range(len(indexes))):
            raise InputFormatError(
                "step indexes are not 0..n-1 in order",
                where=f"{ctx.file_path}:{ctx.line_no}",
                valid="steps listed in order with index 0, 1, 2, ...",
            )
        tools = ep.environment.tool_schemas
        schemas = tool_schema_info(tools, "native:environment.tool_schemas",
                                   "harness_tool_config" if isinstance(tools, dict) else "function_schemas")
        return [ParsedEpisode(episode=self._episode_row(ep), steps=[_step_row(s) for s in ep.steps], tool_schemas=schemas)]

    @staticmethod
    def _episode_row(ep: NativeEpisode) -> dict[str, Any]:
        task, out = ep.task, ep.outcome
        return {
            "source_episode_id": ep.episode_id,
            "task_id": task.task_id,
            "task_digest": ids.digest(task.text) if task.text is not None else None,
            "task_text": task.text,
            "repository": task.repository,
            "base_commit": task.base_commit,
            "base_commit_at": task.base_commit_at,
            "instance_id": task.instance_id,
            "issue_created_at": task.issue_created_at,
            "fix_merged_at": task.fix_merged_at,
            "initial_state_digest": task.initial_state_digest,
            "env_image_digest": ep.environment.image_digest,
            "tool_schema_digest": ep.environment.tool_schema_digest,
            "policy_name": ep.policy.name,
            "policy_checkpoint": ep.policy.checkpoint,
            "policy_version": ep.policy.version,
            "harness_name": ep.harness.name,
            "harness_version": ep.harness.version,
            "harness_commit": ep.harness.commit,
            "verifier_name": ep.verifier.name,
            "verifier_commit": ep.verifier.commit,
            "sampling": _json_or_none(ep.sampling),
            "sampling_digest": ids.digest(ep.sampling) if ep.sampling is not None else None,
            "attempt": ep.attempt,
            "started_at": ep.started_at,
            "ended_at": ep.ended_at,
            "resolved": out.resolved,
            "exit_status": out.exit_status,
            "termination_reason": out.termination_reason,
            "reward": out.reward,
            "verifier_status": out.verifier_status,
            "test_results": _tests(out.test_results),
            "tokens_in": ep.usage.tokens_in,
            "tokens_out": ep.usage.tokens_out,
            "cost_usd": ep.usage.cost_usd,
            "metadata": _json_or_none(ep.metadata),
        }


