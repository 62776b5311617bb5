"""The ``trajwh`` command line.

Exit codes: 0 success; 1 the command ran but achieved nothing (e.g. every record quarantined);
2 bad input or arguments (the message says what is valid); 3 the warehouse is busy (retry).
"""

from __future__ import annotations

import atexit
import functools
import gc
import json
import os
import re
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import orjson
from rich.markup import escape
from trajwh.lineage.catalog import Warehouse
from trajwh.pipelines import render
from trajwh.schemas.config import ENGINES
from trajwh.schemas.errors import ConfigError, TrajwhError, WarehouseBusyError

WAREHOUSE_HELP = ("Warehouse folder (default: $TRAJWH_WAREHOUSE, else ./warehouse), or the s3://bucket/prefix of "
                  "one whose data is in object storage, to read it from another host.")


def warehouse_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--warehouse", "-w", "warehouse", envvar="TRAJWH_WAREHOUSE", default=None,
                        type=click.Path(file_okay=False), help=WAREHOUSE_HELP)(fn)


def handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except WarehouseBusyError as exc:
            render.err_console.print(f"[bold red]busy:[/] {escape(str(exc))}")
            sys.exit(3)
        except TrajwhError as exc:
            render.err_console.print(f"[bold red]error:[/] {escape(str(exc))}")
            sys.exit(2)
        except Exception as exc:
            problem = object_store_problem(exc)
            if problem is None:
                raise
            render.err_console.print(f"[bold red]error:[/] {escape(problem)}")
            sys.exit(2)
    return wrapper


def object_store_problem(exc: BaseException) -> str | None:
    """What an object store's refusal or silence means, in one line, when ``exc`` (or what caused
    it) is one: pyarrow's S3 client reports them as "AWS Error ..." (through DuckDB as well)."""
    seen = 0
    while exc is not None and seen < 10:
        for line in str(exc).splitlines():
            if "AWS Error" in line:
                endpoint = os.environ.get("AWS_ENDPOINT_URL") or "AWS"
                return (f"the object store did not serve the warehouse's data: {line.strip()[:400]}. Valid: the store "
                        f"reachable at {endpoint} (AWS_ENDPOINT_URL) with credentials that may read and write the "
                        f"bucket (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)")
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="trajectory-warehouse")
def main() -> None:
    """Trajectory warehouse: agent rollouts in, lineage-tracked training data out."""
    _freeze_at_exit()


def _freeze_at_exit() -> None:
    """At the process's exit, the heap is frozen (``gc.freeze``) before the interpreter's last
    collections, which then skip what the command left: after an incremental build at 107,000
    episodes they took 1.1 s, now 0.15 s. Freezing stops only the cycle collector: objects are
    still freed by their reference counts, the other exit handlers run, and files, catalog
    connections and logs are closed and flushed by the code that opened them."""
    if not _FREEZE_REGISTERED:
        atexit.register(gc.freeze)
        _FREEZE_REGISTERED.append(True)


_FREEZE_REGISTERED: list[bool] = []  # once per process (a test runs many commands in one)


# --- ingest ------------------------------------------------------------------------------------


def _file_size(path: Path) -> int:
    """For the progress bar only: a file that cannot be stat'ed (or is not a file) counts 0."""
    try:
        st = os.stat(path)
    except OSError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option("--source", default="local", show_default=True, help="Name of the source these files come from.")
@click.option("--license", "license_", default=None, help="SPDX license id or expression of the data.")
@click.option("--format", "format_", default=None, help="Force a format instead of detecting it.")
@click.option("--max-record-mb", default=32.0, show_default=True, help="Records larger than this are quarantined.")
@click.option("--wait", default=60.0, show_default=True, help="Seconds to wait for another writer to finish.")
@click.option("--flush-mb", default=64.0, show_default=True,
              help="Raw bytes buffered before a Parquet file is written (bounds memory).")
