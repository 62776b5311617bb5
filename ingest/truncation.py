"""What the model actually saw: observations the harness cut before the model read them.

Harnesses truncate long command output and say so in their own words; the step then records
``observation_truncated`` and, where the harness tells, ``elided_chars`` and the
``original_length`` (what the command printed), so a reader of the layer can reconstruct the
model's conditional distribution instead of mistaking a cut output for the whole:

- mini-swe-agent: ``<elided_chars>\nN characters elided\n</elided_chars>`` between the head and
  the tail of the output;
- OpenHands (str_replace_editor, bash): ``<response clipped>``;
- Codex CLI: ``[... omitted N of M lines ...]``;
- generic: ``[... N characters truncated ...]``, ``(output truncated)``.
"""

from __future__ import annotations

import re
from typing import Any

_ELIDED = re.compile(r"<elided_chars>\s*(\d+) characters elided\s*</elided_chars>")
_OMITTED_LINES = re.compile(r"\[\.\.\. omitted (\d+) of (\d+) lines \.\.\.\]")
_CHARS_TRUNCATED = re.compile(r"\[\.\.\.\s*(\d+) (?:characters|chars) truncated\s*\.\.\.\]")
_MARKERS = ("<response clipped>", "(output truncated)", "[output truncated]")
_CUES = ("elided", "omitted", "truncated", "clipped")


def truncation(observation: str | None) -> dict[str, Any] | None:
    """``{observation_truncated, elided_chars?, omitted_lines?, original_length?}`` or None."""
    if not observation or not any(w in observation for w in _CUES):  # cheap: every observation passes here
        return None
    m = _ELIDED.search(observation) or _CHARS_TRUNCATED.search(observation)
    if m:
        elided = int(m.group(1))
        return {"observation_truncated": True, "elided_chars": elided,
                "original_length": len(observation) - len(m.group(0)) + elided}
    m = _OMITTED_LINES.search(observation)
    if m:
        return {"observation_truncated": True, "omitted_lines": int(m.group(1)), "original_lines": int(m.group(2))}
    if any(marker in observation for marker in _MARKERS):
        return {"observation_truncated": True}
    return None
