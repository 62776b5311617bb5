"""Lineage to the token: ``trajwh trace PACK_ID:OFFSET``.

A token of a packed sequence -> its segment (fragment or evaluation episode) -> the piece of the
rendering it belongs to (the unit is rendered again from the redacted steps: rendering is
deterministic, and ``trajwh verify-packs`` proves the stored tokens equal it) -> the step, its
author and the field, with the character span of the token inside that field's redacted text ->
the step's episode and raw record (file, line, byte offset) through ``lineage.trace``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trajwh.lineage.catalog import Warehouse
from trajwh.lineage.trace import Trace, trace
from trajwh.packing.layer import _UNITS, episode_tools
from trajwh.packing.render import render
from trajwh.packing.tokenizers import tokenizer_of
from trajwh.schemas.errors import ConfigError


@dataclass
class TokenTrace:
    pack_id: str
    offset: int
    token: int
    token_text: str
    trained: bool
    position: int
    split: str
    segment: dict[str, Any]
    step_id: str | None
    author: str | None
    role: str | None
    field: str  # "text", "observation", "tool_calls[i]" (the call as rendered) or "template"
    char_start: int | None  # in the field's redacted text (or the rendered call); None for template tokens
    char_end: int | None
    lineage: Trace | None


def parse_token_ref(ident: str) -> tuple[str, int] | None:
    """``pk-...:123`` -> (pack id, offset); None when ``ident`` is not a token reference."""
    pack, sep, off = ident.strip().rpartition(":")
    if not sep or not pack.startswith("pk-"):
        return None
    if not off.isdigit():
        raise ConfigError(f"token offset {off!r} in {ident!r} is not a number", valid="PACK_ID:OFFSET, e.g. pk-1a2b:57")
    return pack, int(off)


def trace_token(wh: Warehouse, pack_id: str, offset: int) -> TokenTrace:
    rows = wh.query("SELECT pack_id, pack_set, split, tokenizer_id, seq_len, n_tokens, segments FROM packs "
                    "WHERE pack_id LIKE ? LIMIT 2", [pack_id + "%"]).to_pylist()
    if len(rows) != 1:
        raise ConfigError(f"{'no' if not rows else 'more than one'} pack matches {pack_id!r}",
                          valid="a pack_id from `trajwh sql \"SELECT pack_id FROM packs\"`")
    p = rows[0]
    if not 0 <= offset < p["n_tokens"]:
        raise ConfigError(f"offset {offset} is outside pack {p['pack_id']}", valid=f"0 .. {p['n_tokens'] - 1}")
    seg = next(s for s in p["segments"] if s["start"] <= offset < s["end"])
    # the token in its unit's row: a piece k of a split unit starts at k * seq_len
    at = (seg["piece"] or 0) * p["seq_len"] + offset - seg["start"]
    token = wh.query("SELECT input_ids[? + 1] AS token, loss_mask[? + 1] AS trained FROM pack_tokens "
                     "WHERE pack_set = ? AND unit_id = ?", [at, at, p["pack_set"], seg["fragment_id"].split("#")[0]]
                     ).to_pylist()
    if not token:
        raise ConfigError(f"segment {seg['fragment_id']} of {p['pack_id']} has no token row "
                          "(the layers changed since packing)", valid="rebuild the packs: trajwh pack")
    p.update(token[0], position=offset - seg["start"])
    unit = wh.query(f"SELECT * FROM ({_UNITS.format(evaluation='true')}) WHERE trajectory_key = ? AND unit_id = ?",
                    [seg["trajectory_key"], seg["fragment_id"].split("#")[0]]).to_pylist()
    if not unit:
        raise ConfigError(f"segment {seg['fragment_id']} of {p['pack_id']} has no fragment or evaluation episode now "
                          "(the layers changed since packing)", valid="rebuild the packs: trajwh pack")
    u = unit[0]
    steps = wh.query("SELECT step_id, step_index, author, role, text, observation, tool_calls, metadata FROM redacted_steps "
                     "WHERE trajectory_key = ? ORDER BY step_index", [u["trajectory_key"]]).to_pylist()
    by_id = {s["step_id"]: s for s in steps}
    order = u["step_ids"] if u["step_ids"] is not None else [s["step_id"] for s in steps]
    removed = set(seg["removed_step_ids"] or [])
    span = set(u["span_step_ids"]) if u["span_step_ids"] is not None else set(order)
    tok = tokenizer_of(p["tokenizer_id"])
    r = render([by_id[i] for i in order if i in by_id and i not in removed], span, tok,
               tools=episode_tools(wh, u["trajectory_key"]))
    at = offset - seg["start"] + (seg["piece"] or 0) * p["seq_len"]
    if at >= len(r.ids) or r.ids[at] != p["token"]:
        raise ConfigError(f"pack {p['pack_id']} no longer matches its fragment's rendering",
                          valid="run `trajwh verify-packs`, then rebuild: trajwh pack --full")
    piece = next(i for i, o in enumerate(r.origins) if o[0] <= at < o[1])
    first, _, step_id, source = r.origins[piece]
    char_start = char_end = None
    if source != "template":
        text = r.pieces[piece]
        before = b"".join(tok.token_bytes(t) for t in r.ids[first:at])
        upto = before + tok.token_bytes(r.ids[at])
        raw = text.encode()
        char_start = len(raw[:len(before)].decode("utf-8", errors="ignore"))
        char_end = len(raw[:len(upto)].decode("utf-8", errors="ignore"))
    step = by_id.get(step_id) if step_id else None
    return TokenTrace(p["pack_id"], offset, p["token"], tok.decode([p["token"]]), bool(p["trained"]), p["position"],
                      p["split"], seg, step_id, step and step["author"], step and step["role"], source, char_start,
                      char_end, trace(wh, step_id) if step_id else None)