@click.option("--allow-forgotten", is_flag=True,
              help="Take records that a deletion request removed (refused and counted otherwise).")
@click.option("--data", "data", envvar="TRAJWH_DATA", default=None, metavar="URI",
              help="A new warehouse's data files in object storage (s3://bucket/prefix; credentials from "
                   "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_ENDPOINT_URL); the catalog stays in the folder.")
@warehouse_option
@handle_errors
def ingest(paths: tuple[str, ...], source: str, license_: str | None, format_: str | None,
           max_record_mb: float, wait: float, flush_mb: float, allow_forgotten: bool, data: str | None,
           warehouse: str | None) -> None:
    """Ingest trajectory files or folders (JSONL, JSON or Parquet; gzip, zstd, xz and bzip2 read transparently) into raw.
    A path '-' reads standard input (recorded as the file <stdin>)."""
    from trajwh.ingest.raw_store import IngestOptions, ingest_paths
    from trajwh.ingest.reader import find_input_files

    wh = Warehouse(warehouse, data=data)
    opts = IngestOptions(source=source, license=license_, format=format_,
                         max_record_bytes=int(max_record_mb * (1 << 20)), lock_timeout=wait,
                         flush_bytes=max(1, int(flush_mb * (1 << 20))), allow_forgotten=allow_forgotten)
    opts.validate()
    total = sum(_file_size(p) for p in find_input_files([p for p in paths if p != "-"]))
    t0 = time.monotonic()
    with render.byte_progress("ingesting", total) as advance:
        s = ingest_paths(wh, paths, opts, progress=advance)
    dt = time.monotonic() - t0
    c = render.console
    c.print(f"[bold]{s.n_new} new, {s.n_duplicate} already present[/], {s.n_quarantined} quarantined "
            f"— {len(s.files)} files, {render.human_bytes(s.bytes_read)} in {dt:.1f} s "
            f"({render.human_bytes(s.bytes_read / max(dt, 1e-9))}/s)")
    if s.skipped:
        c.print(escape(f"skipped {len(s.skipped)} file(s) that are not trajectories (documentation, images, video): "
                       + ", ".join(Path(p).name for p in s.skipped[:5]) + (" ..." if len(s.skipped) > 5 else "")))
    if s.opted_out:
        c.print("[yellow]opt-outs match new records[/] (kept out of training and release from the next build): "
                + ", ".join(f"{k} {v}" for k, v in sorted(s.opted_out.items())))
    if s.n_forgotten:
        c.print(f"[yellow]{s.n_forgotten} records refused: a deletion request removed them[/] "
                "(trajwh sql \"SELECT request_id, selector, reason FROM deletions\"; --allow-forgotten takes them)")
    if s.quarantine_reasons:
        c.print(escape("quarantined: " + ", ".join(f"{k} ({v})" for k, v in sorted(s.quarantine_reasons.items()))))
        c.print(f"  see: trajwh sql \"SELECT file_path, line_no, reason FROM quarantine WHERE batch_id = '{s.batch_id}'\"")
    for f in (f for f in s.files if f.error):
        c.print(escape(f"  {f.path}: {f.error}"), highlight=False)
    if s.recorded:
        c.print(f"batch {s.batch_id} in {wh.root}; next: [bold]trajwh build[/]")
    else:
        c.print(f"nothing new in {wh.root}: no batch recorded")
    if s.nothing_ingested:
        why = ("no input files were found" if not s.files else
               f"{s.n_forgotten} records were forgotten before" if s.n_forgotten and not s.n_quarantined else
               "every record was quarantined: " + ", ".join(f"{k} ({v})" for k, v in s.quarantine_reasons.items()))
        render.err_console.print(f"[bold red]nothing ingested:[/] {why}")
        sys.exit(1)


# --- build -------------------------------------------------------------------------------------


