"""The ``trajwh`` command line.

Exit codes: 0 success; 1 the command ran but achieved nothing (e.g. every record quarantined);
2 bad input or arguments (the message says what is valid); 3 the warehouse is busy (retry).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.markup import escape

from lineage.catalog import Warehouse
from pipelines import render
from schemas.errors import TrajwhError, WarehouseBusyError

WAREHOUSE_HELP = "Warehouse folder (default: $TRAJWH_WAREHOUSE, else ./warehouse)."


def warehouse_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--warehouse", "-w", "warehouse", envvar="TRAJWH_WAREHOUSE", default=None,
                        type=click.Path(file_okay=False), help=WAREHOUSE_HELP)(fn)


def handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except WarehouseBusyError as exc:
            render.err_console.print(f"[bold red]busy:[/] {exc}")
            sys.exit(3)
        except TrajwhError as exc:
            render.err_console.print(f"[bold red]error:[/] {exc}")
            sys.exit(2)
    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="trajectory-warehouse")
def main() -> None:
    """Trajectory warehouse: agent rollouts in, lineage-tracked training data out."""


# --- ingest ------------------------------------------------------------------------------------


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option("--source", default="local", show_default=True, help="Name of the source these files come from.")
@click.option("--license", "license_", default=None, help="SPDX license id or expression of the data.")
@click.option("--format", "format_", default=None, help="Force a format instead of detecting it.")
@click.option("--max-record-mb", default=32.0, show_default=True, help="Records larger than this are quarantined.")
@click.option("--wait", default=60.0, show_default=True, help="Seconds to wait for another writer to finish.")
@click.option("--flush-mb", default=64.0, show_default=True,
              help="Raw bytes buffered before a Parquet file is written (bounds memory).")
@warehouse_option
@handle_errors
def ingest(paths: tuple[str, ...], source: str, license_: str | None, format_: str | None,
           max_record_mb: float, wait: float, flush_mb: float, warehouse: str | None) -> None:
    """Ingest trajectory files or folders (JSONL or JSON, gzip read transparently) into raw."""
    from ingest.raw_store import IngestOptions, ingest_paths
    from ingest.reader import find_input_files

    wh = Warehouse(warehouse)
    opts = IngestOptions(source=source, license=license_, format=format_,
                         max_record_bytes=int(max_record_mb * (1 << 20)), lock_timeout=wait,
                         flush_bytes=max(1, int(flush_mb * (1 << 20))))
    opts.validate()
    total = sum(p.stat().st_size for p in find_input_files(paths))
    t0 = time.monotonic()
    with render.byte_progress("ingesting", total) as advance:
        s = ingest_paths(wh, paths, opts, progress=advance)
    dt = time.monotonic() - t0
    c = render.console
    c.print(f"[bold]{s.n_new} new, {s.n_duplicate} already present[/], {s.n_quarantined} quarantined "
            f"— {len(s.files)} files, {render.human_bytes(s.bytes_read)} in {dt:.1f} s "
            f"({render.human_bytes(s.bytes_read / max(dt, 1e-9))}/s)")
    if s.quarantine_reasons:
        c.print(escape("quarantined: " + ", ".join(f"{k} ({v})" for k, v in sorted(s.quarantine_reasons.items()))))
        c.print(f"  see: trajwh sql \"SELECT file_path, line_no, reason FROM quarantine WHERE batch_id = '{s.batch_id}'\"")
    c.print(f"batch {s.batch_id} in {wh.root}; next: [bold]trajwh build[/]")
    if s.nothing_ingested:
        why = ("no input files were found" if not s.files else
               "every record was quarantined: " + ", ".join(f"{k} ({v})" for k, v in s.quarantine_reasons.items()))
        render.err_console.print(f"[bold red]nothing ingested:[/] {why}")
        sys.exit(1)


# --- build -------------------------------------------------------------------------------------


@main.command()
@click.option("--full", is_flag=True, help="Rebuild every batch, not only those whose adapters changed.")
@click.option("--scope", type=click.Choice(["episode", "repository", "dataset"]), default="episode", show_default=True,
              help="Where one sensitive value keeps one placeholder.")
@warehouse_option
@handle_errors
def build(full: bool, scope: str, warehouse: str | None) -> None:
    """(Re)materialize the derived layers through the Dagster graph, in-process."""
    from pipelines.definitions import build as run_build
    from redaction.vault import load_key

    wh = Warehouse(warehouse)
    wh.require()
    if load_key() is None:
        render.err_console.print("[yellow]note:[/] no vault key ($TRAJWH_VAULT_KEY / $TRAJWH_VAULT_KEY_FILE): "
                                 "the redacted layer is built, but the vault (placeholder -> value) is not written")
    t0 = time.monotonic()
    result = run_build(str(wh.root), full=full, scope=scope)
    _print_build(result, time.monotonic() - t0)


def _print_build(result: Any, seconds: float) -> None:
    c = render.console
    for mat in result.get_asset_materialization_events():
        md = mat.materialization.metadata
        c.print(f"  [green]✓[/] {mat.asset_key.to_user_string()}: " +
                ", ".join(f"{k}={v.value}" for k, v in md.items()))
    failed = []
    for ev in result.get_asset_check_evaluations():
        mark = "[green]✓[/]" if ev.passed else "[red]✗[/]"
        c.print(f"  {mark} check {ev.check_name}")
        if not ev.passed:
            failed.append(ev.check_name)
    c.print(f"build run {result.run_id} finished in {seconds:.1f} s")
    if failed:
        render.err_console.print(f"[bold red]checks failed:[/] {', '.join(failed)}")
        sys.exit(1)


# --- sql ---------------------------------------------------------------------------------------


@main.command()
@click.argument("query")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json", "parquet"]), default="table",
              show_default=True)
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="Write the result to FILE.")
@click.option("--max-rows", default=50, show_default=True, help="Rows shown in table format.")
@warehouse_option
@handle_errors
def sql(query: str, fmt: str, out: str | None, max_rows: int, warehouse: str | None) -> None:
    """Run read-only SQL against the catalog (a view per table: see docs/sql.md)."""
    import duckdb

    from lineage.export import write_result

    wh = Warehouse(warehouse)
    try:
        data = wh.query(query)
    except duckdb.Error as exc:
        render.err_console.print(f"[bold red]query failed:[/] {exc}")
        sys.exit(2)
    if fmt == "table" and out is None:
        render.console.print(render.arrow_table(data, max_rows=max_rows))
        return
    if fmt == "table":
        fmt = "csv"
    write_result(data, fmt, out)
    if out:
        render.err_console.print(f"wrote {data.num_rows} rows to {out}")


# --- status and trace --------------------------------------------------------------------------


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.option("--formats", is_flag=True, help="Per input format: files, records, episodes, steps, quarantined.")
@warehouse_option
@handle_errors
def status(as_json: bool, formats: bool, warehouse: str | None) -> None:
    """Rows per layer and table, recent batches and runs, quarantine counts by reason."""
    from lineage.status import format_status, warehouse_status

    wh = Warehouse(warehouse)
    if formats:
        rows = format_status(wh)
        if as_json:
            click.echo(json.dumps(rows, default=str, indent=2))
        else:
            render.console.print(render.dict_table(rows, "per format"))
        return
    st = warehouse_status(wh)
    if as_json:
        click.echo(json.dumps(st, default=str, indent=2))
        return
    c = render.console
    c.print(f"[bold]warehouse[/] {st['warehouse']}")
    c.print(render.dict_table(st["tables"], "tables"))
    c.print(render.dict_table(st["batches"], "last batches"))
    c.print(render.dict_table(st["runs"], "last runs"))
    c.print(render.dict_table(st["quarantine"], "quarantine by reason"))


@main.command()
@click.argument("ident")
@warehouse_option
@handle_errors
def trace(ident: str, warehouse: str | None) -> None:
    """Walk back from a fragment id, step id, trajectory key or record id to the raw record it came from."""
    from lineage.trace import trace as do_trace

    t = do_trace(Warehouse(warehouse), ident)
    c = render.console
    if t.fragment:
        f = t.fragment
        c.print(f"[bold]fragment[/] {f['fragment_id']}  {f['kind']}  steps {f['start_step']}..{f['end_step']} "
                f"(context from {f['context_start']}; {len(f['step_ids'])} steps)  split {f['split']}  weight "
                f"{render.fmt(f['dedup_weight'])}  rules {f['_transform_version'].split(';')[1]}\n  why: {f['selection_reason']}")
        s = t.step
        c.print(f"[bold]step[/] {s['step_id']}  #{s['step_index']} {s['role']}/{s['author']}  "
                f"via {s['_transform']}@{s['_transform_version']} run {s['_run_id']}")
    if t.episode:
        e = t.episode
        c.print(f"[bold]episode[/] {e['trajectory_key']}  task {e['task_id']}  policy {e['policy_name']}  "
                f"harness {e['harness_name']}  attempt {e['attempt']}  ({e['n_steps']} steps; "
                f"key from {', '.join(e['key_fields'])})")
    if t.record:
        r = t.record
        where = f"line {r['line_no']}" if r["line_no"] is not None else "whole file"
        c.print(f"[bold]raw record[/] {r['record_id']}\n  file {r['file_path']} {where}, byte offset "
                f"{r['byte_offset']}, {r['byte_length']} bytes{' (gzip, offsets decompressed)' if r['compression'] else ''}"
                f"\n  format {r['format']}, source {r['source']}, license {r['license'] or '∅'}")
    if t.batch:
        b = t.batch
        c.print(f"[bold]batch[/] {b['batch_id']} committed {render.fmt(b['committed_at'])}")
    for e in t.edges:
        c.print(escape(f"  edge {e['child_table']}:{e['child_id']} ← {e['parent_table']}:{e['parent_id']} "
                       f"[{e['transform']}@{e['transform_version']}, run {e['run_id']}]"))


# --- export ------------------------------------------------------------------------------------


@main.command()
@click.option("--format", "fmt", type=click.Choice(["native", "atif"]), default="native", show_default=True)
@click.option("--layer", type=click.Choice(["redacted", "normalized"]), default="redacted", show_default=True,
              help="normalized holds unredacted data: export it only inside the restricted zone.")
@click.option("--where", default=None, help="SQL filter on the episodes, e.g. \"harness_name = 'swe-agent'\".")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="JSONL file (.gz compresses).")
@warehouse_option
@handle_errors
def export(fmt: str, layer: str, where: str | None, out: str, warehouse: str | None) -> None:
    """Write episodes as native JSONL or ATIF, one episode per line."""
    from ingest.export import export_episodes

    wh = Warehouse(warehouse)
    if layer == "normalized":
        render.err_console.print("[yellow]warning:[/] the normalized layer is not redacted; keep this export "
                                 "inside the restricted zone")
    with render.count_progress("exporting") as advance:
        n = export_episodes(wh, fmt, out, layer=layer, where=where, progress=advance)
    render.console.print(f"wrote {n} episodes as {fmt} to {out}")


# --- audit -------------------------------------------------------------------------------------


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@warehouse_option
@handle_errors
def audit(as_json: bool, warehouse: str | None) -> None:
    """Split audit: groups and near-duplicate clusters across splits (must be 0), time-flagged episodes."""
    from dedup.layer import audit as run_audit

    wh = Warehouse(warehouse)
    wh.require()
    a = run_audit(wh)
    if as_json:
        click.echo(json.dumps(a, default=str, indent=2))
    else:
        c = render.console
        c.print(render.dict_table(a["splits"], f"splits ({a['episodes']} episodes)"))
        ok = a["groups_across_splits"] == 0 and a["clusters_across_splits"] == 0
        c.print(f"groups across splits: {a['groups_across_splits']}   near-duplicate clusters across splits: "
                f"{a['clusters_across_splits']}   {'[green]OK[/]' if ok else '[red]LEAK[/]'}")
        c.print(f"episodes in near-duplicate clusters: {a['near_dup_members']}; not eligible for evaluation (no usable "
                f"times): {a['not_eligible_no_times']}; no repository: {a['no_repository']}; no grouping key: "
                f"{a['no_grouping_key']}")
        c.print(render.dict_table(a["time_flagged"][:40], f"time-flagged ({len(a['time_flagged'])} flags, first 40)"))
    if a["groups_across_splits"] or a["clusters_across_splits"]:
        sys.exit(1)


@main.command()
@click.option("--by", type=click.Choice(["harness_name", "policy_name", "source"]), default="harness_name",
              show_default=True, help="Group the effective rate by this column.")
@click.option("--interaction", nargs=4, default=None, metavar="P0 P1 HA HB",
              help="Interaction term for two policies and two harnesses, paired by task.")
@click.option("--json", "as_json", is_flag=True)
@warehouse_option
@handle_errors
def stats(by: str, interaction: tuple[str, str, str, str] | None, as_json: bool, warehouse: str | None) -> None:
    """Effective rate, the policy x harness success matrix and (optionally) their interaction."""
    from fragments.task_stats import effective_rates, policy_harness_matrix
    from fragments.task_stats import interaction as interaction_term

    wh = Warehouse(warehouse)
    wh.require()
    rows = wh.query("""SELECT coalesce(e.task_id, e.instance_id, 'episode:' || e.trajectory_key) AS task_id, o.cause,
                              e.policy_name, e.harness_name, e.source
                       FROM outcomes o JOIN redacted_episodes e USING (trajectory_key)""").to_pylist()
    out = {"effective_rate": effective_rates(rows, by),
           "matrix": [{"policy": p, "harness": h, "success_rate": round(v, 4)}
                      for (p, h), v in policy_harness_matrix(rows).items()]}
    if interaction:
        out["interaction"] = interaction_term(rows, *interaction)
    if as_json:
        click.echo(json.dumps(out, default=str, indent=2))
        return
    render.console.print(render.dict_table(out["effective_rate"], f"effective rate by {by}"))
    render.console.print(render.dict_table(out["matrix"], "policy x harness success rate (no infrastructure failures)"))
    if interaction:
        render.console.print(f"interaction: {out['interaction']}")


# --- redaction -----------------------------------------------------------------------------------


@main.command("redact-text")
@click.argument("src", type=click.Path(exists=True, dir_okay=False))
@click.argument("dst", type=click.Path(dir_okay=False))
@click.option("--salt", envvar="TRAJWH_REDACT_SALT", default=None,
              help="Placeholder salt (default: a random one per run, so ids are unlinkable across runs).")
@handle_errors
def redact_text(src: str, dst: str, salt: str | None) -> None:
    """Redact free text: each input line {"id", "text"} becomes {"id", "redacted_text"}; one line = one scope."""
    import secrets as _secrets

    import orjson

    from redaction.engine import Redactor
    from schemas.errors import InputFormatError

    red = Redactor(salt.encode() if salt else _secrets.token_bytes(32))
    n = replaced = 0
    lines = Path(src).read_bytes().splitlines()
    with open(dst, "wb") as out, render.count_progress("redacting", len(lines)) as advance:
        for line_no, line in enumerate(lines, start=1):
            advance(1)
            if not line.strip():
                continue
            try:
                obj = orjson.loads(line)
                ident, text = obj["id"], obj["text"]
                if not isinstance(text, str):
                    raise TypeError("text is not a string")
            except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
                raise InputFormatError(f"line is not a {{\"id\", \"text\"}} object ({exc})", where=f"{src}:{line_no}",
                                       valid='one JSON object per line with "id" and a string "text"') from None
            events: list = []
            out.write(orjson.dumps({"id": ident, "redacted_text": red.text(text, red.scope(str(ident)), "text", events)}) + b"\n")
            n += 1
            replaced += len(events)
    render.console.print(f"redacted {n} texts ({replaced} replacements) into {dst}")


@main.group()
def vault() -> None:
    """The encrypted placeholder vault (needs $TRAJWH_VAULT_KEY or $TRAJWH_VAULT_KEY_FILE)."""


@vault.command("init-key")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Where to write the new key (0600).")
@handle_errors
def vault_init_key(out: str) -> None:
    """Create a new vault key file; point $TRAJWH_VAULT_KEY_FILE at it before building."""
    from redaction.vault import new_key_file

    path = new_key_file(out)
    render.console.print(f"wrote a new vault key to {path}\nexport TRAJWH_VAULT_KEY_FILE={path}")


@vault.command("reveal")
@click.argument("placeholder")
@click.option("--scope", default=None, help="Only this scope id (e.g. a trajectory key or its prefix).")
@warehouse_option
@handle_errors
def vault_reveal(placeholder: str, scope: str | None, warehouse: str | None) -> None:
    """Print the original value behind a placeholder (needs the vault key)."""
    from redaction.vault import Vault, load_key

    wh = Warehouse(warehouse)
    wh.require()
    found = Vault(wh, load_key()).reveal(placeholder, scope)
    if not found:
        render.err_console.print(f"no vault entry for {placeholder}")
        sys.exit(1)
    for f in found:
        click.echo(f"{f['placeholder']}\t{f['scope_kind']}:{f['scope_id']}\t{f['entity_type']}\t{f['value']}")


# --- ui, synth, demo, schema -------------------------------------------------------------------


@main.command()
@click.option("--port", default=3000, show_default=True)
@warehouse_option
@handle_errors
def ui(port: int, warehouse: str | None) -> None:
    """Start the Dagster web UI on 127.0.0.1."""
    wh = Warehouse(warehouse)
    home = wh.root / "_dagster"
    home.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TRAJWH_WAREHOUSE": str(wh.root), "DAGSTER_HOME": str(home)}
    exe = Path(sys.executable).with_name("dagster")
    cmd = [str(exe) if exe.exists() else "dagster", "dev", "-m", "pipelines.definitions",
           "-h", "127.0.0.1", "-p", str(port)]
    render.err_console.print(f"Dagster UI for {wh.root} on http://127.0.0.1:{port} (Ctrl-C stops it)")
    os.execvpe(cmd[0], cmd, env)


@main.command()
@click.option("--episodes", default=2000, show_default=True)
@click.option("--tasks", default=None, type=int, help="Default: episodes / 13.")
@click.option("--out", required=True, type=click.Path(file_okay=False))
@click.option("--seed", default=0, show_default=True)
@handle_errors
def synth(episodes: int, tasks: int | None, out: str, seed: int) -> None:
    """Generate a deterministic synthetic corpus in the native format."""
    from synth.generator import SynthConfig, generate_corpus

    t0 = time.monotonic()
    with render.count_progress("generating", episodes) as advance:
        s = generate_corpus(SynthConfig(episodes=episodes, tasks=tasks, seed=seed), out, progress=advance)
    render.console.print(
        f"[bold]{s.episodes} episodes[/], {s.steps} steps, {s.tasks} tasks, {render.human_bytes(s.bytes)} "
        f"in {len(s.files)} files under {out} ({time.monotonic() - t0:.1f} s)\n"
        f"causes: " + ", ".join(f"{k} {v}" for k, v in s.causes.most_common()) +
        f"\nplanted: {s.secrets} secrets, {s.leaks} time leaks, {s.near_dups} near-duplicates "
        f"(ground truth in {out}/.truth/labels.jsonl)")


@main.command()
@click.option("--episodes", default=2000, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--corpus", default="demo-corpus", show_default=True, type=click.Path(file_okay=False),
              help="Where the synthetic corpus is written.")
@warehouse_option
@handle_errors
def demo(episodes: int, seed: int, corpus: str, warehouse: str | None) -> None:
    """Generate a corpus, ingest and build it through the Dagster graph, print a summary."""
    from lineage.status import warehouse_status
    from pipelines.definitions import build as run_build
    from synth.generator import SynthConfig, generate_corpus

    wh = Warehouse(warehouse)
    t0 = time.monotonic()
    with render.count_progress("generating corpus", episodes) as advance:
        generate_corpus(SynthConfig(episodes=episodes, seed=seed), corpus, progress=advance)
    result = run_build(str(wh.root), include_ingest=True,
                       ingest_config={"paths": [str(Path(corpus).resolve())], "source": "synthetic"})
    _print_build(result, time.monotonic() - t0)
    st = warehouse_status(wh)
    tot = st["totals"]
    c = render.console
    c.rule("[bold]trajectory warehouse demo")
    c.print(f"episodes      {tot['episodes']:>10,}\nsteps         {tot['steps']:>10,}\n"
            f"tasks         {tot['tasks']:>10,}\nraw bytes     {render.human_bytes(tot['raw_bytes']):>10}\n"
            f"quarantined   {tot['quarantined']:>10,}\nwall time     {time.monotonic() - t0:>9.1f}s")
    more = wh.query("""SELECT (SELECT count(*) FROM redaction_events) AS replacements,
                              (SELECT count(DISTINCT cluster_id) FROM near_dup_clusters WHERE cluster_size > 1) AS dup_clusters,
                              (SELECT count(DISTINCT group_id) FROM task_groups) AS groups,
                              (SELECT string_agg(split || ' ' || n, ', ' ORDER BY split) FROM
                                  (SELECT split, count(*) AS n FROM splits GROUP BY 1)) AS splits,
                              (SELECT count(DISTINCT trajectory_key) FROM leak_flags WHERE step_index IS NOT NULL) AS leaky,
                              (SELECT string_agg(kind || ' ' || n, ', ' ORDER BY kind) FROM
                                  (SELECT kind, count(*) AS n FROM fragments GROUP BY 1)) AS fragments""").to_pylist()[0]
    c.print(f"redactions    {more['replacements']:>10,}\nnear-dup clusters {more['dup_clusters']:>6,}\n"
            f"task groups   {more['groups']:>10,}\nsplits        {more['splits']}\n"
            f"time leaks    {more['leaky']:>10,} episodes flagged\nfragments     {more['fragments']}")
    c.print(f"warehouse     {wh.root}\ncatalog       {wh.catalog_path}")
    c.print("query it:     trajwh sql \"SELECT harness_name, policy_name, avg(resolved::INT) AS success, "
            "count(*) AS n FROM episodes GROUP BY ALL ORDER BY success DESC\"")
    c.print("              trajwh status  |  trajwh trace <step_id>  |  trajwh ui  |  docs/sql.md")


@main.command()
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="Write to FILE instead of stdout.")
def schema(out: str | None) -> None:
    """Print the JSON Schema of the native trajectory format."""
    from schemas.native import NativeEpisode

    text = json.dumps(NativeEpisode.model_json_schema(), indent=2) + "\n"
    if out:
        Path(out).write_text(text)
    else:
        click.echo(text, nl=False)


if __name__ == "__main__":
    main()
