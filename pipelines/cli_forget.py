"""`trajwh impact`, `trajwh forget`, `trajwh verify-forget`: deletion propagation (docs/forget.md)."""

from __future__ import annotations

import json

import click
from rich.markup import escape
from trajwh.lineage.catalog import Warehouse
from trajwh.pipelines import render
from trajwh.pipelines.cli import handle_errors, main, warehouse_option


@main.command()
@click.argument("selector")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON (every id in full).")
@warehouse_option
@handle_errors
def impact(selector: str, as_json: bool, warehouse: str | None) -> None:
    """Counts and ids, per layer, of everything made from SELECTOR (read only). SELECTOR is KIND:VALUE:
    source:NAME, license:SPDX, batch:ID, file:PATH, record:ID, content:REGEX (raw bytes),
    episode:KEY, task:ID or repository:URL."""
    from trajwh.lineage.impact import impact as run_impact

    result = run_impact(Warehouse(warehouse), selector)
    if as_json:
        click.echo(json.dumps(result.as_dict(), indent=2, default=str))
        return
    c = render.console
    rows = []
    for layer, entry in result.layers.items():
        extra = {k: v for k, v in entry.items() if k not in ("rows", "ids")}
        detail = ", ".join(f"{k}={len(v) if isinstance(v, list) else v}" for k, v in extra.items())
        sample = ", ".join(i[:16] for i in (entry.get("ids") or [])[:3])
        rows.append({"layer": layer, "rows": entry["rows"], "detail": detail, "first ids": sample})
    c.print(render.dict_table(rows, f"impact of {escape(result.selector)}: {len(result.records)} raw records, "
                                    f"{len(result.episodes)} episodes"))
    for note in result.notes:
        c.print(f"  - {escape(note)}")
    if result.empty:
        c.print("[yellow]nothing matches this selector[/]")


@main.command()
@click.argument("selector", required=False)
@click.option("--reason", default=None, help="Why (kept in the tombstone; required for a new request).")
@click.option("--dry-run", is_flag=True, help="Show the plan (as `trajwh impact`) and change nothing.")
@click.option("--resume", is_flag=True, help="Finish the requests a crash left open, then stop.")
@warehouse_option
@handle_errors
def forget(selector: str | None, reason: str | None, dry_run: bool, resume: bool, warehouse: str | None) -> None:
    """Delete SELECTOR (as `trajwh impact` takes it) from every layer, vault and pack, repair what was
    made from it, leave a tombstone and verify that no byte of it is left (docs/forget.md)."""
    import sys

    from trajwh.lineage.forget import forget as run_forget
    from trajwh.lineage.forget import pending_requests
    from trajwh.lineage.forget import resume as run_resume
    from trajwh.schemas.errors import ConfigError

    wh = Warehouse(warehouse)
    c = render.console
    if resume:
        wh.require()
        with wh.write_session("forget"):
            pass
        results = [run_resume(wh, r, progress=c.log) for r in pending_requests(wh)]
        if not results:
            c.print("no deletion request is open")
        for r in results:
            _print_result(r)
        sys.exit(0 if all(r.status == "verified" for r in results) else 1)
    if not selector:
        raise ConfigError("forget needs a SELECTOR (or --resume)", valid="e.g. trajwh forget source:NAME --reason TEXT")
    if dry_run:
        plan = run_forget(wh, selector, reason or "dry run", dry_run=True)
        c.print(f"[bold]dry run[/]: {len(plan.records)} raw records and {len(plan.episodes)} episodes would be "
                f"forgotten; see `trajwh impact {escape(selector)}` for every layer")
        return
    result = run_forget(wh, selector, reason or "", progress=c.log)
    _print_result(result)
    sys.exit(0 if result.status == "verified" else 1)


def _print_result(r) -> None:
    c = render.console
    c.print(f"[bold]{r.request_id}[/] {escape(r.selector)}: [bold]{r.status}[/]")
    c.print(render.dict_table([{"layer": k, "rows": v} for k, v in r.counts.items() if v], "rows removed or recomputed"))
    src = r.sources or {}
    if src:
        c.print(f"rewrote {src.get('files_rewritten', 0)} files: {render.human_bytes(src.get('bytes_replaced', 0))} "
                f"replaced by {render.human_bytes(src.get('bytes_written', 0))}")
    v = r.verify
    c.print(f"proof: rows with a forgotten id left: {sum(v.get('rows_left', {}).values())}; probe strings: "
            f"{v.get('probes', 0)} ({v.get('probes_shared', 0)} shared with data that stays); files holding one: "
            f"{len(v.get('files_with_probes', {}))}; files older than the data, unchanged by their digest: "
            f"{v.get('files_unchanged', 0)}")
    for f in v.get("files_with_probes", {}):
        c.print(f"  [red]leak[/]: {escape(f)}")
    for t, n in v.get("rows_left", {}).items():
        c.print(f"  [red]left[/]: {t}: {n}")
    for e in r.exports:  # what the tool had written out of the warehouse, and its own cards
        color = {"regenerated": "green", "missing": "yellow", "withdrawn": "yellow"}.get(e["status"], "red")
        c.print(f"  export [{color}]{e['status']}[/]: {escape(e['kind'])} {escape(e['path'])}"
                + (f" ({escape(e['note'])})" if e.get("note") else ""))
    if r.moved:
        c.print(f"{len(r.moved)} episodes changed split because their group or cluster lost episodes:")
        c.print(render.dict_table(r.moved[:20], "moved (first 20)"))


@main.command("verify-forget")
@click.argument("request_id")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@warehouse_option
@handle_errors
def verify_forget(request_id: str, as_json: bool, warehouse: str | None) -> None:
    """Prove a deletion again from its tombstone: no row with a forgotten id, no probe string in any byte
    of the warehouse (Parquet decoded, the catalog, its WAL, vault, caches). Exit 1 on a finding."""
    import sys

    from trajwh.lineage.forget import verify_forget as run_verify

    result = run_verify(Warehouse(warehouse), request_id)
    if as_json:
        click.echo(json.dumps(result, indent=2, default=str))
    else:
        c = render.console
        c.print(f"{'[green]clean[/]' if result['ok'] else '[red]NOT CLEAN[/]'}: rows left {result['rows_left'] or 0}, "
                f"files holding a probe {len(result['files_with_probes'])} ({result['probes']} probes, "
                f"{result['probes_shared']} shared with data that stays; {result.get('files_unchanged', 0)} files "
                f"older than the data, unchanged by their digest)")
        for f in result["files_with_probes"]:
            c.print(f"  [red]leak[/]: {escape(f)}")
    sys.exit(0 if result["ok"] else 1)
