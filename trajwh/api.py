"""``trajwh.open(path)``: one warehouse, its operations as methods (thin: each calls the library
function the CLI calls)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from trajwh.lineage.catalog import Warehouse


class WarehouseHandle:
    """A warehouse directory (created by the first ``ingest``)."""

    def __init__(self, path: str | os.PathLike[str] | None = None):
        self.warehouse = Warehouse(path)

    @property
    def root(self) -> Path:
        return self.warehouse.root

    def __repr__(self) -> str:
        return f"trajwh.open({self.warehouse.replica_of or str(self.root)!r})"

    def ingest(self, paths: Sequence[str | os.PathLike[str]] | str | os.PathLike[str], *, source: str = "local",
               license: str | None = None, format: str | None = None, **options: Any) -> Any:
        """Ingest files or folders into a new batch of raw records (``IngestSummary``)."""
        from trajwh.ingest.raw_store import IngestOptions, ingest_paths

        if isinstance(paths, str | os.PathLike):
            paths = [paths]
        return ingest_paths(self.warehouse, list(paths),
                            IngestOptions(source=source, license=license, format=format, **options))

    def build(self, *, full: bool = False, config: str | None = None, record: bool = True, **kwargs: Any) -> Any:
        """Materialize the derived layers through the Dagster graph (``record``: in the warehouse's
        Dagster instance, as ``trajwh build`` does). Raises on a failed step or blocking check."""
        from trajwh.pipelines.definitions import build, warehouse_instance

        instance = warehouse_instance(self.root) if record else None
        return build(str(self.root), full=full, config=config, instance=instance, **kwargs)

    def sql(self, query: str, *, restricted: bool = False, out: str | os.PathLike[str] | None = None,
            fmt: str = "parquet") -> pa.Table | int:
        """One read-only query, as ``trajwh sql`` runs it (safe names; ``restricted`` opens the
        unredacted tables as ``restricted.*``): a pyarrow Table, or with ``out`` the result
        streamed to that file by DuckDB's COPY (``fmt``: csv, json or parquet) and the rows written."""
        if out is None:
            return self.warehouse.user_query(query, restricted=restricted)
        from trajwh.lineage.exports import run_export

        return run_export(self.warehouse, "sql", {"query": query, "restricted": restricted, "out": os.fspath(out),
                                                  "fmt": fmt})

    def connect(self) -> duckdb.DuckDBPyConnection:
        """A read-only DuckDB connection to the catalog with the warehouse as its file search
        path, so the views resolve from any working directory. It sees the catalog's own names
        (``episodes`` and ``steps`` are the normalized, secret-bearing tables): prefer ``sql()``."""
        self.warehouse.require()
        return self.warehouse.connect(read_only=True)

    def trace(self, ident: str) -> Any:
        """Walk back from a fragment, step, episode or record id (a ``Trace``), or from
        ``PACK_ID:OFFSET`` (a token trace) to the raw record."""
        from trajwh.lineage.trace import trace
        from trajwh.packing.trace import parse_token_ref, trace_token

        ref = parse_token_ref(ident)
        return trace_token(self.warehouse, *ref) if ref else trace(self.warehouse, ident)

    def impact(self, selector: str) -> Any:
        """What a forget of ``selector`` would touch, per layer (read only)."""
        from trajwh.lineage.impact import impact

        return impact(self.warehouse, selector)

    def status(self) -> dict[str, Any]:
        from trajwh.lineage.status import warehouse_status

        return warehouse_status(self.warehouse)

    def card(self, out: str | os.PathLike[str] | None = None, *, split: str | None = None) -> Any:
        """Write the data card (README.md, card.json, card.html); returns where."""
        from trajwh.datacards.card import build_card
        from trajwh.lineage.exports import run_export

        if out is None:  # <warehouse>/card: rewritten by every build and forget
            return build_card(self.warehouse, out, split=split, force=True)
        return run_export(self.warehouse, "card", {"out": os.fspath(out), "split": split})

    def export_hf(self, out: str | os.PathLike[str], *, unit: str = "episodes",
                  splits: Sequence[str] = ("train", "valid", "test"), where: str | None = None,
                  eligible_only: bool = False, config: str | None = None, overwrite: bool = False,
                  progress: Any = None) -> Any:
        """Hugging Face-shaped Parquet (``trajwh.packing.hf_export.export_hf``), recorded in the
        ``exports`` table like ``trajwh export --format hf`` (a forget writes it again)."""
        from trajwh.lineage.exports import run_export

        return run_export(self.warehouse, "hf", {"out": os.fspath(out), "unit": unit, "splits": list(splits),
                                                 "where": where, "eligible_only": eligible_only,
                                                 "config_path": config, "overwrite": overwrite}, progress=progress)


def open(path: str | os.PathLike[str] | None = None) -> WarehouseHandle:  # the API's name, as dlt's pipeline()
    """The warehouse at ``path`` (else ``$TRAJWH_WAREHOUSE``, else ``./warehouse``)."""
    return WarehouseHandle(path)

