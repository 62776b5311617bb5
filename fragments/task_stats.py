"""Per-task statistics: posterior success rate, unbiased pass@k and pass^k, all-fail diagnosis,
effective rate per source / harness / policy, and the policy x harness interaction.

- Attempts exclude infrastructure failures (they say nothing about the policy).
- Posterior: Beta(alpha + successes, beta + failures), prior Beta(1, 1) by default; mean and a
  90 % equal-tailed interval.
- pass@k = 1 - C(n - c, k) / C(n, k) (the unbiased estimator of Chen et al. 2021, "Evaluating
  Large Language Models Trained on Code"); pass^k = C(c, k) / C(n, k) (all k of k succeed, as in
  tau-bench); undefined (None) when n < k.
- All-fail tasks: ``likely_broken`` when infrastructure failures dominate the task's episodes or a
  reference / teacher policy also fails, else ``too_hard``.
- Effective rate eta = (N - environment errors - rebuild failures - verifier errors) / N per group;
  harnesses do not report rebuild failures apart from environment errors here, so they are
  counted inside environment errors.
- Interaction Delta = (S1B - S0B) - (S1A - S0A) for policies 0, 1 and harnesses A, B, on the tasks
  all four combinations attempted (paired by task).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from math import comb
from typing import Any

from scipy.stats import beta as beta_dist

KS = (1, 3, 5)


@dataclass(frozen=True)
class StatsConfig:
    prior_alpha: float = 1.0
    prior_beta: float = 1.0
    level: float = 0.9
    reference_policies: tuple[str, ...] = ("teacher", "reference", "oracle")


def pass_at_k(n: int, c: int, k: int) -> float | None:
    if n < k:
        return None
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def pass_hat_k(n: int, c: int, k: int) -> float | None:
    if n < k:
        return None
    return comb(c, k) / comb(n, k)


def task_statistics(rows: list[dict[str, Any]], cfg: StatsConfig = StatsConfig()) -> list[dict[str, Any]]:
    """``rows``: one per episode with task_id, cause, policy_name. One row per task out."""
    by_task: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_task[r["task_id"]].append(r)
    out = []
    for task in sorted(by_task):
        eps = by_task[task]
        counted = [e for e in eps if e["cause"] not in ("harness_crash", "environment_failure", "verifier_unavailable")]
        n = len(counted)
        c = sum(e["cause"] == "resolved" for e in counted)
        a, b = cfg.prior_alpha + c, cfg.prior_beta + n - c
        infra = len(eps) - n
        row: dict[str, Any] = {
            "task_id": task, "episodes": len(eps), "attempts": n, "successes": c, "infrastructure_failures": infra,
            "posterior_mean": a / (a + b), "posterior_low": float(beta_dist.ppf((1 - cfg.level) / 2, a, b)),
            "posterior_high": float(beta_dist.ppf(1 - (1 - cfg.level) / 2, a, b)),
            "prior": f"Beta({cfg.prior_alpha:g},{cfg.prior_beta:g})",
        }
        for k in KS:
            row[f"pass_at_{k}"] = pass_at_k(n, c, k)
            row[f"pass_hat_{k}"] = pass_hat_k(n, c, k)
        if c == 0:
            reference_failed = any(any(r in (e.get("policy_name") or "").lower() for r in cfg.reference_policies)
                                   for e in counted)
            row["all_fail"] = "likely_broken" if infra > n or reference_failed or n == 0 else "too_hard"
        else:
            row["all_fail"] = None
        out.append(row)
    return out


def effective_rates(rows: list[dict[str, Any]], by: str) -> list[dict[str, Any]]:
    """eta per value of ``by`` (source, harness_name or policy_name)."""
    groups: dict[str, list[str]] = defaultdict(list)
    for r in rows:
        groups[r.get(by) or "(none)"].append(r["cause"])
    out = []
    for key in sorted(groups):
        causes = groups[key]
        n = len(causes)
        env = causes.count("environment_failure")
        ver = causes.count("verifier_unavailable")
        out.append({by: key, "episodes": n, "environment_errors": env, "rebuild_failures": 0, "verifier_errors": ver,
                    "eta": (n - env - ver) / n if n else None})
    return out


def policy_harness_matrix(rows: list[dict[str, Any]]) -> dict[tuple[str, str], float]:
    """Success rate per (policy, harness) over non-infrastructure attempts."""
    acc: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for r in rows:
        if r["cause"] in ("harness_crash", "environment_failure", "verifier_unavailable"):
            continue
        cell = acc[(r.get("policy_name") or "(none)", r.get("harness_name") or "(none)")]
        cell[0] += r["cause"] == "resolved"
        cell[1] += 1
    return {k: s / n for k, (s, n) in sorted(acc.items()) if n}


def interaction(rows: list[dict[str, Any]], p0: str, p1: str, h_a: str, h_b: str) -> dict[str, Any]:
    """Delta = (S1B - S0B) - (S1A - S0A) on tasks attempted under all four (policy, harness) cells."""
    cells = [(p0, h_a), (p1, h_a), (p0, h_b), (p1, h_b)]
    per: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0])
    for r in rows:
        if r["cause"] in ("harness_crash", "environment_failure", "verifier_unavailable"):
            continue
        key = (r.get("policy_name"), r.get("harness_name"))
        if key in cells:
            acc = per[(r["task_id"], *key)]
            acc[0] += r["cause"] == "resolved"
            acc[1] += 1
    tasks = sorted({t for t, *_ in per if all((t, *c) in per for c in cells)})
    if not tasks:
        return {"tasks": 0, "delta": None}

    def rate(policy: str, harness: str) -> float:  # mean over tasks of the per-task rate (paired)
        return sum(per[(t, policy, harness)][0] / per[(t, policy, harness)][1] for t in tasks) / len(tasks)

    s = {f"S{i}{h}": rate(p, hh) for i, p in ((0, p0), (1, p1)) for h, hh in (("A", h_a), ("B", h_b))}
    return {"tasks": len(tasks), **s, "delta": (s["S1B"] - s["S0B"]) - (s["S1A"] - s["S0A"])}
