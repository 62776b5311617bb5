"""Build the ``packs`` table: the trainable fragments of each split, rendered, tokenized and packed.

A pack set is one tokenizer + template + packing configuration; building another set (another
tokenizer, another length) writes its files beside the others, never over them, and rebuilding a
set replaces only that set's files, in one commit. Fragments stream in trajectory-key order with
their steps (one episode's steps in memory at a time) and are packed window by window
(best-fit decreasing within ``window`` fragments of one split), so memory is bounded by the
window, not the layer. Which fragments: trainable ones of every split that gives fragments; with
``dedup="representative"`` (default) only the representatives of near-duplicate clusters,
``weighted`` and ``all`` take every member (each segment carries its dedup weight).
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from array import array
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from trajwh.lineage.catalog import Warehouse, now_utc, write_table_file
from trajwh.lineage.parallel import (
    PARALLEL_MIN_ITEMS,
    duckdb_memory,
    parts_within,
    run_parts,
    workers_wanted,
)
from trajwh.lineage.rebuild import inputs_fingerprint, joined_by_key, mark_running, run_row
from trajwh.lineage.storage import WrittenFile, data_root, ensure_dir
from trajwh.packing.pack import PACKERS, POLICIES, Segment
from trajwh.packing.render import TEMPLATE, render, truncate_context
from trajwh.packing.tokenizers import DEFAULT_TOKENIZER, get_tokenizer
from trajwh.packing.windows import (
    CHUNK,
    RENDER_STEPS_SQL,
    WINDOWED_SQL,
    Plan,
    StoredSet,
    batch_versions,
    copied_packs,
    kept_files,
    plan_windows,
    read_drops,
    read_stored,
    remove_drops,
    remove_token_meta,
    stored_rows,
    write_drops,
)
from trajwh.schemas import ids
from trajwh.schemas.arrow import arrow_schema
from trajwh.schemas.errors import ConfigError
from trajwh.schemas.tables import PackRow, PackTokenRow

TRANSFORM = "packs"
PACKS_VERSION = "2.0.0"  # 2.0: packs are layouts over pack_tokens (a token store written once per token key); 1.4: token columns int32 / int8 / int32, written without dictionaries; 1.3: evaluation episodes only when eligible for training; 1.1: tool definitions rendered; 1.2: stable windows (incremental builds)
#: the tables a pack set is made from (its fingerprint, and the round-trip check's cache key)
PACK_INPUTS = ["fragments", "redacted_steps", "redacted_episodes", "redacted_tool_schemas", "near_dup_clusters",
               "splits", "outcomes", "eligibility"]
DEDUP_CHOICES = ("representative", "weighted", "all")
#: the table of token chunks rendered ahead of the layouts (``stage_pack_tokens``)
STAGED = "pack_tokens_staged"
#: the run row of a ``pack_tokens`` partition run without the layouts
STAGE = "pack_tokens"


@dataclass(frozen=True)
class PackConfig:
    tokenizer: str = DEFAULT_TOKENIZER
    seq_len: int = 8192
    policy: str = "drop"
    dedup: str = "representative"
    packer: str = "min-slack"
    evaluation: bool = True  # also pack the resolved episodes of the evaluation splits (an evaluation loss)
    # units packed together (memory: about window x mean tokens x 16 bytes). 500, not 1,000: an
    # incremental build packs again every window a unit enters or leaves, and min-slack fills a
    # few hundred units as well or better (measured 2026-12-03, docs/packing.md "Window size")
    window: int = 500

    def validate(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"unknown over-length policy {self.policy!r}", valid=", ".join(POLICIES))
        if self.dedup not in DEDUP_CHOICES:
            raise ConfigError(f"unknown dedup choice {self.dedup!r}", valid=", ".join(DEDUP_CHOICES))
        if self.packer not in PACKERS:
            raise ConfigError(f"unknown packer {self.packer!r}", valid=", ".join(PACKERS))
        if not 16 <= self.seq_len <= 1 << 20:
            raise ConfigError(f"sequence length {self.seq_len} out of range", valid="16 .. 1048576 tokens")
        if not 1 <= self.window <= 1_000_000:
            raise ConfigError(f"packing window {self.window} out of range", valid="1 .. 1000000 units")


@dataclass
class PackSummary:
    run_id: str
    pack_set: str = ""
    seq_len: int = 0
    skipped: bool = False
    fragments: int = 0
    sequences: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    trainable: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)
    truncated: dict[str, int] = field(default_factory=dict)
    split_fragments: dict[str, int] = field(default_factory=dict)
    windows: dict[str, int] = field(default_factory=dict)  # copied / repacked / new (an incremental build)
    units_rendered: int = 0
    units_reused: int = 0  # lengths taken from the stored token rows (not rendered)
    chunks: dict[str, int] = field(default_factory=dict)  # token chunks kept / written
    drops: dict[str, str] = field(default_factory=dict)  # unit -> token key: dropped as too long (not in counts)
    written: list[str] = field(default_factory=list)  # the token files this run wrote or took staged (not in counts)

    @property
    def efficiency(self) -> float:
        cap = sum(self.sequences.values()) * self.seq_len
        return sum(self.tokens.values()) / cap if cap else 0.0


# what is packed: the trainable fragments (train split) and, for an evaluation loss, each resolved,
# not quarantined episode of an evaluation split whole (model steps trained, as a full_episode fragment);
# only episodes the license policy and opt-outs allow for training (licenses.eligibility; every
# episode while no eligibility was ever built, as for a library call without that step)
_UNITS = """
    SELECT f.fragment_id AS unit_id, f.trajectory_key, f.step_ids, f.span_step_ids, f.split, f.kind,
           f.dedup_weight, c.cluster_id, coalesce(c.is_representative, true) AS representative
    FROM fragments f LEFT JOIN near_dup_clusters c USING (trajectory_key) WHERE f.trainable
    UNION ALL
    SELECT 'ev-' || left(sha256(s.trajectory_key), 20), s.trajectory_key, NULL, NULL, s.split, 'eval_episode',
           c.weight, c.cluster_id, coalesce(c.is_representative, true)
    FROM splits s JOIN outcomes o USING (trajectory_key) LEFT JOIN near_dup_clusters c USING (trajectory_key)
    LEFT JOIN eligibility g USING (trajectory_key)
    WHERE {evaluation} AND s.split NOT IN ('train', 'held_out') AND o.outcome = 'resolved'
      AND NOT coalesce(o.quarantined, false)
      AND (g.train = 'allow' OR (g.train IS NULL AND NOT EXISTS (SELECT 1 FROM eligibility)))"""
_UNITS_SQL = """
    SELECT u.*, e.tool_schema_digest FROM ({units}) u LEFT JOIN redacted_episodes e USING (trajectory_key)
    WHERE {dedup} ORDER BY trajectory_key, unit_id"""
# the tool definitions a model was shown, from the redacted layer (few: one row per distinct set)
_TOOLS_SQL = """
    SELECT tool_schema_digest, any_value(schema_text) AS schema_text FROM redacted_tool_schemas
    WHERE schema_kind = 'function_schemas' GROUP BY 1"""


def tool_definitions(schema_text: str | None) -> list[dict] | None:
    """A stored function-schema list as a chat template's ``tools``: OpenAI's
    ``{"type": "function", "function": {name, description, parameters}}`` per tool (Anthropic's
    ``input_schema`` becomes ``parameters``); None when there is none."""
    try:
        value = orjson.loads(schema_text) if schema_text else None
    except orjson.JSONDecodeError:
        return None
    if not isinstance(value, list):
        return None
    out = []
    for t in value:
        if not isinstance(t, dict):
            continue
        if isinstance(t.get("function"), dict):
            out.append({"type": "function", "function": t["function"]})
        elif isinstance(t.get("name"), str):
            fn = {k: v for k, v in t.items() if k not in ("input_schema", "type")}
            if "input_schema" in t:
                fn["parameters"] = t["input_schema"]
            out.append({"type": "function", "function": fn})
    return out or None


def tools_by_digest(wh: Warehouse, trajectory_key: str | None = None) -> dict[str, list[dict]]:
    """Digest -> tool definitions (of one episode when ``trajectory_key`` is given)."""
    if not wh.files("redacted_tool_schemas"):
        return {}
    sql, params = _TOOLS_SQL, []
    if trajectory_key is not None:
        sql = sql.replace("GROUP BY", "AND tool_schema_digest = (SELECT tool_schema_digest FROM redacted_episodes "
                                      "WHERE trajectory_key = ?) GROUP BY")
        params = [trajectory_key]
    rows = wh.query(sql, params).to_pylist()
    return {r["tool_schema_digest"]: t for r in rows if (t := tool_definitions(r["schema_text"]))}


def episode_tools(wh: Warehouse, trajectory_key: str) -> list[dict] | None:
    """The tool definitions an episode's model was shown, as rendered in its packs."""
    return next(iter(tools_by_digest(wh, trajectory_key).values()), None)
