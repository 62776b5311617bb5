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

from dataclasses import dataclass, field
from typing import Any

import orjson

from packing.tokenizers import Tokenizer

TEMPLATE = "chatml-qwen2.5"
TEMPLATE_VERSION = "1.0.0"
MODEL_AUTHORS = frozenset({"model"})


@dataclass
class Rendered:
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    # (step_id, first token, end token, role) per rendered step: lineage from token to step
    steps: list[tuple[str, int, int, str]] = field(default_factory=list)

    def add(self, ids: list[int], trained: bool) -> None:
        self.ids += ids
        self.mask += [1 if trained else 0] * len(ids)

    @property
    def trainable(self) -> int:
        return sum(self.mask)


def _role(step: dict[str, Any]) -> str:
    author = step.get("author")
    if author in MODEL_AUTHORS:
        return "assistant"
    if author == "environment" or step.get("role") == "tool":
        return "tool"
    return "system" if step.get("role") == "system" else "user"


def tool_call_text(call: dict[str, Any]) -> str:
    """A tool call as the template writes it: the arguments exactly as the model emitted them."""
    args = call.get("arguments")
    try:
        parsed = orjson.loads(args) if args else {}
    except orjson.JSONDecodeError:
        parsed = args  # not JSON (a harness that emits raw text): kept as the string it was
    return orjson.dumps({"name": call.get("name"), "arguments": parsed}).decode()


def model_content(step: dict[str, Any]) -> list[tuple[str, str | None]]:
    """A model step's content as (text, special token around it): its text, then each tool call."""
    parts: list[tuple[str, str | None]] = []
    if step.get("text"):
        parts.append((step["text"], None))
    for call in step.get("tool_calls") or []:
        parts.append((tool_call_text(call), "<tool_call>"))
    return parts


def render(steps: list[dict[str, Any]], span: set[str], tok: Tokenizer, *,
           train_end_of_turn: bool = False) -> Rendered:
    """``steps`` in order (context then span); ``span``: the step ids whose model tokens are trained."""
    out = Rendered()
    start, end = tok.token("<|im_start|>"), tok.token("<|im_end|>")
    for step in steps:
        role = _role(step)
        first = len(out.ids)
        trained = role == "assistant" and step["step_id"] in span
        if role == "tool":
            out.add([start] + tok.encode("user\n<tool_response>\n"), False)
            out.add(tok.encode(step.get("observation") or step.get("text") or ""), False)
            out.add(tok.encode("\n</tool_response>") + [end] + tok.encode("\n"), False)
        elif role == "assistant":
            out.add([start] + tok.encode("assistant\n"), False)
            for i, (text, special) in enumerate(model_content(step)):
                if special is None:
                    out.add(tok.encode(text), trained)
                else:  # "\n" between text and a call is the model's too: it writes the whole turn
                    out.add(tok.encode("\n") if i or step.get("text") else [], trained)
                    out.add(tok.markup(special) + tok.encode("\n" + text + "\n") + tok.markup("</" + special[1:]),
                            trained)
            out.add([end], trained and train_end_of_turn)
            out.add(tok.encode("\n"), False)
        else:
            out.add([start] + tok.encode(f"{role}\n"), False)
            out.add(tok.encode(step.get("text") or step.get("observation") or ""), False)
            out.add([end] + tok.encode("\n"), False)
        out.steps.append((step["step_id"], first, len(out.ids), role))
    return out


def trained_text(steps: list[dict[str, Any]], span: set[str], tok: Tokenizer) -> str:
    """What the unmasked tokens must decode to: the model-authored content of the span, rendered."""
    parts = []
    for step in steps:
        if _role(step) != "assistant" or step["step_id"] not in span:
            continue
        for i, (text, special) in enumerate(model_content(step)):
            if special is None:
                parts.append(text)
            else:
                parts.append(("\n" if i or step.get("text") else "") + f"{special}\n{text}\n</{special[1:]}")
    return "".join(parts)
