"""Helpers shared by the harness adapters: times, message content, JSON-in-strings, rows."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import PurePath
from typing import Any

import orjson
from trajwh.schemas import ids

#: an error text that names the model provider's rate limit or quota (a run it ended is the provider's, not the policy's)
RATE_LIMIT = re.compile(r"rate.?limit|too many requests|\b429\b|quota", re.I)


def ts(value: Any) -> datetime | None:
    """A timestamp from ISO text (with or without zone; no zone means UTC as the harnesses
    write it), or epoch seconds / milliseconds. None when absent or unreadable."""
    if value is None or value == "":
        return None
    if isinstance(value, int | float):
        seconds = value / 1000 if value > 1e11 else value
        return datetime.fromtimestamp(seconds, tz=UTC)
    if isinstance(value, str):
        text = value.strip().replace("Z", "+00:00")
        try:
            dt = datetime.fromisoformat(text)
        except ValueError:
            return None
        return dt if dt.tzinfo else dt.replace(tzinfo=UTC)
    return None


def text_of(content: Any) -> str | None:
    """Message content as text: a string, or the text parts of a list of content blocks."""
    if content is None:
        return None
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for block in content:
            if isinstance(block, str):
                parts.append(block)
            elif isinstance(block, dict):
                for key in ("text", "input_text", "output_text", "content"):
                    if isinstance(block.get(key), str):
                        parts.append(block[key])
                        break
        return "\n".join(parts) if parts else None
    if isinstance(content, dict):
        return text_of(content.get("text") or content.get("content"))
    return str(content)


def decode_json_string(value: Any) -> Any:
    """Arguments that a format stores as JSON inside a string, decoded; other values as they are."""
    if isinstance(value, str):
        stripped = value.strip()
        if stripped[:1] in ("{", "["):
            try:
                return orjson.loads(stripped)
            except orjson.JSONDecodeError:
                return value
    return value


def count_of(value: Any) -> int | None:
    """A token (or other) count as a source wrote it: a non-negative integer, else nothing (a damaged
    record may hold text, a boolean or a negative number there)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def json_text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS, default=str).decode()


def tool_call(name: str, arguments: Any, call_id: str | None = None, *, executed: Any = None) -> dict[str, Any]:
    """A canonical tool call: arguments decoded when they are JSON in a string, stored as JSON text.

    ``executed`` is the request the harness ran (its parsed action object, or a command line);
    it is kept only when the harness rewrote the call (``rewritten``)."""
    args = decode_json_string(arguments)
    call = {"id": call_id, "name": name, "arguments": json_text(args) if args is not None else None}
    if executed is not None and rewritten(args, executed):
        call["executed"] = json_text(executed)
    return call


def rewritten(emitted: Any, executed: Any) -> bool:
    """Did the harness change what the model asked for before running it?

    An object executed for an object emitted is a rewrite when a value the model gave differs (or
    is gone) in the executed one; defaults the harness adds (``blocking``, ``security_risk``, ...)
    are not. A command line executed for a call is a rewrite unless it is the call's own
    ``command`` (or, for a text action, the emitted text itself), whitespace aside."""
    if isinstance(executed, dict):
        if not isinstance(emitted, dict):
            return True
        return any(k not in executed or _norm(executed[k]) != _norm(v) for k, v in emitted.items())
    if isinstance(executed, str):
        own = emitted.get("command") if isinstance(emitted, dict) and len(emitted) == 1 else emitted
        return not (isinstance(own, str) and own.strip() == executed.strip())
    return False


def _norm(value: Any) -> Any:
    """Compare values as a harness parses them: text stripped, "true"/"false" as booleans."""
    if isinstance(value, str):
        value = value.strip()
        return {"true": True, "false": False}.get(value.lower(), value)
    return value


def tool_schema_info(value: Any, origin: str, kind: str = "function_schemas") -> dict[str, Any] | None:
    """The tool definitions a format shows its model, for the ``tool_schemas`` table: the names
    of the tools (OpenAI ``{"type": "function", "function": {...}}``, Anthropic ``{"name",
    "input_schema"}``, or a plain ``{"name": ...}``), where they came from and the JSON text."""
    if isinstance(value, str):
        value = decode_json_string(value)
    if not value or not isinstance(value, (list, dict)):
        return None
    names: list[str] = []
    for t in value if isinstance(value, list) else []:
        if isinstance(t, dict):
            fn = t.get("function") if isinstance(t.get("function"), dict) else t
            if isinstance(fn.get("name"), str):
                names.append(fn["name"])
    if isinstance(value, dict):  # a harness's tool configuration (SWE-agent bundles)
        names = [str(b.get("path")) for b in value.get("bundles") or [] if isinstance(b, dict)]
    return {"origin": origin, "schema_kind": kind, "tool_names": names, "n_tools": len(names),
            "schema_text": json_text(value)}