@main.command()
@click.option("--full", is_flag=True, help="Rebuild every batch, not only those whose adapters changed.")
@click.option("--scope", type=click.Choice(["episode", "repository", "dataset"]), default="episode", show_default=True,
              help="Where one sensitive value keeps one placeholder.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="trajwh.toml to use (else $TRAJWH_CONFIG, <warehouse>/trajwh.toml, ./trajwh.toml).")
@click.option("--cutoff", default=None, metavar="DATE|none",
              help="Split cutoff: evaluation holds only tasks (issue and generation) after it. Overrides the config.")
@click.option("--fractions", default=None, metavar="TRAIN,VALID,TEST", help="Requested split shares, e.g. 0.8,0.1,0.1.")
@click.option("--whole-repository", is_flag=True, default=None,
              help="Put every repository in one group (the most conservative split).")
@click.option("--engine", type=click.Choice(ENGINES), default=None,
              help="What runs the global graph steps (LSH banding, components of the near-duplicate and grouping graphs): "
                   "duckdb in-process, or daft (docs/scale.md). Engines give identical tables. Overrides the config.")
@click.option("--select", "select", default=None, metavar="SELECTION",
              help="Only these assets, in Dagster's syntax: splits, group:curated, +fragments, packs+ "
                   "(their inputs must be built).")
@click.option("--batch", "batch", default=None, metavar="BATCH_ID",
              help="Only the per-batch assets (normalized, redacted, episode features) of this ingest batch: a run "
                   "of its Dagster partition, beside runs of other batches. Then `trajwh build` does the rest.")
@click.option("--force", is_flag=True,
              help="Run the graph (and its checks) even when nothing changed since the last whole build.")
@click.option("--ephemeral", is_flag=True,
              help="Do not record the run in the warehouse's Dagster instance (<warehouse>/_dagster, what "
                   "`trajwh ui` shows); about 1 s faster.")
@warehouse_option
@handle_errors
def build(full: bool, scope: str, config_path: str | None, cutoff: str | None, fractions: str | None,
          whole_repository: bool | None, engine: str | None, select: str | None, batch: str | None, force: bool,
          ephemeral: bool, warehouse: str | None) -> None:
    """(Re)materialize the derived layers through the Dagster graph, in-process, with the
    settings of trajwh.toml (docs/config.md) and the overrides given here. When nothing a build
    reads changed since the last whole build whose checks passed (data, catalog, settings, code,
    environment: lineage/build_state.py), it says the warehouse is up to date and starts nothing."""
    from trajwh.pipelines.settings import with_overrides
    from trajwh.redaction.vault import load_key
    from trajwh.schemas.config import load_settings

    wh = Warehouse(warehouse)
    wh.require()
    if load_key() is None:
        render.err_console.print("[yellow]note:[/] no vault key ($TRAJWH_VAULT_KEY / $TRAJWH_VAULT_KEY_FILE): "
                                 "the redacted layer is built, but the vault (placeholder -> value) is not written; "
                                 "a later build with a key writes it for these batches")
    # validate the file and the overrides before anything runs: a bad key fails here, clearly
    settings = with_overrides(load_settings(config_path, wh.root), cutoff=cutoff, fractions=fractions,
                              whole_repository=whole_repository, engine=engine)
    render.console.print(f"settings: {settings.source or 'defaults'} (digest {settings.digest()})")
    t0 = time.monotonic()
    curate = {"cutoff": cutoff, "fractions": fractions, "whole_repository": whole_repository, "engine": engine}
    if select and batch:
        raise ConfigError("--select and --batch cannot be combined",
                          valid="--batch BATCH_ID (its per-batch assets), or --select SELECTION")
    if not (full or select or batch or force) and _report_up_to_date(wh, scope, curate, config_path, t0):
        return
    from trajwh.pipelines.definitions import build as run_build
    from trajwh.pipelines.definitions import resolve_selection, unbuilt_upstream, warehouse_instance

    only = None
    if select:
        only, added = resolve_selection(select)
        render.console.print(f"selected: {', '.join(only)}" + (f" ({', '.join(added)} built with them: one step)"
                                                               if added else ""))
        for warning in unbuilt_upstream(wh, only):
            render.console.print(f"[yellow]warning:[/yellow] {warning}")
    instance = None if ephemeral else warehouse_instance(wh.root)
    result = run_build(str(wh.root), full=full, scope=scope, config=config_path, instance=instance, only=only,
                       curate=curate, batch=batch)
    print_build(result, time.monotonic() - t0)
    if batch is None:
        print_split_summary(wh)


def _report_up_to_date(wh: Warehouse, scope: str, curate: dict, config_path: str | None, t0: float) -> bool:
    """When the warehouse is what a build would make of it: say so (and since which run), record
    the build in ``runs`` as one that had nothing to do, show the splits, and answer True."""
    import uuid

    from trajwh.lineage.build_state import build_inputs_digest, build_params, up_to_date
    from trajwh.lineage.catalog import now_utc
    from trajwh.lineage.rebuild import run_row

    last = up_to_date(wh, build_inputs_digest(wh, build_params(scope, curate), config_path))
    if last is None:
        return False
    row = run_row(str(uuid.uuid4()), "build", now_utc(), params={"up_to_date": True, **build_params(scope, curate)},
                  counts={"materialized": [], "up_to_date_since": last["run_id"]}, code_version="")
    with wh.write_session("build") as session:
        session.upsert_rows("runs", [row])
    render.console.print(f"up to date: nothing a build reads changed since build run {last['run_id']} "
                         f"({last['finished_at']}); --force runs the graph and its checks anyway")
    render.console.print(f"build run {row['run_id']} finished in {time.monotonic() - t0:.1f} s")
    print_split_summary(wh)
    return True


def _shown(v: Any) -> str:
    """A metadata value in one line (a Markdown document, the data card, by its size only; a
    table schema by its number of columns)."""
    if hasattr(v.value, "columns"):
        return f"({len(v.value.columns)} columns)"
    text = str(v.value)
    return f"({text.count(chr(10)) + 1} lines of Markdown)" if "\n" in text else text


def print_build(result: Any, seconds: float) -> None:
    """One line per asset (a per-batch asset once, with its batches: Dagster records one
    materialization per batch of the run, with the same metadata), then the checks."""
    c = render.console
    batches: dict[str, set[str]] = {}
    firsts = []
    for mat in result.get_asset_materialization_events():
        key = mat.asset_key.to_user_string()
        if key not in batches:
            firsts.append(mat)
        batches.setdefault(key, set()).add(mat.partition)
    for mat in firsts:
        md = mat.materialization.metadata
        key = mat.asset_key.to_user_string()
        n = len(batches[key] - {None})
        c.print(f"  [green]✓[/] {key}{f' ({n} batches)' if n > 1 else ''}: " + escape(
                ", ".join(f"{k.replace('dagster/row_count', 'rows')}={_shown(v)}" for k, v in md.items()
                          if k == "dagster/row_count" or not k.startswith("dagster/"))), emoji=False)
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


def print_split_summary(wh: Warehouse) -> None:
    """Requested vs realized split shares, with the reasons and loud warnings (the audit's)."""
    from trajwh.dedup.audit import audit_cached

    if not wh.manifest_query("SELECT count(*) FROM table_files WHERE table_name = 'splits'").column(0)[0].as_py():
        return
    a = audit_cached(wh)
    parts = [f"{r['split']} {r['episodes']} ({r['realized'] if r['realized'] is not None else r['share']:.1%}"
             + (f" of {r['requested']:.0%} asked)" if r["requested"] is not None else ")") for r in a["splits"]]
    render.console.print("splits: " + ", ".join(parts))
    for note in a["notes"]:
        render.console.print(escape(f"  - {note}"))
    for warning in a["warnings"]:
        render.err_console.print(f"[bold red]WARNING:[/] {escape(warning)}")


def print_fragment_context(f: dict[str, Any]) -> None:
    """The phases of a recovery and the context choice of a fragment, step by step."""
    c = render.console
    for phase, step_ids in orjson.loads(f["phases"] or "{}").items():
        c.print(f"  phase {phase}: {len(step_ids)} step(s) {', '.join(s[:8] for s in step_ids)}")
    reasons = orjson.loads(f["context_reasons"] or "{}")
    c.print(f"  context: {len(f['context_step_ids'])} step(s), {f['context_chars']:,} characters (input only)")
    for sid in f["context_step_ids"]:
        c.print(escape(f"    {sid[:12]}  {reasons.get(sid, '')}"))
    for sid, why in orjson.loads(f["context_dropped"] or "{}").items():
        c.print(escape(f"    dropped {sid[:12]}  {why}"))
    c.print(f"  trained span: {len(f['span_step_ids'])} step(s), loss on the model's own tokens")


# --- sql ---------------------------------------------------------------------------------------


@main.command()
@click.argument("query")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json", "parquet"]), default="table",
              show_default=True)
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="Write the result to FILE (DuckDB's COPY: streamed, any size; csv when --format is table).")
@click.option("--max-rows", default=50, show_default=True, help="Rows shown in table format.")
@click.option("--max-width", default=40, show_default=True,
              help="Characters shown per cell in table format (longer values end with ...; 0: no limit, folded).")
