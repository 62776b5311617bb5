"""The card's plots as inline SVG (matplotlib, Agg backend, no fonts fetched, no network).

The SVG is made deterministic (fixed hash salt, no date metadata), so the same card document gives
the same HTML bytes.
"""

from __future__ import annotations

import io
import re
from typing import Any

_COLORS = {"resolved": "#2e7d32", "policy failure": "#c62828", "infrastructure failure": "#6d4c41",
           "unknown": "#9e9e9e"}


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams.update({"svg.hashsalt": "trajwh-card", "svg.fonttype": "none", "font.size": 9,
                                "axes.spines.top": False, "axes.spines.right": False})
    import matplotlib.pyplot as plt

    return plt


def warm_plots() -> None:
    """Import what the plots need, ahead of them (``build_card`` does it beside its queries)."""
    _plt()


def _svg(fig: Any) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None, "Creator": None})
    _plt().close(fig)
    text = buf.getvalue()
    text = re.sub(r"\s*<metadata>.*?</metadata>", "", text[text.index("<svg"):], flags=re.S)
    return text  # inline: no XML prolog, doctype or RDF metadata


def funnel(steps: list[dict[str, Any]]) -> str | None:
    rows = [s for s in steps if s["share_of_raw"] is not None]
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 0.45 * len(rows) + 0.6))
    labels = [s["step"] for s in rows][::-1]
    values = [s["count"] for s in rows][::-1]
    bars = ax.barh(labels, values, color="#1565c0")
    for bar, s in zip(bars, rows[::-1], strict=True):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {s['count']:,} ({s['share_of_raw']:.1%})",
                va="center", fontsize=8)
    ax.set_xlabel("count")
    ax.set_title("From raw candidates to training fragments")
    ax.set_xlim(0, max(values) * 1.35 or 1)
    return _svg(fig)


def outcomes(causes: list[dict[str, Any]]) -> str | None:
    if not causes:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 0.35 * len(causes) + 0.8))
    rows = causes[::-1]
    ax.barh([r["cause"] for r in rows], [r["episodes"] for r in rows],
            color=[_COLORS.get(r["kind"], "#9e9e9e") for r in rows])
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLORS.values()]
    ax.legend(handles, list(_COLORS), fontsize=7, loc="lower right", frameon=False)
    ax.set_xlabel("episodes")
    ax.set_title("Outcomes by cause")
    return _svg(fig)


def matrix(cells: list[dict[str, Any]]) -> str | None:
    if not cells:
        return None
    plt = _plt()
    policies = sorted({c["policy"] for c in cells})
    harnesses = sorted({c["harness"] for c in cells})
    grid = [[float("nan")] * len(harnesses) for _ in policies]
    for c in cells:
        if c["success_rate"] is not None:
            grid[policies.index(c["policy"])][harnesses.index(c["harness"])] = c["success_rate"]
    fig, ax = plt.subplots(figsize=(1.3 * len(harnesses) + 2.2, 0.5 * len(policies) + 1.2))
    im = ax.imshow(grid, cmap="viridis", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(harnesses)), harnesses, rotation=20, ha="right")
    ax.set_yticks(range(len(policies)), policies)
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            if v == v:
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", color="white" if v < 0.6 else "black", fontsize=8)
    fig.colorbar(im, ax=ax, label="success rate")
    ax.set_title("Success rate by policy and harness (infrastructure failures excluded)")
    return _svg(fig)


def histogram(bins: list[dict[str, Any]], x: str, y: str, title: str, xlabel: str, width: float = 0.9) -> str | None:
    if not bins:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 2.6))
    ax.bar([b[x] for b in bins], [b[y] for b in bins], width=width, color="#6a1b9a", align="edge")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(y.replace("_", " "))
    ax.set_title(title)
    return _svg(fig)


def card_plots(card: dict[str, Any]) -> dict[str, str]:
    """Section name -> SVG text, for the sections that have data."""
    s = card["sections"]
    out: dict[str, str | None] = {}
    if s["funnel"].get("present"):
        out["funnel"] = funnel(s["funnel"]["steps"])
    if s["outcomes"].get("present"):
        out["outcomes"] = outcomes(s["outcomes"]["causes"])
        out["matrix"] = matrix(s["outcomes"]["policy_harness"])
        tasks = s["outcomes"].get("tasks") or {}
        out["posterior"] = histogram([{"bin": b["bin"] / 10, "task_policy_pairs": b["task_policies"]}
                                      for b in tasks.get("posterior_mean_histogram", [])], "bin", "task_policy_pairs",
                                     "Posterior mean success rate per (task, policy)", "posterior mean", width=0.09)
    if s["fragments"].get("present"):
        out["lengths"] = histogram(s["fragments"]["span_length_histogram"], "span_steps_from", "fragments",
                                   "Trained span length", "steps in the trained span (bins of 5; 40 = 40 or more)",
                                   width=4.5)
    return {k: v for k, v in out.items() if v}