_STEPS_SQL = """
    SELECT trajectory_key, step_id, step_index, author, role, text, observation, tool_calls, metadata FROM {steps}
    WHERE trajectory_key IN (SELECT trajectory_key FROM ({units}) WHERE {dedup}) ORDER BY trajectory_key, step_index"""


def units_with_steps(wh: Warehouse, dedup: str = "representative", evaluation: bool = True
                     ) -> Iterator[tuple[dict, list[dict]]]:
    """(unit, its steps in rendering order) in trajectory-key order; one episode's steps in memory at a time.

    A unit is a trainable fragment or an evaluation episode; ``unit["span"]`` is the set of step ids
    whose model tokens are trained.
    """
    parts = {"units": _UNITS.format(evaluation="true" if evaluation else "false"),
             "dedup": "representative" if dedup == "representative" else "true"}
    tools = tools_by_digest(wh)
    unit_stream = wh.stream(_UNITS_SQL.format(**parts), batch_rows=2_000, memory_limit=duckdb_memory(512), threads=1)
    step_stream = wh.stream(_STEPS_SQL.format(**parts, steps="redacted_steps"), memory_limit=duckdb_memory(512), threads=1)
    try:
        for u, mine in joined_by_key(unit_stream, step_stream):
            u["tools"] = tools.get(u.pop("tool_schema_digest"))
            yield with_span(u, mine)
    finally:
        unit_stream.close()
        step_stream.close()


def with_span(u: dict, steps: list[dict]) -> tuple[dict, list[dict]]:
    """The unit with its trained span (``u["span"]``: step ids) and its steps in rendering order:
    an evaluation episode is all of its steps, a fragment its ``step_ids``."""
    if u["step_ids"] is None:
        u["span"] = {s["step_id"] for s in steps}
        return u, list(steps)
    by_id = {s["step_id"]: s for s in steps}
    u["span"] = set(u["span_step_ids"])
    return u, [by_id[i] for i in u["step_ids"] if i in by_id]


def pack_set_id(cfg: PackConfig, tok: Any = None) -> str:
    """The set a configuration makes: its tokenizer and template ids and its packing choices."""
    tok = tok or get_tokenizer(cfg.tokenizer)
    return "ps-" + ids.digest([tok.id, tok.template_id, cfg.seq_len, cfg.policy, cfg.dedup,
                               cfg.packer, cfg.evaluation, cfg.window, PACKS_VERSION])[:16]


def _config_rules(cfg: PackConfig, tok: Any) -> str:
    """The part of a set's rules that its configuration makes (``build_packs``'s ``rules`` after
    the packing version and the set id)."""
    return (f"tokenizer={tok.id};template={tok.template_id};seq_len={cfg.seq_len};policy={cfg.policy};"
            f"dedup={cfg.dedup};packer={cfg.packer};evaluation={cfg.evaluation};window={cfg.window}")


def _upgrade_neutral(rules: str) -> str:
    """A configuration's rules with the built-in template's id reduced to its name: an earlier
    version of the built-in template is the same configuration made by older code (a folder's
    own template is the user's choice, and its id stays)."""
    return re.sub(rf"template={re.escape(TEMPLATE)}@[0-9a-f]+", f"template={TEMPLATE}", rules)


def _outdated_sets(wh: Warehouse, cfg: PackConfig, tok: Any) -> list[dict[str, Any]]:
    """The files (layouts and token rows) of the sets an earlier packing version, or an earlier
    version of the built-in template, made from this configuration: the build of the current
    version replaces them (an upgrade never leaves the old set beside the new)."""
    current = f"{TRANSFORM}@{PACKS_VERSION};set={pack_set_id(cfg, tok)};"
    want = [_upgrade_neutral(_config_rules(cfg, tok))]
    return [r for r in wh.query(
        "SELECT path, transform_version FROM table_files WHERE table_name IN ('packs', 'pack_tokens', ?) AND "
        "NOT starts_with(transform_version, ?)", [STAGED, current]).to_pylist()
        if [_upgrade_neutral(x) for x in r["transform_version"].split(";inputs=")[0].split(";", 2)[2:]] == want]


def _forget_caches(wh: Warehouse, outdated: list[dict[str, Any]]) -> None:
    """The cached state (drops, token meta, the check's ledgers) of the sets ``_outdated_sets`` removed."""
    from trajwh.packing.verify import remove_ledgers  # verify imports this module

    for pack_set in {r["transform_version"].split(";")[1].removeprefix("set=") for r in outdated}:
        remove_drops(wh, pack_set)
        remove_token_meta(wh, pack_set)
        remove_ledgers(wh, pack_set)


