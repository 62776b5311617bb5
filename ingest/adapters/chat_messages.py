"""Chat-message trajectories: one episode per row of a message list, the shape most public agent
SFT datasets are published in (Hugging Face rows exported as JSON lines, or a JSON array of them).

A row holds its messages under ``messages``, ``conversations``, ``conversation``, ``trajectory``,
``traj``, ``chat`` or ``dialog`` (a list, or that list as JSON text), or as TRL's ``prompt`` and
``completion`` lists; a file that is one JSON array of messages (a trace dump) is one conversation. Two message spellings:

- **OpenAI** (SWE-smith, SWE-Gym, nebius SWE-rebench-OpenHands, SWE-Zero, tau-bench style):
  ``role`` and ``content`` (text or a list of parts), ``tool_calls`` (``{"id", "function":
  {"name", "arguments"}}``, arguments as JSON text) or a legacy ``function_call``; ``role: tool``
  (or ``function``) results with ``tool_call_id``; ``reasoning_content`` kept in step metadata.
- **Anthropic** content blocks (``text``, ``tool_use``, ``tool_result`` inside a user message,
  ``thinking``), the system prompt beside the messages (``system``).
- **OpenAI Responses API items** (Agents SDK input lists): ``message``, ``function_call`` /
  ``custom_tool_call`` and their ``*_output`` items by ``call_id``, ``reasoning`` summaries.
- **ShareGPT** (``from`` / ``value``: ``system``, ``human``, ``gpt``, ``function_call``,
  ``observation``) and nebius SWE-agent rows (``role: ai``, ``text``, ``mask``).
- **Cline / Roo Code** task histories (``api_conversation_history.json``: a bare array of
  Anthropic messages). Their tool results come back as user text blocks headed ``[read_file for
  'x'] Result:`` (not ``tool_result`` blocks): each is tool output, linked to the earliest
  unanswered call of that name; the ``<environment_details>`` beside it stays the harness's. Older
  versions call tools in the assistant's text as XML (``<read_file><path>x</path></read_file>``).
- **OpenCode** exports (``opencode export``: the session's ``info`` and ``messages`` of ``info`` and
  ``parts``): each assistant step is a message of its text, reasoning and tool calls, then the
  calls' results from the tool parts' ``state``; the user's messages are what a person typed.
- **LangChain / LangGraph** messages (``type``: ``human``, ``ai``, ``tool``; ``tool_calls`` with ``args``;
  also ``messages_to_dict``'s ``{"type", "data"}``), a thread's id as the episode id, the model
  from ``response_metadata``; a tool message with ``status: error`` is flagged.
- **Calls written in the text** by a model without native tools, read when a message has no
  structured call: Cline's tags, OpenHands' non-function-calling format (``<function=execute_bash>
  <parameter=command>ls</parameter></function>``, results as user turns headed ``EXECUTION RESULT of
  [execute_bash]:``; SFT sets converted by its fn_call_converter), Hermes / Qwen
  ``<tool_call>{...}</tool_call>`` with ``<tool_response>`` results, and ReAct lines (``Action:
  search[red shoes]``, ``Act: answer(4)``: WebShop, HotpotQA, AgentInstruct) with ``Observation:``
  results.

Authorship: system and developer messages are ``harness``, and so is a demonstration (SWE-agent's
``is_demo`` or ``message_type: demonstration``) whatever its role; the first user message is the
task prompt the harness wrote (``harness``). A user message SWE-agent marks ``message_type:
observation`` is tool output (``environment``); its tool results name their call in
``tool_call_ids``. Later user messages are tool output (``environment``)
when the model acts in text (no structured calls anywhere: SWE-agent style, where each command's
output comes back as a user turn), else messages the harness sends back (``harness``). Assistant
messages are ``model``; a fenced shell block in a text-acting model's message is its command.
A per-message training flag (``mask``, ``weight``, ``train``) is kept in the step's metadata as
``trained_in_source``: the warehouse's own loss mask is decided by authorship, not by it.

Episode fields come from the row: ``instance_id`` / ``task_id``, ``resolved`` (or a boolean
``target`` / ``success``, or a 0/1 ``reward``), the model (``model``, ``model_name``, ...),
``exit_status``, ``repo``, the submitted patch (metadata ``submission``), the tools the model
was shown (``tools``, ``available_tools``, ``functions``). An episode id is taken only from a
per-trajectory id (``trajectory_id``, ``traj_id``, ``id``, ...), never from the instance id:
datasets hold many attempts per instance. A trial number (tau-bench's ``trial``) is kept in the
metadata, not made the attempt key: result files of different runs number their trials alike.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import orjson
from trajwh.ingest.actions import command_in_text
from trajwh.ingest.adapters.base import Adapter, ParsedEpisode, RecordContext
from trajwh.ingest.adapters.cline import task_of
from trajwh.ingest.adapters.common import (
    count_of,
    decode_json_string,
    decode_jsonl_document,
    episode,
    exit_code_in,
    id_text,
    json_text,
    link_observations,
    number_steps,
    step,
    text_of,
    tool_call,
    tool_schema_info,
    ts,
)
from trajwh.schemas.errors import InputFormatError

#: where a row keeps its message list, in the order they are looked for
MESSAGE_KEYS = ("messages", "conversations", "conversation", "trajectory", "traj", "chat", "dialog")
_SYSTEM = {"system", "developer"}
_USER = {"user", "human"}
_MODEL = {"assistant", "ai", "gpt", "model", "bot", "chatbot"}
_TOOL = {"tool", "function", "ipython", "observation", "tool_response", "tool_result", "environment"}
ROLES = _SYSTEM | _USER | _MODEL | _TOOL | {"function_call"}
_CANONICAL_ROLE = {**{r: "system" for r in _SYSTEM}, **{r: "user" for r in _USER}, **{r: "assistant" for r in _MODEL},
                   **{r: "tool" for r in _TOOL}, "function_call": "assistant"}
#: a per-trajectory id (never the instance id: many attempts share one)
_ID_KEYS = ("trajectory_id", "traj_id", "conversation_id", "session_id", "thread_id", "uuid", "id")
_MODEL_KEYS = ("model", "model_name", "model_name_or_path", "model_id", "policy", "policy_name")
_PATCH_KEYS = ("model_patch", "generated_patch", "patch", "submission")
_TOOLS_KEYS = ("tools", "available_tools", "functions")
_TRAIN_KEYS = ("mask", "weight", "train", "loss")
#: keys of a list of agent steps that are not messages (smolagents' memory steps)
_STEP_KEYS = ("intermediate_steps", "steps")
#: a message list in the first bytes: its key, then a list or a JSON string holding one
_SNIFF_LIST = re.compile(rb'"(?:' + b"|".join(k.encode() for k in (*MESSAGE_KEYS, "prompt")) + rb')"\s*:\s*(?:\[|"\s*\[)')
_SNIFF_STEPS = re.compile(rb'"(?:intermediate_steps|steps)"\s*:\s*\[')
_SNIFF_ROLE = re.compile(rb'\\?"(?:role|from)\\?"\s*:|"type"\s*:\s*"(?:human|ai)"')
#: LangChain / LangGraph messages (``model_dump()``, or ``messages_to_dict``'s ``{"type", "data"}``): their role
_LANGCHAIN_ROLES = {"human": "user", "ai": "assistant", "AIMessageChunk": "assistant", "tool": "tool", "system": "system",
                    "function": "function", "chat": "user"}


#: OpenAI Responses API items (Agents SDK input lists): what each becomes as a chat message
_ITEM_TYPES = {"message", "function_call", "function_call_output", "custom_tool_call", "custom_tool_call_output",
               "reasoning", "computer_call", "computer_call_output", "local_shell_call", "local_shell_call_output",
               "web_search_call"}
#: built-in tool calls of the Responses API (computer use, the local shell, web search): the tool's name
_BUILTIN_CALLS = {"computer_call": "computer", "local_shell_call": "local_shell", "web_search_call": "web_search"}


def _builtin_output(output: Any, item: dict[str, Any]) -> str | None:
    """A computer-use output as text: the screenshot named, not its bytes (the raw record keeps them), and the page."""
    if isinstance(output, dict) and output.get("type") in ("computer_screenshot", "input_image"):
        url = item.get("current_url") or output.get("current_url")
        return "[screenshot]" + (f" {url}" if url else "")
    return output if isinstance(output, str) else json_text(output)


def _from_items(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses API items as chat messages: a ``message`` keeps its role, a (custom) function call
    is an assistant message with that call, its output a tool message naming the call id, and a
    ``reasoning`` item's summary goes with the next assistant message. Built-in tools' calls
    (``computer_call``, ``local_shell_call``, ``web_search_call``) are calls of ``computer``,
    ``local_shell`` and ``web_search`` with their ``action`` as arguments; a screenshot output is
    named with its page, not kept as bytes."""
    out: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for it in items:
        kind = it.get("type")
        if kind == "reasoning":
            reasoning += [t for t in (text_of(it.get("summary")), text_of(it.get("content"))) if t]
            continue
        if kind in ("function_call", "custom_tool_call"):
            m = {"role": "assistant", "tool_calls": [{"id": it.get("call_id") or it.get("id"), "function": {
                "name": it.get("name"), "arguments": it.get("arguments", it.get("input"))}}]}
        elif kind in _BUILTIN_CALLS:  # the action (a click, a command, a query) is the call's arguments
            m = {"role": "assistant", "tool_calls": [{"id": it.get("call_id") or it.get("id"), "function": {
                "name": _BUILTIN_CALLS[kind], "arguments": it.get("action")}}]}
        elif kind in ("computer_call_output", "local_shell_call_output"):
            m = {"role": "tool", "tool_call_id": it.get("call_id") or it.get("id"),
                 "content": _builtin_output(decode_json_string(it.get("output")), it)}
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output, code = decode_json_string(it.get("output")), None
            if isinstance(output, dict) and "output" in output:  # Codex's JSON form: the output and its exit code
                code = (output.get("metadata") or {}).get("exit_code") if isinstance(output.get("metadata"), dict) else None
                output = output["output"]
            m = {"role": "tool", "tool_call_id": it.get("call_id"), "content": output if isinstance(output, str | list)
                 else json_text(output), **({"exit_code": code} if isinstance(code, int) else {})}
        else:
            m = {k: v for k, v in it.items() if k != "type"}
        if reasoning and _role(m) in _MODEL:
            m["reasoning_content"] = "\n".join(reasoning)
            reasoning = []
        out.append(m)
    return out


