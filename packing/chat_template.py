"""Rendering through a Hugging Face jinja chat template, with the loss mask from exact piece boundaries.

A template is a program: where a message's content lands, and what belongs to a tool call, is
found by rendering, never by searching the rendered text for the content:

1. the conversation is rendered once with every content and every tool call's arguments replaced
   by a unique sentinel (``⟦trajwh:K⟧``, ``⟦trajwh:K.J⟧``); the sentinels cut that skeleton into
   template scaffolding and content slots;
2. for each model step with tool calls, the skeleton is rendered again without its calls: the
   text that appears only with them (their common prefix and suffix removed) is the calls' region,
   template markup included (``<tool_call>``, the JSON around the arguments);
3. the real content goes into its slot (the arguments as the template's ``tojson`` writes them),
   and the result must equal the template's rendering of the real conversation, or the template
   is refused with a clear error (one that transforms or drops content cannot be delimited).

Content and arguments are encoded as ordinary text (an agent writing ``<|im_end|>`` gets the
characters); scaffolding and the calls' markup as template text (special tokens recognized).
Trained (mask 1): a model step's content and its calls' region, inside the trained span.
``tojson`` is Hugging Face's (``ensure_ascii=False``, keys in order), so the text equals what
``transformers``' ``apply_chat_template`` writes.
"""

from __future__ import annotations

import json
import os
import re
from datetime import datetime
from functools import cache
from typing import Any

from trajwh.packing.render import Rendered, rendered_calls, role_of, step_content, trained_step
from trajwh.schemas.errors import ConfigError

_SENT = "\u27e6trajwh:{}\u27e7"
_SENT_RE = re.compile("\"?\u27e6trajwh:([0-9]+)(?:\\.([0-9]+))?\u27e7\"?")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise ConfigError(f"the chat template refused the conversation: {message}")


@cache
def _compiled(template: str) -> Any:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except Exception as exc:  # noqa: BLE001 - a template syntax error is the user's file's
        raise ConfigError(f"the chat template does not compile: {exc}", valid="a jinja chat template") from None


def _arguments(call: dict[str, Any]) -> Any:
    args = call.get("arguments")
    try:
        return json.loads(args) if args else {}
    except (TypeError, ValueError):
        return args


def _messages(steps: list[dict[str, Any]], skeleton: bool, without_calls: int | None = None) -> list[dict[str, Any]]:
    out = []
    for k, step in enumerate(steps):
        role = role_of(step)
        content = step_content(step)
        m: dict[str, Any] = {"role": role, "content": _SENT.format(k) if skeleton and content else content}
        calls = rendered_calls(step) if role == "assistant" else []
        if calls and k != without_calls:
            m["tool_calls"] = [{"type": "function", "id": f"call_{k}_{j}", "function": {
                "name": c.get("name"), "arguments": _SENT.format(f"{k}.{j}") if skeleton else _arguments(c)}}
                for j, c in enumerate(calls)]
        out.append(m)
    return out


def _special(config: dict[str, Any], key: str) -> str:
    v = config.get(key)
    return (v.get("content") if isinstance(v, dict) else v) or ""


def render_template(steps: list[dict[str, Any]], span: set[str], tok: Any,
                    tools: list[dict[str, Any]] | None = None) -> Rendered:
    """``tools``: the template's ``tools`` variable (function definitions; scaffolding, never trained)."""
    tmpl = _compiled(tok.chat_template)
    extra = {"bos_token": _special(tok.config, "bos_token"), "eos_token": _special(tok.config, "eos_token"),
             "add_generation_prompt": False, "tools": tools or None}

    def run(messages: list[dict[str, Any]]) -> str:
        try:
            return tmpl.render(messages=messages, **extra)
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - the template's own error, named
            raise ConfigError(f"the chat template failed: {exc}", where=tok.name) from None

    skel = run(_messages(steps, True))
    regions: dict[int, tuple[int, int]] = {}  # model step -> its calls' region in the skeleton
    for k, step in enumerate(steps):
        if role_of(step) == "assistant" and rendered_calls(step):
            wo = run(_messages(steps, True, without_calls=k))
            suffix = len(os.path.commonprefix([skel[::-1], wo[::-1]]))
            start = len(wo) - suffix
            regions[k] = (start, len(skel) - suffix)
    cuts = {0, len(skel)}
    slots = {}
    for m in _SENT_RE.finditer(skel):
        cuts |= {m.start(), m.end()}
        slots[m.start()] = m
    for a, b in regions.values():
        cuts |= {a, b}
    out = Rendered()
    order = sorted(cuts)
    owner = _owners(skel, slots, len(steps))
    for a, b in zip(order, order[1:], strict=False):
        if a == b:
            continue
        m = slots.get(a)
        in_region = next((k for k, (ra, rb) in regions.items() if ra <= a and b <= rb), None)
        if m is not None and m.end() == b:
            k = int(m.group(1))
            step = steps[k]
            trained = trained_step(step, span)
            out.current = step["step_id"]
            if m.group(2) is None:
                text = step_content(step)
                source = "text" if step.get("text") and role_of(step) != "tool" else (
                    "observation" if step.get("observation") else "text")
                out.add(tok.encode(text), trained, text, source)
            else:
                j = int(m.group(2))
                args = _arguments(rendered_calls(step)[j])
                text = _tojson(args) if m.group(0).startswith('"') else str(args)
                out.add(tok.encode(text), trained, text, f"tool_calls[{j}]")
            continue
        text = skel[a:b]
        if in_region is not None:
            step = steps[in_region]
            out.current = step["step_id"]
            out.add(tok.markup(text), trained_step(step, span), text, "tool_calls")
        else:
            k = owner(a)
            out.current = steps[k]["step_id"] if k is not None else None
            out.add(tok.markup(text), False, text, "template")
    real = run(_messages(steps, False))
    if out.text != real:
        at = len(os.path.commonprefix([out.text, real]))
        raise ConfigError(f"the chat template of {tok.name} writes content other than as given (first difference "
                          f"at character {at}: {real[at:at + 40]!r}); its messages cannot be delimited",
                          valid="a template that writes each message's content and tool calls verbatim")
    _step_bounds(out, steps)
    return out


def _owners(skel: str, slots: dict[int, Any], n: int) -> Any:
    """Scaffolding belongs to the step whose first slot follows it (its header), else the last step."""
    starts = sorted((a, int(m.group(1))) for a, m in slots.items())

    def owner(at: int) -> int | None:
        for a, k in starts:
            if a >= at:
                return k
        return n - 1 if n else None
    return owner


def _step_bounds(out: Rendered, steps: list[dict[str, Any]]) -> None:
    """(step id, first token, end token, role) per step, from the pieces' owners."""
    first: dict[str, int] = {}
    for a, _, sid, _ in out.origins:
        if sid is not None and sid not in first:
            first[sid] = a
    starts = [first.get(s["step_id"]) for s in steps]
    for k, step in enumerate(steps):
        a = starts[k] if starts[k] is not None else (out.steps[-1][2] if out.steps else 0)
        nxt = next((x for x in starts[k + 1:] if x is not None), len(out.ids))
        out.steps.append((step["step_id"], a, max(a, nxt), role_of(step)))
