"""Inspect AI evaluation logs (``inspect eval``: ``logs/*.json`` and ``logs/*.eval``).

A log is one evaluation of one task by one model. Two containers are read:

- **JSON** (``--log-format json``): one object with ``version``, ``status``, ``eval`` (run and
  task ids, the task, the model, the dataset, the package versions), ``plan``, ``results``,
  ``stats`` and ``samples``. The file is one record; each sample (one dataset row in one epoch)
  is one episode.
- **.eval** (the default since 0.3.46): a zip archive of ``header.json`` (the same header;
  ``_journal/start.json`` in a log whose run did not finish) and one ``samples/<id>_epoch_<n>.json``
  member per sample. Ingest reads it like Parquet (``ingest/reader.py``): each sample member is
  rendered as one JSON line ``{"inspect_header": <header>, "sample": <member>}``, and that line
  is the raw record (its place: the member's number in the archive).

A sample holds the conversation as ``messages``: ``system`` and ``user`` messages are the
harness's (the dataset's prompt, the agent scaffold's nudges: nobody types during a run),
``assistant`` messages the model's (text and ``reasoning`` parts, ``tool_calls`` with a
``function`` name and ``arguments`` as an object), ``tool`` messages the environment's (the
result of the call named by ``tool_call_id``; an ``error`` of a type such as ``timeout`` or
``parsing`` is flagged). Strings written as ``attachment://<hash>`` are read from the sample's
``attachments``. Images and other media are named, not kept as bytes.

The verdict is the first scorer's value: ``C`` (correct) resolves, ``I`` (incorrect) and ``N``
(no answer) do not, ``P`` (partial) and numbers are a reward (a number resolves at 1 or more,
a boolean as it says); every scorer's value and explanation stay in the metadata. A sample that
hit a limit (``message``, ``token``, ``time``, ``working``, ``cost``, ``context``) ends with that
limit as its termination reason; a sample that failed (``error``) ends with its message. SWE-bench
tasks (``inspect_evals``) carry ``repo``, ``base_commit`` and ``created_at`` in the sample's
metadata: they become the episode's repository, base commit and issue time.
"""

from __future__ import annotations

import math
from typing import Any

from trajwh.ingest.adapters.base import Adapter, ParsedEpisode, RecordContext
from trajwh.ingest.adapters.common import (
    count_of,
    episode,
    id_text,
    json_text,
    link_observations,
    number_steps,
    step,
    tool_call,
    tool_schema_info,
    ts,
)
from trajwh.ingest.reader import EVAL_HEADER_KEY as HEADER_KEY
from trajwh.ingest.reader import inspect_json
from trajwh.schemas.errors import InputFormatError

_ATTACHMENT = "attachment://"
#: a limit's type as the words the outcome rules read (fragments/outcomes.py: budget exhausted)
_LIMITS = {"message": "max turns", "token": "token limit", "time": "time limit", "working": "time limit",
           "cost": "cost limit", "context": "context window"}
_SCORE_WORDS = {"C": True, "I": False, "N": False}
_SCORE_REWARD = {"C": 1.0, "I": 0.0, "N": 0.0, "P": 0.5}


def _resolver(attachments: Any):
    """A function that replaces ``attachment://<hash>`` strings (anywhere in a value) by the
    attachment's text; an unknown hash stays as written."""
    table = attachments if isinstance(attachments, dict) else {}

    def resolve(value: Any) -> Any:
        if isinstance(value, str):
            if value.startswith(_ATTACHMENT):
                found = table.get(value[len(_ATTACHMENT):])
                return found if isinstance(found, str) else value
            return value
        if isinstance(value, list):
            return [resolve(v) for v in value]
        if isinstance(value, dict):
            return {k: resolve(v) for k, v in value.items()}
        return value

    return resolve if table else (lambda value: value)