@click.option("--restricted", is_flag=True,
              help="Also open the restricted zone: restricted.episodes, restricted.steps, restricted.raw_records "
                   "(with payloads), ... They hold unredacted data: keep results inside the restricted zone.")
@warehouse_option
@handle_errors
def sql(query: str, fmt: str, out: str | None, max_rows: int, max_width: int, restricted: bool,
        warehouse: str | None) -> None:
    """Run read-only SQL against the catalog (a view per table: see docs/sql.md). Safe by default:
    episodes and steps are the redacted tables; raw_records and quarantine show no bytes."""
    import shutil
    import tempfile

    import duckdb

    wh = Warehouse(warehouse)
    if restricted:
        render.err_console.print("[yellow]restricted zone:[/] restricted.* holds unredacted data")
    if fmt == "parquet" and out is None:
        raise ConfigError("--format parquet needs --out FILE", valid="--out result.parquet")
    fmt = "csv" if fmt == "table" and out is not None else fmt
    try:
        if fmt == "table":
            data = wh.user_query(query, restricted=restricted)
            render.console.print(render.arrow_table(data, max_rows=max_rows, max_width=max_width))
        elif out is not None:  # recorded: a deletion request writes it again (lineage/exports.py)
            from trajwh.lineage.exports import run_export

            rows = run_export(wh, "sql", {"query": query, "restricted": restricted, "out": out, "fmt": fmt})
            render.err_console.print(f"wrote {rows} rows to {out}")
        else:  # csv or json lines on standard output: the same COPY, through a private file
            with tempfile.TemporaryDirectory(prefix="trajwh-sql-") as tmp:
                part = os.path.join(tmp, f"result.{fmt}")
                wh.user_query(query, restricted=restricted, out=part, fmt=fmt)
                sys.stdout.flush()
                with open(part, "rb") as f:
                    shutil.copyfileobj(f, sys.stdout.buffer)
                sys.stdout.flush()
    except duckdb.Error as exc:
        if object_store_problem(exc) is not None:  # handle_errors says what the store's refusal means
            raise
        render.err_console.print(f"[bold red]query failed:[/] {escape(str(exc))}")
        if not restricted and re.search(r"restricted|payload|normalized/|raw/", str(exc)):
            render.err_console.print("the unredacted tables (restricted.episodes, restricted.steps, restricted.raw_records "
                                     "with payloads, ...) open with --restricted (docs/sql.md)")
        sys.exit(2)


