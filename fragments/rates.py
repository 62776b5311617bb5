"""Rates over episodes: the effective rate, cost per effective trajectory, the policy x harness
matrix, the policy x harness interaction, and paired harness comparisons.

- Effective rate eta = (N - environment errors - rebuild failures - verifier errors) / N per
  group, where N counts the episodes with a known outcome (``unknown`` is neither effective nor
  an error: it is reported apart). Resource exhaustion counts with environment errors; rebuild
  failures are the environment failures whose evidence names an image build or rebuild (where a
  source reports them). Cost per effective trajectory = C / (N * eta) over the episodes whose cost
  is known, and likewise for wall-clock duration.
- Harness comparisons (the matrix, the interaction, ``compare_harnesses``) count a harness
  crash as an outcome of that harness (it is what is compared); environment, resource and
  verifier failures and unknown outcomes are excluded for both sides. Pairs are made by task;
  intervals come from a task-level bootstrap (tasks resampled with replacement).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
from trajwh.fragments.outcomes import NOT_THE_HARNESS

_REBUILD = re.compile(r"rebuild|image.?build|build.?(?:failed|error)", re.I)


def effective_rates(rows: list[dict[str, Any]], by: str) -> list[dict[str, Any]]:
    """eta per value of ``by`` (source, harness_name or policy_name); rows carry cause, evidence,
    cost_usd and duration_s when known."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[r.get(by) or "(none)"].append(r)
    out = []
    for key in sorted(groups):
        eps = groups[key]
        known = [e for e in eps if e["cause"] != "unknown"]
        n = len(known)
        env = [e for e in known if e["cause"] in ("environment_failure", "resource_exhausted")]
        rebuild = sum(bool(_REBUILD.search(e.get("evidence") or "")) for e in env)
        ver = sum(e["cause"] == "verifier_unavailable" for e in known)
        eta = (n - len(env) - ver) / n if n else None
        row = {by: key, "episodes": len(eps), "unknown": len(eps) - n, "known": n,
               "environment_errors": len(env) - rebuild, "rebuild_failures": rebuild, "verifier_errors": ver,
               "eta": eta}
        for field, name in (("cost_usd", "cost_per_effective"), ("duration_s", "seconds_per_effective")):
            with_value = [e for e in known if e.get(field) is not None]
            effective = sum(e["cause"] not in ("environment_failure", "resource_exhausted", "verifier_unavailable")
                            for e in with_value)
            row[name] = sum(e[field] for e in with_value) / effective if effective else None
        out.append(row)
    return out


def _counted(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r["cause"] not in NOT_THE_HARNESS]


def policy_harness_matrix(rows: list[dict[str, Any]]) -> dict[tuple[str, str], float]:
    """Success rate per (policy, harness); a harness crash counts against its harness."""
    acc: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for r in _counted(rows):
        cell = acc[(r.get("policy_name") or "(none)", r.get("harness_name") or "(none)")]
        cell[0] += r["cause"] == "resolved"
        cell[1] += 1
    return {k: s / n for k, (s, n) in sorted(acc.items()) if n}


def _per_task_rates(rows: list[dict[str, Any]], cells: list[tuple[str, str]]) -> tuple[list[str], np.ndarray]:
    """Tasks attempted in every cell, and their success rate per cell (tasks x cells)."""
    acc: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0])
    for r in _counted(rows):
        key = (r.get("policy_name"), r.get("harness_name"))
        if key in cells:
            a = acc[(r["task_id"], *key)]
            a[0] += r["cause"] == "resolved"
            a[1] += 1
    tasks = sorted({t for t, *_ in acc if all((t, *c) in acc for c in cells)})
    rates = np.array([[acc[(t, *c)][0] / acc[(t, *c)][1] for c in cells] for t in tasks]).reshape(len(tasks), len(cells))
    return tasks, rates


def _bootstrap(per_task: np.ndarray, stat: Callable[[np.ndarray], float], n_boot: int, level: float,
               seed: int) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(per_task), size=(n_boot, len(per_task)))
    values = np.array([stat(per_task[i]) for i in idx])
    lo, hi = np.quantile(values, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(lo), float(hi)


def interaction(rows: list[dict[str, Any]], p0: str, p1: str, h_a: str, h_b: str, *, n_boot: int = 2000,
                level: float = 0.9, seed: int = 0) -> dict[str, Any]:
    """Delta = (S1B - S0B) - (S1A - S0A) on tasks attempted under all four (policy, harness) cells,
    with a task-level bootstrap interval."""
    cells = [(p0, h_a), (p1, h_a), (p0, h_b), (p1, h_b)]
    tasks, r = _per_task_rates(rows, cells)
    if not tasks:
        return {"tasks": 0, "delta": None}

    def delta(m: np.ndarray) -> float:
        s0a, s1a, s0b, s1b = m.mean(axis=0)
        return float((s1b - s0b) - (s1a - s0a))

    s = dict(zip(("S0A", "S1A", "S0B", "S1B"), (float(x) for x in r.mean(axis=0)), strict=True))
    lo, hi = _bootstrap(r, delta, n_boot, level, seed)
    return {"tasks": len(tasks), **s, "delta": delta(r), "delta_low": lo, "delta_high": hi, "level": level}


def compare_harnesses(rows: list[dict[str, Any]], h_a: str, h_b: str, *, policy: str | None = None,
                      n_boot: int = 2000, level: float = 0.9, seed: int = 0) -> dict[str, Any]:
    """Harness B minus harness A, paired by task (under one policy, or per policy pooled as
    cells of the same task when ``policy`` is None): mean per-task success-rate difference with a
    task-level bootstrap interval, and the counts of tasks improved, regressed and unchanged."""
    policies = [policy] if policy else sorted({r.get("policy_name") for r in rows
                                               if r.get("harness_name") in (h_a, h_b)}, key=str)
    diffs: list[float] = []
    for p in policies:
        _, r = _per_task_rates(rows, [(p, h_a), (p, h_b)])
        diffs += list(r[:, 1] - r[:, 0]) if len(r) else []
    if not diffs:
        return {"pairs": 0, "delta": None}
    d = np.array(diffs)
    lo, hi = _bootstrap(d, lambda m: float(m.mean()), n_boot, level, seed)
    return {"pairs": len(d), "delta": float(d.mean()), "delta_low": lo, "delta_high": hi, "level": level,
            "improved": int((d > 0).sum()), "regressed": int((d < 0).sum()), "unchanged": int((d == 0).sum())}
