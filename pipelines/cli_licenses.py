"""`trajwh licenses`, `trajwh opt-out ...` and `trajwh card`: license screening, the opt-out registry
(docs/licenses.md) and the data card (docs/cards.md)."""

from __future__ import annotations

import json
import sys
from typing import Any

import click
from rich.markup import escape
from trajwh.lineage.catalog import Warehouse
from trajwh.pipelines import render
from trajwh.pipelines.cli import handle_errors, main, warehouse_option


def print_license_report(rep: dict[str, Any]) -> None:
    c = render.console
    if not rep["built"]:
        c.print("licenses: eligibility not built yet (run `trajwh build`)")
    else:
        c.print(render.dict_table(rep["licenses"], "licenses by kind (episodes)"))
        c.print(render.dict_table(rep["eligibility"], "eligibility (release = train and release)"))
        c.print(render.dict_table(rep["reasons"], "why a use is not allowed (episodes; an episode can have several)"))
    c.print(render.dict_table(rep["opt_outs"], "opt-outs applied (counts only)"))


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@warehouse_option
@handle_errors
def licenses(as_json: bool, warehouse: str | None) -> None:
    """Episodes by license, eligibility (train, release, blocked) and reason, and opt-outs applied."""
    from trajwh.licenses.report import license_report

    wh = Warehouse(warehouse)
    wh.require()
    rep = license_report(wh)
    if as_json:
        click.echo(json.dumps(rep, default=str, indent=2))
    else:
        print_license_report(rep)


@main.group("opt-out")
def opt_out() -> None:
    """The opt-out registry: data never trained on or released (docs/licenses.md)."""


@opt_out.command("add")
@click.argument("selector")
@click.option("--reason", required=True, help="Why (never who: no names or addresses here).")
@warehouse_option
@handle_errors
def opt_out_add(selector: str, reason: str, warehouse: str | None) -> None:
    """Add SELECTOR: repository:URL, email:ADDRESS (author:ADDRESS; stored hashed), source:NAME,
    task:ID or content:REGEX. Every build from now on keeps the matching episodes out of training
    and release; new batches are matched on arrival."""
    from trajwh.licenses.optout import add_opt_out

    wh = Warehouse(warehouse)
    wh.require()
    row = add_opt_out(wh, selector, reason, progress=render.console.log)
    render.console.print(f"opt-out {row['opt_out_id']} ({escape(row['shown'])}) is active: it matches "
                         f"{row['episodes']} redacted episode(s) now; the next `trajwh build` excludes them. "
                         f"To delete them: trajwh opt-out forget {row['opt_out_id']} --reason TEXT")


@opt_out.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.option("--all", "show_all", is_flag=True, help="Also the removed ones.")
@warehouse_option
@handle_errors
def opt_out_list(as_json: bool, show_all: bool, warehouse: str | None) -> None:
    """The registry: id, kind, what it matches (an e-mail by its digest), reason, episodes matched."""
    from trajwh.licenses.optout import OptOutSelector, opt_out_episodes

    wh = Warehouse(warehouse)
    wh.require()
    rows = wh.query("SELECT * FROM opt_outs " + ("" if show_all else "WHERE status = 'active' ") +
                    "ORDER BY created_at, opt_out_id").to_pylist()
    matched = opt_out_episodes(wh, [r for r in rows if r["status"] == "active"])
    per: dict[str, int] = {}
    for oids in matched.values():
        for oid in oids:
            per[oid] = per.get(oid, 0) + 1
    out = [{"opt_out_id": r["opt_out_id"], "matches": OptOutSelector(r["kind"], r["value"]).shown(),
            "reason": r["reason"], "status": r["status"], "created_at": r["created_at"],
            "episodes": per.get(r["opt_out_id"], 0)} for r in rows]
    if as_json:
        click.echo(json.dumps(out, default=str, indent=2))
    else:
        render.console.print(render.dict_table(out, "opt-outs"))


@opt_out.command("remove")
@click.argument("opt_out_id")
@warehouse_option
@handle_errors
def opt_out_remove(opt_out_id: str, warehouse: str | None) -> None:
    """Withdraw an opt-out (kept in the registry as removed); the next build uses the data again."""
    from trajwh.licenses.optout import remove_opt_out

    row = remove_opt_out(Warehouse(warehouse), opt_out_id)
    render.console.print(f"opt-out {row['opt_out_id']} removed; the next `trajwh build` decides its episodes again")


@opt_out.command("forget")
@click.argument("opt_out_id")
@click.option("--reason", required=True, help="Why (kept in the tombstone).")
@warehouse_option
@handle_errors
def opt_out_forget(opt_out_id: str, reason: str, warehouse: str | None) -> None:
    """Turn an opt-out into a deletion request: `trajwh forget opt-out:ID` (every layer, proved)."""
    from trajwh.lineage.forget import forget
    from trajwh.pipelines.cli_forget import _print_result

    result = forget(Warehouse(warehouse), f"opt-out:{opt_out_id}", reason, progress=render.console.log)
    _print_result(result)
    sys.exit(0 if result.status == "verified" else 1)


@main.command()
@click.option("--out", default=None, type=click.Path(file_okay=False),
              help="Folder for README.md, card.json and card.html (default <warehouse>/card, or card-SPLIT).")
@click.option("--split", default=None, type=click.Choice(["train", "valid", "test", "held_out"]),
              help="Only the episodes of one split (provenance, the raw funnel head and deletions stay whole).")
@warehouse_option
@handle_errors
def card(out: str | None, split: str | None, warehouse: str | None) -> None:
    """Write the data card from the warehouse: Markdown with a YAML header (Hugging Face style),
    JSON, and one self-contained HTML page with plots."""
    from trajwh.datacards.card import build_card
    from trajwh.lineage.exports import run_export

    wh = Warehouse(warehouse)
    if out is None:  # the warehouse's own card folder: rewritten by every build and forget
        r = build_card(wh, out, split=split, force=True)
    else:  # a card written elsewhere is recorded: a deletion request writes it again
        r = run_export(wh, "card", {"out": out, "split": split})
    for kind, path in r.files.items():
        render.console.print(f"{kind:<9} {path}")
