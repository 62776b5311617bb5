"""OpenAI Codex CLI headless runs (``codex exec --json``: the event stream on standard output).

One file is one run (one thread, one episode). Lines: ``thread.started`` (the thread id),
``turn.started`` / ``turn.completed`` (the turn's ``usage``: input tokens, cached input tokens as a
part of them, output tokens) / ``turn.failed`` (``error.message``), ``item.started`` /
``item.updated`` / ``item.completed`` (an item and its state: the completed state is read, else the
last one written, for a run cut short), and ``error``. Harbor / Terminal-Bench keep these logs for
their Codex agent; the CLI's own session file is the rollout (the ``codex`` adapter).

Items: ``agent_message`` (the model's text), ``reasoning`` (kept as reasoning on the model's next
step), ``command_execution`` (a ``shell`` call of its ``command``, then its ``aggregated_output`` and
``exit_code`` as the environment's result; ``failed`` or ``declined`` flagged), ``file_change``
(an edit of its ``changes``' paths, its status the result), ``mcp_tool_call`` (the server's tool
with its arguments, then its result or error), ``web_search`` (its query), ``todo_list`` (the plan)
and ``error`` (the harness's, flagged). The prompt is given on the command line and is not in the
stream: an episode has no task text unless a ``user_message`` item carries it.
"""

from __future__ import annotations

from typing import Any

from trajwh.ingest.adapters.base import JsonlSessionAdapter, ParsedEpisode, RecordContext
from trajwh.ingest.adapters.common import (
    episode,
    id_text,
    json_text,
    link_observations,
    number_steps,
    step,
    text_of,
    tool_call,
)

_EVENT_TYPES = (b'"type":"thread.started"', b'"type":"turn.started"', b'"type":"item.completed"',
                b'"type": "thread.started"', b'"type": "item.completed"')


