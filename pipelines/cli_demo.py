"""`trajwh ui`, `synth`, `demo` and `schema`."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import click
from trajwh.lineage.catalog import Warehouse
from trajwh.pipelines import render
from trajwh.pipelines.cli import handle_errors, main, print_build, warehouse_option

# --- ui, synth, demo, schema -------------------------------------------------------------------


@main.command()
@click.option("--port", default=3000, show_default=True)
@warehouse_option
@handle_errors
def ui(port: int, warehouse: str | None) -> None:
    """Start the Dagster web UI on 127.0.0.1."""
    wh = Warehouse(warehouse)
    from trajwh.pipelines.definitions import DAGSTER_DIR, warehouse_instance

    warehouse_instance(wh.root)  # its dagster.yaml (telemetry off), as the CLI builds write it
    env = {**os.environ, "TRAJWH_WAREHOUSE": str(wh.root), "DAGSTER_HOME": str(wh.root / DAGSTER_DIR)}
    # `dagster dev` says it is superseded by `dg dev`, which needs the repository's pyproject.toml
    # ([tool.dg]); this command serves an installed package as well, so it keeps `dagster dev`
    quiet = "ignore:Function `dev_command` is superseded"
    env["PYTHONWARNINGS"] = ",".join(w for w in (env.get("PYTHONWARNINGS"), quiet) if w)
    exe = Path(sys.executable).with_name("dagster")
    cmd = [str(exe) if exe.exists() else "dagster", "dev", "-m", "trajwh.pipelines.definitions",
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
    from trajwh.synth.generator import SynthConfig, generate_corpus

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
    from trajwh.lineage.status import warehouse_status
    from trajwh.pipelines.definitions import build as run_build
    from trajwh.synth.generator import SynthConfig, generate_corpus

    wh = Warehouse(warehouse)
    t0 = time.monotonic()
    with render.count_progress("generating corpus", episodes) as advance:
        generate_corpus(SynthConfig(episodes=episodes, seed=seed), corpus, progress=advance)
    from trajwh.pipelines.definitions import warehouse_instance

    result = run_build(str(wh.root), include_ingest=True, instance=warehouse_instance(wh.root), job="demo",
                       ingest_config={"paths": [str(Path(corpus).resolve())], "source": "synthetic",
                                      "license": "CC-BY-4.0"})
    print_build(result, time.monotonic() - t0)
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
                              (SELECT count(DISTINCT trajectory_key) FROM leak_flags WHERE kind = 'fix_after_cutoff')
                                  AS fixed_after,
                              (SELECT string_agg(kind || ' ' || n, ', ' ORDER BY kind) FROM
                                  (SELECT kind, count(*) AS n FROM fragments GROUP BY 1)) AS fragments,
                              (SELECT string_agg(eligibility || ' ' || n, ', ' ORDER BY eligibility) FROM
                                  (SELECT eligibility, count(*) AS n FROM eligibility GROUP BY 1)) AS eligibility""").to_pylist()[0]
    c.print(f"redactions    {more['replacements']:>10,}\nnear-dup clusters {more['dup_clusters']:>6,} (of 2 or more "
            f"episodes)\n"
            f"task groups   {more['groups']:>10,}\nsplits        {more['splits']}\n"
            f"time leaks    {more['leaky']:>10,} episodes saw the future in a step; {more['fixed_after']:,} "
            f"fixed after the cutoff\neligibility   {more['eligibility']} "
            f"(trajwh licenses)\nfragments     {more['fragments']}")
    from trajwh.pipelines.cli_packing import print_pack_sets

    print_pack_sets(wh)
    c.print(f"warehouse     {wh.root}\ncatalog       {wh.catalog_path}")
    card = wh.root / "card" / "card.html"
    if card.exists():
        c.print(f"data card     {card} (and README.md, card.json beside it; trajwh card)")
    c.print("query it:     trajwh sql \"SELECT harness_name, policy_name, avg(resolved::INT) AS success, "
            "count(*) AS n FROM episodes GROUP BY ALL ORDER BY success DESC\"")
    c.print("              trajwh status  |  trajwh trace <step_id>  |  trajwh trace <pack_id>:<token>  |  "
            "trajwh export-packs --split train --format parquet --out DIR  |  trajwh ui  |  docs/sql.md")


@main.command()
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="Write to FILE instead of stdout.")
def schema(out: str | None) -> None:
    """Print the JSON Schema of the native trajectory format."""
    from trajwh.schemas.native import NativeEpisode

    text = json.dumps(NativeEpisode.model_json_schema(), indent=2) + "\n"
    if out:
        Path(out).write_text(text)
    else:
        click.echo(text, nl=False)