def _windowed(cfg: PackConfig, where: str = "", *, lists: bool = True) -> str:
    """The spool's query. ``lists=False``: without the units' step-id lists, for a build that
    renders few units (those take their fragment's in ``_units_to_render``): at 107,000 episodes
    they are 1 M step ids, and the query takes 0.61 s without them, 0.95 s with."""
    return WINDOWED_SQL.format(units=_UNITS.format(evaluation="true" if cfg.evaluation else "false"),
                               dedup="representative" if cfg.dedup == "representative" else "true",
                               window=int(cfg.window), chunk=CHUNK, where=where,
                               exclude="" if lists else "EXCLUDE (step_ids, span_step_ids)")


#: what the plan reads of each unit (the spool keeps them all: the token parts render from it)
_PLAN_COLUMNS = ["unit_id", "trajectory_key", "window_id", "chunk_id", "ord_key", "chunk_key", "dedup_weight",
                 "cluster_id", "token_key"]


def _spool(batches: Iterator[pa.RecordBatch], path: Path) -> None:
    """The rows of ``batches``, written whole to the Parquet file ``path`` (none when there are no
    rows): the plan walks the units from it and the token parts read theirs back (the step lists are
    never made Python objects here: 51,000 units' took 1.6 s)."""
    writer = None
    try:
        for rb in batches:
            if writer is None:
                ensure_dir(path.parent, restricted=True)
                # uncompressed: a spool read a few times and deleted (107,000 episodes' 51,000 units: 0.35 -> 0.14 s)
                writer = pq.ParquetWriter(path, rb.schema, compression="none")
            writer.write_batch(rb)
    finally:
        if writer is not None:
            writer.close()


#: spooled units read at a time when they take their step lists from the fragments (one query each)
_LISTS_ROWS = 10_000


def _with_lists(wh: Warehouse, batches: Iterator[list[dict[str, Any]]], rendering: set[str]
                ) -> Iterator[list[dict[str, Any]]]:
    """The spooled units' batches, each unit with its fragment's step lists (None for an
    evaluation episode: all of its steps) when it is one to render, read from the fragments: for
    every unit to render in one query when they are at most ``_LISTS_ROWS`` (an incremental
    build's, a forget's: one scan of the fragments instead of one per batch, 108,070 episodes:
    about 75 ms each), else for each batch's units at once (no sort of the spool's rows, and one
    batch's lists in memory)."""
    few = _lists_of(wh, sorted(rendering)) if len(rendering) <= _LISTS_ROWS else None
    for batch in batches:
        found = few if few is not None else _lists_of(wh, [u["unit_id"] for u in batch if u["unit_id"] in rendering])
        for u in batch:
            f = found.get(u["unit_id"])  # (only units to render were looked up)
            u["step_ids"], u["span_step_ids"] = (f["step_ids"], f["span_step_ids"]) if f else (None, None)
        yield batch


def _lists_of(wh: Warehouse, units: list[str]) -> dict[str, dict[str, Any]]:
    """Fragment -> its step lists, for the fragments among ``units``."""
    return {r["fragment_id"]: r for r in wh.query(
        "SELECT fragment_id, step_ids, span_step_ids FROM fragments WHERE fragment_id IN "
        "(SELECT unnest(?::VARCHAR[]))", [units]).to_pylist()} if units else {}


def _spooled_rows(path: Path, columns: list[str]) -> Iterator[dict[str, Any]]:
    """The spool's rows (their ``columns``), in its order."""
    if path.exists():
        for rb in pq.ParquetFile(path).iter_batches(batch_size=5_000, columns=columns):
            yield from rb.to_pylist()


def spooled_chunks(path: Path, chunks: list[str], batch_rows: int) -> Iterator[list[dict[str, Any]]]:
    """The spool's rows of ``chunks`` in the file's order (chunk order), in batches of at most
    ``batch_rows``. Read by Arrow, which keeps a file's order: DuckDB does not promise it for a
    filtered scan, even on one thread (2.0.1, a spool of 51,000 units filtered to 2,000 chunks:
    one row group's rows came after a later one's), and a chunk whose units came in two runs
    would be written twice, the second file losing the first one's rows."""
    wanted = pa.array(sorted(set(chunks)), type=pa.string())
    for rb in pq.ParquetFile(path).iter_batches(batch_size=batch_rows):
        mine = rb.filter(pc.is_in(rb.column("chunk_id").cast(pa.string()), value_set=wanted))
        if mine.num_rows:
            yield mine.to_pylist()


def _units_to_render(wh: Warehouse, plan: Plan, units: Path, chunks: list[str], *, memory: int, threads: int = 1
                     ) -> Iterator[tuple[dict, list[dict]]]:
    """(unit, its steps) of the units of ``chunks`` in chunk order, read from the file the plan
    spooled (``units``): a unit to render carries its steps, the others none. ``memory``: the
    steps query's DuckDB memory in MB at the default budget (``duckdb_memory``); ``threads``: its
    threads."""
    if not units.exists() or not chunks:
        return
    tools = tools_by_digest(wh)
    mine = set(chunks)
    render = {k: o for k, o in plan.render.items() if o.partition("|")[0] in mine}
    lists = "step_ids" in pq.read_schema(units).names
    # the file is in chunk order, which Arrow's read keeps: no sort
    unit_stream = spooled_chunks(units, chunks, 2_000 if lists else _LISTS_ROWS)
    if not lists:  # a spool without the step lists: the units to render take their fragment's
        unit_stream = _with_lists(wh, unit_stream, plan.rendering)
    step_stream = wh.stream(RENDER_STEPS_SQL.format(steps=wh.rows_of("redacted_steps", list(render))),
                            [list(render), list(render.values())],
                            memory_limit=duckdb_memory(memory), threads=threads, batch_rows=2_000)
    try:
        for u, steps in joined_by_key(unit_stream, step_stream, key="chunk_key"):
            u["token_key"] = plan.keys[u["unit_id"]]
            u["tools"] = tools.get(u.pop("tool_schema_digest"))
            yield (with_span(u, steps) if u["unit_id"] in plan.rendering else (u, []))
    finally:
        unit_stream.close()
        step_stream.close()


