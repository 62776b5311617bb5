"""Three renderings of one card document: ``README.md`` (Hugging Face dataset-card style: a YAML
header, then sections), ``card.json`` (the document itself) and ``card.html`` (one self-contained
page, plots inline as SVG). Every number comes from the document; nothing is typed here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from trajwh.lineage.storage import write_bytes_atomic

SECTION_TITLES = {
    "provenance": "Provenance", "licenses": "Licenses and opt-outs", "funnel": "From raw candidates to training data",
    "outcomes": "Outcomes", "redaction": "Redaction", "splits": "Splits and leak audit", "fragments": "Fragments",
    "packs": "Packed tokens", "deletions": "Deletions",
}


def _size_category(n: int) -> str:
    for limit, name in ((1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K"), (1_000_000, "100K<n<1M")):
        if n < limit:
            return name
    return "1M<n<10M"


def yaml_header(card: dict[str, Any]) -> dict[str, Any]:
    lic = card["sections"]["licenses"]
    spdx = [x.lower() for x in lic.get("spdx", [])] if lic.get("present") else []
    header: dict[str, Any] = {
        "license": (spdx[0] if len(spdx) == 1 else spdx) if spdx and all(" " not in x for x in spdx) else "other",
        "pretty_name": card["pretty_name"],
        "size_categories": [_size_category(card["scope"]["episodes"])],
        "task_categories": ["text-generation"],
        "tags": ["agent-trajectories", "tool-use", "code", "trajwh"],
    }
    packs = card["sections"]["packs"]
    if packs.get("present"):
        splits = sorted({r["split"] for r in packs["by_pack_set_and_split"]})
        header["configs"] = [{"config_name": "default", "data_files": [
            {"split": s, "path": f"data/{s}-*.parquet"} for s in splits]}]
    return header


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list | dict):
        v = json.dumps(v, default=str)
    return str("" if v is None else v).replace("|", "\\|").replace("\n", " ")


def md_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "_(none)_\n"
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _section_blocks(name: str, sec: dict[str, Any]) -> list[tuple[str, Any]]:
    """(caption, rows or value) of one section, in the order the renderings show them."""
    if not sec.get("present"):
        return [("", sec.get("note", "not built"))]
    blocks: list[tuple[str, Any]] = []
    scalars = {k: v for k, v in sec.items() if k != "present" and not isinstance(v, list | dict)}
    if scalars:
        blocks.append(("", [scalars]))
    for k, v in sec.items():
        if isinstance(v, list) and v and isinstance(v[0], dict):
            blocks.append((k.replace("_", " "), v))
        elif isinstance(v, dict):
            inner_lists = {ik: iv for ik, iv in v.items() if isinstance(iv, list) and iv and isinstance(iv[0], dict)}
            flat = {ik: iv for ik, iv in v.items() if ik not in inner_lists}
            if flat:
                blocks.append((k.replace("_", " "), [flat]))
            for ik, iv in inner_lists.items():
                blocks.append((f"{k.replace('_', ' ')}: {ik.replace('_', ' ')}", iv))
        elif isinstance(v, list) and v:
            blocks.append((k.replace("_", " "), [{"value": x} for x in v]))
    return blocks


def render_markdown(card: dict[str, Any]) -> str:
    head = yaml.safe_dump(yaml_header(card), sort_keys=False, allow_unicode=True)
    out = [f"---\n{head}---\n", f"# {card['pretty_name']}\n",
           f"Generated from the warehouse by `trajwh card` at {card['generated_at']} (card schema "
           f"{card['card_schema_version']}); every number below is computed from the catalog. Scope: "
           f"{card['scope']['split'] or 'all splits'}, {card['scope']['episodes']:,} episodes.\n"]
    for name, title in SECTION_TITLES.items():
        out.append(f"## {title}\n")
        for caption, rows in _section_blocks(name, card["sections"][name]):
            if isinstance(rows, str):
                out.append(f"_{rows}_\n")
                continue
            if caption:
                out.append(f"**{caption}**\n")
            out.append(md_table(rows))
    out.append("## How to trace a row and request a deletion\n")
    out += [f"- {k}: {v}\n" for k, v in card["how_to"].items()]
    return "\n".join(out)


_HTML = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{{ card.pretty_name }}: data card</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
 body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1f2328; margin: 0; background: #f6f8fa; }
 main { max-width: 1060px; margin: 0 auto; padding: 24px 32px 48px; background: #fff; }
 h1 { font-size: 26px; margin: 8px 0 4px; } h2 { font-size: 19px; margin: 32px 0 8px; border-bottom: 1px solid #d0d7de; padding-bottom: 4px; }
 .meta { color: #57606a; font-size: 13px; }
 .kpis { display: flex; flex-wrap: wrap; gap: 12px; margin: 16px 0; }
 .kpi { background: #f6f8fa; border: 1px solid #d0d7de; border-radius: 6px; padding: 8px 14px; min-width: 120px; }
 .kpi b { display: block; font-size: 20px; } .kpi span { color: #57606a; font-size: 12px; }
 table { border-collapse: collapse; margin: 6px 0 14px; font-size: 12.5px; display: block; overflow-x: auto; max-width: 100%; }
 th, td { border: 1px solid #d0d7de; padding: 3px 8px; text-align: left; vertical-align: top; }
 th { background: #f6f8fa; } td.n { text-align: right; font-variant-numeric: tabular-nums; }
 .caption { font-weight: 600; margin-top: 10px; } .note { color: #57606a; font-style: italic; }
 figure { margin: 8px 0 16px; } figure svg { max-width: 100%; height: auto; }
 nav a { margin-right: 12px; font-size: 13px; }
 .ok { color: #1a7f37; font-weight: 600; } .bad { color: #cf222e; font-weight: 600; }
</style></head>
<body><main>
<h1>{{ card.pretty_name }}</h1>
<div class="meta">Data card generated by <code>trajwh card</code> at {{ card.generated_at }} · card schema
{{ card.card_schema_version }} · scope: {{ card.scope.split or "all splits" }} · every number computed from the warehouse</div>
<div class="kpis">{% for label, value in kpis %}<div class="kpi"><b>{{ value }}</b><span>{{ label }}</span></div>{% endfor %}</div>
<nav>{% for name, title in titles %}<a href="#{{ name }}">{{ title }}</a>{% endfor %}</nav>
{% for name, title, blocks, plots in sections %}
<h2 id="{{ name }}">{{ title }}</h2>
{% for svg in plots %}<figure>{{ svg | safe }}</figure>{% endfor %}
{% for caption, rows in blocks %}
 {% if rows is string %}<p class="note">{{ rows }}</p>{% else %}
 {% if caption %}<div class="caption">{{ caption }}</div>{% endif %}
 <table><tr>{% for c in rows[0] %}<th>{{ c }}</th>{% endfor %}</tr>
 {% for r in rows %}<tr>{% for c in rows[0] %}{% set v = r.get(c) %}<td{% if v is number %} class="n"{% endif %}>{{ fmt(v) }}</td>{% endfor %}</tr>{% endfor %}
 </table>{% endif %}
{% endfor %}
{% endfor %}
<h2 id="how">How to trace a row and request a deletion</h2>
<ul>{% for k, v in card.how_to.items() %}<li><b>{{ k }}</b>: <code>{{ v }}</code></li>{% endfor %}</ul>
</main></body></html>
"""

