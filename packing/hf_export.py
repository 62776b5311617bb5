"""`trajwh export --format hf`: episodes or fragments as Hugging Face-shaped Parquet with a
TRL-style ``messages`` column, one shard set per split.

Layout: ``DIR/data/{split}-{k:05d}-of-{n:05d}.parquet`` (``valid`` is written as ``validation``, the
name ``datasets`` maps to its validation split), so ``datasets.load_dataset("parquet",
data_dir=DIR + "/data")`` finds the splits by file name; ``DIR/manifest.json`` lists files and counts.

A message is ``{role, content, tool_calls, tool_call_id}`` with roles as the packed layer renders
them (``packing.render.role_of``: model steps are ``assistant``, environment and tool output
``tool``, the system prompt ``system``, anything else ``user``); a tool call is ``{id, type:
"function", function: {name, arguments}}`` with the arguments as the JSON string the model emitted
(a model that wrote its calls in its text has them in its ``content`` only, as it wrote them).
Episode rows carry ``trajectory_key``, ``split``, ``dedup_weight``, ``cluster_id``, outcome and
cause, task, repository, harness and policy, and ``tools`` (the function schemas the model was
shown, JSON). Fragment rows (``unit="fragments"``) carry the fragment's kind and span, its
messages (context, then the span) and ``trained``: per message, whether it is a model message of
the trained span (what a trainer puts the loss on).

Only the redacted layer is read, and only episodes allowed for release leave (the same rule and
refusal as ``trajwh export``: ``licenses.eligibility.not_releasable``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from trajwh.lineage.catalog import Warehouse, now_utc
from trajwh.lineage.storage import write_bytes_atomic
from trajwh.packing.render import (
    arguments_json,
    rendered_calls,
    role_of,
    step_content,
    trained_step,
)
from trajwh.schemas.errors import ConfigError

HF_EXPORT_VERSION = "1.1.0"  # 1.1: calls a model wrote in its text stay in its text (no tool_calls); a simulated user is a user
UNITS = ("episodes", "fragments")
SPLIT_FILE_NAMES = {"train": "train", "valid": "validation", "test": "test", "held_out": "held_out"}

_CALL = pa.struct([("id", pa.string()), ("type", pa.string()),
                   ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())]))])
MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string()), ("tool_calls", pa.list_(_CALL)),
                     ("tool_call_id", pa.string())])
_COMMON = [("trajectory_key", pa.string()), ("split", pa.string()), ("dedup_weight", pa.float64()),
           ("cluster_id", pa.string()), ("outcome", pa.string()), ("cause", pa.string()), ("task_id", pa.string()),
           ("repository", pa.string()), ("harness", pa.string()), ("policy", pa.string()), ("tools", pa.string()),
           ("messages", pa.list_(MESSAGE))]
SCHEMAS = {
    "episodes": pa.schema(_COMMON),
    "fragments": pa.schema([("fragment_id", pa.string()), ("kind", pa.string()), ("start_step", pa.int64()),
                            ("end_step", pa.int64()), *_COMMON, ("trained", pa.list_(pa.bool_()))]),
}


def to_messages(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Steps (in order) as TRL-style chat messages."""
    out = []
    for k, s in enumerate(steps):
        role = role_of(s)
        calls = [{"id": c.get("id") or f"call_{k}_{j}", "type": "function",
                  "function": {"name": c.get("name"), "arguments": arguments_json(c)}}
                 for j, c in enumerate(rendered_calls(s))] if role == "assistant" else []
        out.append({"role": role, "content": step_content(s), "tool_calls": calls or None,
                    "tool_call_id": s.get("tool_call_id") if role == "tool" else None})
    return out


@dataclass
class HfExportSummary:
    out: Path
    unit: str
    rows: dict[str, int] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    left_out: int = 0  # episodes not allowed for release, left out (eligible_only)
    keys: set[str] = field(default_factory=set)  # the episodes written (the exports registry records them)


_EPISODES_SQL = """
    SELECT e.trajectory_key, e.task_id, e.repository, e.harness_name AS harness, e.policy_name AS policy,
           e.tool_schema_digest, s.split, c.weight AS dedup_weight, c.cluster_id, o.outcome, o.cause
    FROM redacted_episodes e JOIN splits s USING (trajectory_key)
    LEFT JOIN near_dup_clusters c USING (trajectory_key) LEFT JOIN outcomes o USING (trajectory_key)
    WHERE s.split = ? {where} ORDER BY e.trajectory_key"""
_FRAGMENTS_SQL = """
    SELECT f.fragment_id, f.kind, f.start_step, f.end_step, f.step_ids, f.span_step_ids, e.trajectory_key, e.task_id,
           e.repository, e.harness_name AS harness, e.policy_name AS policy, e.tool_schema_digest, f.split,
           f.dedup_weight, c.cluster_id, o.outcome, o.cause
    FROM fragments f JOIN redacted_episodes e USING (trajectory_key)
    LEFT JOIN near_dup_clusters c USING (trajectory_key) LEFT JOIN outcomes o USING (trajectory_key)
    WHERE f.trainable AND f.split = ? {where} ORDER BY e.trajectory_key, f.fragment_id"""