def build_packs(wh: Warehouse, *, run_id: str, cfg: PackConfig = PackConfig(), full: bool = False,
                lock_timeout: float = 60.0, workers: int | None = None, engine: str = "duckdb") -> PackSummary:
    """Build (or bring up to date) one pack set, in two steps. **Tokens**: each unit's rendering,
    tokenized, is a ``pack_tokens`` row, written once per token key in chunks of about ``CHUNK``
    units of one batch (``packing.windows``); only the chunks whose units or token keys changed are
    written again, the new units rendered, the others' rows copied. **Layouts**: each window whose
    packing inputs changed is packed again from its units' lengths (no tokens read), the others'
    layouts copied. Incremental unless ``full``; the result equals a full build's. The chunks to
    write are dealt out to ``workers`` parts (default ``workers_wanted()``: this process and
    workers; one part below ``PARALLEL_MIN_ITEMS`` units to render). The window and chunk
    assignment (window functions over every unit) runs once, here: its rows are spooled to a file
    under ``.tmp`` that each part reads its chunks' units from. ``engine`` runs the layouts' bin
    assignment (``packing.bins``: the same packs on every engine)."""
    tok, summary, started, prefix, rules, version = _begin(wh, cfg, run_id)
    schema = arrow_schema(PackRow)
    with wh.write_session("packs", timeout=lock_timeout) as session:
        mark_running(session, run_id, "packs", started)
        mine, token_files = _set_files(wh, "packs", prefix), _set_files(wh, "pack_tokens", prefix)
        old_versions = {r["transform_version"] for r in mine + token_files}
        outdated = _outdated_sets(wh, cfg, tok)
        if not full and mine and old_versions == {version} and not outdated:
            summary = _stored_summary(wh, run_id, version, summary)
            session.upsert_rows("runs", [run_row(run_id, "packs", started, params={"version": version, "skipped": True},
                                                 counts=_counts(summary), code_version=f"{TRANSFORM}@{PACKS_VERSION}")])
            return summary
        reusable = not full and (mine or token_files) and {v.split(";inputs=")[0] for v in old_versions} == {rules}
        staged_files = _set_files(wh, STAGED, prefix)  # every one goes at the commit: taken, or of no use now
        staged = [r for r in staged_files if _rules_of(r) == rules] if not full else []
        known_drops = read_drops(wh, summary.pack_set) if reusable or staged else {}
        versions = batch_versions(wh)
        units = wh.root / ".tmp" / f"pack-units-{uuid.uuid4().hex}.parquet"
        try:
            # the plan's query (every core) spools the units; the stored set is read beside it, in a
            # thread (its Python work beside DuckDB's; 107,000 + 1 %: the stage 5.7 -> 5.0 s with
            # min_slack's deletes in place), then the plan walks the spool
            with ThreadPoolExecutor(1) as pool:
                pending = (pool.submit(read_stored, wh, summary.pack_set, mine, token_files, staged) if reusable else
                           pool.submit(read_stored, wh, summary.pack_set, [], [], staged) if staged else None)
                # (a build whose stored tokens cannot be reused renders every unit: the spool keeps their lists)
                _spool(wh.stream(_windowed(cfg, lists=not reusable), [list(versions), list(versions.values())],
                                 batch_rows=5_000, arrow=True), units)
                stored = pending.result() if pending is not None else StoredSet(mine, token_files=token_files)
            plan = plan_windows(_spooled_rows(units, _PLAN_COLUMNS), stored, known_drops)
            lineage = {"_run_id": run_id, "_transform": TRANSFORM, "_transform_version": version}
            files: list[Any] = []
            # 1. tokens: the chunks to write, dealt out to parts (this process and workers); a chunk
            # whose stored file is not found is written too (never a chunk without its file)
            held = {c for p, c in stored.file_chunks.items() if c in plan.chunks}
            plan.write |= set(plan.chunks) - held
            # a chunk staged as it is now is taken as it is: its file joins the set
            taken = _current_staged(stored, plan)
            replaced = set(taken.values())  # (a stored file of such a chunk is an older one: it goes)
            plan.write -= replaced
            written, made = _write_chunks(wh, plan, stored, units, sorted(plan.write), cfg=cfg, summary=summary,
                                          lineage=lineage, run_id=run_id, workers=workers)
            files += written.values()
            summary.written = [str(f.path) for f in written.values()]
            lengths = {**plan.known, **made}
            kept_tokens = [_listed_again(wh, r) for r in stored.token_files if _chunk_of(stored, r) in plan.chunks
                           and _chunk_of(stored, r) not in plan.write | replaced]
            kept_tokens += [_listed_again(wh, r) for r in staged if r["path"] in taken]
            files += kept_tokens
            summary.written += [str(wh.data / path) for path in taken]  # (checked as staged; checked again)
            # 2. layouts: the windows whose inputs changed packed again from lengths, the others copied
            seen: set[str] = set()
            kept, rewrite = kept_files(wh, plan, stored)
            for written, table, segments in kept:  # committed again with this run's version, not rewritten
                files.append(written)
                _count_copied(summary, table, segments, seen)
            files += _rewrite_copied(wh, summary.pack_set, plan, schema, lineage, rewrite, summary, seen)
            from trajwh.packing.bins import pack_windows  # (it imports this module)

            pack_windows(engine, _layout_units(wh, plan, units, lengths), cfg, tok, summary,
                         lambda rows: files.append(write_table_file(wh, "packs", pack_table(rows, schema))), lineage)
            _count_dropped_in_copies(summary, plan, seen)
        finally:
            units.unlink(missing_ok=True)
        summary.fragments = plan.units
        summary.windows = {"copied": len(plan.copy), "repacked": len(plan.repack),
                           "new": len(plan.digests) - len(plan.copy) - len(plan.repack)}
        summary.chunks = {"kept": len(kept_tokens) - len(taken), "written": len(plan.write), "staged_taken": len(taken)}
        summary.units_rendered, summary.units_reused = plan.rendered_units, len(plan.known)
        if not any(f.table == "packs" for f in files):
            files.append(session.write("packs", pa.Table.from_pylist([], schema=schema)))
        summary.drops.update({u: k for u, k in known_drops.items() if u in plan.dropped})
        session.commit(files, removed=[wh.data / r["path"] for r in mine + token_files + staged_files + outdated],
                       run_id=run_id, transform_version=version)
        write_drops(wh, summary.pack_set, summary.drops)
        _forget_caches(wh, outdated)
        session.upsert_rows("runs", [run_row(run_id, "packs", started, params={"version": version},
                                             counts=_counts(summary), code_version=f"{TRANSFORM}@{PACKS_VERSION}")])
    return summary


def _begin(wh: Warehouse, cfg: PackConfig, run_id: str) -> tuple[Any, PackSummary, Any, str, str, str]:
    """A pack step's start: the set's tokenizer, its empty summary, the start time, and the set's
    transform-version prefix, rules (the prefix and the configuration) and version (the rules and
    the inputs' fingerprint)."""
    cfg.validate()
    tok = get_tokenizer(cfg.tokenizer)
    summary = PackSummary(run_id, pack_set=pack_set_id(cfg, tok), seq_len=cfg.seq_len)
    prefix = f"{TRANSFORM}@{PACKS_VERSION};set={summary.pack_set};"
    rules = f"{prefix}{_config_rules(cfg, tok)}"
    return tok, summary, now_utc(), prefix, rules, f"{rules};inputs={inputs_fingerprint(wh, PACK_INPUTS)}"


def _set_files(wh: Warehouse, table: str, prefix: str) -> list[dict[str, Any]]:
    """The manifest rows of ``table``'s files whose transform version starts with ``prefix`` (a set's)."""
    return wh.query("SELECT path, sha256, rows, bytes, transform_version, batch_id FROM table_files WHERE "
                    "table_name = ? AND starts_with(transform_version, ?)", [table, prefix]).to_pylist()