def _content(content: Any) -> tuple[str | None, str | None]:
    """A message's content as (text, reasoning): text parts joined; ``reasoning`` parts apart
    (a redacted one said as such); images, audio, video and documents named, never kept as bytes."""
    if content is None or isinstance(content, str):
        return content, None
    texts: list[str] = []
    thoughts: list[str] = []
    for part in content if isinstance(content, list) else [content]:
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            continue
        kind = part.get("type")
        if kind == "reasoning":
            said = part.get("reasoning") if isinstance(part.get("reasoning"), str) else None
            thoughts.append("[reasoning redacted by the provider]" if part.get("redacted") and not said
                            else said or "")
        elif isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in ("image", "audio", "video", "document"):
            ref = part.get(kind) if isinstance(part.get(kind), str) else part.get("filename")
            name = ref if isinstance(ref, str) and not ref.startswith("data:") else "inline data"
            texts.append(f"[{kind}] {name}")
        elif kind is not None:
            texts.append(json_text(part) or "")
    return ("\n".join(t for t in texts if t) or None), ("\n".join(t for t in thoughts if t) or None)


def _verdict(scores: Any) -> dict[str, Any]:
    """Episode columns from the sample's scores: the first scorer decides (see the module notes)."""
    if not isinstance(scores, dict) or not scores:
        return {}
    name, first = next(iter(scores.items()))
    value = first.get("value") if isinstance(first, dict) else first
    out: dict[str, Any] = {"verifier_name": str(name), "verifier_status": "ok"}
    if isinstance(value, bool):
        out.update(resolved=value, reward=float(value))
    elif isinstance(value, int | float) and math.isfinite(value):
        out.update(resolved=value >= 1, reward=float(value))
    elif isinstance(value, str) and value.upper() in _SCORE_REWARD:
        letter = value.upper()
        out.update(resolved=_SCORE_WORDS.get(letter, False), reward=_SCORE_REWARD[letter])
    else:  # a dict of values, or a word of the scorer's own: kept in the metadata, no verdict
        out["verifier_status"] = "unreadable"
    return out


def _score_summary(scores: Any) -> dict[str, Any] | None:
    if not isinstance(scores, dict):
        return None
    return {str(k): {f: v.get(f) for f in ("value", "answer", "explanation") if v.get(f) is not None}
            if isinstance(v, dict) else {"value": v} for k, v in scores.items()}


def _tools(events: Any) -> Any:
    """The tool definitions the model was shown: the first model call's ``tools``."""
    for ev in events if isinstance(events, list) else []:
        if isinstance(ev, dict) and ev.get("event") == "model" and ev.get("tools"):
            return ev["tools"]
    return None


def _from_events(sample: dict[str, Any]) -> list[Any]:
    """A sample that kept no ``messages`` (only its transcript): the last model call's input and
    its output. The input is inline, or (log format 3) ``input_refs``: [start, end) ranges into the
    sample's ``message_pool``."""
    last = next((ev for ev in reversed(sample.get("events") or []) if isinstance(ev, dict)
                 and ev.get("event") == "model"), None)
    if last is None:
        return []
    messages = list(last.get("input") or []) if isinstance(last.get("input"), list) else []
    pool = sample.get("message_pool") if isinstance(sample.get("message_pool"), list) else []
    for ref in last.get("input_refs") or [] if not messages else []:
        if isinstance(ref, list | tuple) and len(ref) == 2 and all(isinstance(x, int) for x in ref):
            messages += pool[ref[0]:ref[1]]
    choices = (last.get("output") or {}).get("choices") if isinstance(last.get("output"), dict) else None
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        messages.append(choices[0].get("message"))
    return messages


def _event_times(events: Any) -> list[Any]:
    return [t for ev in (events if isinstance(events, list) else []) if isinstance(ev, dict)
            and (t := ts(ev.get("timestamp")))]


