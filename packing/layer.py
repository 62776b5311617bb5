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

import uuid
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
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
from trajwh.lineage.storage import ensure_dir
from trajwh.packing.pack import PACKERS, POLICIES, Segment
from trajwh.packing.render import render, truncate_context
from trajwh.packing.tokenizers import DEFAULT_TOKENIZER, get_tokenizer
from trajwh.packing.windows import (
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
    stored_state,
    stored_tokens,
    write_drops,
)
from trajwh.schemas import ids
from trajwh.schemas.arrow import arrow_schema
from trajwh.schemas.errors import ConfigError
from trajwh.schemas.tables import PackRow

TRANSFORM = "packs"
PACKS_VERSION = "1.4.0"  # 1.4: token columns int32 / int8 / int32, written without dictionaries; 1.3: evaluation episodes only when eligible for training; 1.1: tool definitions rendered; 1.2: stable windows (incremental builds)
#: the tables a pack set is made from (its fingerprint, and the round-trip check's cache key)
PACK_INPUTS = ["fragments", "redacted_steps", "redacted_episodes", "redacted_tool_schemas", "near_dup_clusters",
               "splits", "outcomes", "eligibility"]
DEDUP_CHOICES = ("representative", "weighted", "all")


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
    units_reused: int = 0  # tokens taken from the stored packs of their window
    drops: dict[str, str] = field(default_factory=dict)  # unit -> token key: dropped as too long (not in counts)

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
    SELECT trajectory_key, step_id, step_index, author, role, text, observation, tool_calls FROM redacted_steps
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
    step_stream = wh.stream(_STEPS_SQL.format(**parts), memory_limit=duckdb_memory(512), threads=1)
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


def _outdated_sets(wh: Warehouse, cfg: PackConfig, tok: Any) -> list[dict[str, Any]]:
    """The files of the sets an earlier packing version made from this configuration: the build
    of the current version replaces them (an upgrade never leaves the old set beside the new)."""
    return [r for r in wh.query(
        "SELECT path, transform_version FROM table_files WHERE table_name = 'packs' AND NOT starts_with(transform_version, ?)",
        [f"{TRANSFORM}@{PACKS_VERSION};"]).to_pylist()
        if r["transform_version"].split(";inputs=")[0].split(";", 2)[2:] == [_config_rules(cfg, tok)]]


def _forget_caches(wh: Warehouse, outdated: list[dict[str, Any]]) -> None:
    """The cached state (drops, the check's ledgers) of the sets ``_outdated_sets`` removed."""
    from trajwh.packing.verify import remove_ledgers  # verify imports this module

    for pack_set in {r["transform_version"].split(";")[1].removeprefix("set=") for r in outdated}:
        remove_drops(wh, pack_set)
        remove_ledgers(wh, pack_set)


def _windowed(cfg: PackConfig, where: str = "") -> str:
    return WINDOWED_SQL.format(units=_UNITS.format(evaluation="true" if cfg.evaluation else "false"),
                               dedup="representative" if cfg.dedup == "representative" else "true",
                               window=int(cfg.window), where=where)


def _spooled(batches: Iterator[pa.RecordBatch], path: Path) -> Iterator[dict[str, Any]]:
    """The rows of ``batches``, written to the Parquet file ``path`` on the way (none when there
    are no rows): the plan walks the units once and the packing parts read theirs back."""
    writer = None
    try:
        for rb in batches:
            if writer is None:
                ensure_dir(path.parent, restricted=True)
                # uncompressed: a spool read once and deleted (107,000 episodes' 51,000 units: 0.35 -> 0.14 s)
                writer = pq.ParquetWriter(path, rb.schema, compression="none")
            writer.write_batch(rb)
            yield from rb.to_pylist()
    finally:
        if writer is not None:
            writer.close()


