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

from pathlib import Path as _Path
from typing import Any

# The subpackages (trajwh.lineage, trajwh.pipelines, ...) live in the repository's top-level
# folders; an installed distribution maps them under this package (pyproject.toml
# [tool.setuptools.package-dir]). Run from a source checkout that is not installed, the
# checkout's root is searched as well, so the same names resolve to the same files.
_SOURCE_ROOT = _Path(__file__).resolve().parent.parent
if (_SOURCE_ROOT / "pyproject.toml").is_file() and (_SOURCE_ROOT / "lineage" / "__init__.py").is_file():
    __path__.append(str(_SOURCE_ROOT))  # noqa: F821 (the package's own search path)

__all__ = ["WarehouseHandle", "open"]


def __getattr__(name: str) -> Any:
    # loaded on first use, so importing trajwh.lineage (or a worker's module) does not import
    # the API and everything it reaches
    if name in __all__:
        from trajwh import api

        return getattr(api, name)
    raise AttributeError(f"module 'trajwh' has no attribute {name!r}")
