"""The Python API beside the CLI, in the spirit of ``dlt.pipeline()``::

    import trajwh

    wh = trajwh.open("warehouse")              # or $TRAJWH_WAREHOUSE, else ./warehouse
    wh.ingest(["runs/"], source="team-a", license="MIT")
    wh.build()                                  # the Dagster graph, recorded in <warehouse>/_dagster
    wh.sql("SELECT harness_name, count(*) FROM episodes GROUP BY 1")   # a pyarrow Table (redacted names)
    con = wh.connect()                          # a read-only DuckDB connection, any working directory
    wh.trace("3f2a91c0")                        # back to the raw record (a fragment, step, episode or record id)
    wh.export_hf("out/", unit="fragments")      # Hugging Face-shaped Parquet, releasable episodes only

Each method is the library function the CLI calls, so both behave the same (docs/api.md).
"""

from __future__ import annotations

from trajwh.api import WarehouseHandle, open

__all__ = ["WarehouseHandle", "open"]
