"""Normalize: raw records -> canonical ``episodes`` and ``steps`` (+ lineage edges), per batch.

Each committed ingest batch is normalized on its own and replaced as a unit, so the work is
incremental (a batch whose rows already carry the current adapter and schema versions is
skipped) and replayable (bumping an adapter's version, or ``full=True``, regenerates the rows
from ``raw`` and the new rows record the new version). Output files of a batch are swapped in
one catalog commit: readers see the old rows or the new ones, never a mix.

A record whose adapter rejects it, or whose episode is already in the warehouse under the
same trajectory key from another record, goes to ``quarantine`` with stage ``normalize``; the
rest of the batch goes on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from trajwh.ingest.actions import annotate_step
from trajwh.ingest.adapters.base import ParsedEpisode, RecordContext
from trajwh.ingest.adapters.registry import adapters, get_adapter
from trajwh.ingest.raw_store import quarantine_row
from trajwh.ingest.sessions import find_parts, find_superseded
from trajwh.ingest.test_output import parse_test_output
from trajwh.ingest.truncation import truncation
from trajwh.lineage.catalog import Warehouse, WriteSession, now_utc, write_table_file
from trajwh.lineage.parallel import (
    PARALLEL_MIN_ITEMS,
    ordered_chunks,
    workers_wanted,
    workers_within,
)
from trajwh.lineage.rebuild import chosen_batches, mark_running, run_row
from trajwh.lineage.storage import WrittenFile
from trajwh.schemas import ids
from trajwh.schemas.arrow import arrow_schema
from trajwh.schemas.errors import ConfigError, InputFormatError, WarehouseBusyError
from trajwh.schemas.repository import normalize_repository
from trajwh.schemas.tables import (
    SCHEMA_VERSION,
    EpisodeRow,
    LineageEdgeRow,
    QuarantineRow,
    StepRow,
    ToolSchemaRow,
)
from trajwh.schemas.values import bad_value

NORMALIZE_VERSION = "1.0.4"  # 1.0.4: an episode whose model steps are all empty is quarantined (no_content); 1.0.1: action kinds of smolagents (python_interpreter, final_answer) and of code given as plain-text arguments; 1.0.2: of Trae Agent and codex exec tools, and of commands wrapped in bash -lc; 1.0.3: browser-use actions (browse; done a submit), a ReAct action's argument as its object, an MCP tool's name read without its server (developer__shell)
FLUSH_STEPS = 20_000
FLUSH_QUARANTINE_BYTES = 32 << 20  # quarantined payloads buffered before a write
_RAW_COLUMNS = ["record_id", "source", "license", "file_path", "line_no", "byte_offset", "format", "payload"]
_DERIVED_TABLES = ("episodes", "steps", "lineage_edges", "tool_schemas")


@dataclass
class NormalizeSummary:
    run_id: str
    batches_done: int = 0
    batches_skipped: int = 0
    records: int = 0
    episodes: int = 0
    steps: int = 0
    quarantined: int = 0
    companions: int = 0
    superseded: int = 0  # raw records of a session that a longer copy replaces (ingest/sessions.py)
    quarantine_reasons: dict[str, int] = field(default_factory=dict)
    #: batches a per-batch run marked to build again: they hold a key or tool schema that a batch
    #: committed before them keeps (their next run, or the next build, builds them)
    marked_stale: list[str] = field(default_factory=list)


def batch_transform_version(formats: list[str], facts_digest: str = "") -> str:
    """What the normalized rows of a batch depend on: adapters, schema, normalizer, and the
    companion facts when one of its formats reads them (a new verdict file rebuilds them)."""
    parts, reads_facts = [], False
    for name in sorted(formats):
        try:
            adapter = get_adapter(name)
            parts.append(adapter.tag)
            reads_facts |= adapter.consumes_facts
        except ConfigError:
            parts.append(f"{name}@missing")
    version = ",".join(parts) + f";schema={SCHEMA_VERSION};normalize={NORMALIZE_VERSION}"
    return version + (f";facts={facts_digest}" if reads_facts and facts_digest else "")


class FactIndex:
    """Companion facts of the whole warehouse, by (source, kind, key); later records win."""

    def __init__(self, wh: Warehouse):
        self.index: dict[tuple[str, str, str], dict[str, Any]] = {}
        names = [a.name for a in adapters() if a.companion and a.gives_facts]
        rows = wh.query(
            "SELECT r.record_id, r.source, r.file_path, r.line_no, r.format, r.payload FROM raw_records r "
            "JOIN batches b USING (batch_id) WHERE list_contains(?, r.format) "
            "ORDER BY b.committed_at, r.file_path, r.byte_offset", [names]).to_pylist() if names else []
        self.record_ids = sorted(r["record_id"] for r in rows)
        for r in rows:
            adapter = get_adapter(r["format"])
            ctx = RecordContext(r["record_id"], r["source"], r["file_path"], r["line_no"])
            try:
                triples = adapter.facts(adapter.decode(r["payload"]), ctx)
            except Exception:  # noqa: BLE001 - a broken companion gives no facts; its record stays in raw
                continue
            for kind, key, facts in triples:
                merged = self.index.setdefault((r["source"], kind, key), {})
                for name, value in facts.items():  # one level deep: {"predictions": {sha: ...}} accumulate
                    if isinstance(value, dict) and isinstance(merged.get(name), dict):
                        merged[name] = {**merged[name], **value}
                    else:
                        merged[name] = value
        self.digest = ids.digest(self.record_ids)[:12] if self.record_ids else ""

    def lookup(self, source: str) -> Any:
        return lambda kind, key: self.index.get((source, kind, key), {})


#: records a worker makes into rows at a time (big batches only; lineage.parallel)
_CHUNK_RECORDS = 32
#: a worker's task is a raw file, or a range of one when the batch has fewer files than twice the
#: workers; never fewer records than this
_TASK_RECORDS_MIN = 256
#: a normalize worker at most: libraries, its raw file streamed, up to ``FLUSH_STEPS`` steps' rows
#: held as Arrow before a write (measured at 20,000 episodes: 288-327 MB)
_WORKER_MB = 350


def _facts_lookup(index: dict) -> Callable[[str], Any]:
    return lambda source: (lambda kind, key: index.get((source, kind, key), {}))


def _no_model_content(steps: list[dict[str, Any]]) -> str | None:
    """Why an episode's model steps hold nothing (no text, call, command or reasoning in any of
    them), or None. An adapter that meets a newer version of its format, or another harness's lines
    that look like its own, can read every message as empty: that is lost content, not an episode."""
    model = [s for s in steps if s.get("author") == "model"]
    if not model or any(s.get("text") or s.get("tool_calls") or s.get("action_command")
                        or any(k in (s.get("metadata") or "") for k in ('"reasoning"', '"thinking":"')) for s in model):
        return None
    return (f"its {len(model)} model step(s) are all empty (no text, call, command or reasoning): the adapter read "
            "none of their content; another harness's format, or a version of this one it does not know?")


def prepare_record(rec: dict[str, Any], facts: Callable[[str], Any], parts: list[bytes] | None = None) -> tuple:
    """The work on one record that needs nothing but the record (and the facts of companions):
    decode, parse, check values, compute trajectory keys, annotate steps. Runs in worker
    processes for big batches. Returns ``("companion",)``, ``("reject", code, reason)`` or
    ``("ok", adapter, version, [(index, episode or None, key, used, missing, problem), ...])``."""
    ctx = RecordContext(rec["record_id"], rec["source"], rec["file_path"], rec["line_no"], facts(rec["source"]))
    adapter = None
    try:
        adapter = get_adapter(rec["format"])
        if adapter.companion:
            return ("companion",)
        obj = adapter.decode(rec["payload"])
        if parts is not None:  # one session in many files: parse them as one
            obj = adapter.combine([adapter.decode(p) for p in parts])
        parsed = adapter.parse(obj, ctx)
    except (InputFormatError, ConfigError, orjson.JSONDecodeError, UnicodeDecodeError) as exc:
        return ("reject", "invalid_record", str(exc))
    except Exception as exc:  # noqa: BLE001 - an adapter bug must not stop the batch
        name = adapter.name if adapter else rec["format"]
        return ("reject", "adapter_error", f"{name} adapter failed: {type(exc).__name__}: {exc}")
    out = []
    for index, pe in enumerate(parsed):
        problem = bad_value(pe.episode, "episode") or bad_value(pe.steps, "steps") \
            or bad_value(pe.tool_schemas, "tool_schemas")
        if problem:  # a value no table can hold: this episode is quarantined, the batch goes on
            out.append((index, None, None, None, None, problem))
            continue
        empty = None if adapter.exact_schema else _no_model_content(pe.steps)
        if empty:  # the adapter found none of what the model did: never an episode of empty turns
            out.append((index, None, None, None, None, ("no_content", empty)))
            continue
        if pe.tool_schemas and not pe.episode.get("tool_schema_digest"):
            pe.episode["tool_schema_digest"] = ids.digest(pe.tool_schemas["schema_text"])
        key, used, missing = ids.trajectory_key(pe.episode, raw_origin=f"{rec['record_id']}:{index}")
        for step in pe.steps:
            annotate_step(step)
            _read_test_output(step)
            if step.get("author") == "environment":
                cut = truncation(step.get("observation"))
                if cut:
                    step["metadata"] = _with_meta(step.get("metadata"), cut)
        out.append((index, pe, key, used, missing, None))
    return ("ok", adapter.name, adapter.version, out)


#: a chunk table's column naming the row's episode (its ordinal in the chunk): the batch's process
#: keeps or drops whole episodes by it (a duplicate key); never written
_EP = "_ep"
_MODELS = {"episodes": EpisodeRow, "steps": StepRow, "tool_schemas": ToolSchemaRow, "lineage_edges": LineageEdgeRow}
_worker_state: tuple | None = None


@dataclass
class _Chunk:
    """Consecutive raw records made into rows, in a worker process or the batch's own.

    ``verdicts`` per record: ``("deferred",)`` (superseded, or an assembled session: the batch's
    process does it), ``("companion",)``, ``("reject", code, reason)`` or ``("ok", adapter, version,
    [(ordinal or None, index, key, problem, n_steps), ...])``; ``tables``: the rows of every
    episode, with ``_EP``; ``bad``: records whose rows Arrow cannot hold (record id -> reason)."""

    verdicts: list[tuple]
    tables: dict[str, pa.Table]
    bad: dict[str, str]


def build_chunk(recs: list[dict[str, Any]], facts: Callable[[str], Any], batch_id: str, run_id: str,
                defer: set[str] | frozenset[str] = frozenset(), parts: list[bytes] | None = None) -> _Chunk:
    """Decode, parse, check, key and annotate each record (``prepare_record``), then make its
    episodes' rows and Arrow tables: everything that needs only the records. Which episodes are
    kept (a trajectory key already taken) is the batch's process's decision (``_BatchNormalizer``)."""
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in _MODELS}
    owners: dict[str, list[int]] = {name: [] for name in _MODELS}
    episode_record: list[str] = []
    verdicts: list[tuple] = []
    digests: set[str] = set()
    for rec in recs:
        if rec["record_id"] in defer:
            verdicts.append(("deferred",))
            continue
        prepared = prepare_record(rec, facts, parts)
        if prepared[0] != "ok":
            verdicts.append(prepared)
            continue
        _, adapter, version, episodes = prepared
        out = []
        for index, pe, key, used, missing, problem in episodes:
            if problem:
                out.append((None, index, key, problem, 0))
                continue
            ordinal = len(episode_record)
            episode_record.append(rec["record_id"])
            _episode_rows(rows, owners, ordinal, rec, adapter, version, index, pe, key, used, missing,
                          {"_batch_id": batch_id, "_run_id": run_id}, digests)
            out.append((ordinal, index, key, None, len(pe.steps)))
        verdicts.append(("ok", adapter, version, out))
    tables, bad = _chunk_tables(rows, owners, episode_record)
    return _Chunk(verdicts, tables, bad)


def _episode_rows(rows: dict[str, list[dict[str, Any]]], owners: dict[str, list[int]], ordinal: int,
                  rec: dict[str, Any], adapter: str, version: str, index: int, pe: ParsedEpisode, key: str,
                  used: list[str], missing: list[str], run: dict[str, str], digests: set[str]) -> None:
    def add(name: str, row: dict[str, Any]) -> None:
        rows[name].append(row)
        owners[name].append(ordinal)

    lineage = {"_record_id": rec["record_id"], **run, "_transform": f"adapter:{adapter}", "_transform_version": version}
    written = pe.episode.get("repository")
    repository = normalize_repository(written, pe.episode.get("instance_id"))
    if written and repository != written:
        pe.episode["metadata"] = _with_meta(pe.episode.get("metadata"), {"repository_as_written": written})
    add("episodes", {**pe.episode, "repository": repository, "trajectory_key": key, "key_fields": used,
                     "key_fields_missing": missing, "source": rec["source"], "license": rec["license"],
                     "format": rec["format"], "n_steps": len(pe.steps), "_record_index": index,
                     "_schema_version": SCHEMA_VERSION, **lineage})
    add("lineage_edges", _edge(key, "episodes", rec["record_id"], "raw_records", lineage))
    digest = pe.episode.get("tool_schema_digest")
    if pe.tool_schemas and digest not in digests:  # once per chunk here, once per warehouse in the batch's process
        digests.add(digest)
        add("tool_schemas", {**pe.tool_schemas, "tool_schema_digest": digest, **lineage})
    for step in pe.steps:  # annotated by prepare_record
        sid = ids.step_id(key, step["step_index"])
        add("steps", {**step, "step_id": sid, "trajectory_key": key, **lineage})
        add("lineage_edges", _edge(sid, "steps", key, "episodes", lineage))


def _chunk_tables(rows: dict[str, list[dict[str, Any]]], owners: dict[str, list[int]], episode_record: list[str]
                  ) -> tuple[dict[str, pa.Table], dict[str, str]]:
    """The rows as Arrow tables with their episode ordinals. The last guard: a record with a row
    Arrow cannot convert is left out whole (its bad rows' reason returned; the record stays in
    ``raw`` and the batch's process quarantines it); the rest of the chunk is kept."""
    bad: dict[str, str] = {}
    for _ in range(2):
        tables = {}
        for name, model in _MODELS.items():
            try:
                tables[name] = pa.Table.from_pylist(rows[name], schema=arrow_schema(model)).append_column(
                    _EP, pa.array(owners[name], type=pa.int32()))
            except (pa.ArrowException, OverflowError, ValueError, TypeError):
                for row, ordinal in zip(rows[name], owners[name], strict=True):
                    try:
                        pa.Table.from_pylist([row], schema=arrow_schema(model))
                    except (pa.ArrowException, OverflowError, ValueError, TypeError) as exc:
                        bad.setdefault(episode_record[ordinal], f"{name}: {type(exc).__name__}: {str(exc)[:300]}")
        if len(tables) == len(_MODELS):
            return tables, bad
        for name in _MODELS:
            keep = [i for i, o in enumerate(owners[name]) if episode_record[o] not in bad]
            rows[name] = [rows[name][i] for i in keep]
            owners[name] = [owners[name][i] for i in keep]
    raise AssertionError("rows still unwritable after their records were left out")


def _init_worker(facts_index: dict, batch_id: str, run_id: str, defer: set[str], root: str,
                 taken: frozenset[str]) -> None:
    global _worker_state
    _worker_state = (_facts_lookup(facts_index), batch_id, run_id, defer, Warehouse(root), taken)


@dataclass
class _Segment:
    """Consecutive records of a worker's task whose rows it wrote itself (files not yet visible):
    every one parsed cleanly and none of their trajectory keys was taken when the worker looked.
    Where they are in the raw file, to build them again in the batch's process when an earlier
    task of the batch took one of the keys meanwhile (``_BatchNormalizer.take_segment``)."""

    path: Any
    start: int
    count: int
    record_ids: list[str]
    verdicts: list[tuple]
    files: list[WrittenFile]
    tool_schemas: pa.Table


def _raw_slice(path: Any, start: int, count: int) -> Iterator[list[dict[str, Any]]]:
    """The records ``start`` to ``start + count`` of a raw file, ``_CHUNK_RECORDS`` at a time, read
    as a stream (a raw file holds up to ingest's ``flush_bytes``, 64 MB, of payloads: read whole
    with its decompression buffers, about 250 MB; streamed, about 130)."""
    seen = 0
    for rb in pq.ParquetFile(path, pre_buffer=False).iter_batches(batch_size=_CHUNK_RECORDS, columns=_RAW_COLUMNS):
        lo, hi = max(start - seen, 0), min(start + count - seen, rb.num_rows)
        seen += rb.num_rows
        if lo < hi:
            yield rb.slice(lo, hi - lo).to_pylist()
        if seen >= start + count:
            return


def _raw_tasks(raw_files: list[Any], workers: int) -> list[tuple[Any, int, int]]:
    """(raw file, first record, records) per worker task: whole files, each cut in equal ranges
    when the batch has fewer files than twice the workers (each range reads its file)."""
    sizes = [(p, n) for p in raw_files if (n := pq.ParquetFile(p).metadata.num_rows)]  # (none: a forget emptied it)
    cuts = -(-2 * workers // max(1, len(sizes)))
    tasks = []
    for path, n in sizes:
        step = -(-n // max(1, min(cuts, n // _TASK_RECORDS_MIN)))
        tasks += [(path, a, min(step, n - a)) for a in range(0, n, step)]
    return tasks


def _clean(chunk: _Chunk) -> list[str] | None:
    """The trajectory keys of a chunk whose every record parsed into writable episodes (``None``
    when one did not: a reject, a companion, a deferred record, a value Arrow cannot hold)."""
    if chunk.bad:
        return None
    keys = []
    for verdict in chunk.verdicts:
        if verdict[0] != "ok" or any(ordinal is None or problem for ordinal, _, _, problem, _ in verdict[3]):
            return None
        keys += [key for _, _, key, _, _ in verdict[3]]
    return keys


def _task_in_worker(tasks: list[tuple[Any, int, int]]) -> list[tuple]:
    """One task's records made into rows (``build_chunk``), in order: runs of clean records whose
    keys are new to this worker are written here, up to ``FLUSH_STEPS`` steps a file
    (``("segment", _Segment)``); any other chunk goes back as rows for the batch's process to decide
    (``("rows", records, chunk)``), as every chunk did before workers wrote."""
    assert _worker_state is not None
    facts, batch_id, run_id, defer, wh, taken = _worker_state
    ((path, start, count),) = tasks
    out: list[tuple] = []
    seen: set[str] = set()
    held: dict[str, list[pa.Table]] = {name: [] for name in _MODELS}
    ids_, verdicts = [], []
    first, steps = 0, 0

    def flush(upto: int) -> None:
        nonlocal first, steps, ids_, verdicts
        if ids_:
            files = [write_table_file(wh, name, pa.concat_tables(held[name]))
                     for name in ("episodes", "steps", "lineage_edges") if any(t.num_rows for t in held[name])]
            schemas = (pa.concat_tables(held["tool_schemas"]) if held["tool_schemas"]
                       else pa.Table.from_pylist([], schema=arrow_schema(ToolSchemaRow)))
            out.append(("segment", _Segment(path, start + first, upto - first, ids_, verdicts, files, schemas)))
        for name in held:
            held[name] = []
        ids_, verdicts, first, steps = [], [], upto, 0

    i = 0
    for recs in _raw_slice(path, start, count):
        chunk = build_chunk(recs, facts, batch_id, run_id, defer)
        keys = _clean(chunk)
        if keys is None or len(set(keys)) < len(keys) or any(k in seen or k in taken for k in keys):
            flush(i)
            out.append(("rows", recs, chunk))
            i = first = i + len(recs)
            seen.update(k for v in chunk.verdicts if v[0] == "ok" for _, _, k, _, _ in v[3] if k)
            continue
        seen.update(keys)
        for name, table in chunk.tables.items():
            if table.num_rows:
                held[name].append(table.drop_columns([_EP]))
        ids_ += [r["record_id"] for r in recs]
        verdicts += chunk.verdicts
        steps += chunk.tables["steps"].num_rows
        i += len(recs)
        if steps >= FLUSH_STEPS:
            flush(i)
    flush(i)
    return out


class _BatchNormalizer:
    def __init__(self, session: WriteSession, batch_id: str, run_id: str, keys: dict[str, str],
                 summary: NormalizeSummary, facts: FactIndex,
                 superseded: dict[str, tuple[str, str, str]] | None = None, parts: dict[str, list[str]] | None = None,
                 schemas_known: set[str] | None = None):
        self.session, self.batch_id, self.run_id, self.facts = session, batch_id, run_id, facts
        self.schemas_known = schemas_known if schemas_known is not None else set()  # tool schema digests stored
        self.kept: dict[str, str] = {}  # trajectory key -> raw record of the episodes this batch keeps
        self.schemas_new: set[str] = set()  # the tool schemas this batch stores
        self.superseded = superseded or {}
        self.parts = parts or {}  # an assembled session's owner record -> all its part records
        self.supersedes: dict[str, list[str]] = {}  # longer record -> the shorter copies it replaces
        for old, (new, _, _) in self.superseded.items():
            self.supersedes.setdefault(new, []).append(old)
        self.keys, self.summary = keys, summary
        self.buffers: dict[str, list[pa.Table]] = {name: [] for name in _MODELS}
        self.buffered_steps = 0
        self.edges: list[dict[str, Any]] = []  # edges made here: the copies an episode supersedes or assembles
        self.quarantine: list[dict[str, Any]] = []
        self.quarantine_bytes = 0
        self.files: list[WrittenFile] = []
        self.wrote_episodes = False

    def run(self, raw_files: list[Path], progress: Callable[[int], None] | None, n_records: int = 0) -> None:
        def records() -> Iterator[dict[str, Any]]:
            for path in raw_files:
                for rb in pq.ParquetFile(path).iter_batches(batch_size=256, columns=_RAW_COLUMNS):
                    yield from rb.to_pylist()

        def chunks() -> Iterator[list[dict[str, Any]]]:
            part: list[dict[str, Any]] = []
            for rec in records():
                part.append(rec)
                if len(part) >= _CHUNK_RECORDS:
                    yield part
                    part = []
            if part:
                yield part

        defer = set(self.superseded) | set(self.parts)
        n_workers = workers_within(workers_wanted(), _WORKER_MB) if n_records >= PARALLEL_MIN_ITEMS else 1
        if n_workers < 2:
            made: Iterator[tuple] = (("rows", recs, build_chunk(recs, self.facts.lookup, self.batch_id, self.run_id, defer))
                                     for recs in chunks())
        else:  # workers read their raw files, make the rows and write the clean ones; which episodes are kept stays here
            made = (item for _, items in ordered_chunks(
                _task_in_worker, _raw_tasks(raw_files, n_workers), chunk=1, workers=n_workers, initializer=_init_worker,
                initargs=(self.facts.index, self.batch_id, self.run_id, defer, str(self.session.wh.root),
                          frozenset(self.keys))) for item in items)
        for item in made:
            if item[0] == "rows":
                self.take(item[1], item[2])
                n = len(item[1])
            else:
                n = self.take_segment(item[1], defer)
            if self.buffered_steps >= FLUSH_STEPS or self.quarantine_bytes >= FLUSH_QUARANTINE_BYTES:
                self.flush()
            if progress:
                progress(n)
        self.flush(final=True)

    def take_segment(self, seg: _Segment, defer: set[str]) -> int:
        """A worker's written records: kept whole, their files committed with the batch's, when none
        of their keys is taken (by an earlier record); else built again here and decided record by
        record (their files are left unlisted: garbage to the next writer)."""
        if any(self.keys.get(key, rid) != rid for rid, v in zip(seg.record_ids, seg.verdicts, strict=True)
               for _, _, key, _, _ in v[3]):
            for part in _raw_slice(seg.path, seg.start, seg.count):
                self.take(part, build_chunk(part, self.facts.lookup, self.batch_id, self.run_id, defer))
            return seg.count
        for rid, verdict in zip(seg.record_ids, seg.verdicts, strict=True):
            self.summary.records += 1
            self._decide({"record_id": rid}, verdict, {})
        self.files += seg.files
        self.wrote_episodes |= any(f.table == "episodes" for f in seg.files)
        self._buffer({"tool_schemas": seg.tool_schemas.append_column(
            _EP, pa.array([0] * seg.tool_schemas.num_rows, type=pa.int32()))}, [0], every=True)
        return seg.count

    def take(self, recs: list[dict[str, Any]], chunk: _Chunk) -> None:
        """Decide each record's episodes in input order (the first record of a trajectory key keeps
        it) and buffer the kept episodes' rows."""
        kept: list[int] = []
        for rec, verdict in zip(recs, chunk.verdicts, strict=True):
            self.summary.records += 1
            if verdict[0] == "deferred":
                if rec["record_id"] in self.superseded:  # a shorter copy of a session: the longer one is the episode
                    self.summary.superseded += 1
                    continue
                # an assembled session: its parts parsed here, as one
                one = build_chunk([rec], self.facts.lookup, self.batch_id, self.run_id,
                                  parts=self._payloads(self.parts[rec["record_id"]]))
                self._buffer(one.tables, self._decide(rec, one.verdicts[0], one.bad))
                continue
            kept += self._decide(rec, verdict, chunk.bad)
        self._buffer(chunk.tables, kept)

    def _decide(self, rec: dict[str, Any], verdict: tuple, bad: dict[str, str]) -> list[int]:
        """The ordinals of the record's episodes that are kept; rejects quarantined."""
        if verdict[0] == "companion":
            self.summary.companions += 1
            return []
        if verdict[0] == "reject":
            self.reject(rec, verdict[1], verdict[2])
            return []
        if rec["record_id"] in bad:  # a value no table can hold (the last guard): the record stays in raw
            self.reject(rec, "unwritable_value", bad[rec["record_id"]], keep_payload=False)
            return []
        _, adapter, version, episodes = verdict
        kept, keys = [], []
        for ordinal, index, key, problem, n_steps in episodes:
            if problem:
                code, said = problem if isinstance(problem, tuple) else ("invalid_value", problem)
                self.reject(rec, code, f"episode {index} of this record: {said}")
                continue
            owner = self.keys.get(key)
            if key in keys or (owner is not None and owner != rec["record_id"]):
                self.reject(rec, "duplicate_episode",
                            f"episode {index} of this record has trajectory key {key}, already built from "
                            f"raw record {owner}; kept the first")
                continue
            self.keys[key] = self.kept[key] = rec["record_id"]
            kept.append(ordinal)
            keys.append(key)
            self.summary.episodes += 1
            self.summary.steps += n_steps
            lineage = {"_run_id": self.run_id, "_transform_version": NORMALIZE_VERSION}
            assembled = set(self.parts.get(rec["record_id"], []))
            for old in self.supersedes.get(rec["record_id"], []):  # shorter copies and other parts stay reachable
                self.edges.append(_edge(key, "episodes", old, "raw_records", {
                    **lineage, "_transform": "assembles" if old in assembled else "supersedes"}))
        return kept

    def _buffer(self, tables: dict[str, pa.Table], kept: list[int], every: bool | None = None) -> None:
        every = tables["episodes"].num_rows == len(kept) if every is None else every
        chosen = pa.array(kept, type=pa.int32())
        for name, table in tables.items():
            if not every:
                table = table.filter(pc.is_in(table.column(_EP), value_set=chosen))
            table = table.drop_columns([_EP])
            if name == "tool_schemas" and table.num_rows:  # once per digest in the warehouse
                first = []
                for i, digest in enumerate(table.column("tool_schema_digest").to_pylist()):
                    if digest not in self.schemas_known:
                        self.schemas_known.add(digest)
                        self.schemas_new.add(digest)
                        first.append(i)
                table = table.take(pa.array(first, type=pa.int64()))
            if table.num_rows:
                self.buffers[name].append(table)
        self.buffered_steps += tables["steps"].num_rows if "steps" in tables else 0

    def _payloads(self, record_ids: list[str]) -> list[bytes]:
        rows = self.session.wh.query("SELECT record_id, payload FROM raw_records WHERE list_contains(?, record_id)",
                                     [record_ids]).to_pylist()
        by_id = {r["record_id"]: r["payload"] for r in rows}
        return [by_id[i] for i in record_ids if i in by_id]

    def reject(self, rec: dict[str, Any], code: str, reason: str, keep_payload: bool = True) -> None:
        payload = rec["payload"] if keep_payload else b""
        self.quarantine_bytes += min(len(payload), 1 << 20) + 512
        self.quarantine.append(quarantine_row(
            batch_id=self.batch_id, run_id=self.run_id, stage="normalize", source=rec["source"],
            file_path=rec["file_path"], line_no=rec["line_no"], offset=rec["byte_offset"], fmt=rec["format"],
            reason_code=code, reason=reason, payload=payload, record_id=rec["record_id"]))
        self.summary.quarantined += 1
        self.summary.quarantine_reasons[code] = self.summary.quarantine_reasons.get(code, 0) + 1

    def flush(self, final: bool = False) -> None:
        write = self.session.write
        if self.edges:
            self.buffers["lineage_edges"].append(pa.Table.from_pylist(self.edges, schema=arrow_schema(LineageEdgeRow)))
        tables = {name: pa.concat_tables(parts) if parts else pa.Table.from_pylist([], schema=arrow_schema(_MODELS[name]))
                  for name, parts in self.buffers.items()}
        if tables["episodes"].num_rows or (final and not self.wrote_episodes):
            # at least one (possibly empty) episodes file per batch marks the batch as built
            self.files.append(write("episodes", tables["episodes"]))
            self.wrote_episodes = True
        for name in ("steps", "lineage_edges", "tool_schemas"):
            if tables[name].num_rows:
                self.files.append(write(name, tables[name]))
        if self.quarantine:  # bounded like good rows: written at every flush, not held to the end
            self.files.append(write("quarantine", pa.Table.from_pylist(self.quarantine, schema=arrow_schema(QuarantineRow))))
            self.quarantine, self.quarantine_bytes = [], 0
        self.buffers = {name: [] for name in _MODELS}
        self.buffered_steps, self.edges = 0, []


def _read_test_output(step: dict[str, Any]) -> None:
    """Per-test results from a runner's output, when the source gave none (ingest/test_output.py)."""
    if step.get("author") != "environment" or step.get("test_results") or not step.get("observation"):
        return
    parsed = parse_test_output(step["observation"])
    if parsed:
        runner, results, summary = parsed
        step["test_results"] = results or None
        step["metadata"] = _with_meta(step.get("metadata"), {"tests_parsed_from": runner, "tests_summary": summary})


def _with_meta(metadata: str | dict | None, extra: dict[str, Any]) -> str:
    current = orjson.loads(metadata) if isinstance(metadata, str) and metadata else metadata or {}
    merged = {**(current if isinstance(current, dict) else {"metadata": current}), **extra}
    return orjson.dumps(merged, option=orjson.OPT_SORT_KEYS).decode()  # as adapters write it (json_text)


def _edge(child: str, child_table: str, parent: str, parent_table: str, lineage: dict[str, str]) -> dict[str, str]:
    return {"child_id": child, "child_table": child_table, "parent_id": parent, "parent_table": parent_table,
            "transform": lineage["_transform"], "transform_version": lineage["_transform_version"],
            "run_id": lineage["_run_id"]}


#: how often a per-batch run builds its batch again when earlier batches commit its keys meanwhile
_ATTEMPTS = 3


class _Overtaken(Exception):
    """An earlier batch committed a trajectory key or tool schema this batch kept (a partition run
    beside others): the batch is built again against what is committed now."""


@dataclass
class _Stored:
    """What batches that are up to date keep: trajectory key -> (raw record, batch's commit rank),
    tool schema digest -> batch's commit rank."""

    keys: dict[str, tuple[str, int]]
    schemas: dict[str, int]

    def before(self, rank: int) -> tuple[dict[str, str], set[str]]:
        """The keys (-> their raw record) and schemas of the batches committed before ``rank``."""
        return ({k: rec for k, (rec, r) in self.keys.items() if r < rank},
                {d for d, r in self.schemas.items() if r < rank})


def _stored(wh: Warehouse, pending: set[str], rank: dict[str, int]) -> _Stored:
    """The keys and tool schemas of the stored batches that are not ``pending`` (to be built). A
    batch that is no longer committed counts as the earliest."""
    keys = {r["trajectory_key"]: (r["_record_id"], rank.get(r["_batch_id"], -1)) for r in wh.query(
        "SELECT trajectory_key, _record_id, _batch_id FROM episodes WHERE NOT list_contains(?, _batch_id)",
        [sorted(pending)]).to_pylist()}
    schemas: dict[str, int] = {}
    if wh.files("tool_schemas"):
        for r in wh.query("SELECT tool_schema_digest, _batch_id FROM tool_schemas WHERE NOT list_contains(?, _batch_id)",
                          [sorted(pending)]).to_pylist():
            r_ = rank.get(r["_batch_id"], -1)
            schemas[r["tool_schema_digest"]] = min(r_, schemas.get(r["tool_schema_digest"], r_))
    return _Stored(keys, schemas)


def _version_of(b: dict[str, Any], facts: FactIndex, by_batch: dict[str, list[str]]) -> str:
    """A batch's normalize version: its formats' adapters and the facts, and the superseded copies
    it holds or supersedes."""
    version = batch_transform_version(orjson.loads(b["formats"]), facts.digest)
    if by_batch.get(b["batch_id"]):  # a copy in this batch was superseded: rebuild it without
        version += f";superseded={ids.digest(sorted(by_batch[b['batch_id']]))[:12]}"
    return version


def _batches_to_build(wh: Warehouse, committed: list[dict[str, Any]], facts: FactIndex,
                      by_batch: dict[str, list[str]], full: bool) -> list[tuple[str, str]]:
    """(batch, version) of every committed batch whose stored rows are not of its version now (all
    with new records if ``full``), in commit order."""
    built = {r["batch_id"]: r["version"] for r in wh.query(
        "SELECT batch_id, any_value(transform_version) AS version FROM table_files "
        "WHERE table_name = 'episodes' GROUP BY batch_id").to_pylist()}
    todo = []
    for b in committed:
        version = _version_of(b, facts, by_batch)
        if b["n_new"] and (full or built.get(b["batch_id"]) != version):
            todo.append((b["batch_id"], version))
    return todo


def _commit_batch(session: WriteSession, worker: _BatchNormalizer, rank: dict[str, int], version: str,
                  run_id: str) -> list[str]:
    """Commit one built batch in place of its earlier output, deciding in the commit's transaction
    against what is committed then: another batch that holds a key or tool schema this one keeps
    is either earlier (``_Overtaken``: nothing is committed) or later, and then marked to build
    again: its normalized, redacted and episode-features files leave the manifest in the same
    transaction (no reader sees a key twice), so the next normalize builds it. Returns the later batches marked."""
    from trajwh.dedup.layer import features_outputs  # (imported here: the later layers load late)
    from trajwh.redaction.layer import redacted_outputs

    batch_id, later = worker.batch_id, []

    def guard(con: Any) -> list[Any]:
        holders: set[str] = set()
        for table, column, values in (("episodes", "trajectory_key", list(worker.kept)),
                                      ("tool_schemas", "tool_schema_digest", sorted(worker.schemas_new))):
            if values:
                holders |= {b for (b,) in con.execute(
                    f"SELECT DISTINCT _batch_id FROM {table} WHERE _batch_id IS DISTINCT FROM ? AND "
                    f"{column} IN (SELECT unnest(?::VARCHAR[]))", [batch_id, values]).fetchall()}
        mine = rank[batch_id]
        earlier = sorted(b for b in holders if rank.get(b, -1) < mine)
        if earlier:
            raise _Overtaken(f"batch {earlier[0]} holds some of them")
        later.extend(sorted(holders, key=lambda b: rank[b]))
        gone = _batch_outputs(session.wh, batch_id, con)  # read in the transaction: a run of the same batch beside
        for b in later:  # out of the manifest (normalized, redacted, features) until built again: nothing held twice
            gone += (_batch_outputs(session.wh, b, con) + redacted_outputs(session.wh, b, con)
                     + features_outputs(session.wh, b, con))
        return gone

    session.commit(worker.files, batch_id=batch_id, run_id=run_id, transform_version=version, guard=guard)
    return later


def _batch_outputs(wh: Warehouse, batch_id: str, con: Any = None) -> list[Path]:
    """The files a previous normalization of this batch wrote (replaced on rebuild); read through
    ``con`` when given (a commit's transaction)."""
    sql = ("SELECT path FROM table_files WHERE batch_id = ? AND coalesce(transform_version, '') LIKE '%;normalize=%' "
           # the redaction stage's versions embed the normalized version they were made from: not ours
           "AND NOT starts_with(coalesce(transform_version, ''), 'redact@') "
           "AND (list_contains(?, table_name) OR table_name = 'quarantine')")
    params = [batch_id, list(_DERIVED_TABLES)]
    paths = wh.query(sql, params).column(0).to_pylist() if con is None else [p for (p,) in con.execute(sql, params).fetchall()]
    return [wh.data / p for p in paths]


def normalize_warehouse(wh: Warehouse, *, run_id: str, full: bool = False, lock_timeout: float = 60.0,
                        progress: Callable[[int], None] | None = None,
                        on_plan: Callable[[int], None] | None = None,
                        batches: Sequence[str] | None = None) -> NormalizeSummary:
    """Build ``episodes`` and ``steps`` for every batch that needs it (all batches if ``full``),
    in commit order.

    A batch keeps an episode whose trajectory key no earlier batch (in commit order) keeps, and a
    tool schema no earlier batch stores. ``batches``: only these (a run of their Dagster
    partitions). Such a run holds the writers' lock shared, so runs of other batches go on beside
    it, and decides against what is committed when it commits (``_commit_batch``): an earlier
    batch that took one of its keys meanwhile makes it build again; a later batch that holds one
    of its keys is marked to build again (its next run, or this run when it builds every batch).
    Any order of partition runs then ends, once each marked batch is built again, with the
    tables one build of every batch gives."""
    summary = NormalizeSummary(run_id)
    started = now_utc()
    with wh.write_session("normalize", timeout=lock_timeout, shared=batches is not None) as session:
        mark_running(session, run_id, "normalize", started)
        facts = FactIndex(wh)
        absorbed, parts = find_parts(wh)
        superseded = {**find_superseded(wh), **absorbed}
        committed = wh.query("SELECT batch_id, formats, n_new FROM batches WHERE status = 'committed' "
                             "ORDER BY committed_at, batch_id").to_pylist()
        rank = {b["batch_id"]: i for i, b in enumerate(committed)}
        n_new = {b["batch_id"]: b["n_new"] for b in committed}
        by_batch: dict[str, list[str]] = {}  # batches whose rows change: the copy dropped, the edges added
        for old, (new, new_batch, old_batch) in superseded.items():
            by_batch.setdefault(old_batch, []).append(old)
            by_batch.setdefault(new_batch, []).append(f"{new}>{old}")
        todo = _batches_to_build(wh, committed, facts, by_batch, full)
        pending = {b for b, _ in todo}  # every batch to build, chosen or not: its stored rows do not count
        summary.batches_skipped = len(committed) - len(todo)
        if batches is not None:
            todo = chosen_batches(wh, todo, batches)
            summary.batches_skipped = len(committed) - len(todo)
        if on_plan:
            on_plan(sum(n_new[bid] for bid, _ in todo))
        stored = _stored(wh, pending, rank) if todo else _Stored({}, {})
        queue, marked = list(todo), []
        here_keys: dict[str, str] = {}  # what the batches this run built keep (all earlier: it builds in commit order)
        here_schemas: set[str] = set()
        while queue:
            batch_id, version = queue.pop(0)
            for attempt in range(_ATTEMPTS):
                if attempt:  # overtaken: what is up to date now
                    pending = {b for b, _ in _batches_to_build(wh, committed, facts, by_batch, full)}
                    stored = _stored(wh, pending | {batch_id}, rank)
                keys, schemas = stored.before(rank[batch_id])
                keys.update(here_keys)
                schemas |= here_schemas
                counts = {**summary.__dict__, "quarantine_reasons": dict(summary.quarantine_reasons)}
                worker = _BatchNormalizer(session, batch_id, run_id, keys, summary, facts, superseded, parts, schemas)
                worker.run(wh.files("raw_records", batch_id=batch_id), progress, n_records=n_new[batch_id])
                try:
                    later = _commit_batch(session, worker, rank, version, run_id)
                except _Overtaken as exc:  # an earlier batch committed a key or schema of this one meanwhile
                    summary.__dict__.update(counts)
                    if attempt + 1 == _ATTEMPTS:
                        raise WarehouseBusyError(f"normalize: batch {batch_id} was overtaken {_ATTEMPTS} times by "
                                                 f"earlier batches committing its keys ({exc})",
                                                 valid="run it again, or build every batch (trajwh build)") from None
                    continue
                break
            here_keys.update(worker.kept)
            here_schemas |= worker.schemas_new
            summary.batches_done += 1
            for b in later:  # they hold a key or schema this batch keeps: built again after it
                marked.append(b)
                if batches is None and all(q != b for q, _ in queue):  # a whole build: in this run
                    queue.append((b, _version_of(committed[rank[b]], facts, by_batch)))
                    queue.sort(key=lambda t: rank[t[0]])
        summary.marked_stale = sorted(set(marked) if batches is not None else set())
        session.upsert_rows("runs", [run_row(
            run_id, "normalize", started, params={"full": full, **({"batches": list(batches)} if batches else {})},
            counts={k: v for k, v in summary.__dict__.items() if k != "run_id"}, code_version=f"normalize@{NORMALIZE_VERSION}")])
    return summary