def _from_langchain(m: dict[str, Any]) -> dict[str, Any]:
    """A LangChain message as a chat message: its ``type`` the role, its ``tool_calls`` (``args`` as a
    dict) the calls, a tool message's ``status: error`` flagged."""
    body = m["data"] if isinstance(m.get("data"), dict) else m
    kind = m.get("type") if isinstance(m.get("type"), str) else body.get("type")
    out = {**body, "role": _LANGCHAIN_ROLES.get(kind, kind)}
    if out["role"] == "tool" and body.get("status") == "error":
        out["is_error"] = True
    return out


def _is_opencode(m: dict[str, Any]) -> bool:
    """An OpenCode message (``opencode export``): ``info`` (its role, model, times) and ``parts``."""
    return isinstance(m.get("info"), dict) and isinstance(m["info"].get("role"), str) and isinstance(m.get("parts"), list)


def _from_opencode(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenCode messages as chat messages. An assistant message holds several steps (``step-start``
    ... ``step-finish``): each is an assistant message of its text, reasoning and tool calls, then a
    user message of those calls' results (``tool_result`` blocks: a tool part's ``state`` holds its
    input and its output, or its error)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        info = m["info"]
        when = info["time"].get("created") if isinstance(info.get("time"), dict) else None
        parts = [p for p in m["parts"] if isinstance(p, dict)]
        if info["role"] != "assistant":  # what a person typed in the CLI
            out.append({"role": info["role"], "timestamp": when, "typed_by_person": info["role"] == "user", "content": [
                {"type": "text", "text": p["text"]} for p in parts if p.get("type") == "text" and isinstance(p.get("text"), str)]})
            continue
        step: list[dict[str, Any]] = []
        for p in [*parts, {"type": "step-finish"}]:  # the last step may have no step-finish
            if p.get("type") != "step-finish":
                step.append(p)
            elif step:
                out.extend(_opencode_step(step, when))
                step = []
    return out