def _listed_again(wh: Warehouse, manifest_row: dict[str, Any]) -> WrittenFile:
    """A stored or staged token file kept as it is, to be listed as a ``pack_tokens`` file of this
    run (a staged file already lies in ``pack_tokens``' folder: only its manifest row changes)."""
    r = manifest_row
    return WrittenFile("pack_tokens", data_root(str(wh.data / r["path"])), r["sha256"], r["rows"], r["bytes"])


def _rules_of(manifest_row: dict[str, Any]) -> str:
    """The rules a set's file was made by (its transform version without the inputs)."""
    return str(manifest_row["transform_version"]).split(";inputs=")[0]


def _current_staged(stored: StoredSet, plan: Plan) -> dict[str, str]:
    """Manifest path -> chunk of the staged files that hold a chunk to write as it is now: the same
    units and token keys (its digest), none of them to render (a unit the staging dropped as too
    long is known only from the drops file; if that was lost, the chunk is written again)."""
    rendering = {order.partition("|")[0] for order in plan.render.values()}
    return {path: chunk for path, (chunk, digest) in sorted(stored.staged_files.items())
            if chunk in plan.write and plan.chunks.get(chunk) == digest and chunk not in rendering}


def _write_chunks(wh: Warehouse, plan: Plan, stored: StoredSet, units: Path, todo: list[str], *, cfg: PackConfig,
                  summary: PackSummary, lineage: dict[str, str], run_id: str, workers: int | None
                  ) -> tuple[dict[str, Any], dict[str, tuple[int, tuple[int, ...], list[str]]]]:
    """The token chunks ``todo`` written (files not yet visible), dealt out to parts (this process
    and workers; ``workers`` default: ``workers_wanted()``, one part below ``PARALLEL_MIN_ITEMS``
    units to render); the drops found go to ``summary``. Returns chunk -> its file (none for a
    chunk whose every unit was dropped) and each rendered unit's lengths."""
    if workers is None:  # below PARALLEL_MIN_ITEMS renders a worker's start-up costs more than it saves
        workers = parts_within(workers_wanted(), PART_MB) if plan.rendered_units >= PARALLEL_MIN_ITEMS else 1
    n = max(1, min(workers, len(todo)))
    shares = _deal_chunks(todo, n, plan)
    tasks = [{"root": str(wh.root), "cfg": cfg, "pack_set": summary.pack_set, "plan": plan, "stored": stored,
              "chunks": shares[i], "units": str(units), "lineage": lineage, "run_id": run_id,
              "memory": _ONE_PART_MEMORY if n == 1 else _PART_MEMORY,
              # one part (few to render, or a small set) has the cores to itself
              "threads": 2 if n == 1 else 1} for i in range(n)]
    files: dict[str, Any] = {}
    lengths: dict[str, tuple[int, tuple[int, ...], list[str]]] = {}
    for written, part, made in (run_parts(_token_part, tasks) if n > 1 else [_token_part(tasks[0])]):
        files.update(written)
        lengths.update(made)
        summary.drops.update(part.drops)
    return files, lengths


def stage_pack_tokens(wh: Warehouse, *, run_id: str, cfg: PackConfig = PackConfig(), batches: list[str] | None = None,
                      lock_timeout: float = 60.0, workers: int | None = None) -> PackSummary:
    """Render and tokenize, ahead of the layouts, the units of ``batches`` (None: every batch) whose
    token chunks the set does not hold as they are now: a ``pack_tokens`` partition run without
    ``packs`` (a backfill, a retry, the UI). The chunks are written as ``pack_tokens_staged`` files
    (one manifest commit per batch, under the batch's id), which the next ``build_packs`` takes as
    they are when a chunk's units and token keys are still the staged ones (else it copies their
    rows): ``pack_tokens`` and ``packs`` are not touched, so readers always see one consistent
    set. A batch's staged files from an earlier run that are no longer current go. Which units and
    chunks a batch has depends on the curation (representatives, splits, fragments): stage after
    it. Several staging runs go on at once (the write lock held shared, as the other per-batch
    stages); the packs build waits for them."""
    _, summary, started, prefix, rules, version = _begin(wh, cfg, run_id)
    with wh.write_session(STAGE, timeout=lock_timeout, shared=True) as session:
        mark_running(session, run_id, STAGE, started)
        token_files = [r for r in _set_files(wh, "pack_tokens", prefix) if _rules_of(r) == rules]
        staged = [r for r in _set_files(wh, STAGED, prefix) if _rules_of(r) == rules]
        stored = read_stored(wh, summary.pack_set, [], token_files, staged)
        known_drops = read_drops(wh, summary.pack_set)
        versions = batch_versions(wh)
        scope = None if batches is None else sorted(set(batches))
        units = wh.root / ".tmp" / f"pack-units-{uuid.uuid4().hex}.parquet"
        try:
            where, params = ("", []) if scope is None else ("WHERE list_contains(?::VARCHAR[], batch_id)", [scope])
            _spool(wh.stream(_windowed(cfg, where, lists=not (token_files or staged)),
                             [list(versions), list(versions.values()), *params], batch_rows=5_000, arrow=True), units)
            plan = plan_windows(_spooled_rows(units, _PLAN_COLUMNS), stored, known_drops)
            held = {c for c in stored.file_chunks.values() if c in plan.chunks}
            plan.write |= set(plan.chunks) - held
            current = _current_staged(stored, plan)
            todo = sorted(plan.write - set(current.values()))
            lineage = {"_run_id": run_id, "_transform": TRANSFORM, "_transform_version": version}
            written, made = _write_chunks(wh, plan, stored, units, todo, cfg=cfg, summary=summary, lineage=lineage,
                                          run_id=run_id, workers=workers)
        finally:
            units.unlink(missing_ok=True)
        # one commit per batch (its files under its id): a chunk is of one batch (its id starts with it)
        by_batch: dict[str | None, list[WrittenFile]] = {}
        for chunk in todo:
            by_batch.setdefault(_batch_of(chunk), [])
            if chunk in written:
                # (written in pack_tokens' folder, listed as staged: taking it later moves no bytes)
                by_batch[_batch_of(chunk)].append(dataclasses.replace(written[chunk], table=STAGED))
        by_batch.update({b: [] for r in staged if r["path"] not in current and (b := r["batch_id"]) not in by_batch
                         and (scope is None or b in scope)})  # only stale staged files to remove
        summary.written = [str(f.path) for fs in by_batch.values() for f in fs]
        keep = set(current)
        merged: list[bool] = []
        for batch in sorted(by_batch, key=lambda b: b or ""):
            def guard(con: Any, batch: str | None = batch) -> list[Any]:
                if summary.drops and not merged:  # in the catalog's transaction: one writer at a time
                    write_drops(wh, summary.pack_set, {**read_drops(wh, summary.pack_set), **summary.drops})
                    merged.append(True)
                # read in the transaction: a run of the same batch beside this one
                return [wh.data / p for (p,) in con.execute(
                    "SELECT path FROM table_files WHERE table_name = ? AND batch_id IS NOT DISTINCT FROM ? AND "
                    "starts_with(transform_version, ?)", [STAGED, batch, prefix]).fetchall() if p not in keep]

            session.commit(by_batch[batch], batch_id=batch, run_id=run_id, transform_version=version, guard=guard)
        summary.fragments = plan.units
        summary.units_rendered, summary.units_reused = len(made), len(plan.known)
        summary.chunks = {"staged": len(todo), "already_staged": len(current),
                          "held": len(plan.chunks) - len(plan.write)}
        session.upsert_rows("runs", [run_row(run_id, STAGE, started, params={"version": version, "batches": scope},
                                             counts=_counts(summary), code_version=f"{TRANSFORM}@{PACKS_VERSION}")])
    return summary


