"""Scoring the redactor on a labelled set: recall per type and decoys kept.

A case is ``{"id", "text", "secrets": [{"type", "value"}], "keep" | "decoys": [...]}``. A secret
is caught when its value no longer appears anywhere in the output (every recurrence, every
spelling listed); a kept value must appear in the output verbatim as often as in the input
(a decoy, or the text around a secret that an exact span must leave alone).

Two sets use it: the development set (``synth/secrets_eval.py``, generated, the detectors were
tuned on it) and the held-out set (``tests/cases/redaction_eval/heldout.jsonl``: written by hand from
public secret scanners' documented token formats and test fixtures and from the shapes of real
trajectory text, before the detectors were changed for it). A miss on the held-out set is fixed
only together with new cases that the fix did not see (bench/README.md).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import orjson

HELDOUT = Path(__file__).resolve().parents[1] / "tests" / "cases" / "redaction_eval" / "heldout.jsonl"


def load_cases(path: Path = HELDOUT) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def score(cases: Iterable[dict[str, Any]], redact: Callable[[dict[str, Any]], str]) -> dict[str, Any]:
    """Recall per type, overall recall, decoys kept, and the first misses of each kind."""
    total, caught = Counter(), Counter()
    kept = decoys = 0
    missed: list[dict[str, str]] = []
    destroyed: list[dict[str, str]] = []
    for c in cases:
        out = redact(c)
        for s in c["secrets"]:
            total[s["type"]] += 1
            if s["value"] in out:
                missed.append({"id": c["id"], "type": s["type"], "value": s["value"][:60]})
            else:
                caught[s["type"]] += 1
        for d in c.get("keep", c.get("decoys", [])):
            decoys += 1
            if out.count(d) >= c["text"].count(d):
                kept += 1
            else:
                destroyed.append({"id": c["id"], "value": d[:80], "output": out[:160]})
    n = sum(total.values())
    return {
        "cases": sum(1 for _ in cases) if isinstance(cases, list) else None,
        "secrets": n, "decoys": decoys,
        "recall": round(sum(caught.values()) / n, 4) if n else None,
        "decoys_kept": round(kept / decoys, 4) if decoys else None,
        "per_type": {t: {"n": total[t], "recall": round(caught[t] / total[t], 3)} for t in sorted(total)},
        "missed": missed, "destroyed": destroyed,
    }