def _opencode_step(parts: list[dict[str, Any]], when: Any) -> list[dict[str, Any]]:
    """One step of an OpenCode assistant message: the assistant's blocks, then its calls' results."""
    blocks, results = [], []
    for p in parts:
        kind = p.get("type")
        if kind == "text" and isinstance(p.get("text"), str):
            blocks.append({"type": "text", "text": p["text"]})
        elif kind == "reasoning" and isinstance(p.get("text"), str):
            blocks.append({"type": "thinking", "thinking": p["text"]})
        elif kind == "tool":
            state = p.get("state") if isinstance(p.get("state"), dict) else {}
            blocks.append({"type": "tool_use", "id": p.get("callID"), "name": p.get("tool"), "input": state.get("input")})
            if state.get("status") in ("completed", "error"):
                error = state.get("status") == "error"
                results.append({"type": "tool_result", "tool_use_id": p.get("callID"), "is_error": error,
                                "content": state.get("error") if error else state.get("output")})
    return [*([{"role": "assistant", "content": blocks, "timestamp": when}] if blocks else []),
            *([{"role": "user", "content": results, "timestamp": when}] if results else [])]


#: smolagents: the roles its memory writes (``write_memory_to_messages``): a step's calls as the text
#: "Calling tools:\n[...]" (a Python repr of OpenAI-shaped calls), their results as "Call id: X\nObservation:\n..."
#: (or "Error:\n..."; the call id is left out when a step's observations follow its calls)
_SMOL_ROLES = {"tool-call", "tool-response"}
_SMOL_CALLS = re.compile(r"\A\s*Calling tools:\s*\n(?P<calls>.*)\Z", re.S)
_SMOL_RESULT = re.compile(r"\A\s*(?:Call id:\s*(?P<id>\S+)\s*\n)?(?P<kind>Observation|Error):[ \t]*\n?")
#: what a smolagents memory step (``AgentMemory.get_full_steps()`` / ``get_succinct_steps()``, a run's
#: ``intermediate_steps``) holds, by kind
_SMOL_ACTION = {"step_number", "observations"}


