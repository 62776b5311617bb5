"""Arrow schemas derived from the row models, so a table's shape is written down once.

Mapping: ``str`` -> string, ``int`` -> int64 (``Int32`` / ``Int8`` -> int32 / int8), ``float`` -> float64, ``bool`` -> bool,
``datetime`` -> timestamp[us, UTC], ``bytes`` -> large_binary (raw payloads can be tens of MB),
``list[X]`` -> list<X>, a nested model -> struct, ``JsonText`` -> string. ``X | None`` is a
nullable column; anything else is declared non-nullable.
"""

from __future__ import annotations

import types
import typing
from datetime import datetime
from functools import cache

import pyarrow as pa
from pydantic import BaseModel
from trajwh.schemas import tables
from trajwh.schemas.errors import ConfigError

_SCALARS: dict[type, pa.DataType] = {
    str: pa.string(),
    int: pa.int64(),
    float: pa.float64(),
    bool: pa.bool_(),
    datetime: pa.timestamp("us", tz="UTC"),
    bytes: pa.large_binary(),
}


def _unwrap_optional(tp: typing.Any) -> tuple[typing.Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise ConfigError(f"unsupported union {tp!r} in a row model", valid="X | None")
        return args[0], True
    return tp, False


def arrow_type(tp: typing.Any) -> pa.DataType:
    """The Arrow type of one (non-optional) annotation."""
    if typing.get_origin(tp) is typing.Annotated:
        width = [m for m in typing.get_args(tp)[1:] if isinstance(m, tables.ArrowWidth)]
        if width:
            return getattr(pa, width[0].name)()
        tp = typing.get_args(tp)[0]
    if tp in _SCALARS:
        return _SCALARS[tp]
    if typing.get_origin(tp) is list:
        (inner,) = typing.get_args(tp)
        inner, _ = _unwrap_optional(inner)
        return pa.list_(arrow_type(inner))
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return pa.struct(_fields_of(tp))
    raise ConfigError(f"no Arrow type for annotation {tp!r}", valid=", ".join(t.__name__ for t in _SCALARS))


def _fields_of(model: type[BaseModel]) -> list[pa.Field]:
    out = []
    for name, info in model.model_fields.items():
        tp, nullable = _unwrap_optional(info.annotation)
        out.append(pa.field(info.alias or name, arrow_type(tp), nullable=nullable))
    return out


@cache
def arrow_schema(model: type[BaseModel]) -> pa.Schema:
    """The Arrow schema of a row model, with the schema version in its metadata."""
    return pa.schema(
        _fields_of(model),
        metadata={b"trajwh.schema_version": tables.SCHEMA_VERSION.encode(), b"trajwh.model": model.__name__.encode()},
    )


#: table name -> row model, for every table stored as Parquet
PARQUET_TABLES: dict[str, type[BaseModel]] = {
    "raw_records": tables.RawRecord,
    "quarantine": tables.QuarantineRow,
    "episodes": tables.EpisodeRow,
    "steps": tables.StepRow,
    "lineage_edges": tables.LineageEdgeRow,
    "tool_schemas": tables.ToolSchemaRow,
    "redacted_episodes": tables.EpisodeRow,
    "redacted_steps": tables.StepRow,
    "redaction_events": tables.RedactionEventRow,
    "redacted_tool_schemas": tables.ToolSchemaRow,
    "episode_features": tables.EpisodeFeatureRow,
    "near_dup_clusters": tables.NearDupClusterRow,
    "task_groups": tables.TaskGroupRow,
    "splits": tables.SplitRow,
    "leak_flags": tables.LeakFlagRow,
    "outcomes": tables.OutcomeRow,
    "task_stats": tables.TaskStatsRow,
    "fragments": tables.FragmentRow,
    "packs": tables.PackRow,
    "pack_tokens": tables.PackTokenRow,
    # token chunks rendered ahead of the layouts (a pack_tokens partition run alone): the next packs build takes them
    "pack_tokens_staged": tables.PackTokenRow,
    "license_facts": tables.LicenseFactRow,
    "eligibility": tables.EligibilityRow,
}

#: table name -> columns written without a dictionary: a pack's token columns, whose dictionary
#: (ids of a vocabulary of about 150,000) costs more to build than it saves (packs of the scale
#: benchmark: 12.5 M tokens written in 0.61 s with dictionaries, 0.33 s without; smaller files)
PLAIN_COLUMNS: dict[str, frozenset[str]] = {"pack_tokens": frozenset({"input_ids", "loss_mask"}),
                                             "pack_tokens_staged": frozenset({"input_ids", "loss_mask"})}

#: table name -> layer folder
TABLE_LAYERS: dict[str, str] = {
    "raw_records": "raw",
    "quarantine": "raw",
    "episodes": "normalized",
    "steps": "normalized",
    "lineage_edges": "lineage",
    "tool_schemas": "normalized",
    "redacted_episodes": "redacted",
    "redacted_steps": "redacted",
    "redaction_events": "redacted",
    "redacted_tool_schemas": "redacted",
    "episode_features": "curated",
    "near_dup_clusters": "curated",
    "task_groups": "curated",
    "splits": "curated",
    "leak_flags": "curated",
    "outcomes": "curated",
    "task_stats": "curated",
    "fragments": "fragments",
    "packs": "packed",
    "pack_tokens": "packed",
    "pack_tokens_staged": "packed",
    "license_facts": "curated",
    "eligibility": "curated",
}

#: tables kept inside catalog.duckdb itself (small metadata)
CATALOG_TABLES: dict[str, type[BaseModel]] = {
    "batches": tables.BatchRow,
    "ingested_files": tables.IngestedFileRow,
    "runs": tables.RunRow,
    "deletions": tables.DeletionRow,
    "opt_outs": tables.OptOutRow,
    "opt_out_matches": tables.OptOutMatchRow,
    "opt_out_scans": tables.OptOutScanRow,
    "exports": tables.ExportRow,
}

#: layers that hold secrets: owner-only permissions (ARCHITECTURE.md section 1)
RESTRICTED_LAYERS = frozenset({"raw", "normalized"})


def empty_table(table: str) -> pa.Table:
    model = PARQUET_TABLES.get(table) or CATALOG_TABLES[table]
    return arrow_schema(model).empty_table()