def _batch_of(chunk_id: str | None) -> str | None:
    """The batch a token chunk is of (``WINDOWED_SQL``'s chunk id: batch, or ``-`` for none, then the range)."""
    batch = str(chunk_id or "-").rsplit("/", 1)[0]
    return None if batch == "-" else batch


def _chunk_of(stored: StoredSet, manifest_row: dict[str, Any]) -> str | None:
    """The chunk a stored token file holds (one chunk a file)."""
    return stored.file_chunks.get(str(manifest_row["path"]))


#: what a token part holds beyond its process's libraries, at most (measured at 107,000 episodes:
#: an incremental build's two parts peaked at 2,034 MB beside a build process of about 850 MB,
#: about 520 MB each)
PART_MB = 550
#: a part's DuckDB memory, for both of its queries (one process's connections to a catalog share one
#: DuckDB instance, and so its memory limit): its units' (a sort of the spooled units) and its
#: steps' (a sort, which spills). Measured at 107,000 episodes, a full pack build in two parts:
#: 320 MB gave a worker of 735 MB and a tree of 1,576 MB in 41.0 s; 192 MB, 618 and 1,347 MB in 44.4 s
#: (MB at the default memory budget, scaled to the build's)
_PART_MEMORY = 192
#: the same when the build's process renders every chunk itself: the 512 MB this path always had
#: (``_PART_MEMORY`` scaled to a 1 GB budget, 96 MB then, ran out of memory at 20,000 episodes:
#: some of the sort's blocks cannot spill; ``duckdb_memory`` now never goes below 128 MB)
_ONE_PART_MEMORY = 512
#: what a chunk costs a part: a unit to render about this many stored tokens copied (rendering and
#: tokenizing a unit's 2,100 tokens costs about twice copying them); a worker's start, this many
_RENDER_COST, _START_COST, _COPY_COST = 4_000, 4_000_000, 2_000


def _deal_chunks(todo: list[str], n: int, plan: Plan) -> list[list[str]]:
    """The chunks to write dealt out to ``n`` parts, the costliest first to the part with the least
    to do (each worker starts with its start-up). Chunks are independent, so the rows do not
    depend on the dealing."""
    render_in: dict[str, int] = {}
    for order in plan.render.values():
        chunk = order.partition("|")[0]
        render_in[chunk] = render_in.get(chunk, 0) + 1
    cost = {c: render_in.get(c, 0) * _RENDER_COST + plan.chunk_units.get(c, 0) * _COPY_COST for c in todo}
    shares: list[list[str]] = [[] for _ in range(n)]
    load = [0] + [_START_COST] * (n - 1)
    for chunk in sorted(todo, key=lambda c: (-cost[c], c)):
        i = load.index(min(load))
        shares[i].append(chunk)
        load[i] += cost[chunk]
    return [sorted(share) for share in shares]


def _rewrite_copied(wh: Warehouse, pack_set: str, plan: Plan, schema: pa.Schema, lineage: dict[str, str],
                    rewrite: list[Path], summary: PackSummary, seen: set[str]) -> list[Any]:
    """The stored layout files of copied windows that ``kept_files`` does not keep, written again
    with their segments brought up to date (``copied_packs``), counted in ``summary``."""
    files = []
    for table, segments in copied_packs(wh, pack_set, plan, schema, lineage, rewrite):
        files.append(write_table_file(wh, "packs", table))
        _count_copied(summary, table, segments, seen)
    return files