def _steps(messages: list[Any], resolve: Any) -> tuple[list[dict[str, Any]], list[str], dict[str, int]]:
    steps: list[dict[str, Any]] = []
    models: list[str] = []
    unknown: dict[str, int] = {}
    for m in messages:
        if not isinstance(m, dict):
            continue
        m = resolve(m)
        role = m.get("role")
        text, reasoning = _content(m.get("content"))
        if role in ("system", "user"):
            steps.append(step(role, "harness", text=text,
                              metadata={"source": m.get("source")} if m.get("source") else None))
        elif role == "assistant":
            model = m.get("model") if isinstance(m.get("model"), str) else None
            if model:
                models.append(model)
            calls = [c for c in m.get("tool_calls") or [] if isinstance(c, dict)]
            meta: dict[str, Any] = {"reasoning": reasoning, "model": model}
            parse_errors = [c.get("parse_error") for c in calls if c.get("parse_error")]
            if parse_errors:
                meta.update(parse_errors=parse_errors, is_error=True)
            steps.append(step("assistant", "model", text=text, metadata={k: v for k, v in meta.items() if v},
                              tool_calls=[tool_call(str(c.get("function") or "unknown"), c.get("arguments"),
                                                    id_text(c.get("id"))) for c in calls]))
        elif role == "tool":
            error = m.get("error") if isinstance(m.get("error"), dict) else None
            meta = {"function": m.get("function")}
            if error:
                meta.update(is_error=True, error_type=error.get("type"), error=error.get("message"))
            observation = text
            if error and not observation and isinstance(error.get("message"), str):
                observation = error["message"]
            steps.append(step("tool", "environment", observation=observation, tool_call_id=id_text(m.get("tool_call_id")),
                              metadata={k: v for k, v in meta.items() if v is not None}))
        else:
            unknown[str(role)] = unknown.get(str(role), 0) + 1
            steps.append(step("system", "harness", text=text or json_text(m), metadata={"unknown_role": role}))
    return steps, models, unknown


def _usage(model_usage: Any) -> tuple[int | None, int | None]:
    def count(u: dict[str, Any], key: str) -> int:
        return count_of(u.get(key)) or 0

    usages = [u for u in (model_usage.values() if isinstance(model_usage, dict) else []) if isinstance(u, dict)]
    return (sum(count(u, "input_tokens") for u in usages) or None, sum(count(u, "output_tokens") for u in usages) or None)


def _episode(header: dict[str, Any], sample: dict[str, Any]) -> ParsedEpisode:
    ev = header.get("eval") if isinstance(header.get("eval"), dict) else {}
    resolve = _resolver(sample.get("attachments"))
    messages = sample.get("messages") if isinstance(sample.get("messages"), list) else []
    rebuilt = not messages
    steps, models, unknown = _steps(messages or _from_events(sample), resolve)
    counts = link_observations(steps)
    number_steps(steps)
    meta = sample.get("metadata") if isinstance(sample.get("metadata"), dict) else {}
    sample_id, epoch = id_text(sample.get("id")), sample.get("epoch")
    task = ev.get("task") if isinstance(ev.get("task"), str) else None
    run = id_text(ev.get("run_id")) or id_text(ev.get("eval_id"))
    episode_id = id_text(sample.get("uuid")) or (
        "/".join(str(x) for x in (run or task or "inspect", sample_id, f"epoch{epoch}" if epoch is not None else None)
                 if x is not None))
    task_input = resolve(sample.get("input"))
    task_text = task_input if isinstance(task_input, str) else _content(
        next((m.get("content") for m in task_input if isinstance(m, dict) and m.get("role") == "user"), None)
        if isinstance(task_input, list) else None)[0]
    limit = sample.get("limit") if isinstance(sample.get("limit"), dict) else None
    error = sample.get("error") if isinstance(sample.get("error"), dict) else None
    exit_status = termination = None
    if error:
        message = str(error.get("message") or "error")
        exit_status, termination = "error", message.strip().splitlines()[0][:500] if message.strip() else "error"
    elif limit:
        kind = str(limit.get("type") or "")
        exit_status = "limit"
        termination = f"{_LIMITS.get(kind, kind + ' limit')} ({kind} limit {limit.get('limit')})"
    elif steps:
        exit_status = "finished"
    times = _event_times(sample.get("events"))
    tokens_in, tokens_out = _usage(sample.get("model_usage"))
    model = ev.get("model") if isinstance(ev.get("model"), str) else (models[0] if models else None)
    packages = ev.get("packages") if isinstance(ev.get("packages"), dict) else {}
    schemas = tool_schema_info(resolve(_tools(sample.get("events"))), "inspect model event tools")
    ep = episode(
        source_episode_id=episode_id,
        task_id=f"{task}/{sample_id}" if task and sample_id is not None else sample_id,
        task_text=task_text,
        instance_id=sample_id,
        repository=meta.get("repo") if isinstance(meta.get("repo"), str) else None,
        base_commit=meta.get("base_commit") if isinstance(meta.get("base_commit"), str) else None,
        issue_created_at=ts(meta.get("created_at")),
        policy_name=model,
        harness_name="inspect_ai",
        harness_version=packages.get("inspect_ai") if isinstance(packages.get("inspect_ai"), str) else None,
        attempt=epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None,
        sampling=ev.get("model_generate_config") or None,
        started_at=ts(sample.get("started_at")) or (min(times) if times else ts(ev.get("created"))),
        ended_at=ts(sample.get("completed_at")) or (max(times) if times else None),
        exit_status=exit_status, termination_reason=termination,
        tokens_in=tokens_in, tokens_out=tokens_out,
        **_verdict(sample.get("scores")),
        metadata={"eval_task": task, "eval_task_id": id_text(ev.get("task_id")), "eval_run_id": run,
                  "eval_status": header.get("status"), "log_version": header.get("version"),
                  "sample_id": sample_id, "epoch": epoch, "target": resolve(sample.get("target")),
                  "scores": _score_summary(resolve(sample.get("scores"))), "limit": limit,
                  "error": error.get("message") if error else None, "dataset": (ev.get("dataset") or {}).get("name")
                  if isinstance(ev.get("dataset"), dict) else None,
                  "models": sorted(set(models)) or None, "unknown_roles": unknown or None,
                  "messages_from": "the last model event" if rebuilt and steps else None,
                  "total_time": sample.get("total_time"), "working_time": sample.get("working_time"), **counts},
    )
    return ParsedEpisode(ep, steps, tool_schemas=schemas)


