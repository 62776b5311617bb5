"""`trajwh audit` and `trajwh stats`: the curated layer from the command line."""

from __future__ import annotations

import json
import sys

import click
from rich.markup import escape
from trajwh.lineage.catalog import Warehouse
from trajwh.pipelines import render
from trajwh.pipelines.cli import handle_errors, main, warehouse_option

# --- audit -------------------------------------------------------------------------------------


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@warehouse_option
@handle_errors
def audit(as_json: bool, warehouse: str | None) -> None:
    """Split audit: what must be 0 (groups / clusters across splits, train states after an evaluation
    fix, leak-flagged evaluation episodes), held-out episodes, requested vs realized shares."""
    from trajwh.dedup.audit import audit as run_audit

    wh = Warehouse(warehouse)
    wh.require()
    a = run_audit(wh)
    if as_json:
        click.echo(json.dumps(a, default=str, indent=2))
    else:
        c = render.console
        c.print(render.dict_table(a["splits"], f"splits ({a['episodes']} episodes; requested vs realized "
                                                  "shares of the episodes not held out)"))
        ok = a["violations"] == 0
        c.print(f"groups across splits: {a['groups_across_splits']}   near-duplicate clusters across splits: "
                f"{a['clusters_across_splits']}   train states after an evaluation fix (pairs): "
                f"{a['train_after_eval_fix_pairs']}   leak-flagged in evaluation: {a['leak_flagged_in_eval']}   "
                f"{'[green]OK[/]' if ok else '[red]LEAK[/]'}")
        c.print(f"groups: {a['groups']} (largest holds {a['largest_group_share']:.1%}); episodes that lost a weak "
                f"grouping key: {a['weak_key_dropped']}; held out: {a['held_out']}; in near-duplicate clusters: "
                f"{a['near_dup_members']}; not eligible for evaluation (no usable times): {a['not_eligible_no_times']}; "
                f"no repository: {a['no_repository']}; no grouping key: {a['no_grouping_key']}")
        for note in a["notes"]:
            c.print(f"  - {escape(note)}")
        for warning in a["warnings"]:
            c.print(f"[bold red]WARNING[/]: {escape(warning)}")
        c.print(render.dict_table(a["time_flagged"][:40], f"time-flagged ({len(a['time_flagged'])} flags, first 40)"))
    if a["violations"]:
        sys.exit(1)


@main.command()
@click.option("--by", type=click.Choice(["harness_name", "policy_name", "source"]), default="harness_name",
              show_default=True, help="Group the effective rate by this column.")
@click.option("--interaction", nargs=4, default=None, metavar="P0 P1 HA HB",
              help="Interaction term for two policies and two harnesses, paired by task.")
@click.option("--compare", nargs=2, default=None, metavar="HA HB",
              help="Harness B minus harness A, paired by task, with a bootstrap interval.")
@click.option("--policy", default=None, help="With --compare: only this policy's episodes.")
@click.option("--json", "as_json", is_flag=True)
@warehouse_option
@handle_errors
def stats(by: str, interaction: tuple[str, str, str, str] | None, compare: tuple[str, str] | None,
          policy: str | None, as_json: bool, warehouse: str | None) -> None:
    """Effective rate (with cost per effective trajectory), the policy x harness success matrix,
    and (optionally) the interaction and a paired harness comparison. Unknown outcomes never
    count as failures; a harness crash counts against its harness (docs/fragments.md)."""
    from trajwh.fragments.rates import compare_harnesses, effective_rates, policy_harness_matrix
    from trajwh.fragments.rates import interaction as interaction_term

    wh = Warehouse(warehouse)
    wh.require()
    rows = wh.query("""SELECT coalesce(e.task_id, e.instance_id, 'episode:' || e.trajectory_key) AS task_id, o.cause,
                              o.evidence, e.policy_name, e.harness_name, e.source, e.cost_usd,
                              epoch(e.ended_at) - epoch(e.started_at) AS duration_s
                       FROM outcomes o JOIN redacted_episodes e USING (trajectory_key)""").to_pylist()
    _known_names(rows, interaction, compare, policy)
    out = {"effective_rate": effective_rates(rows, by),
           "matrix": [{"policy": p, "harness": h, "success_rate": round(v, 4)}
                      for (p, h), v in policy_harness_matrix(rows).items()]}
    if interaction:
        out["interaction"] = interaction_term(rows, *interaction)
    if compare:
        out["compare"] = compare_harnesses(rows, *compare, policy=policy)
    if as_json:
        click.echo(json.dumps(out, default=str, indent=2))
        return
    render.console.print(render.dict_table(out["effective_rate"], f"effective rate by {by}"))
    render.console.print(render.dict_table(out["matrix"], "policy x harness success rate (harness crashes count; "
                                                          "environment, verifier and unknown outcomes do not)"))
    if interaction:
        render.console.print(f"interaction: {_rounded(out['interaction'])}")
    if compare:
        render.console.print(f"{compare[1]} - {compare[0]}: {_rounded(out['compare'])}")


def _rounded(d: dict) -> dict:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in d.items()}


def _known_names(rows: list[dict], interaction: tuple | None, compare: tuple | None, policy: str | None) -> None:
    """Policy and harness names given to --interaction / --compare / --policy must exist: an
    unknown name is exit 2 with the valid ones, never an empty result that looks like an answer."""
    from trajwh.schemas.errors import ConfigError

    policies = sorted({r["policy_name"] for r in rows if r["policy_name"]})
    harnesses = sorted({r["harness_name"] for r in rows if r["harness_name"]})
    wanted = [("policy", p, policies) for p in (interaction or ())[:2]] + \
             [("harness", h, harnesses) for h in (interaction or ())[2:] + tuple(compare or ())] + \
             ([("policy", policy, policies)] if policy else [])
    for what, name, valid in wanted:
        if name not in valid:
            raise ConfigError(f"no {what} named {name!r} among the outcomes", valid=", ".join(valid) or "none (build first)")