def _units_to_pack(wh: Warehouse, pack_set: str, plan: Plan, units: Path, windows: list[str] | None = None,
                   *, memory: int) -> Iterator[tuple[dict, list[dict]]]:
    """(unit, its steps) in packing order for every window that is not copied (or only those of
    ``windows``), the units read from the file the plan spooled (``units``): a unit whose stored
    tokens are reused carries them (``stored``) and no steps; the others their steps. ``memory``:
    the queries' DuckDB memory in MB at the default budget (``duckdb_memory``)."""
    if not units.exists():  # no units at all
        return
    tools = tools_by_digest(wh)
    if windows is None:
        where, chosen = "NOT list_contains(?, window_id)", list(plan.copy)
        render, repack = plan.render, plan.repack
    else:
        where, chosen = "list_contains(?, window_id)", windows
        mine = set(windows)
        render = {k: o for k, o in plan.render.items() if o.partition("|")[0] in mine}
        repack = plan.repack & mine
    # the file is in packing order, and one thread's scan keeps it (insertion order is preserved): no sort
    unit_stream = wh.stream(f"SELECT * FROM read_parquet(?) WHERE {where}", [str(units), chosen], batch_rows=2_000,
                            memory_limit=duckdb_memory(memory), threads=1)
    step_stream = wh.stream(RENDER_STEPS_SQL, [list(render), list(render.values())],
                            memory_limit=duckdb_memory(memory), threads=1,
                            batch_rows=2_000)
    stored = stored_tokens(wh, pack_set, sorted(repack))
    window, tokens = None, {}
    try:
        for u, mine in joined_by_key(unit_stream, step_stream, key="ord_key"):
            u["token_key"] = plan.keys[u["unit_id"]]
            u["tools"] = tools.get(u.pop("tool_schema_digest"))
            u["window_digest"] = plan.digests[u["window_id"]]
            if u["unit_id"] in plan.dropped:  # dropped by an earlier build with the same token key
                u["drop"] = True
                yield u, []
            elif u["unit_id"] in plan.reuse:
                while window is None or window < u["window_id"]:
                    window, tokens = next(stored)
                u["stored"] = tokens.pop(u["unit_id"])
                yield u, []
            else:
                yield with_span(u, mine)
    finally:
        unit_stream.close()
        step_stream.close()
        stored.close()


