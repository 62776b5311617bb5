"""A fragment's steps rendered through a chat template, tokenized piece by piece, with its loss mask.

The template is ChatML as Qwen2.5 writes it: ``<|im_start|>{role}\\n{content}<|im_end|>\\n``;
a model step's tool calls follow its text as ``\\n<tool_call>\\n{"name": ..., "arguments": ...}\\n
</tool_call>`` (the arguments as the model emitted them); an environment observation is a user turn
``<tool_response>\\n{observation}\\n</tool_response>``.

The mask comes from the pieces, never from searching the rendered text: each piece is tokenized on
its own and carries its mask, so the boundaries are exact. A token is trained (mask 1) only when it
is part of a model-authored step **inside the fragment's trained span** and is the step's own
content: its text and its tool calls (with their ``<tool_call>`` tokens). Everything else is 0:
system, user, harness-inserted and environment turns, the role headers and turn ends, and the
context steps before the span (input only). Optionally (``train_end_of_turn``) the ``<|im_end|>``
closing a trained model turn is trained too, so a model learns where its turn stops.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import xxhash
from trajwh.packing.tokenizers import Tokenizer

TEMPLATE = "chatml-qwen2.5"
TEMPLATE_VERSION = "1.2.0"  # 1.2: calls the model wrote in its text are not written again; a simulated user speaks as the user; the harness's assistant turns are assistant turns
#: the exact text layout ``render`` writes; the template id is its digest, so any change to it is a new id
TOOLS_PROSE = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
               "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_CLOSING = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
                 "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                 "<args-json-object>}\n</tool_call>")
TEMPLATE_SPEC = f"""{TEMPLATE} {TEMPLATE_VERSION}
turn: <|im_start|>{{role}}\n{{content}}<|im_end|>\n
roles: system -> system; model -> assistant; environment or tool -> user; other -> user
  (the environment speaking as the user, in text: a simulated user's reply, is a plain user turn;
  a turn the harness wrote as the agent's, role assistant, is an assistant turn, never trained)
assistant content: {{text}} then per tool call ("\n" first unless it opens the turn), unless the
  model wrote its calls in its text (step metadata calls_in_text): then the text alone
  <tool_call>\n{{"name": NAME, "arguments": ARGUMENTS}}\n</tool_call> (JSON arguments verbatim, as
  emitted; other arguments as a JSON string)
tool content: <tool_response>\n{{observation}}\n</tool_response>
tools (the episode's function schemas, when it has them): appended to the first system turn after
  "\n\n" (or a system turn of their own, first), as Qwen2.5 writes them: {TOOLS_PROSE!r}, then per
  tool "\n" + JSON (ensure_ascii=False, ", " and ": "), then {TOOLS_CLOSING!r}
content is ordinary text: special-token strings in it are characters
"""
TEMPLATE_ID = f"{TEMPLATE}@{hashlib.sha256(TEMPLATE_SPEC.encode()).hexdigest()[:16]}"
MODEL_AUTHORS = frozenset({"model"})


@dataclass
class Rendered:
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)  # the text of each piece, as written (the round-trip reference)
    # per piece: (first token, end token, step id, field): the step field its text comes from, or
    # "template" for scaffolding, "tool_calls[i]" for a call as rendered
    origins: list[tuple[int, int, str | None, str]] = field(default_factory=list)
    current: str | None = None  # the step being rendered
    trained_pieces: list[bool] = field(default_factory=list)
    # (step_id, first token, end token, role) per rendered step: lineage from token to step
    steps: list[tuple[str, int, int, str]] = field(default_factory=list)

    def add(self, ids: list[int], trained: bool, text: str, source: str = "template") -> None:
        self.origins.append((len(self.ids), len(self.ids) + len(ids), self.current, source))
        self.trained_pieces.append(trained)
        self.ids += ids
        self.mask += [1 if trained else 0] * len(ids)
        self.pieces.append(text)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def trainable(self) -> int:
        return sum(self.mask)


class Layout:
    """A stand-in tokenizer that renders the *layout* a rendering's tokens must have, without
    tokenizing: each ordinary text the template encodes on its own becomes one atom, minus its UTF-8
    byte length; a special token is its id. ``render(steps, span, Layout(tok))`` gives these atoms in
    ``ids`` with their mask, so a check can test stored tokens against the rendering's bytes, special
    tokens and loss mask (``rendered_layout``) at the cost of the Python template alone."""

    chat_template = None

    def __init__(self, tok: Tokenizer) -> None:
        self.special = tok.special
        self._tok = tok

    def token(self, special: str) -> int:
        return self._tok.token(special)

    def encode(self, text: str) -> list[int]:
        n = len(text.encode())
        return [-n] if n else []

    def markup(self, text: str) -> list[int]:
        return [self.special[text]] if text in self.special else self.encode(text)


def layout_digest(text: bytes, special_ids: Any, special_at: Any, run_at: Any, run_mask: Any) -> bytes:
    """A rendering's layout in 16 bytes (XXH3-128): its text's bytes, its special tokens and their
    byte offsets, and its loss mask as runs (the byte offset where each run starts and its value).
    Two token sequences with the same layout decode to the same text, hold the same control tokens
    at the same places, and train the same bytes."""
    sizes = np.array([len(text), len(special_ids), len(run_at)], dtype="<i8")
    h = xxhash.xxh3_128(sizes)
    h.update(text)
    for values, dtype in ((special_ids, "<i8"), (special_at, "<i8"), (run_at, "<i8"), (run_mask, "<i1")):
        h.update(np.ascontiguousarray(values, dtype=dtype))
    return h.digest()


def rendered_layout(layout: Rendered, tok: Tokenizer) -> bytes:
    """``layout_digest`` of a rendering made with ``Layout(tok)``: what its tokens' layout must be."""
    atoms = np.asarray(layout.ids, dtype=np.int64)
    mask = np.asarray(layout.mask, dtype=np.int8)
    special = atoms >= 0
    size = np.where(special, tok.token_lengths[np.where(special, atoms, 0)], -atoms)
    at = np.cumsum(size) - size
    runs = np.flatnonzero(np.diff(mask, prepend=np.int8(-1)) != 0)
    return layout_digest(layout.text.encode(), atoms[special], at[special], at[runs], mask[runs])


def step_content(step: dict[str, Any]) -> str:
    """The text a step's turn carries: a model step's text, an observation, else the step's text."""
    if role_of(step) == "assistant":
        return step.get("text") or ""
    if role_of(step) == "tool":
        return step.get("observation") or step.get("text") or ""
    return step.get("text") or step.get("observation") or ""


def role_of(step: dict[str, Any]) -> str:
    author = step.get("author")
    if author in MODEL_AUTHORS:
        return "assistant"
    if author == "harness" and step.get("role") == "assistant":
        return "assistant"  # a turn the harness wrote as the agent's (a demonstration, a fixed greeting): never trained
    if author == "environment" and step.get("role") == "user" and step.get("text") and not step.get("observation"):
        return "user"  # a simulated user's reply (τ-bench): what it says, not a tool's output
    if author == "environment" or step.get("role") == "tool":
        return "tool"
    return "system" if step.get("role") == "system" else "user"


def arguments_json(call: dict[str, Any]) -> str:
    """A call's arguments as JSON text, exactly as the model emitted them: JSON arguments verbatim,
    anything else (a harness whose model emits raw text) as a JSON string."""
    args = (call.get("arguments") or "").strip()
    try:
        orjson.loads(args or "{}")
        return args or "{}"
    except orjson.JSONDecodeError:
        return json.dumps(args, ensure_ascii=False)


def tool_call_text(call: dict[str, Any]) -> str:
    """A tool call as the template writes it (Qwen2.5's ``{"name": ..., "arguments": ...}``), with
    the arguments as the model emitted them (``arguments_json``)."""
    return '{"name": ' + json.dumps(call.get("name"), ensure_ascii=False) + ', "arguments": ' + arguments_json(call) + "}"


def trained_step(step: dict[str, Any], span: set[str]) -> bool:
    """Is this step's content trained: a model step of the span (a harness turn written as the
    agent's is context, whatever its role)."""
    return step.get("author") in MODEL_AUTHORS and step["step_id"] in span


def calls_in_text(step: dict[str, Any]) -> bool:
    """Did the model write its calls in its text (a ReAct ``Action:``, a fenced command the harness
    ran, Hermes ``<tool_call>`` written as text)? The adapter says so (step metadata
    ``calls_in_text``); the calls are then read from the text for analysis, and the text alone is
    what the model wrote."""
    meta = step.get("metadata")
    if not meta or "calls_in_text" not in meta:
        return False
    try:
        return orjson.loads(meta).get("calls_in_text") is True
    except (orjson.JSONDecodeError, AttributeError):
        return False


def rendered_calls(step: dict[str, Any]) -> list[dict[str, Any]]:
    """The tool calls a model turn writes as calls: none when they are in its text already."""
    calls = step.get("tool_calls") or []
    return [] if calls and calls_in_text(step) else calls


def model_content(step: dict[str, Any]) -> list[tuple[str, str | None]]:
    """A model step's content as (text, special token around it): its text, then each tool call
    (``rendered_calls``)."""
    parts: list[tuple[str, str | None]] = []
    if step.get("text"):
        parts.append((step["text"], None))
    for call in rendered_calls(step):
        parts.append((tool_call_text(call), "<tool_call>"))
    return parts


def tools_text(tools: list[dict[str, Any]]) -> str:
    """The tool definitions as Qwen2.5's template writes them (``tojson``: ``json.dumps`` defaults,
    non-ASCII kept)."""
    return TOOLS_PROSE + "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools) + TOOLS_CLOSING


def _markup_text(text: str, tok: Tokenizer) -> list[int]:
    """Template text: the tokenizer's special-token strings in it are those tokens, the rest ordinary."""
    specials = [s for s in getattr(tok, "special", {}) if s in text]
    if not specials:
        return tok.encode(text)
    out: list[int] = []
    for part in re.split("(" + "|".join(map(re.escape, sorted(specials, key=len, reverse=True))) + ")", text):
        if part:
            out += tok.markup(part) if part in specials else tok.encode(part)
    return out


def render(steps: list[dict[str, Any]], span: set[str], tok: Tokenizer, *,
           train_end_of_turn: bool = False, tools: list[dict[str, Any]] | None = None) -> Rendered:
    """``steps`` in order (context then span); ``span``: the step ids whose model tokens are trained;
    ``tools``: the function definitions the model was shown (in the system turn, never trained).
    A tokenizer with its own chat template (a Hugging Face folder) renders through it."""
    if getattr(tok, "chat_template", None):
        from trajwh.packing.chat_template import render_template

        return render_template(steps, span, tok, tools=tools)
    out = Rendered()
    start, end = tok.token("<|im_start|>"), tok.token("<|im_end|>")

    def plain(text: str, trained: bool, source: str = "template") -> None:
        out.add(tok.encode(text), trained, text, source)

    def tools_block(sep: str) -> None:
        text = sep + tools_text(tools or [])
        out.add(_markup_text(text, tok), False, text, "tools")

    if tools and (not steps or role_of(steps[0]) != "system"):  # a system turn of their own
        out.add([start] + tok.encode("system\n"), False, "<|im_start|>system\n")
        tools_block("")
        out.add([end], False, "<|im_end|>")
        plain("\n", False)
        tools = None

    def turn(header: str) -> None:
        out.add([start] + tok.encode(header), False, "<|im_start|>" + header)

    def turn_end(trained: bool = False) -> None:
        out.add([end], trained, "<|im_end|>")
        plain("\n", False)

    for k, step in enumerate(steps):
        role = role_of(step)
        first = len(out.ids)
        out.current = step["step_id"]
        trained = trained_step(step, span)
        if role == "tool":
            turn("user\n<tool_response>\n")
            plain(step.get("observation") or step.get("text") or "", False,
                  "observation" if step.get("observation") else "text")
            plain("\n</tool_response>", False)
            turn_end()
        elif role == "assistant":
            turn("assistant\n")
            calls = 0
            for i, (text, special) in enumerate(model_content(step)):
                if special is None:
                    plain(text, trained, "text")
                else:  # "\n" between text and a call is the model's too: it writes the whole turn
                    if i or step.get("text"):
                        plain("\n", trained, f"tool_calls[{calls}]")
                    closing = "</" + special[1:]
                    out.add(tok.markup(special) + tok.encode("\n" + text + "\n") + tok.markup(closing), trained,
                            f"{special}\n{text}\n{closing}", f"tool_calls[{calls}]")
                    calls += 1
            turn_end(trained and train_end_of_turn)
        else:
            turn(f"{role}\n")
            plain(step.get("text") or step.get("observation") or "", False,
                  "text" if step.get("text") else "observation")
            if tools and role == "system" and k == 0:
                tools_block("\n\n")
            turn_end()
        out.steps.append((step["step_id"], first, len(out.ids), role))
    return out


def trained_text(steps: list[dict[str, Any]], span: set[str], tok: Tokenizer,
                 tools: list[dict[str, Any]] | None = None) -> str:
    """What the unmasked tokens must decode to: the model-authored content of the span, rendered.
    (Through a jinja template: the span's model content and its calls' region as the template wrote them.)"""
    if getattr(tok, "chat_template", None):
        r = render(steps, span, tok, tools=tools)
        return "".join(t for t, trained in zip(r.pieces, r.trained_pieces, strict=True) if trained)
    parts = []
    for step in steps:
        if not trained_step(step, span):
            continue
        for i, (text, special) in enumerate(model_content(step)):
            if special is None:
                parts.append(text)
            else:
                parts.append(("\n" if i or step.get("text") else "") + f"{special}\n{text}\n</{special[1:]}")
    return "".join(parts)


def truncate_context(steps: list[dict[str, Any]], span: set[str], seq_len: int, tok: Tokenizer,
                     rendered: Rendered | None = None, tools: list[dict[str, Any]] | None = None
                     ) -> tuple[Rendered, list[str]] | None:
    """Policy ``truncate-context``: cut the oldest context steps until the rendering fits ``seq_len``.

    The leading system and user turns (the task statement) are kept, and so is the trained span;
    what goes is whole exchanges right after the head, oldest first (a model turn with the tool
    results that answer it, never a result without its call). Returns (the rendering of the kept
    steps, the removed step ids), or None when even without any context the fragment is too long
    (it is then dropped).
    """
    r = rendered or render(steps, span, tok, tools=tools)
    if len(r.ids) <= seq_len:
        return r, []
    first_span = next((k for k, s in enumerate(steps) if s["step_id"] in span), len(steps))
    head = 0
    while head < first_span and role_of(steps[head]) in ("system", "user"):
        head += 1
    sizes = {sid: b - a for sid, a, b, _ in r.steps}
    cut, removed = head, 0
    while cut < first_span:
        removed += sizes.get(steps[cut]["step_id"], 0)
        cut += 1
        while cut < first_span and role_of(steps[cut]) == "tool":  # the results belong to the call just cut
            removed += sizes.get(steps[cut]["step_id"], 0)
            cut += 1
        if removed >= len(r.ids) - seq_len:
            kept = steps[:head] + steps[cut:]
            again = render(kept, span, tok, tools=tools)
            if len(again.ids) <= seq_len:  # (a template may render the kept steps a little differently)
                return again, [s["step_id"] for s in steps[head:cut]]
    return None