# --- status and trace --------------------------------------------------------------------------


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.option("--formats", is_flag=True, help="Per input format: files, records, episodes, steps, quarantined, "
                                              "the share of model steps with an action kind, authors, verdicts.")
@warehouse_option
@handle_errors
def status(as_json: bool, formats: bool, warehouse: str | None) -> None:
    """Rows per layer and table, recent batches and runs, quarantine counts by reason."""
    from trajwh.lineage.status import format_status, warehouse_status

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
    c.print(f"[bold]warehouse[/] {st['warehouse']}" + (f"  [bold]data[/] {st['data']}" if st["data"] != st["warehouse"] else ""))
    c.print(render.dict_table(st["tables"], "tables"))
    c.print(render.dict_table(st["batches"], "last batches"))
    c.print(render.dict_table(st["runs"], "last runs"))
    c.print(render.dict_table(st["quarantine"], "quarantine by reason"))
    from trajwh.pipelines.cli_licenses import print_license_report

    print_license_report(st["licenses"])


@main.command()
@click.argument("ident")
@warehouse_option
@handle_errors
def trace(ident: str, warehouse: str | None) -> None:
    """Walk back from a fragment id, step id, trajectory key or record id to the raw record it came
    from; PACK_ID:OFFSET traces one packed token to its segment, step, characters and raw record."""
    from trajwh.lineage.trace import trace as do_trace
    from trajwh.packing.trace import parse_token_ref

    c = render.console
    ref = parse_token_ref(ident)
    if ref:
        from trajwh.packing.trace import trace_token

        tt = trace_token(Warehouse(warehouse), *ref)
        s = tt.segment
        c.print(escape(f"token {tt.pack_id}:{tt.offset} = {tt.token} {tt.token_text!r}  position {tt.position}  "
                       f"{'trained (loss)' if tt.trained else 'masked (input only)'}  split {tt.split}"))
        c.print(escape(f"  segment {s['fragment_id']} ({s['kind']}) tokens {s['start']}..{s['end']}"
                       + (f", context steps cut {len(s['removed_step_ids'])}" if s["removed_step_ids"] else "")))
        if tt.field == "template":
            c.print(f"  template scaffolding of step {tt.step_id} ({tt.role}/{tt.author})")
        else:
            c.print(escape(f"  step {tt.step_id} {tt.role}/{tt.author}, field {tt.field}, characters "
                           f"{tt.char_start}..{tt.char_end} of the redacted text"))
        if tt.lineage is None:
            return
        t = tt.lineage
    else:
        t = do_trace(Warehouse(warehouse), ident)
    if t.fragment:
        f = t.fragment
        c.print(f"[bold]fragment[/] {f['fragment_id']}  {f['kind']}  steps {f['start_step']}..{f['end_step']} "
                f"(context from {f['context_start']}; {len(f['step_ids'])} steps)  split {f['split']}  weight "
                f"{render.fmt(f['dedup_weight'])}  rules {f['_transform_version'].split(';')[1]}\n  why: {f['selection_reason']}")
        c.print(f"  evidence {f['evidence_source']} (confidence {f['confidence']:.3f}), verdict reward "
                f"{render.fmt(f['verdict_reward'])}, progress {render.fmt(f['progress_score'])}"
                f"{'' if f['trainable'] else ', a control: never trained'}")
        print_fragment_context(f)
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
        unit = {"parquet": "row", "zip": "sample"}.get(r["compression"] or "", "line")
        where = f"{unit} {r['line_no']}" if r["line_no"] is not None else "whole file"
        how = (" (its rows rendered as JSON lines: offsets in that rendering)" if unit == "row"
               else " (an Inspect .eval archive's samples rendered as JSON lines with its header: offsets in that "
                    "rendering)" if unit == "sample"
               else f" ({r['compression']}, offsets decompressed)" if r["compression"] else "")
        c.print(f"[bold]raw record[/] {r['record_id']}\n  file {r['file_path']} {where}, byte offset "
                f"{r['byte_offset']}, {r['byte_length']} bytes{how}"
                f"\n  format {r['format']}, source {r['source']}, license {r['license'] or '∅'}")
    if t.batch:
        b = t.batch
        c.print(f"[bold]batch[/] {b['batch_id']} committed {render.fmt(b['committed_at'])}")
    for e in t.edges:
        c.print(escape(f"  edge {e['child_table']}:{e['child_id']} ← {e['parent_table']}:{e['parent_id']} "
                       f"[{e['transform']}@{e['transform_version']}, run {e['run_id']}]"))