def _token_part(t: dict[str, Any]) -> tuple[dict[str, Any], PackSummary, dict[str, tuple[int, tuple[int, ...], list[str]]]]:
    """A share of the chunks written (files not yet visible: the build commits them): each chunk's
    units rendered where their token key is new, their stored rows copied where it is not; in the
    build's process or a worker. Returns the files (chunk -> its file: none when every unit of
    it was dropped), the drops found, and each rendered unit's lengths (tokens, trainable tokens
    per ``seq_len`` piece, cut steps) for the layouts."""
    wh, cfg, plan, stored = Warehouse(t["root"]), t["cfg"], t["plan"], t["stored"]
    tok = get_tokenizer(cfg.tokenizer)
    part = PackSummary(t["run_id"], pack_set=t["pack_set"], seq_len=cfg.seq_len)
    schema = arrow_schema(PackTokenRow)
    files: dict[str, Any] = {}
    made: dict[str, tuple[int, tuple[int, ...], list[str]]] = {}
    chunk, rows, copy = None, [], []

    def write(chunk: str, rows: list[dict[str, Any]], copy: list[str]) -> None:
        base = {"pack_set": t["pack_set"], "chunk_id": chunk, "chunk_digest": plan.chunks[chunk], "tokenizer_id": tok.id,
                "seq_len": cfg.seq_len, **t["lineage"]}
        tables = [token_table([{**r, **base} for r in rows], schema)] if rows else []
        if copy:
            old = stored_rows(stored, copy)
            found = set() if old is None else set(old.column("unit_id").to_pylist())
            if len(found) != len(copy) or (old is not None and old.num_rows != len(copy)):
                missing = sorted(set(copy) - found)
                raise RuntimeError(f"token chunk {chunk}: {len(copy)} stored rows to copy, {0 if old is None else old.num_rows} "
                                   f"read; not found: {missing[:5]} (listed in "
                                   f"{sorted({stored.tokens[u]['filename'] for u in missing})[:3]})")
            if old is not None and old.num_rows:
                for k, v in base.items():
                    old = old.set_column(schema.get_field_index(k), schema.field(k), pa.array([v] * old.num_rows,
                                                                                             type=schema.field(k).type))
                tables.append(old.select(schema.names).cast(schema))
        if not tables:
            return
        table = pa.concat_tables(tables)
        table = table.take(pc_sort(table))
        files[chunk] = write_table_file(wh, "pack_tokens", table)

    # a chunk is written (its copied rows read, the file encoded and hashed: Arrow's work, mostly
    # outside the GIL) in a thread while the next chunk's units are rendered; two chunks at a time,
    # so at most three chunks' rows are held (a chunk is about 64 units' tokens: a few MB). A part
    # that mostly copies (a forget's, an incremental build's) waits on its writes: 108,070 + 1 %
    # forgotten, 68 chunks written, one writer busy 0.98 s
    writer = ThreadPoolExecutor(_WRITERS)
    pending: list[Any] = []
    flushed: set[str] = set()

    def flush() -> None:
        if chunk is None:
            return
        if chunk in flushed:  # its file would replace the one already written, and lose those rows
            raise RuntimeError(f"token chunk {chunk}'s units came back after it was written: the spooled units "
                               "(read without a sort) are out of chunk order")
        flushed.add(chunk)
        while len(pending) >= _WRITERS:
            pending.pop(0).result()
        pending.append(writer.submit(write, chunk, rows, copy))

    try:
        for u, steps in _units_to_render(wh, plan, Path(t["units"]), t["chunks"], memory=t["memory"],
                                         threads=t["threads"]):
            if u["chunk_id"] != chunk:
                flush()
                chunk, rows, copy = u["chunk_id"], [], []
            unit = u["unit_id"]
            if unit in plan.dropped:
                continue
            if unit not in plan.rendering:
                copy.append(unit)
                continue
            r = render(steps, u["span"], tok, tools=u.get("tools"))
            removed: list[str] = []
            if cfg.policy == "truncate-context" and len(r.ids) > cfg.seq_len:
                cut = truncate_context(steps, u["span"], cfg.seq_len, tok, r, tools=u.get("tools"))
                if cut is None:
                    part.drops[unit] = u["token_key"]
                    continue
                r, removed = cut
            elif cfg.policy == "drop" and len(r.ids) > cfg.seq_len:
                part.drops[unit] = u["token_key"]
                continue
            ids_ = np.asarray(r.ids, dtype=np.int32)
            mask = np.asarray(r.mask, dtype=np.int8)
            pieces = tuple(int(mask[a:a + cfg.seq_len].sum()) for a in range(0, max(1, len(ids_)), cfg.seq_len))
            made[unit] = (len(ids_), pieces, removed)
            rows.append({"unit_id": unit, "token_key": u["token_key"], "trajectory_key": u["trajectory_key"],
                         "n_tokens": len(ids_), "n_trainable": int(mask.sum()), "piece_trainable": list(pieces),
                         "input_ids": ids_, "loss_mask": mask, "removed_step_ids": removed})
        flush()
        while pending:
            pending.pop().result()
    finally:
        writer.shutdown(wait=True, cancel_futures=True)
    return files, part, made


#: token chunks a part writes at once (each in a thread of its own)
_WRITERS = 2


def pc_sort(table: pa.Table) -> pa.Array:
    """A token chunk's rows in (trajectory key, unit) order: the same file whatever the part."""
    return pc.sort_indices(table, sort_keys=[("trajectory_key", "ascending"), ("unit_id", "ascending")])


def _layout_units(wh: Warehouse, plan: Plan, units: Path,
                  lengths: dict[str, tuple[int, tuple[int, ...], list[str]]]) -> Iterator[tuple[dict, list[dict]]]:
    """The units of every window that is not copied, in packing order (the spooled file's), each
    with its lengths (``known``) or marked dropped: what the packer reads."""
    if not units.exists():
        return
    # packing order: a sort of the columns a layout reads (the spool is in chunk order)
    for batch in wh.stream("SELECT unit_id, trajectory_key, kind, split, dedup_weight, cluster_id, window_id FROM "
                           "read_parquet(?) WHERE NOT list_contains(?, window_id) ORDER BY ord_key, unit_id",
                           [str(units), list(plan.copy)], batch_rows=5_000, memory_limit=duckdb_memory(512)):
        for u in batch:
            u["token_key"] = plan.keys[u["unit_id"]]
            u["window_digest"] = plan.digests[u["window_id"]]
            if u["unit_id"] in lengths:
                u["known"] = lengths[u["unit_id"]]
            else:
                u["drop"] = True
            yield u, []


_TOKEN_COLUMNS = ("input_ids", "loss_mask")


def pack_table(rows: list[dict], schema: pa.Schema) -> pa.Table:
    """Pack rows (layouts) as an Arrow table."""
    return pa.Table.from_pylist(rows, schema=schema)


def token_table(rows: list[dict], schema: pa.Schema) -> pa.Table:
    """Token rows as an Arrow table, the token columns built from their arrays in one piece
    (``from_pylist`` converts them value by value: 3 of the 8 s of an incremental pack build)."""
    table = pa.Table.from_pylist([{**r, **{k: [] for k in _TOKEN_COLUMNS}} for r in rows], schema=schema)
    for k in _TOKEN_COLUMNS:
        field = schema.field(k)
        dtype = field.type.value_type.to_pandas_dtype()
        arrays = [np.asarray(r[k], dtype=dtype) for r in rows]
        offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
        np.cumsum([len(a) for a in arrays], out=offsets[1:])
        values = np.concatenate(arrays) if arrays else np.zeros(0, dtype=dtype)
        table = table.set_column(schema.get_field_index(k), field,
                                 pa.ListArray.from_arrays(pa.array(offsets), pa.array(values), type=field.type))
    return table


def _bump(counter: dict[str, int], split: str, n: int = 1) -> None:
    if n:
        counter[split] = counter.get(split, 0) + n


def _count_copied(summary: PackSummary, table: pa.Table, segments: list[list[dict]], seen: set[str]) -> None:
    """A copied window's figures, from its stored rows."""
    for split, n, trainable, segs in zip(table.column("split").to_pylist(), table.column("n_tokens").to_pylist(),
                                         table.column("n_trainable").to_pylist(), segments, strict=True):
        _bump(summary.sequences, split)
        _bump(summary.tokens, split, n)
        _bump(summary.trainable, split, trainable)
        for s in segs:
            if s["piece"] == 0:
                _bump(summary.split_fragments, split)
            if s["removed_step_ids"] and not s["piece"]:
                _bump(summary.truncated, split)
            seen.add(s["fragment_id"].partition("#")[0])


def _count_dropped_in_copies(summary: PackSummary, plan: Plan, seen: set[str]) -> None:
    """Units of copied windows that no copied segment holds were dropped (over-length) there."""
    for window, units in plan.copy_units.items():
        split = window.split("/", 1)[0]
        _bump(summary.dropped, split, sum(1 for u in units if u not in seen))