def _rows(wh: Warehouse, unit: str, split: str, where: str, exclude: set[str], tools: dict[str, str]) -> Iterator[dict]:
    sql = (_EPISODES_SQL if unit == "episodes" else _FRAGMENTS_SQL).format(
        where=f"AND e.trajectory_key IN (SELECT trajectory_key FROM redacted_episodes WHERE {where})" if where else "")
    for batch in wh.stream(sql, [split], batch_rows=500):
        batch = [r for r in batch if r["trajectory_key"] not in exclude]
        keys = sorted({r["trajectory_key"] for r in batch})
        steps: dict[str, list[dict]] = {}
        for s in wh.query("SELECT * FROM redacted_steps WHERE list_contains(?, trajectory_key) "
                          "ORDER BY trajectory_key, step_index", [keys]).to_pylist():
            steps.setdefault(s["trajectory_key"], []).append(s)
        for r in batch:
            mine = steps.get(r["trajectory_key"], [])
            r["tools"] = tools.get(r.pop("tool_schema_digest") or "")
            if unit == "episodes":
                r["messages"] = to_messages(mine)
            else:
                by_id = {s["step_id"]: s for s in mine}
                chosen = [by_id[i] for i in r.pop("step_ids") if i in by_id]
                span = set(r.pop("span_step_ids"))
                r["messages"] = to_messages(chosen)
                r["trained"] = [trained_step(s, span) for s in chosen]
            yield r


def _write_shard(rows: list[dict], schema: pa.Schema, work: Path, name: str, shards: int,
                 summary: HfExportSummary) -> None:
    k = sum(f.startswith(f"data/{name}-") for f in summary.files)
    path = work / "data" / f"{name}-{k:05d}-of-{shards:05d}.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, compression="zstd")
    summary.files.append(str(path.relative_to(work)))


def export_hf(wh: Warehouse, out: str | Path, *, unit: str = "episodes", splits: tuple[str, ...] = ("train", "valid", "test"),
              where: str | None = None, eligible_only: bool = False, policy_digest: str | None = None,
              rows_per_shard: int = 5_000, overwrite: bool = False,
              progress: Callable[[int], None] | None = None) -> HfExportSummary:
    """Write the splits' episodes (or trainable fragments) as HF-shaped Parquet shards in ``out``."""
    from trajwh.ingest.export import check_filter
    from trajwh.licenses.eligibility import releasable_only
    from trajwh.packing.layer import tools_by_digest

    if unit not in UNITS:
        raise ConfigError(f"unknown export unit {unit!r}", valid=", ".join(UNITS))
    bad = [s for s in splits if s not in SPLIT_FILE_NAMES]
    if bad:
        raise ConfigError(f"unknown split(s) {bad}", valid=", ".join(SPLIT_FILE_NAMES))
    wh.require()
    need = ["redacted_episodes", "splits"] + (["fragments"] if unit == "fragments" else [])
    missing = [t for t in need if not wh.manifest_query("SELECT count(*) FROM table_files WHERE table_name = ?", [t]).column(0)[0].as_py()]
    if missing:
        raise ConfigError(f"{', '.join(missing)} not built in {wh.root}", valid="run `trajwh build` first")
    check_filter(wh, "redacted_episodes", where)
    blocked = releasable_only(wh, where, policy_digest, eligible_only)
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ConfigError(f"{out} exists and is not empty", valid="an empty or new folder, or --overwrite")
    work = out / f".partial-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    (work / "data").mkdir(parents=True)
    tools = {d: json.dumps(t, ensure_ascii=False) for d, t in tools_by_digest(wh).items()}
    summary = HfExportSummary(out, unit, left_out=len(blocked))
    schema = SCHEMAS[unit]
    for split in splits:
        table = "fragments f" if unit == "fragments" else "splits s"
        count_sql = (f"SELECT count(*) FROM {table} WHERE {'f.trainable AND f' if unit == 'fragments' else 's'}.split = ?"
                     + (f" AND trajectory_key IN (SELECT trajectory_key FROM redacted_episodes WHERE {where})" if where else "")
                     + " AND NOT list_contains(?, trajectory_key)")
        total = wh.query(count_sql, [split, sorted(blocked)]).column(0)[0].as_py()
        if not total:
            continue
        shards = math.ceil(total / rows_per_shard)
        name = SPLIT_FILE_NAMES[split]
        buf: list[dict] = []
        for r in _rows(wh, unit, split, where or "", set(blocked), tools):
            buf.append(r)
            summary.keys.add(r["trajectory_key"])
            if progress:
                progress(1)
            if len(buf) >= rows_per_shard:
                _write_shard(buf, schema, work, name, shards, summary)
                buf = []
        if buf:
            _write_shard(buf, schema, work, name, shards, summary)
        summary.rows[split] = total
    manifest = {"export_version": HF_EXPORT_VERSION, "unit": unit, "created_at": now_utc().isoformat(),
                "rows": summary.rows, "files": summary.files, "left_out_not_releasable": summary.left_out,
                "load": 'datasets.load_dataset("parquet", data_dir="<DIR>/data")'}
    write_bytes_atomic(json.dumps(manifest, indent=2).encode(), work / "manifest.json", restricted=False)
    for old in ([p for p in out.iterdir() if p != work] if out.exists() else []):
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    for p in work.iterdir():
        p.rename(out / p.name)
    work.rmdir()
    return summary