def _is_sample(value: Any) -> bool:
    return isinstance(value, dict) and isinstance(value.get("messages"), list) and "epoch" in value


class InspectAdapter(Adapter):
    name = "inspect-ai"
    version = "1.0.0"
    framing = "jsonl"  # a JSON log is a document (it opens with a line that is only "{"); an .eval's samples are lines
    description = "Inspect AI evaluation log (logs/*.json, or an .eval archive: a sample per record)"

    def sniff(self, path: str, head: bytes) -> bool:
        start = head.lstrip()[:1] == b"{"
        if start and head.lstrip().startswith(b'{"' + HEADER_KEY.encode() + b'"'):
            return True
        return start and b'"eval"' in head and b'"task_id"' in head and b'"run_id"' in head and b'"version"' in head

    def decode(self, data: bytes) -> Any:
        return inspect_json(data)  # Inspect writes NaN and Infinity

    def check_record(self, obj: Any) -> str | None:
        if not isinstance(obj, dict):
            return "expected an Inspect log object (version, eval, samples) or an .eval sample line"
        if HEADER_KEY in obj and "unreadable_member" in obj:
            return f"the archive's member {obj['unreadable_member']} is not JSON: {obj.get('error')}"
        if HEADER_KEY in obj:
            return None if _is_sample(obj.get("sample")) else "an .eval line without a sample (messages, epoch)"
        if not isinstance(obj.get("eval"), dict):
            return "expected an Inspect log object with an 'eval' header"
        samples = obj.get("samples")
        if not isinstance(samples, list) or not samples:
            return (f"an Inspect log without samples (status {obj.get('status')!r}): a header only, nothing to read "
                    "(valid: a log written with its samples, as `inspect eval` writes it)")
        return None

    def parse(self, obj: dict[str, Any], ctx: RecordContext) -> list[ParsedEpisode]:
        if HEADER_KEY in obj:
            header = obj.get(HEADER_KEY) if isinstance(obj.get(HEADER_KEY), dict) else {}
            return [_episode(header, obj["sample"])]
        out = [_episode(obj, s) for s in obj["samples"] if _is_sample(s)]
        if not out:
            raise InputFormatError("none of the log's samples has 'messages' and an 'epoch'", where=ctx.where(),
                                   valid="Inspect samples (id, epoch, input, messages, scores)")
        return out