def window_rows(segs: list[tuple[Segment, dict]], window_id: str | None, digest: str | None, cfg: PackConfig,
                tok_ids: tuple[str, str], pack_set: str, lineage: dict[str, str]
                ) -> tuple[list[dict], dict[str, int], dict[str, str]]:
    """One window packed (the bin assignment): its units' segments (with their meta) through the
    configured packer. Returns the layout rows, the window's counts (sequences, tokens, trainable,
    dropped, split_fragments) and the units dropped as too long (unit -> token key). A pure
    function of its arguments: ``pack_stream`` calls it in this process, an engine's workers
    call it per window (``packing.bins``)."""
    split = segs[0][1]["split"]
    meta = {s.fragment_id: m for s, m in segs}
    result = PACKERS[cfg.packer]([s for s, _ in segs], cfg.seq_len, cfg.policy)
    counts = {"sequences": len(result.sequences), "tokens": 0, "trainable": 0, "dropped": len(result.dropped),
              "split_fragments": len(result.split)}
    drops = {fid: meta[fid]["token_key"] for fid in result.dropped if meta[fid]["token_key"]}
    rows = []
    for seq in result.sequences:
        segments = []
        for fid, a, b in seq.segments:
            base, _, piece = fid.partition("#")
            segments.append({"fragment_id": fid, "start": a, "end": b, "piece": int(piece) if piece else None,
                             **meta[base]})
        rows.append({"pack_id": "pk-" + ids.digest([pack_set, split, seq.segments])[:20],
                     "pack_set": pack_set, "split": split, "tokenizer_id": tok_ids[0], "template_id": tok_ids[1],
                     "seq_len": cfg.seq_len, "n_tokens": seq.n_tokens, "n_trainable": seq.n_trainable,
                     "segments": segments, "window_id": window_id, "window_digest": digest, **lineage})
        counts["tokens"] += seq.n_tokens
        counts["trainable"] += seq.n_trainable
    return rows, counts, drops


def _add_window(summary: PackSummary, split: str, counts: dict[str, int], drops: dict[str, str]) -> None:
    """A packed window's counts (``window_rows``) added to the summary."""
    for k, n in counts.items():
        _bump(getattr(summary, k), split, n)
    summary.drops.update(drops)


def _count_known_drop(summary: PackSummary, u: dict, split: str, cfg: PackConfig) -> None:
    """A unit an earlier build found too long, dropped again without rendering (``read_drops``)."""
    _bump(summary.dropped, split)
    summary.drops[u["unit_id"]] = u["token_key"]
    if cfg.policy != "truncate-context":  # as the packer's drops are counted (truncation's are not)
        summary.fragments += 1


def _known_segment(summary: PackSummary, u: dict, split: str) -> tuple[Segment, list[str]]:
    """The segment of a unit that carries its lengths (``known``) and its cut steps."""
    n, trainable, removed = u["known"]
    if removed:
        _bump(summary.truncated, split)
    return Segment(u["unit_id"], None, None, n, tuple(trainable)), removed


def segment_meta(u: dict, split: str, removed: list[str]) -> dict[str, Any]:
    """What a unit's segments carry beside their place (the layout's segment fields)."""
    return {"trajectory_key": u["trajectory_key"], "kind": u["kind"], "split": split,
            "dedup_weight": u["dedup_weight"], "cluster_id": u["cluster_id"], "removed_step_ids": removed,
            "token_key": u.get("token_key")}


def pack_stream(units: Iterable[tuple[dict, list[dict]]], cfg: PackConfig, tok: Any, summary: PackSummary,
                write: Callable[[list[dict]], None], lineage: dict[str, str]) -> None:
    """Pack a stream of (unit, steps) window by window (a unit's ``window_id``, else ``cfg.window``
    units of one split at a time); each window's layout rows go to ``write``. A unit that carries
    its lengths (``known``: tokens, trainable tokens per ``seq_len`` piece, cut steps) is packed
    from them; another is rendered and tokenized here (its tokens are not kept: a library call or
    a benchmark of the packer). Counts accumulate in ``summary``."""
    windows: dict[str, list[tuple[Segment, dict]]] = {}
    window_of: dict[str, tuple[str | None, str | None]] = {}

    def flush(key: str) -> None:
        segs = windows.pop(key, [])
        if not segs:
            return
        window_id, digest = window_of.pop(key)
        rows, counts, drops = window_rows(segs, window_id, digest, cfg, (tok.id, tok.template_id), summary.pack_set,
                                          lineage)
        _add_window(summary, segs[0][1]["split"], counts, drops)
        if rows:  # a window whose units were all dropped writes no (empty) file
            write(rows)

    open_key = None
    for u, steps in units:
        split = u["split"] or "unsplit"
        key = u.get("window_id") or split
        if u.get("window_id") and key != open_key and open_key is not None:
            flush(open_key)
        open_key = key
        if u.get("drop"):  # too long, as an earlier build found: dropped without rendering
            _count_known_drop(summary, u, split, cfg)
            continue
        if u.get("known") is not None:  # a layout over stored tokens: lengths only
            seg, removed = _known_segment(summary, u, split)
        else:
            r = render(steps, u["span"], tok, tools=u.get("tools"))
            removed = []
            if cfg.policy == "truncate-context" and len(r.ids) > cfg.seq_len:
                cut = truncate_context(steps, u["span"], cfg.seq_len, tok, r, tools=u.get("tools"))
                if cut is None:
                    _bump(summary.dropped, split)
                    if u.get("token_key"):
                        summary.drops[u["unit_id"]] = u["token_key"]
                    continue
                r, removed = cut
                _bump(summary.truncated, split)
            seg = Segment(u["unit_id"], array("i", r.ids), array("b", r.mask))
        windows.setdefault(key, []).append((seg, segment_meta(u, split, removed)))
        summary.fragments += 1
        window_of[key] = (u.get("window_id"), u.get("window_digest"))
        if not u.get("window_id") and len(windows[key]) >= cfg.window:
            flush(key)
    for key in sorted(windows):
        flush(key)


def _stored_summary(wh: Warehouse, run_id: str, version: str, summary: PackSummary) -> PackSummary:
    """An unchanged set's figures: those of the run that built it."""
    last = wh.query(_LAST_COUNTS, [version]).column(0).to_pylist()
    if last:
        counts = orjson.loads(last[0])
        for k in ("fragments", "sequences", "tokens", "trainable", "dropped", "truncated", "split_fragments"):
            if k in counts:
                setattr(summary, k, counts[k])
    summary.skipped = True
    return summary


_LAST_COUNTS = """
    SELECT counts FROM runs WHERE job = 'packs' AND status = 'succeeded'
      AND json_extract_string(params, '$.version') = ?
      AND NOT coalesce(json_extract(counts, '$.skipped')::BOOLEAN, false)
    ORDER BY finished_at DESC LIMIT 1"""


def _counts(s: PackSummary) -> dict[str, Any]:
    return {**{k: v for k, v in s.__dict__.items() if k not in ("run_id", "drops", "written")},
            "efficiency": round(s.efficiency, 4)}