def build_packs(wh: Warehouse, *, run_id: str, cfg: PackConfig = PackConfig(), full: bool = False,
                lock_timeout: float = 60.0, workers: int | None = None) -> PackSummary:
    """Build (or bring up to date) one pack set. Incremental unless ``full``: windows whose
    packing inputs are unchanged are copied, the others packed again with the stored tokens of
    unchanged units (packing.windows); the result equals a full build's. The windows to pack are
    dealt out to ``workers`` parts (default ``workers_wanted()``: this process and workers; one
    part below ``PARALLEL_MIN_ITEMS`` units); windows are independent, so the packs are the same.
    The window assignment (a window function over every unit) runs once, here: its rows are
    spooled to a file under ``.tmp`` that each part reads its windows' units from."""
    cfg.validate()
    tok = get_tokenizer(cfg.tokenizer)
    summary = PackSummary(run_id, pack_set=pack_set_id(cfg, tok), seq_len=cfg.seq_len)
    started = now_utc()
    rules = f"{TRANSFORM}@{PACKS_VERSION};set={summary.pack_set};{_config_rules(cfg, tok)}"
    version = f"{rules};inputs={inputs_fingerprint(wh, PACK_INPUTS)}"
    schema = arrow_schema(PackRow)
    with wh.write_session("packs", timeout=lock_timeout) as session:
        mark_running(session, run_id, "packs", started)
        mine = wh.query("SELECT path, sha256, rows, bytes, transform_version FROM table_files WHERE table_name = 'packs' AND "
                        "starts_with(transform_version, ?)", [f"{TRANSFORM}@{PACKS_VERSION};set={summary.pack_set};"]
                        ).to_pylist()
        old_versions = {r["transform_version"] for r in mine}
        outdated = _outdated_sets(wh, cfg, tok)
        if not full and mine and old_versions == {version} and not outdated:
            summary = _stored_summary(wh, run_id, version, summary)
            session.upsert_rows("runs", [run_row(run_id, "packs", started, params={"version": version, "skipped": True},
                                                 counts=_counts(summary), code_version=f"{TRANSFORM}@{PACKS_VERSION}")])
            return summary
        reusable = not full and mine and {v.split(";inputs=")[0] for v in old_versions} == {rules}
        stored = read_stored(wh, summary.pack_set, mine) if reusable else StoredSet(mine)
        stored_windows, stored_units = stored_state(stored)
        known_drops = read_drops(wh, summary.pack_set) if reusable else {}
        versions = batch_versions(wh)
        units = wh.root / ".tmp" / f"pack-units-{uuid.uuid4().hex}.parquet"
        try:
            # nothing else runs beside the plan: its query takes every core (107,000 episodes: 1.6 -> 1.1 s)
            plan = plan_windows(_spooled(wh.stream(_windowed(cfg), batch_rows=5_000, arrow=True), units),
                                versions, stored_windows, stored_units, known_drops)
            lineage = {"_run_id": run_id, "_transform": TRANSFORM, "_transform_version": version}
            files: list[Any] = []
            seen: set[str] = set()
            kept, rewrite = kept_files(wh, plan, stored)
            loads = _window_loads(stored, plan, rewrite)
            del stored
            for written, table, segments in kept:  # committed again with this run's version, not rewritten
                files.append(written)
                _count_copied(summary, table, segments, seen)

            todo = sorted(set(plan.digests) - set(plan.copy))
            if workers is None:  # below PARALLEL_MIN_ITEMS units a worker's start-up costs more than it saves
                workers = (parts_within(workers_wanted(), PART_MB)
                           if plan.rendered_units + len(plan.reuse) >= PARALLEL_MIN_ITEMS else 1)
            n = max(1, min(workers, len(todo)))
            # the windows dealt out to parts (this process and workers), each packing and writing its own;
            # this process's part also rewrites the copied windows, while the workers start
            shares = _deal_windows(todo, n, loads)
            tasks = [{"root": str(wh.root), "cfg": cfg, "pack_set": summary.pack_set, "plan": plan,
                      "windows": shares[i], "units": str(units), "lineage": lineage, "run_id": run_id,
                      "rewrite": rewrite if i == 0 else [], "memory": _ONE_PART_MEMORY if n == 1 else _PART_MEMORY}
                     for i in range(n)]
            for written, part, copied in (run_parts(_pack_part, tasks) if n > 1 else [_pack_part(tasks[0])]):
                files += written
                _add_counts(summary, part)
                seen |= copied
            _count_dropped_in_copies(summary, plan, seen)
        finally:
            units.unlink(missing_ok=True)
        summary.fragments = plan.units
        summary.windows = {"copied": len(plan.copy), "repacked": len(plan.repack),
                           "new": len(plan.digests) - len(plan.copy) - len(plan.repack)}
        summary.units_rendered, summary.units_reused = plan.rendered_units, len(plan.reuse)
        if not files:
            files.append(session.write("packs", pa.Table.from_pylist([], schema=schema)))
        kept = set().union(*plan.copy_units.values()) | plan.dropped
        summary.drops.update({u: k for u, k in known_drops.items() if u in kept})
        session.commit(files, removed=[wh.data / r["path"] for r in mine + outdated], run_id=run_id,
                       transform_version=version)
        write_drops(wh, summary.pack_set, summary.drops)
        _forget_caches(wh, outdated)
        session.upsert_rows("runs", [run_row(run_id, "packs", started, params={"version": version},
                                             counts=_counts(summary), code_version=f"{TRANSFORM}@{PACKS_VERSION}")])
    return summary


#: what a pack part holds beyond its process's libraries, at most (measured at 107,000 episodes:
#: an incremental build's two parts peaked at 2,034 MB beside a build process of about 850 MB,
#: about 520 MB each)
PART_MB = 550
#: a part's DuckDB memory, for both of its queries (one process's connections to a catalog share one
#: DuckDB instance, and so its memory limit): its units' (a scan of the spooled units) and its
#: steps' (a sort, which spills). Measured at 107,000 episodes, a full pack build in two parts:
#: 320 MB gave a worker of 735 MB and a tree of 1,576 MB in 41.0 s; 192 MB, 618 and 1,347 MB in 44.4 s
#: (MB at the default memory budget, scaled to the build's)
_PART_MEMORY = 192
#: the same when the build's process packs every window itself: the 512 MB this path always had
#: (``_PART_MEMORY`` scaled to a 1 GB budget, 96 MB then, ran out of memory at 20,000 episodes:
#: some of the sort's blocks cannot spill; ``duckdb_memory`` now never goes below 128 MB)
_ONE_PART_MEMORY = 512