_PLOTS_OF = {"funnel": ["funnel"], "outcomes": ["outcomes", "matrix", "posterior"], "fragments": ["lengths"]}


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list | dict):
        return json.dumps(v, default=str)
    return "" if v is None else str(v)


def _kpis(card: dict[str, Any]) -> list[tuple[str, str]]:
    s = card["sections"]
    out = [("episodes", f"{card['scope']['episodes']:,}")]
    if s["outcomes"].get("present"):
        kinds = s["outcomes"]["by_kind"]
        out.append(("resolved", f"{kinds.get('resolved', 0):,}"))
    if s["fragments"].get("present"):
        out.append(("training fragments", f"{s['fragments']['fragments']:,}"))
    if s["packs"].get("present"):
        out.append(("trainable tokens", f"{sum(r['trainable_tokens'] for r in s['packs']['by_pack_set_and_split']):,}"))
    if s["splits"].get("present"):
        out.append(("split audit", s["splits"]["audit"]["result"]))
    if s["redaction"].get("present"):
        out.append(("redactions", f"{s['redaction']['replacements']:,}"))
    return out


def render_html(card: dict[str, Any], plots: dict[str, str]) -> str:
    from jinja2 import Environment

    env = Environment(autoescape=True, trim_blocks=True, lstrip_blocks=True)
    sections = [(name, title, _section_blocks(name, card["sections"][name]),
                 [plots[p] for p in _PLOTS_OF.get(name, []) if p in plots]) for name, title in SECTION_TITLES.items()]
    return env.from_string(_HTML).render(card=card, sections=sections, titles=list(SECTION_TITLES.items()),
                                         kpis=_kpis(card), fmt=_fmt)


def write_card(card: dict[str, Any], out: Path) -> dict[str, Path]:
    """The three files in ``out`` (each written atomically)."""
    from trajwh.datacards.plots import card_plots

    out.mkdir(parents=True, exist_ok=True)
    files = {"json": out / "card.json", "markdown": out / "README.md", "html": out / "card.html"}
    write_bytes_atomic(json.dumps(card, indent=2, default=str).encode() + b"\n", files["json"], restricted=False)
    write_bytes_atomic(render_markdown(card).encode(), files["markdown"], restricted=False)
    write_bytes_atomic(render_html(card, card_plots(card)).encode(), files["html"], restricted=False)
    return files
