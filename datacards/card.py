"""``trajwh card`` and the ``data_card`` asset: collect, render, write; skipped when nothing it
reads changed since the card in ``out`` was written."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from trajwh.datacards.plots import warm_plots
from trajwh.datacards.render import write_card
from trajwh.datacards.stats import CARD_SCHEMA_VERSION, collect_card, policy_of
from trajwh.lineage.catalog import DAGSTER_DIR, Warehouse
from trajwh.lineage.rebuild import inputs_fingerprint
from trajwh.schemas import ids

#: the tables the card reads (their files' digests, with the catalog rows below, decide a rebuild)
CARD_INPUTS = ["raw_records", "quarantine", "redacted_episodes", "redaction_events", "near_dup_clusters", "splits",
               "task_groups", "leak_flags", "outcomes", "task_stats", "fragments", "packs", "license_facts",
               "eligibility"]
DEFAULT_DIR = "card"


@dataclass
class CardResult:
    out: Path
    files: dict[str, Path]
    skipped: bool


def withdraw_cards(wh: Warehouse, keep: set[str] = frozenset()) -> list[dict[str, str]]:
    """Delete the warehouse's own cards (``<warehouse>/card`` and ``card-SPLIT``): after a forget
    they count episodes that are gone; the next build (or ``trajwh card``) writes them again. One
    entry per card withdrawn, as a forget lists its exports. ``keep``: paths of recorded exports
    (a ``card --out`` into the folder is written again by the forget, not withdrawn)."""
    import shutil

    out = []
    for folder in sorted(wh.root.glob(f"{DEFAULT_DIR}*")):
        if str(folder) in keep or str(folder.resolve()) in keep:
            continue
        if folder.is_dir() and (folder.name == DEFAULT_DIR or folder.name.startswith(DEFAULT_DIR + "-")):
            shutil.rmtree(folder)
            out.append({"kind": "card", "path": str(folder), "status": "withdrawn",
                        "note": "written again by the next `trajwh build` or `trajwh card`"})
    return out


#: the data card's asset: builds before 2026-12-07 recorded the card's text as its materialization's
#: metadata ("card"), a copy of the card in the warehouse's Dagster instance
CARD_ASSET = "data_card"
#: how an event log names a markdown metadata value (the card's text; no other metadata is
#: markdown): its serialized class, under its older name and its current one
_CARD_TEXT = (b"MarkdownMetadataEntryData", b"MarkdownMetadataValue")


def withdraw_card_copies(warehouse: str | os.PathLike[str]) -> list[dict[str, str]]:
    """The copies of the data card in the warehouse's Dagster instance, withdrawn with the card by a
    forget (``datacards.card.withdraw_cards``): the runs whose ``data_card`` materialization holds
    the card's text are deleted with their event logs (the catalog's ``runs`` table keeps their ids,
    times and counts), the asset's index forgets its last materialization, and the storage files
    are vacuumed, so the deleted rows leave no bytes in free pages. One entry per run deleted."""
    import sqlite3

    from trajwh.schemas.errors import ConfigError

    home = Path(warehouse) / DAGSTER_DIR
    if not (home / "dagster.yaml").exists() or not any(
            any(m in data for m in _CARD_TEXT) for p in sorted(home.glob("history/**/*.db*")) if p.is_file()
            and (data := p.read_bytes())):
        return []  # (no card's text in any storage file: Dagster is not even loaded)
    import dagster as dg
    from trajwh.pipelines.definitions import warehouse_instance

    instance = warehouse_instance(warehouse)
    key, runs, cursor = dg.AssetKey(CARD_ASSET), set(), None
    try:
        while True:
            page = instance.fetch_materializations(key, limit=1_000, cursor=cursor)
            runs |= {r.run_id for r in page.records
                     if r.asset_materialization is not None and "card" in r.asset_materialization.metadata}
            if not page.has_more:
                break
            cursor = page.cursor
        for run_id in sorted(runs):
            instance.delete_run(run_id)
        if runs:
            instance.wipe_assets([key])  # (its last materialization is kept in the asset index)
    finally:
        instance.dispose()
    if not runs:
        return []
    shards = home / "history" / "runs"
    for run_id in runs:  # a deleted run's own event log file, now empty
        for suffix in (".db", ".db-wal", ".db-shm"):
            (shards / f"{run_id}{suffix}").unlink(missing_ok=True)
    # the run storage and the event log's index, where the deleted rows were
    for db in sorted([*home.glob("history/*.db"), *shards.glob("index.db")]):
        try:
            con = sqlite3.connect(db, timeout=30)
            try:
                con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                con.execute("VACUUM")  # a new file without the free pages the deletes left
            finally:
                con.close()
        except sqlite3.OperationalError as exc:
            raise ConfigError(f"the Dagster storage file {db} could not be vacuumed ({exc}): the rows a forget deleted "
                              "may stay in its free pages", valid="stop `trajwh ui` (it holds the file), then run "
                              "`trajwh forget --resume`") from exc
    return [{"kind": "dagster_run", "path": str(shards / f"{r}.db"), "status": "deleted",
             "note": "a copy of the data card in its event log; the catalog's runs table keeps the run"} for r in sorted(runs)]


def card_inputs(wh: Warehouse, split: str | None) -> str:
    rows = wh.query("""SELECT (SELECT string_agg(request_id || status, ',' ORDER BY request_id) FROM deletions) AS d,
                              (SELECT string_agg(opt_out_id || status, ',' ORDER BY opt_out_id) FROM opt_outs) AS o,
                              (SELECT string_agg(batch_id, ',' ORDER BY batch_id) FROM batches) AS b""").to_pylist()[0]
    return ids.digest([CARD_SCHEMA_VERSION, split, inputs_fingerprint(wh, CARD_INPUTS), rows["d"], rows["o"],
                       rows["b"]])[:16]


def build_card(wh: Warehouse, out: str | Path | None = None, *, split: str | None = None,
               force: bool = False, license_policy: dict | None = None) -> CardResult:
    """Write ``card.json``, ``README.md`` and ``card.html`` to ``out`` (default ``<warehouse>/card``,
    or ``card-SPLIT`` for one split)."""
    wh.require()
    out = Path(out) if out else wh.root / (DEFAULT_DIR + (f"-{split}" if split else ""))
    files = {"json": out / "card.json", "markdown": out / "README.md", "html": out / "card.html"}
    if license_policy is None:
        license_policy = policy_of(wh)
    key = card_inputs(wh, split) + ids.digest([license_policy])[:8]
    stamp = out / ".inputs"
    if not force and all(p.exists() for p in files.values()) and stamp.exists() and stamp.read_text() == key:
        return CardResult(out, files, skipped=True)
    # matplotlib (for the plots) imported in a thread while the card's queries run outside the GIL
    # (its import is about 0.35 s of the card's 1.7 s in an incremental build at 108,070 episodes)
    with ThreadPoolExecutor(1) as pool:
        warm = pool.submit(warm_plots)
        card = collect_card(wh, split, license_policy)
        warm.result()
    files = write_card(card, out)
    stamp.write_text(key)
    return CardResult(out, files, skipped=False)