def step(role: str, author: str, *, text: str | None = None, tool_calls: list[dict[str, Any]] | None = None,
         tool_call_id: str | None = None, observation: str | None = None, exit_code: int | None = None,
         started_at: datetime | None = None, ended_at: datetime | None = None, tokens_in: int | None = None,
         tokens_out: int | None = None, action_command: str | None = None,
         metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "role": role, "author": author, "text": text, "tool_calls": tool_calls or None,
        "tool_call_id": tool_call_id, "observation": observation, "exit_code": exit_code,
        "started_at": started_at, "ended_at": ended_at, "tokens_in": tokens_in, "tokens_out": tokens_out,
        "test_results": None, "action_command": action_command,
        "metadata": json_text(metadata) if metadata else None,
    }


def number_steps(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for i, s in enumerate(steps):
        s["step_index"] = i
    return steps


def episode(**fields: Any) -> dict[str, Any]:
    """Episode columns; ``task_text`` also sets ``task_digest``; metadata becomes JSON text."""
    row = dict(fields)
    if row.get("task_text") and not row.get("task_digest"):
        row["task_digest"] = ids.digest(row["task_text"])
    if isinstance(row.get("sampling"), dict):
        row["sampling_digest"] = ids.digest(row["sampling"])
        row["sampling"] = json_text(row["sampling"])
    if isinstance(row.get("metadata"), dict):
        row["metadata"] = json_text({k: v for k, v in row["metadata"].items() if v is not None}) or None
    return row


def link_observations(steps: list[dict[str, Any]]) -> dict[str, int]:
    """Mark observations whose call is missing (and calls with no result) in step metadata.

    Order is kept as the source wrote it, even when a result comes before its call: the link is
    the id, not the position. Returns counts for the episode metadata.
    """
    calls = {c["id"] for s in steps for c in (s.get("tool_calls") or []) if c.get("id")}
    results = {s["tool_call_id"] for s in steps if s.get("tool_call_id")}
    seen_calls: set[str] = set()
    early = orphan = 0
    for s in steps:
        for c in s.get("tool_calls") or []:
            if c.get("id"):
                seen_calls.add(c["id"])
        cid = s.get("tool_call_id")
        if cid:
            if cid not in calls:
                orphan += 1
                _add_meta(s, {"call_missing": True})
            elif cid not in seen_calls:
                early += 1
                _add_meta(s, {"result_before_call": True})
    unanswered = len(calls - results)
    return {"results_before_call": early, "results_without_call": orphan, "calls_without_result": unanswered}


def _add_meta(step_row: dict[str, Any], extra: dict[str, Any]) -> None:
    current = orjson.loads(step_row["metadata"]) if step_row.get("metadata") else {}
    current.update(extra)
    step_row["metadata"] = json_text(current)


def file_stem(path: str, suffixes: tuple[str, ...]) -> str:
    name = PurePath(path).name
    for suffix in suffixes:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def exit_code_in(text: str | None) -> int | None:
    if not text:
        return None
    m = re.search(r"<returncode>(-?\d+)</returncode>|^Exit code (-?\d+)", text, re.M)
    if m:
        return int(m.group(1) or m.group(2))
    return None


def github_repo(url: str | None) -> str | None:
    """``https://github.com/org/repo(.git)(/...)`` -> ``github.com/org/repo``."""
    if not url:
        return None
    m = re.search(r"github\.com[/:]([^/\s]+)/([^/\s#?]+)", url)
    if not m:
        return url
    return f"github.com/{m.group(1)}/{m.group(2).removesuffix('.git')}"


def id_text(value: Any) -> str | None:
    """An id as text (some datasets number their calls and sessions); None when absent or empty."""
    return None if value is None or value == "" else str(value)


def looks_like_jsonl(head: bytes) -> bool:
    """Does the file start with one whole JSON object on its line and another object on the next
    (JSON lines, not one document)?"""
    lines = head.lstrip().split(b"\n", 2)
    return len(lines) > 1 and lines[0].rstrip().endswith(b"}") and lines[1].lstrip()[:1] == b"{"


def decode_jsonl_document(data: bytes) -> dict[str, Any]:
    """A whole JSONL session file as one record: its entries and the lines that did not parse
    (kept by number; the bytes stay in ``raw``). Raises if nothing parses."""
    entries, bad = [], []
    for n, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            value = orjson.loads(line)
        except orjson.JSONDecodeError:
            bad.append(n)
            continue
        if isinstance(value, dict):
            entries.append(value)
        else:
            bad.append(n)
    if not entries:
        raise ValueError("no JSON object lines")
    return {"entries": entries, "bad_lines": bad}