#: what a window costs a part, in stored tokens: a unit to render costs about this many (rendering
#: and tokenizing a unit's 2,100 tokens costs about twice copying them); a worker's start, this many;
#: a copied window's token, rewritten with its segments brought up to date (no packing, no stored
#: tokens looked up), this share of a packed window's (measured at 107,000 + 1 %: 35 copied windows
#: rewritten in 1.9 s beside 36 windows packed in 4.8 s)
_RENDER_COST, _START_COST, _REWRITE_SHARE = 4_000, 4_000_000, 0.4


def _window_loads(stored: StoredSet, plan: Plan, rewrite: list[Path]) -> dict[str, int]:
    """What each window to pack costs a part, in tokens (its stored tokens, which it reads and writes
    again, and its units to render), and under "" what rewriting the copied windows' files costs
    the build's own part: ``_deal_windows`` balances the parts by it."""
    loads: dict[str, int] = {}
    if stored.table is not None:
        mine = {str(p) for p in rewrite}
        for name, window, n in zip(stored.table.column("filename").to_pylist(),
                                   stored.table.column("window_id").to_pylist(),
                                   stored.table.column("n_tokens").to_pylist(), strict=True):
            key = "" if window in plan.copy else window
            if key or name in mine:
                loads[key] = loads.get(key, 0) + (n or 0)
    for order in plan.render.values():
        window = order.partition("|")[0]
        loads[window] = loads.get(window, 0) + _RENDER_COST
    return loads


def _deal_windows(todo: list[str], n: int, loads: dict[str, int]) -> list[list[str]]:
    """The windows to pack dealt out to ``n`` parts, the costliest first to the part with the least
    to do: the build's own part (the first) starts with the copied windows' rewrite, each worker with
    its start. Windows are independent, so the packs do not depend on the dealing."""
    shares: list[list[str]] = [[] for _ in range(n)]
    load = [int(loads.get("", 0) * _REWRITE_SHARE)] + [_START_COST] * (n - 1)
    for window in sorted(todo, key=lambda w: (-loads.get(w, 0), w)):
        i = load.index(min(load))
        shares[i].append(window)
        load[i] += loads.get(window, 0)
    return [sorted(share) for share in shares]


def _rewrite_copied(wh: Warehouse, pack_set: str, plan: Plan, schema: pa.Schema, lineage: dict[str, str],
                    rewrite: list[Path], summary: PackSummary, seen: set[str]) -> list[Any]:
    """The stored files of copied windows that ``kept_files`` does not keep, written again with
    their segments brought up to date (``copied_packs``), counted in ``summary``."""
    files = []
    for table, segments in copied_packs(wh, pack_set, plan, schema, lineage, rewrite):
        files.append(write_table_file(wh, "packs", table))
        _count_copied(summary, table, segments, seen)
    return files


def _pack_part(t: dict[str, Any]) -> tuple[list[Any], PackSummary, set[str]]:
    """A share of the windows rendered, packed and written (files not yet visible: the build
    commits them), and the copied windows' files ``t["rewrite"]`` written again, with their counts
    and the units the copies hold; in the build's process or a worker. Its two queries get
    ``t["memory"]`` (``_PART_MEMORY`` when there are two parts or more: two parts at once stay
    within the memory bound)."""
    wh, cfg = Warehouse(t["root"]), t["cfg"]
    tok = get_tokenizer(cfg.tokenizer)
    part = PackSummary(t["run_id"], pack_set=t["pack_set"], seq_len=cfg.seq_len)
    schema = arrow_schema(PackRow)
    seen: set[str] = set()
    files: list[Any] = _rewrite_copied(wh, t["pack_set"], t["plan"], schema, t["lineage"], t.get("rewrite", []),
                                       part, seen)

    def write(rows: list[dict]) -> None:
        files.append(write_table_file(wh, "packs", pack_table(rows, schema)))

    pack_stream(_units_to_pack(wh, t["pack_set"], t["plan"], Path(t["units"]), t["windows"], memory=t["memory"]),
                cfg, tok, part, write, t["lineage"])
    return files, part, seen


