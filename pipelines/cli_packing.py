"""`trajwh pack`, `verify-packs`, `export-packs`: the packed token layer from the command line."""

from __future__ import annotations

import sys
import time
from typing import Any

import click
from rich.markup import escape
from trajwh.lineage.catalog import Warehouse
from trajwh.pipelines import render
from trajwh.pipelines.cli import handle_errors, main, print_build, warehouse_option

_PACK_OPTIONS = [
    click.option("--tokenizer", default=None, help="qwen2.5, cl100k, or a Hugging Face tokenizer folder "
                 "(tokenizer.json + tokenizer_config.json with a chat_template). Default: [packing] of trajwh.toml."),
    click.option("--seq-len", type=int, default=None, help="Tokens per packed sequence (default 8192)."),
    click.option("--policy", type=click.Choice(["drop", "truncate-context", "split"]), default=None,
                 help="Fragments longer than a sequence (default drop)."),
    click.option("--dedup", type=click.Choice(["representative", "weighted", "all"]), default=None,
                 help="Which near-duplicates are packed (default representative)."),
    click.option("--packer", type=click.Choice(["min-slack", "best-fit-decreasing", "first-fit"]), default=None,
                 help="Bin packing algorithm (default min-slack)."),
]


def pack_options(fn: Any) -> Any:
    for opt in reversed(_PACK_OPTIONS):
        fn = opt(fn)
    return fn


def print_pack_sets(wh: Warehouse, pack_set: str | None = None) -> None:
    """Per pack set and split: sequences, tokens, trainable tokens, efficiency."""
    if not wh.manifest_query("SELECT count(*) FROM table_files WHERE table_name = 'packs'").column(0)[0].as_py():
        return
    rows = wh.query("""
        SELECT pack_set, split_part(any_value(tokenizer_id), '@', 1) AS tokenizer, any_value(seq_len) AS seq_len,
               split, count(*) AS sequences, sum(n_tokens) AS tokens, sum(n_trainable) AS trainable,
               round(sum(n_tokens) / (count(*) * any_value(seq_len)), 4) AS efficiency
        FROM packs WHERE ? IS NULL OR pack_set = ? GROUP BY pack_set, split ORDER BY pack_set, split""",
                    [pack_set, pack_set]).to_pylist()
    render.console.print(render.dict_table(rows, "packs"))


@main.command()
@pack_options
@click.option("--full", is_flag=True, help="Rebuild the pack set even if its inputs did not change.")
@click.option("--batch", "batch", default=None, metavar="ID",
              help="Only render and tokenize this ingest batch's units, ahead of the layouts (its pack_tokens "
                   "partition): staged, and taken by the next `trajwh pack` or `trajwh build`.")
@warehouse_option
@handle_errors
def pack(tokenizer: str | None, seq_len: int | None, policy: str | None, dedup: str | None, packer: str | None,
         full: bool, batch: str | None, warehouse: str | None) -> None:
    """Render, tokenize and pack the trainable fragments per split (the `pack_tokens` and `packs` assets,
    through Dagster). Another tokenizer or configuration makes a new pack set beside the others."""
    from trajwh.packing.layer import pack_set_id
    from trajwh.packing.tokenizers import get_tokenizer
    from trajwh.pipelines.definitions import build as run_build
    from trajwh.pipelines.settings import pack_config
    from trajwh.schemas.config import load_settings

    wh = Warehouse(warehouse)
    wh.require()
    overrides = {"tokenizer": tokenizer, "seq_len": seq_len, "policy": policy, "dedup": dedup, "packer": packer}
    cfg = pack_config(load_settings(None, wh.root), **overrides)  # fails here, clearly, on a bad value
    tok = get_tokenizer(cfg.tokenizer)
    if not wh.manifest_query("SELECT count(*) FROM table_files WHERE table_name = 'fragments'").column(0)[0].as_py():
        render.err_console.print("[bold red]no fragments yet:[/] run [bold]trajwh build[/] first")
        sys.exit(1)
    t0 = time.monotonic()
    from trajwh.pipelines.definitions import warehouse_instance

    if batch is not None and full:
        raise click.UsageError("--batch stages one batch's tokens; --full rebuilds the whole set: not both")
    result = run_build(str(wh.root), only=["pack_tokens"] if batch else ["pack_tokens", "packs"], full=full,
                       instance=warehouse_instance(wh.root), job="pack", batch=batch,
                       pack={k: v for k, v in overrides.items() if v is not None})
    print_build(result, time.monotonic() - t0)
    if batch is not None:
        render.console.print(f"batch {batch}: its token chunks staged for pack set {pack_set_id(cfg, tok)}; "
                             "the next `trajwh pack` or `trajwh build` takes them")
        return
    ps = pack_set_id(cfg, tok)
    render.console.print(f"pack set {ps}: tokenizer {tok.id}")
    print_pack_sets(wh, ps)