def _from_smolagents(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """smolagents messages as chat messages: a ``tool-call`` message's calls join the assistant message
    before it (or make one), a ``tool-response`` is the result of the call it names (else of the last
    call made), an ``Error:`` result flagged."""
    import ast

    out: list[dict[str, Any]] = []
    last: list[str] = []
    for m in messages:
        role = _role(m)
        text = text_of(m.get("content"))
        if role == "tool-call":
            found = _SMOL_CALLS.match(text or "")
            try:
                value = ast.literal_eval(found.group("calls").strip()) if found else None
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                value = None
            calls = [c for c in value if isinstance(c, dict)] if isinstance(value, list) else []
            if not calls:  # not the shape smolagents writes: its words kept as the model's
                out.append({**m, "role": "assistant", "content": text})
                continue
            last = [str(c["id"]) for c in calls if c.get("id") is not None]
            if out and _role(out[-1]) in _MODEL and not out[-1].get("tool_calls"):
                out[-1] = {**out[-1], "tool_calls": calls}
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": calls})
        elif role == "tool-response":
            found = _SMOL_RESULT.match(text or "")
            call_id = (found.group("id") if found else None) or (last[0] if last else None)
            out.append({**m, "role": "tool", "tool_call_id": call_id, "content": (text or "")[found.end():] if found else text,
                        **({"is_error": True} if found and found.group("kind") == "Error" else {})})
        else:
            out.append(m)
    return out


def _is_smol_step(s: Any) -> bool:
    return isinstance(s, dict) and (_SMOL_ACTION <= set(s) or "system_prompt" in s
                                    or ("task" in s and "step_number" not in s and "role" not in s)
                                    or ("plan" in s and "model_output_message" in s))


def _from_smolagents_steps(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """smolagents memory steps as chat messages: the system prompt, the task (the harness's prompt),
    a plan (the model's), and each action step's model output with its calls, then its observations
    and its error (flagged) as the results of its first call."""
    out: list[dict[str, Any]] = []
    for s in steps:
        timing = s.get("timing") if isinstance(s.get("timing"), dict) else {}
        when = timing.get("start_time")
        if "system_prompt" in s:
            out.append({"role": "system", "content": s["system_prompt"]})
        elif "task" in s and "step_number" not in s:
            out.append({"role": "user", "content": s["task"]})
        elif "plan" in s and "step_number" not in s:
            out.append({"role": "assistant", "content": s["plan"], "timestamp": when})
        else:
            calls = [c for c in s.get("tool_calls") or [] if isinstance(c, dict)]
            text = s.get("model_output")
            if not isinstance(text, str):
                said = s.get("model_output_message")
                text = text_of(said.get("content")) if isinstance(said, dict) else text_of(text)
            out.append({"role": "assistant", "content": text, "tool_calls": calls, "timestamp": when})
            first = calls[0].get("id") if calls else None
            if s.get("observations") is not None:
                out.append({"role": "tool", "tool_call_id": first, "content": text_of(s["observations"]), "timestamp": when})
            error = s.get("error")
            if error:
                said = error.get("message") if isinstance(error, dict) else error
                out.append({"role": "tool", "tool_call_id": first, "content": str(said), "is_error": True,
                            "timestamp": when})
    return out


def _bare_message_first(head: bytes) -> bool:
    """Does the file open with a line that is one chat message (a role and what it said, no message
    list): one conversation written as JSON lines?"""
    first, _, rest = head.lstrip().partition(b"\n")
    if not rest and len(head) >= 65536:  # the first line does not end in the head: not a message per line
        return False
    try:
        value = orjson.loads(first)
    except orjson.JSONDecodeError:
        return False
    return (isinstance(value, dict) and (_role(value) in ROLES or _role(value) in _SMOL_ROLES)
            and any(k in value for k in ("content", "value", "tool_calls", "text"))
            and not any(k in value for k in (*MESSAGE_KEYS, "prompt", *_STEP_KEYS)))


def _usage(m: dict[str, Any]) -> tuple[int | None, int | None, float | None]:
    """A model message's tokens in and out and its cost, where it says them: Cline's ``metrics``
    (``tokens.prompt`` / ``completion``, ``cost``), an API's ``usage`` (OpenAI's or Anthropic's names)."""
    metrics = m.get("metrics") if isinstance(m.get("metrics"), dict) else {}
    tokens = metrics.get("tokens") if isinstance(metrics.get("tokens"), dict) else None
    usage = m.get("usage") if isinstance(m.get("usage"), dict) else {}
    tin = tokens.get("prompt") if tokens else usage.get("prompt_tokens", usage.get("input_tokens"))
    tout = tokens.get("completion") if tokens else usage.get("completion_tokens", usage.get("output_tokens"))
    cost = metrics.get("cost")
    return count_of(tin), count_of(tout), float(cost) if isinstance(cost, int | float) and not isinstance(cost, bool) else None


def _message_model(row: dict[str, Any]) -> str | None:
    """The model named by the row's first assistant message that names one, when the row does not:
    an OpenCode message's ``info.modelID``, a LangChain message's ``response_metadata.model_name``."""
    raw = row.get("messages")
    for m in raw if isinstance(raw, list) else []:
        if not isinstance(m, dict):
            continue
        body = m["data"] if isinstance(m.get("data"), dict) else m
        info = body.get("info") if isinstance(body.get("info"), dict) else {}
        meta = body.get("response_metadata") if isinstance(body.get("response_metadata"), dict) else {}
        cline = body.get("modelInfo") if isinstance(body.get("modelInfo"), dict) else {}  # Cline's per message
        for name in (info.get("modelID") if info.get("role") == "assistant" else None, meta.get("model_name"),
                     cline.get("modelId")):
            if isinstance(name, str) and name:
                return name
    return None


def _messages(row: dict[str, Any]) -> tuple[str, list[Any]] | None:
    """(key, message list) of a row, the list decoded when the row keeps it as JSON text (and
    Responses API items made messages)."""
    for key in (*MESSAGE_KEYS, "prompt", *_STEP_KEYS):
        value = decode_json_string(row.get(key))
        if key in _STEP_KEYS:  # smolagents memory steps (a run's intermediate steps): made messages
            if not (isinstance(value, list) and value and all(_is_smol_step(x) for x in value)):
                continue
            value = _from_smolagents_steps(value)
        if key == "prompt":  # TRL's conversational prompt-completion rows: the prompt, then the completion
            completion = decode_json_string(row.get("completion"))
            value = [*value, *completion] if isinstance(value, list) and isinstance(completion, list) else None
        if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
            if any(m.get("type") in _ITEM_TYPES - {"message"} for m in value):
                value = _from_items(value)
            elif all(_is_opencode(m) for m in value):
                value = _from_opencode(value)
            elif not any("role" in m or "from" in m for m in value) and any(
                    m.get("type") in ("human", "ai") for m in value):
                value = [_from_langchain(m) for m in value]
            elif any(_role(m) in _SMOL_ROLES for m in value):
                value = _from_smolagents(value)
            if any(isinstance(m.get("role"), str) or isinstance(m.get("from"), str) for m in value):
                return key, value
    return None


def _role(m: dict[str, Any]) -> str | None:
    role = m.get("role") if isinstance(m.get("role"), str) else m.get("from")
    return role.strip().lower() if isinstance(role, str) else None


def _content(m: dict[str, Any]) -> str | None:
    for key in ("content", "value", "text"):
        if key in m and m[key] is not None:
            return text_of(m[key])
    return None


def _calls(m: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    raw = m.get("tool_calls")
    for c in raw if isinstance(raw, list) else []:
        if isinstance(c, dict):
            fn = c.get("function") if isinstance(c.get("function"), dict) else c
            args = fn.get("arguments", fn.get("parameters", fn.get("args")))  # LangChain: args, a dict
            out.append(tool_call(str(fn.get("name") or "unknown"), args, id_text(c.get("id"))))
    legacy = m.get("function_call")
    if isinstance(legacy, dict):
        out.append(tool_call(str(legacy.get("name") or "unknown"), legacy.get("arguments"), id_text(legacy.get("id"))))
    return out


def _sharegpt_call(text: str | None) -> list[dict[str, Any]]:
    """A ShareGPT ``function_call`` turn: its value is the call as JSON (name and arguments)."""
    value = decode_json_string(text)
    if isinstance(value, str):  # not JSON: the call written in text (OpenHands' converter writes <function=...>)
        return _text_calls(value)
    calls = value if isinstance(value, list) else [value]
    return [tool_call(str(c.get("name") or "unknown"), c.get("arguments", c.get("parameters")), id_text(c.get("id")))
            for c in calls if isinstance(c, dict)]


#: how OpenHands and SWE-agent style tools report a command's exit code in its output
_EXIT_NOTE = re.compile(r"\[(?:The command completed|Command finished) with exit code (-?\d+)\.?\]")


def _exit_code(text: str | None) -> int | None:
    code = exit_code_in(text)
    if code is None and text and (m := _EXIT_NOTE.search(text)):
        code = int(m.group(1))
    return code


#: a tool's result as the user text that carries it, when the model calls tools in its text: Cline / Roo
#: Code's ``[read_file for 'x'] Result:`` header, OpenHands' non-function-calling ``EXECUTION RESULT of
#: [execute_bash]:`` (its fn_call_converter, and the SFT sets made with it), Hermes / Qwen ``<tool_response>``,
#: ReAct's ``Observation:``
#: what a person typed in Cline / Roo Code (the task, later feedback or messages), sent together with the
#: editor's state (``<environment_details>``, the harness's)
_PERSON_TEXT = re.compile(r"\A\s*<(?:task|feedback|user_message)>")
_DETAILS = "<environment_details>"


def _person_and_details(text: str | None) -> tuple[str | None, str | None]:
    """(what the person typed, the environment details after it) for a Cline user message that
    opens with ``<task>``, ``<feedback>`` or ``<user_message>`` and carries environment details;
    else (None, None)."""
    if not text or not _PERSON_TEXT.match(text) or _DETAILS not in text:
        return None, None
    at = text.index(_DETAILS)
    return text[:at].rstrip("\n"), text[at:]


_TEXT_RESULT = re.compile(r"\A\s*(?:\[(?P<cline>\w+)(?: for '[^\n]*?')?\] Result:|EXECUTION RESULT of \[(?P<oh>[\w.-]+)\]:"
                          r"|<tool_response>|Observation:)[ \t]*\n?")
_TEXT_ERROR = re.compile(r"\A\s*(?:The tool execution failed|\[ERROR\]|<error>)")
#: Cline / Roo Code tools called as XML in the assistant's text (older versions, and any model without native tools)
_XML_TOOLS = ("read_file", "write_to_file", "replace_in_file", "apply_diff", "insert_content", "search_and_replace",
              "search_files", "list_files", "list_code_definition_names", "codebase_search", "execute_command",
              "browser_action", "web_fetch", "use_mcp_tool", "access_mcp_resource", "ask_followup_question",
              "attempt_completion", "plan_mode_respond", "new_task", "switch_mode", "fetch_instructions")
#: a call in the text: Cline's tags, OpenHands' ``<function=name><parameter=k>v</parameter></function>``, or a
#: Hermes / Qwen ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
_TEXT_CALL = re.compile(r"<(?P<tag>" + "|".join(_XML_TOOLS) + r")>(?P<body>.*?)</(?P=tag)>"
                        r"|<function=(?P<fn>[\w.-]+)>(?P<params>.*?)</function>"
                        r"|<tool_call>\s*(?P<json>\{.*?\})\s*</tool_call>"
                        # ReAct (WebShop, HotpotQA, AgentInstruct): a line "Action: search[red shoes]" or "Act: answer(4)"
                        r"|(?m:^[ \t]*Act(?:ion)?[ \t]*:[ \t]*(?P<react>[A-Za-z_][\w.-]*)[ \t]*"
                        r"(?:\[(?P<rarg>[^\n]*)\]|\((?P<parg>[^\n]*)\))[ \t]*$)", re.S)
_XML_PARAM = re.compile(r"<(\w+)>(.*?)</\1>", re.S)
_FN_PARAM = re.compile(r"<parameter=([\w.-]+)>(.*?)</parameter>", re.S)


def _text_result(text: str | None) -> tuple[str | None, str | None, bool, str | None] | None:
    """A tool result carried as text (see ``_TEXT_RESULT``), as (call id, output, error, tool name), or None."""
    m = _TEXT_RESULT.match(text or "")
    if m is None:
        return None
    output = (text or "")[m.end():]
    if m.group(0).lstrip().startswith("<tool_response>"):
        output = re.sub(r"\s*</tool_response>\s*\Z", "", output)
    return None, output, bool(_TEXT_ERROR.match(output)), m.group("cline") or m.group("oh")


def _text_calls(text: str | None) -> list[dict[str, Any]]:
    """Tool calls a model wrote in its text (see ``_TEXT_CALL``), for a message with no structured call."""
    if not text or ("</" not in text and "Act" not in text):
        return []
    calls = []
    for m in _TEXT_CALL.finditer(text):
        if m.group("tag"):
            calls.append(tool_call(m.group("tag"), {k: v.strip("\n") for k, v in _XML_PARAM.findall(m.group("body"))}))
        elif m.group("fn"):
            calls.append(tool_call(m.group("fn"), {k: v.strip("\n") for k, v in _FN_PARAM.findall(m.group("params"))}))
        elif m.group("react"):
            arg = m.group("rarg") if m.group("rarg") is not None else m.group("parg")
            calls.append(tool_call(m.group("react"), {"input": arg} if arg else {}))
        elif isinstance(call := decode_json_string(m.group("json")), dict) and isinstance(call.get("name"), str):
            calls.append(tool_call(call["name"], call.get("arguments", call.get("parameters")), id_text(call.get("id"))))
    return calls


@dataclass
class _Parts:
    """What one message holds: its text, the calls it makes, the results it carries (call id,
    output, error flag) and its reasoning."""

    text: str | None
    calls: list[dict[str, Any]] = field(default_factory=list)
    results: list[tuple[str | None, str | None, bool, str | None]] = field(default_factory=list)  # id, output, error, tool
    reasoning: str | None = None
    from_text: bool = False  # its calls were written in its text (no structured call)


def _parts(m: dict[str, Any], role: str | None) -> _Parts:
    """A message's parts. Content blocks in Anthropic's spelling are read by type: ``text``,
    ``tool_use`` (a call), ``tool_result`` (a result, in a user message), ``thinking``; a ShareGPT
    ``function_call`` turn is a call written as JSON."""
    if role == "function_call":  # its words are kept when it is not JSON (the call written in the text)
        text = _content(m)
        written = isinstance(decode_json_string(text), str)
        return _Parts(text if written else None, _sharegpt_call(text), from_text=written)
    content = next((m[k] for k in ("content", "value", "text") if k in m and m[k] is not None), None)
    if not isinstance(content, list):
        text = text_of(content)
        if role in _USER and (result := _text_result(text)):  # Cline: a result in a plain-text user message
            return _Parts(None, results=[result])
        calls = _calls(m)
        return _Parts(text, calls or (_text_calls(text) if role in _MODEL else []), from_text=not calls)
    texts: list[str] = []
    out = _Parts(None, _calls(m))
    thinking: list[str] = []
    open_result = False  # a Cline result header was the last text block
    for b in content:
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "tool_use":
            out.calls.append(tool_call(str(b.get("name") or "unknown"), b.get("input"), id_text(b.get("id"))))
        elif kind == "tool_result":
            out.results.append((id_text(b.get("tool_use_id")), text_of(b.get("content")), bool(b.get("is_error")), None))
        elif kind in ("thinking", "reasoning"):
            thinking.append(str(b.get("thinking") or b.get("text") or ""))
        elif (t := text_of([b])) is not None:
            if role in _USER and (result := _text_result(t)):
                out.results.append(result)
                open_result = True
            elif open_result and not t.lstrip().startswith("<environment_details>"):
                call_id, output, error, tool = out.results[-1]  # the output in blocks of its own, after its header
                output = f"{output}\n{t}" if output else t
                out.results[-1] = (call_id, output, error or bool(_TEXT_ERROR.match(output)), tool)
            else:
                open_result = False
                texts.append(t)
    out.text = "\n".join(texts) if texts else None
    if role in _MODEL and not out.calls:
        out.calls, out.from_text = _text_calls(out.text), True
    out.reasoning = "\n".join(t for t in thinking if t) or None
    return out


def _first(row: dict[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        value = row.get(key)
        if value is not None and value != "":
            return value
    return None


def _resolved(row: dict[str, Any]) -> bool | None:
    for key in ("resolved", "target", "success"):
        if isinstance(row.get(key), bool):
            return row[key]
    reward = row.get("reward")
    if isinstance(reward, int | float) and not isinstance(reward, bool) and reward in (0, 1):
        return bool(reward)
    return None


def _text_field(row: dict[str, Any], *keys: str) -> str | None:
    value = _first(row, keys)
    return value if isinstance(value, str) else None


def _meta(m: dict[str, Any]) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for key in _TRAIN_KEYS:
        if isinstance(m.get(key), bool | int | float):
            meta["trained_in_source"] = bool(m[key])
            break
    reasoning = m.get("reasoning_content") or m.get("reasoning") or m.get("thinking")
    if isinstance(reasoning, str) and reasoning:
        meta["reasoning"] = reasoning
    if isinstance(m.get("name"), str) and m["name"]:
        meta["name"] = m["name"]
    return meta


class ChatMessagesAdapter(Adapter):
    name = "chat-messages"
    version = "1.5.0"  # 1.5: calls read from a model's text are marked so (rendered once); 1.1: Cline results and calls in text, the Responses API's built-in tools; 1.2: what a person typed in Cline is human; 1.3: smolagents messages and memory steps; 1.4: tokens and cost of model messages, Cline's task id, start and model
    framing = "jsonl"  # a row per line; a pretty-printed row or an array of rows is one document
    row_arrays = True  # an array of rows too large for one record: a record per row
    description = "chat-message rows: OpenAI messages or ShareGPT conversations (agent SFT datasets)"

    def sniff(self, path: str, head: bytes) -> bool:
        if _bare_message_first(head):
            return True  # one conversation as JSON lines: a message per line
        first = head.lstrip()[:1]
        if first in (b"{", b"[") and _SNIFF_STEPS.search(head) and b'"step_number"' in head:
            return True  # smolagents memory steps (a run's intermediate steps)
        if first not in (b"{", b"[") or not _SNIFF_ROLE.search(head):
            return False
        # rows holding a message list, or one conversation: an array of messages
        return bool(_SNIFF_LIST.search(head)) or (first == b"[" and (b'"content"' in head or b'"value"' in head))

    def framing_of(self, head: bytes) -> str | None:
        return "document" if _bare_message_first(head) else None

    def decode(self, data: bytes) -> Any:
        """A row, an array of rows or of messages; or one conversation written as JSON lines (a
        message per line: the file is one record), its messages under ``messages`` and the lines
        that are not JSON objects counted."""
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            doc = decode_jsonl_document(data)  # (raises when no line is an object)
            return {"messages": doc["entries"], "bad_lines": doc["bad_lines"] or None}

    @staticmethod
    def _rows(obj: Any) -> list[Any]:
        """The rows of a record: one row, an array of rows, or one conversation (an array of messages)."""
        if isinstance(obj, list) and obj and all(isinstance(m, dict) for m in obj) and _messages({"messages": obj}) \
                and not any(_messages(m) for m in obj):
            return [{"messages": obj}]
        return obj if isinstance(obj, list) else [obj]

    def check_record(self, obj: Any) -> str | None:
        rows = self._rows(obj)
        if not rows:
            return "an empty array"
        for i, row in enumerate(rows):
            where = f"row {i}: " if rows is obj else ""
            if not isinstance(row, dict):
                return f"{where}expected an object, found {type(row).__name__}"
            if _messages(row) is None:
                return (f"{where}no message list (one of {', '.join(MESSAGE_KEYS)}, or prompt and completion: "
                        "objects with 'role' or 'from')")
        return None

    def parse(self, obj: Any, ctx: RecordContext) -> list[ParsedEpisode]:
        rows = self._rows(obj)
        many = isinstance(obj, list) and rows is obj
        return [self._episode(row, ctx, i if many else None) for i, row in enumerate(rows)]

    def _episode(self, row: dict[str, Any], ctx: RecordContext, index: int | None) -> ParsedEpisode:
        found = _messages(row)
        where = ctx.where() + (f" row {index}" if index is not None else "")
        if found is None:
            raise InputFormatError("no message list", where=where, valid=f"one of {', '.join(MESSAGE_KEYS)}")
        key, messages = found
        system = row.get("system") if isinstance(row.get("system"), str) else None
        if system and not any(_role(m) in _SYSTEM for m in messages):  # Anthropic's API keeps it beside the messages
            messages = [{"role": "system", "content": system}, *messages]
        roles = [_role(m) for m in messages]
        for n, role in enumerate(roles):
            if role not in ROLES:
                raise InputFormatError(f"{key}[{n}] has the role {role!r}", where=where,
                                       valid=", ".join(sorted(ROLES)))
        parsed = [_parts(m, role) for m, role in zip(messages, roles, strict=True)]
        # a model that acts in text gets its commands' output back as user turns
        # (calls it writes in its text count as acting in text, unless their results come back marked as such)
        text_acting = not any(r in _TOOL for r in roles) and not any(
            (p.calls and not p.from_text) or p.results for p in parsed)
        steps: list[dict[str, Any]] = []
        task_prompt: str | None = None
        waiting: list[dict[str, Any]] = []  # the last model message's calls no result has named yet
        totals: list[float] = [0, 0, 0.0]  # tokens in, out, cost of the model messages that say them
        seen_usage = False
        for m, role, p in zip(messages, roles, parsed, strict=True):
            text, when = p.text, ts(m.get("timestamp") or m.get("created_at"))
            meta = {**_meta(m), **({"reasoning": p.reasoning} if p.reasoning else {})}
            for call_id, output, error, tool in p.results:  # tool_result blocks (Cline: text blocks) in a user message
                if tool is not None:  # Cline names the tool, not the call: the earliest unanswered call of that name
                    call = next((c for c in waiting if c["name"] == tool), None)
                    if call is not None:
                        waiting.remove(call)
                        call_id = call.get("id")
                steps.append(step("tool", "environment", observation=output, tool_call_id=call_id,
                                  exit_code=_exit_code(output), started_at=when,
                                  metadata={"is_error": True, **({"tool": tool} if tool else {})} if error
                                  else {"tool": tool} if tool else None))
            kind = m.get("message_type")
            if m.get("is_demo") or kind == "demonstration":  # a harness-written example, whatever its role
                steps.append(step(_CANONICAL_ROLE.get(role or "", "user"), "harness", text=text, started_at=when,
                                  metadata={**meta, "demonstration": True}))
            elif role in _SYSTEM:
                steps.append(step("system", "harness", text=text, started_at=when, metadata=meta))
            elif role in _USER:
                if p.results and text is None:
                    continue
                said, details = _person_and_details(text)
                if m.get("typed_by_person") or said is not None:  # OpenCode's user turns; Cline's task and feedback
                    said = text if said is None else said
                    if task_prompt is None:
                        task_prompt = said or ""
                    steps.append(step("user", "human", text=said, started_at=when, metadata=meta))
                    if details:  # the editor's state Cline sends with them: the harness's
                        steps.append(step("user", "harness", text=details, started_at=when, metadata=meta))
                elif task_prompt is None:
                    task_prompt = text or ""
                    steps.append(step("user", "harness", text=text, started_at=when, metadata=meta))
                elif text_acting or kind == "observation":  # SWE-agent marks command output it sends as a user turn
                    steps.append(step("user", "environment", observation=text, exit_code=_exit_code(text),
                                      started_at=when, metadata=meta))
                else:
                    steps.append(step("user", "harness", text=text, started_at=when, metadata=meta))
            elif role in _MODEL or role == "function_call":
                waiting = list(p.calls)
                tin, tout, cost = _usage(m)
                totals = [a + (b or 0) for a, b in zip(totals, (tin, tout, cost), strict=True)]
                seen_usage |= any(v is not None for v in (tin, tout, cost))
                if p.calls and p.from_text and text:  # its calls are in its text: rendered once, as written
                    meta["calls_in_text"] = True
                steps.append(step("assistant", "model", text=text, tool_calls=p.calls,
                                  action_command=None if p.calls or not text_acting else command_in_text(text),
                                  started_at=when, tokens_in=tin, tokens_out=tout,
                                  metadata={**meta, "cost_usd": cost} if cost is not None else meta))
            else:
                ids_ = m.get("tool_call_ids")  # SWE-agent writes a list (one id)
                call_id = id_text(m.get("tool_call_id") or (ids_[0] if isinstance(ids_, list) and ids_ else None))
                code = m.get("exit_code") if isinstance(m.get("exit_code"), int) else _exit_code(text)
                steps.append(step("tool", "environment", observation=text, tool_call_id=call_id, exit_code=code,
                                  started_at=when, metadata={**meta, "is_error": True} if m.get("is_error") is True else meta))
        counts = link_observations(steps)
        number_steps(steps)
        times = [s["started_at"] for s in steps if s.get("started_at")]
        iid = _first(row, ("instance_id", "task_id", "problem_id"))
        raw = row.get("messages")  # an OpenCode export: the session is its "info"
        opencode = isinstance(raw, list) and bool(raw) and all(isinstance(m, dict) and _is_opencode(m) for m in raw)
        session = row["info"] if opencode and isinstance(row.get("info"), dict) else {}
        episode_id = _first(row, _ID_KEYS) or (session.get("id") if isinstance(session.get("id"), str) else None)
        cline_task, cline_ms = task_of(ctx.file_path)  # a Cline history: its task folder names it and its start
        episode_id = episode_id or cline_task
        tools = _first(row, _TOOLS_KEYS)
        patch = _first(row, _PATCH_KEYS)
        reward = row.get("reward")
        ep = episode(
            source_episode_id=str(episode_id) if episode_id is not None else None,
            task_id=str(iid) if iid is not None else None, instance_id=str(iid) if iid is not None else None,
            task_text=task_prompt or None, repository=_text_field(row, "repo", "repository"),
            policy_name=_text_field(row, *_MODEL_KEYS) or _message_model(row),
            harness_name=_text_field(row, "scaffold", "harness", "agent") or ("opencode" if opencode else None)
            or ("cline" if cline_task else None),
            resolved=_resolved(row), exit_status=_text_field(row, "exit_status"),
            reward=float(reward) if isinstance(reward, int | float) and not isinstance(reward, bool) else None,
            started_at=ts(row.get("created_at") or row.get("timestamp")) or (min(times) if times else ts(cline_ms)),
            tokens_in=int(totals[0]) if seen_usage and totals[0] else None,
            tokens_out=int(totals[1]) if seen_usage and totals[1] else None,
            cost_usd=totals[2] if seen_usage and totals[2] else None,
            ended_at=max(times) if times else None,
            metadata={"messages_key": key, "text_acting": text_acting,
                      "submission": patch if isinstance(patch, str) else json_text(patch),
                      "row_license": _text_field(row, "license"), "dataset": _first(row, ("dataset", "source", "subset")),
                      "row_index": index, "trial": _first(row, ("trial", "attempt", "run_index")),
                      "bad_lines": row.get("bad_lines"), **counts},
        )
        return ParsedEpisode(ep, steps, tool_schema_info(tools, f"chat-messages:{_first_key(row, _TOOLS_KEYS)}"))


def _first_key(row: dict[str, Any], keys: tuple[str, ...]) -> str | None:
    return next((k for k in keys if row.get(k) not in (None, "")), None)