def _add_counts(summary: PackSummary, part: PackSummary) -> None:
    summary.fragments += part.fragments
    summary.drops.update(part.drops)
    for k in ("sequences", "tokens", "trainable", "dropped", "truncated", "split_fragments"):
        for split, n in getattr(part, k).items():
            _bump(getattr(summary, k), split, n)


_TOKEN_COLUMNS = ("input_ids", "loss_mask", "position_ids")


def pack_table(rows: list[dict], schema: pa.Schema) -> pa.Table:
    """Pack rows as an Arrow table, the token columns built from their arrays in one piece
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


def pack_stream(units: Iterable[tuple[dict, list[dict]]], cfg: PackConfig, tok: Any, summary: PackSummary,
                write: Callable[[list[dict]], None], lineage: dict[str, str]) -> None:
    """Render, tokenize and pack a stream of (unit, steps) window by window (a unit's
    ``window_id``, else ``cfg.window`` units of one split at a time); each window's packed rows go
    to ``write``. A unit that carries ``stored`` tokens is not rendered. Counts accumulate in
    ``summary``."""
    windows: dict[str, list[tuple[Segment, dict]]] = {}
    window_of: dict[str, tuple[str | None, str | None]] = {}
    packer = PACKERS[cfg.packer]

    def flush(key: str) -> None:
        segs = windows.pop(key, [])
        if not segs:
            return
        window_id, digest = window_of.pop(key)
        split = segs[0][1]["split"]
        meta = {s.fragment_id: m for s, m in segs}
        result = packer([s for s, _ in segs], cfg.seq_len, cfg.policy)
        _bump(summary.dropped, split, len(result.dropped))
        summary.drops.update({fid: meta[fid]["token_key"] for fid in result.dropped if meta[fid]["token_key"]})
        _bump(summary.split_fragments, split, len(result.split))
        rows = []
        for seq in result.sequences:
            segments = []
            for fid, a, b in seq.segments:
                base, _, piece = fid.partition("#")
                segments.append({"fragment_id": fid, "start": a, "end": b, "piece": int(piece) if piece else None,
                                 **meta[base]})
            rows.append({"pack_id": "pk-" + ids.digest([summary.pack_set, split, seq.segments])[:20],
                         "pack_set": summary.pack_set, "split": split, "tokenizer_id": tok.id,
                         "template_id": tok.template_id, "seq_len": cfg.seq_len, "n_tokens": len(seq.ids),
                         "n_trainable": sum(seq.mask), "input_ids": np.frombuffer(seq.ids, np.int32),
                         "loss_mask": np.frombuffer(seq.mask, np.int8), "position_ids": np.frombuffer(seq.positions, np.int32),
                         "segments": segments, "window_id": window_id, "window_digest": digest, **lineage})
            _bump(summary.sequences, split)
            _bump(summary.tokens, split, len(seq.ids))
            _bump(summary.trainable, split, sum(seq.mask))
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
            _bump(summary.dropped, split)
            summary.drops[u["unit_id"]] = u["token_key"]
            if cfg.policy != "truncate-context":  # as the packer's drops are counted (truncation's are not)
                summary.fragments += 1
            continue
        stored = u.get("stored")
        if stored is not None:
            tokens, mask, removed = stored
            seg = Segment(u["unit_id"], array("i", tokens.astype(np.int32).tobytes()), array("b", mask.astype(np.int8).tobytes()))
            if removed:
                _bump(summary.truncated, split)
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
        meta = {"trajectory_key": u["trajectory_key"], "kind": u["kind"], "split": split,
                "dedup_weight": u["dedup_weight"], "cluster_id": u["cluster_id"], "removed_step_ids": removed,
                "token_key": u.get("token_key")}
        windows.setdefault(key, []).append((seg, meta))
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
    return {**{k: v for k, v in s.__dict__.items() if k not in ("run_id", "drops")}, "efficiency": round(s.efficiency, 4)}
