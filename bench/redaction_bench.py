"""Redaction quality and speed on the labelled evaluation set, next to presidio and detect-secrets.

Recall of a type = share of planted values of that type that no longer appear in the output
(for the baselines: whose span one of their findings covers). Decoys intact = share of
look-alike values that survive verbatim. Throughput = characters per second over the same texts
in the same process; presidio's ``AnalyzerEngine.analyze`` is called on chunks of at most
4,000 characters (it slows down badly on large strings).
"""

from __future__ import annotations

import resource
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trajwh.redaction.engine import Detector, Redactor  # noqa: E402
from trajwh.redaction.evaluation import load_cases, score  # noqa: E402
from trajwh.redaction.pii import presidio_analyzer  # noqa: E402
from trajwh.synth.secrets_eval import SECRET_TYPES, make_eval_set  # noqa: E402

CHUNK = 4000


def _ours(cases):
    # no memo: the ratio against presidio is detection speed on every text (the memo's gain on
    # repeated trajectory text is measured by the redaction stage, bench/README.md)
    red = Redactor(b"bench-salt", detector=Detector(memo_chars=0))
    red.text("warm up alice@example.com +1 (415) 555-2671 52.1.2.3 4111111111111111", red.scope("w"), "t", [])
    outs = []
    t0 = time.perf_counter()
    for c in cases:
        outs.append(red.text(c["text"], red.scope(c["id"]), "text", []))
    return outs, time.perf_counter() - t0


def _covered(spans, text, value):
    i = text.find(value)
    while i >= 0:
        if not any(s <= i and i + len(value) <= e or (s < i + len(value) and e > i) for s, e in spans):
            return False
        i = text.find(value, i + 1)
    return True


def _presidio(cases):
    engine = presidio_analyzer()
    engine.analyze("warm up text alice@example.com", language="en")
    spans = []
    t0 = time.perf_counter()
    for c in cases:
        text, found = c["text"], []
        for off in range(0, len(text), CHUNK):
            found += [(off + r.start, off + r.end) for r in engine.analyze(text[off:off + CHUNK], language="en")]
        spans.append(found)
    return spans, time.perf_counter() - t0


def _detect_secrets(cases):
    from detect_secrets.core.scan import scan_line
    from detect_secrets.settings import default_settings

    found_values = []
    t0 = time.perf_counter()
    with default_settings():
        for c in cases:
            vals = set()
            for line in c["text"].splitlines():
                for secret in scan_line(line):
                    if secret.secret_value:
                        vals.add(secret.secret_value)
            found_values.append(vals)
    return found_values, time.perf_counter() - t0


def trajectory_throughput(episodes: int = 300) -> dict:
    """Both engines over realistic step text (the synthetic corpus: code, logs, test output)."""
    from trajwh.synth.generator import SynthConfig, _Generator

    gen = _Generator(SynthConfig(episodes=episodes, seed=3))
    texts = [s.get("observation") or s.get("text") or "" for n in range(episodes) for s in gen.episode(n)[0]["steps"]]
    cases = [{"id": str(i), "text": t} for i, t in enumerate(texts) if t]
    chars = sum(len(c["text"]) for c in cases)
    _, t_ours = _ours(cases)
    _, t_presidio = _presidio(cases)
    return {"texts": len(cases), "characters": chars, "ours_chars_per_s": round(chars / t_ours),
            "presidio_chars_per_s": round(chars / t_presidio), "speedup_vs_presidio": round(t_presidio / t_ours, 1)}


def run(n_per_type: int = 40, seed: int = 0) -> dict:
    cases = make_eval_set(n_per_type, seed)
    chars = sum(len(c["text"]) for c in cases)
    outs, t_ours = _ours(cases)
    spans, t_presidio = _presidio(cases)
    ds_vals, t_ds = _detect_secrets(cases)
    tot, ours, pres, ds = Counter(), Counter(), Counter(), Counter()
    decoys = kept = 0
    for c, out, sp, dv in zip(cases, outs, spans, ds_vals, strict=True):
        for s in c["secrets"]:
            tot[s["type"]] += 1
            ours[s["type"]] += s["value"] not in out
            pres[s["type"]] += _covered(sp, c["text"], s["value"])
            ds[s["type"]] += any(s["value"] in v or v in s["value"] and len(v) >= 8 for v in dv)
        for d in c["decoys"]:
            decoys += 1
            kept += d in out
    per_type = {t: {"n": tot[t], "ours": round(ours[t] / tot[t], 3), "presidio": round(pres[t] / tot[t], 3),
                    "detect_secrets": round(ds[t] / tot[t], 3)} for t in SECRET_TYPES}
    n = sum(tot.values())
    return {
        "cases": len(cases), "characters": chars, "secrets": n, "decoys": decoys,
        "recall": {"ours": round(sum(ours.values()) / n, 4), "presidio": round(sum(pres.values()) / n, 4),
                   "detect_secrets": round(sum(ds.values()) / n, 4)},
        "min_type_recall_ours": min(v["ours"] for v in per_type.values()),
        "decoys_intact_ours": round(kept / decoys, 4),
        "chars_per_s": {"ours": round(chars / t_ours), "presidio": round(chars / t_presidio),
                        "detect_secrets": round(chars / t_ds)},
        "speedup_vs_presidio": round(t_presidio / t_ours, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "per_type": per_type,
    }


def heldout() -> dict:
    """The held-out set (tests/cases/redaction_eval/heldout.jsonl): ours only, recall per type,
    decoys and surrounding text kept, and what was missed or destroyed."""
    red = Redactor(b"bench-salt")
    result = score(load_cases(), lambda c: red.text(c["text"], red.scope(c["id"]), "text", []))
    result["missed"], result["destroyed"] = result["missed"][:10], result["destroyed"][:10]
    return result


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