def _items(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each item once, in the order it started, in its completed state (else its last state)."""
    order: list[str] = []
    state: dict[str, dict[str, Any]] = {}
    done: set[str] = set()
    for n, e in enumerate(entries):
        kind = e.get("type")
        item = e.get("item") if isinstance(e.get("item"), dict) else None
        if item is None or kind not in ("item.started", "item.updated", "item.completed"):
            continue
        key = id_text(item.get("id")) or f"#{n}"
        if key not in state:
            order.append(key)
        if key in done:
            continue
        state[key] = item
        if kind == "item.completed":
            done.add(key)
    return [state[k] for k in order]


class CodexExecAdapter(JsonlSessionAdapter):
    name = "codex-exec"
    version = "1.0.0"
    description = "OpenAI Codex CLI headless run (codex exec --json event stream; one run per file)"

    def sniff(self, path: str, head: bytes) -> bool:
        first = head.lstrip().split(b"\n", 1)[0]
        return first[:1] == b"{" and any(t in head[:4096] for t in _EVENT_TYPES) and (
            b'"thread_id"' in head or b'"item"' in head)

    def check_record(self, obj: Any) -> str | None:
        entries = obj.get("entries", [])
        if not any(isinstance(e.get("item"), dict) for e in entries):
            return "no item events (item.started / item.completed)"
        return None

    def parse(self, obj: dict[str, Any], ctx: RecordContext) -> list[ParsedEpisode]:
        entries = obj["entries"]
        thread = next((id_text(e.get("thread_id")) for e in entries if e.get("type") == "thread.started"), None)
        steps: list[dict[str, Any]] = []
        pending_reasoning: list[str] = []
        statuses: dict[str, int] = {}

        def model(text: str | None = None, calls: list[dict[str, Any]] | None = None, **extra: Any) -> None:
            meta = {k: v for k, v in extra.items() if v is not None}
            if pending_reasoning:
                meta["reasoning"] = "\n".join(pending_reasoning)
                pending_reasoning.clear()
            steps.append(step("assistant", "model", text=text, tool_calls=calls, metadata=meta or None))

        def result(call_id: str | None, output: str | None, *, failed: bool, exit_code: Any = None,
                   **extra: Any) -> None:
            code = exit_code if isinstance(exit_code, int) and not isinstance(exit_code, bool) else None
            meta = {k: v for k, v in extra.items() if v is not None}
            if failed:
                meta["is_error"] = True
            steps.append(step("tool", "environment", observation=output, tool_call_id=call_id, exit_code=code,
                              metadata=meta or None))

        for it in _items(entries):
            kind, iid = it.get("type") or it.get("item_type"), id_text(it.get("id"))
            status = it.get("status") if isinstance(it.get("status"), str) else None
            if status:
                statuses[status] = statuses.get(status, 0) + 1
            failed = status in ("failed", "declined")
            if kind == "agent_message":
                model(text_of(it.get("text")))
            elif kind == "reasoning":
                said = it.get("text") or it.get("summary") or it.get("content")
                if isinstance(said, str) and said:
                    pending_reasoning.append(said)
            elif kind == "user_message":
                steps.append(step("user", "human", text=text_of(it.get("text") or it.get("content"))))
            elif kind == "command_execution":
                model(calls=[tool_call("shell", {"command": it.get("command")}, iid)])
                if status != "in_progress":
                    result(iid, it.get("aggregated_output"), failed=failed or (
                        isinstance(it.get("exit_code"), int) and it["exit_code"] != 0 and status == "failed"),
                        exit_code=it.get("exit_code"), status=status)
            elif kind == "file_change":
                changes = [c for c in it.get("changes") or [] if isinstance(c, dict)]
                model(calls=[tool_call("file_change", {"changes": changes}, iid)])
                result(iid, status, failed=failed, status=status)
            elif kind == "mcp_tool_call":
                name = str(it.get("tool") or "unknown")
                model(calls=[tool_call(name, it.get("arguments"), iid)], mcp_server=it.get("server"))
                error = it.get("error")
                said = error.get("message") if isinstance(error, dict) else error
                output = it.get("result")
                text = said if said else (text_of(output.get("content")) if isinstance(output, dict) else
                                          output if isinstance(output, str) else json_text(output))
                if status != "in_progress":
                    result(iid, text, failed=failed or bool(said), status=status)
            elif kind == "web_search":
                model(calls=[tool_call("web_search", {"query": it.get("query")}, iid)])
            elif kind == "todo_list":
                model(calls=[tool_call("update_plan", {"items": it.get("items")}, iid)])
            elif kind == "error":
                steps.append(step("system", "harness", text=text_of(it.get("message")), metadata={"is_error": True}))
            else:
                steps.append(step("system", "harness", text=json_text(it), metadata={"unknown_item": kind}))
        if pending_reasoning:  # reasoning after the last message: kept on a step of its own
            model()
        usage = [e.get("usage") for e in entries if e.get("type") == "turn.completed" and isinstance(e.get("usage"), dict)]
        failures = [e.get("error") for e in entries if e.get("type") == "turn.failed"]
        errors = [e.get("message") for e in entries if e.get("type") == "error" and isinstance(e.get("message"), str)]
        exit_status = termination = None
        if failures:
            said = failures[-1].get("message") if isinstance(failures[-1], dict) else failures[-1]
            exit_status, termination = "turn_failed", (str(said) if said else "turn failed")[:300]
        elif usage:
            exit_status = "completed"
        counts = link_observations(steps)
        number_steps(steps)

        def total(key: str) -> int | None:
            values = [u.get(key) for u in usage if isinstance(u.get(key), int)]
            return sum(values) if values else None

        first_human = next((s["text"] for s in steps if s["author"] == "human"), None)
        ep = episode(
            source_episode_id=thread, task_text=first_human, harness_name="codex",
            exit_status=exit_status, termination_reason=termination,
            tokens_in=total("input_tokens"), tokens_out=total("output_tokens"),
            metadata={"headless": True, "turns": sum(1 for e in entries if e.get("type") == "turn.started") or None,
                      "cached_input_tokens": total("cached_input_tokens"), "item_statuses": statuses or None,
                      "stream_errors": errors or None, "bad_lines": obj["bad_lines"] or None, **counts},
        )
        return [ParsedEpisode(ep, steps)]
