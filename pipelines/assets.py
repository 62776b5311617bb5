"""The asset graph: ``raw_records -> episodes, steps``. Bodies only call library functions."""

# no `from __future__ import annotations`: Dagster reads these annotations at runtime

import dagster as dg

from ingest.normalize import normalize_warehouse
from ingest.raw_store import IngestOptions, ingest_paths
from pipelines.render import count_progress
from pipelines.resources import WarehouseResource


class IngestConfig(dg.Config):
    """What ``raw_records`` ingests: by default the warehouse's ``landing/`` folder."""

    paths: list[str] = []
    source: str = "landing"
    license: str | None = None
    format: str | None = None


class BuildConfig(dg.Config):
    full: bool = False  # rebuild every batch, not only those whose adapter or schema changed


def landing_dir(warehouse: WarehouseResource) -> str:
    return str(warehouse.get().root / "landing")


@dg.asset(group_name="raw", description="Append-only raw records exactly as received, one batch per ingest.")
def raw_records(context: dg.AssetExecutionContext, config: IngestConfig,
                warehouse: WarehouseResource) -> dg.MaterializeResult:
    wh = warehouse.get()
    paths = config.paths or [landing_dir(warehouse)]
    for p in paths:
        if p == landing_dir(warehouse):
            wh.root.joinpath("landing").mkdir(parents=True, exist_ok=True)
    opts = IngestOptions(source=config.source, license=config.license, format=config.format,
                         lock_timeout=warehouse.lock_timeout)
    with count_progress("ingesting files") as advance:
        s = ingest_paths(wh, paths, opts, run_id=context.run_id,
                         on_files=lambda files: advance.set_total(len(files)))
    return dg.MaterializeResult(metadata={
        "batch_id": s.batch_id, "files": len(s.files), "new": s.n_new, "already_present": s.n_duplicate,
        "quarantined": s.n_quarantined, "bytes": dg.MetadataValue.int(s.bytes_read)})


@dg.multi_asset(
    specs=[
        dg.AssetSpec("episodes", deps=[raw_records], group_name="normalized",
                     description="Canonical episodes with trajectory keys and lineage."),
        dg.AssetSpec("steps", deps=[raw_records], group_name="normalized",
                     description="Canonical steps (messages, tool calls, observations) with lineage."),
    ],
    can_subset=False,
)
def normalized(context: dg.AssetExecutionContext, config: BuildConfig, warehouse: WarehouseResource):
    with count_progress("normalizing records") as advance:
        s = normalize_warehouse(warehouse.get(), run_id=context.run_id, full=config.full,
                                lock_timeout=warehouse.lock_timeout, progress=advance,
                                on_plan=advance.set_total)
    common = {"batches_built": s.batches_done, "batches_unchanged": s.batches_skipped,
              "quarantined": s.quarantined}
    yield dg.MaterializeResult(asset_key="episodes", metadata={**common, "episodes_built": s.episodes})
    yield dg.MaterializeResult(asset_key="steps", metadata={**common, "steps_built": s.steps})
