"""Success-rate confidence intervals with the task, not the rollout, as the sampling unit.

Rollouts of one task are correlated (same difficulty, same environment), so a binomial interval
over rollouts is too narrow. ``task_clustered_ci`` treats the rate as a ratio estimator over
tasks (sum of successes / sum of attempts) and uses the cluster-robust (delta-method) variance
across tasks, with a t quantile on (tasks - 1) degrees of freedom (Cameron & Miller, "A
Practitioner's Guide to Cluster-Robust Inference", 2015).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from scipy import stats as _stats


def task_clustered_ci(rows: Iterable[tuple[str, bool]], level: float = 0.9) -> dict[str, float]:
    """``rows``: (task id, resolved) per rollout. Returns rate, interval, tasks and rollouts."""
    per_task: dict[str, list[int]] = {}
    for task, ok in rows:
        t = per_task.setdefault(task, [0, 0])
        t[0] += int(bool(ok))
        t[1] += 1
    k = len(per_task)
    n = sum(v[1] for v in per_task.values())
    if n == 0:
        return {"rate": float("nan"), "low": float("nan"), "high": float("nan"), "tasks": 0, "rollouts": 0}
    rate = sum(v[0] for v in per_task.values()) / n
    if k < 2:
        return {"rate": rate, "low": 0.0, "high": 1.0, "tasks": k, "rollouts": n}
    mean_n = n / k
    resid = [(s - rate * m) / mean_n for s, m in per_task.values()]
    var = k / (k - 1) * sum(r * r for r in resid) / k**2
    se = math.sqrt(var)
    q = _stats.t.ppf(0.5 + level / 2, k - 1)
    return {"rate": rate, "low": max(0.0, rate - q * se), "high": min(1.0, rate + q * se), "se": se,
            "tasks": k, "rollouts": n}


def binomial_ci(successes: int, n: int, level: float = 0.9) -> tuple[float, float]:
    """Wilson interval over rollouts (for comparison: ignores task clustering)."""
    if n == 0:
        return float("nan"), float("nan")
    z = _stats.norm.ppf(0.5 + level / 2)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half