@main.command("verify-packs")
@click.option("--pack-set", default=None, help="One pack set (default: every set).")
@click.option("--no-secrets", is_flag=True, help="Skip the secret re-scan of the decoded text.")
@warehouse_option
@handle_errors
def verify_packs_cmd(pack_set: str | None, no_secrets: bool, warehouse: str | None) -> None:
    """Check packs against the layers they came from: round trip to the rendered fragment, trained
    tokens = the span's model text, no split mixing, layouts that agree with the token rows, no secret in the decoded text."""
    from trajwh.packing.verify import verify_packs, violations

    wh = Warehouse(warehouse)
    wh.require()
    sets = [pack_set] if pack_set else wh.query("SELECT DISTINCT pack_set FROM packs ORDER BY 1").column(0).to_pylist()
    if not sets:
        render.err_console.print("[bold red]no packs:[/] run [bold]trajwh pack[/] first")
        sys.exit(1)
    bad = 0
    for ps in sets:
        with render.count_progress(f"verifying {ps}") as advance:
            r = verify_packs(wh, ps, scan_secrets=not no_secrets, progress=advance)
        n = violations(r)
        bad += n
        mark = "[green]✓[/]" if n == 0 else "[red]✗[/]"
        render.console.print(f"{mark} {ps}: {r['packs']} packs, {r['segments']} segments, {r['tokens']:,} tokens; "
                             + ", ".join(f"{k} {v}" for k, v in r.items() if k.endswith("_violations")))
        for e in r["examples"]:
            render.console.print(escape(f"    {e['check']}: {e['pack_id']} {e['fragment_id']}: {e['why']}"))
    if bad:
        sys.exit(1)


@main.command("export-packs")
@click.option("--split", required=True, help="train, valid or test.")
@click.option("--format", "fmt", type=click.Choice(["parquet", "megatron"]), default="parquet", show_default=True)
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Folder (new or empty).")
@click.option("--pack-set", default=None, help="Default: the only set, else the configured one.")
@click.option("--overwrite", is_flag=True, help="Replace an existing export in OUT.")
@warehouse_option
@handle_errors
def export_packs_cmd(split: str, fmt: str, out: str, pack_set: str | None, overwrite: bool,
                     warehouse: str | None) -> None:
    """Write one split of a pack set for a trainer: Parquet shards (input_ids, labels, position_ids,
    cu_seqlens, fragment_ids) or a Megatron indexed dataset (.bin/.idx + loss-mask and boundary
    sidecars), with manifest.json (tokenizer and template ids, counts, efficiency, fragment ids)."""
    from trajwh.lineage.exports import run_export

    wh = Warehouse(warehouse)
    with render.count_progress(f"exporting {split}") as advance:
        s = run_export(wh, "packs", {"split": split, "fmt": fmt, "out": out, "pack_set": pack_set,
                                     "overwrite": overwrite}, progress=advance)
    render.console.print(f"wrote {s.sequences:,} sequences ({s.tokens:,} tokens, {s.trainable:,} trained, efficiency "
                         f"{s.efficiency:.3f}) of pack set {s.pack_set} as {fmt} to {out}:")
    for f in s.files:
        render.console.print(f"  {f}")