# --- export ------------------------------------------------------------------------------------


@main.command()
@click.option("--format", "fmt", type=click.Choice(["native", "atif", "hf"]), default="native", show_default=True,
              help="native / atif: one JSONL file; hf: Parquet shards per split with a TRL-style messages column.")
@click.option("--layer", type=click.Choice(["redacted", "normalized"]), default="redacted", show_default=True,
              help="normalized holds unredacted data: export it only inside the restricted zone (not with hf).")
@click.option("--where", default=None, help="SQL filter on the episodes, e.g. \"harness_name = 'swe-agent'\".")
@click.option("--out", required=True, type=click.Path(), help="JSONL file (.gz compresses); a folder for hf.")
@click.option("--unit", type=click.Choice(["episodes", "fragments"]), default="episodes", show_default=True,
              help="hf: whole episodes, or the trainable fragments (context + trained span, with a trained flag per message).")
@click.option("--split", "splits", multiple=True, type=click.Choice(["train", "valid", "test", "held_out"]),
              help="hf: the splits to write (repeatable; default train, valid and test).")
@click.option("--overwrite", is_flag=True, help="hf: replace what OUT holds.")
@click.option("--eligible-only", is_flag=True,
              help="Leave out the episodes the license policy or an opt-out does not allow for release "
                   "(otherwise the export is refused and says why).")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="trajwh.toml whose [licenses] policy is in force (else the usual places).")
@warehouse_option
@handle_errors
def export(fmt: str, layer: str, where: str | None, out: str, unit: str, splits: tuple[str, ...], overwrite: bool,
           eligible_only: bool, config_path: str | None, warehouse: str | None) -> None:
    """Write episodes as native JSONL or ATIF (one episode per line), or as Hugging Face-shaped Parquet
    (--format hf). Only episodes allowed for release leave the warehouse (docs/licenses.md)."""
    from trajwh.lineage.exports import run_export

    wh = Warehouse(warehouse)
    if fmt == "hf":
        if layer != "redacted":
            raise ConfigError("--format hf exports the redacted layer only", valid="--layer redacted (the default)")
        with render.count_progress(f"exporting {unit}") as advance:
            s = run_export(wh, "hf", {"out": out, "unit": unit, "splits": list(splits or ("train", "valid", "test")),
                                      "where": where, "eligible_only": eligible_only, "config_path": config_path,
                                      "overwrite": overwrite}, progress=advance)
        render.console.print(f"wrote {', '.join(f'{k} {v}' for k, v in s.rows.items()) or 'nothing'} ({unit}) to {out}/data"
                             + (f"; {s.left_out} episodes not allowed for release left out" if s.left_out else "")
                             + f"\nload: datasets.load_dataset(\"parquet\", data_dir=\"{out}/data\")")
        return
    if layer == "normalized":
        render.err_console.print("[yellow]warning:[/] the normalized layer is not redacted; keep this export "
                                 "inside the restricted zone")
    with render.count_progress("exporting") as advance:
        n = run_export(wh, "episodes", {"fmt": fmt, "out": out, "layer": layer, "where": where,
                                        "eligible_only": eligible_only, "config_path": config_path}, progress=advance)
    render.console.print(f"wrote {n} episodes as {fmt} to {out}")


# the other command groups register themselves on `main`
from trajwh.pipelines import (  # noqa: E402, F401
    cli_curation,
    cli_demo,
    cli_forget,
    cli_licenses,
    cli_packing,
    cli_redaction,
)

if __name__ == "__main__":
    main()
