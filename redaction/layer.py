"""Build the redacted layer: ``redacted_episodes``, ``redacted_steps``, ``redaction_events``,
``redacted_tool_schemas``.

Per ingest batch, like the normalized layer: a batch is (re)built when its normalized rows or
the redaction policy changed, and its output files are swapped in one catalog commit. Each
episode is one scope by default: a first pass learns every sensitive value in all of the
episode's fields, a second replaces them, so a token seen in a tool call, a later observation
and a diff is one placeholder everywhere in the episode, even where nothing around it says
"secret". Tool-call arguments and metadata are redacted as JSON and stay valid JSON. The tool
definitions a batch brought (``tool_schemas``, stored once per digest) are redacted as JSON too,
each definition its own scope (``tool_schema:DIGEST``): packing renders them from here, never from
the normalized layer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from trajwh.lineage.catalog import Warehouse, now_utc, write_table_file
from trajwh.lineage.parallel import (
    PARALLEL_MIN_ITEMS,
    ordered_chunks,
    scaled_mb,
    workers_wanted,
    workers_within,
)
from trajwh.lineage.rebuild import chosen_batches, mark_running, run_row
from trajwh.lineage.storage import WrittenFile
from trajwh.redaction.engine import (
    POLICY_VERSION,
    SCOPE_KINDS,
    Detector,
    Redactor,
    Replacement,
    Scope,
)
from trajwh.redaction.vault import Vault, load_key
from trajwh.schemas import ids
from trajwh.schemas.arrow import arrow_schema
from trajwh.schemas.errors import ConfigError
from trajwh.schemas.repository import is_normalized_remote
from trajwh.schemas.tables import (
    EpisodeRow,
    LineageEdgeRow,
    RedactionEventRow,
    StepRow,
    ToolSchemaRow,
)

TRANSFORM = "redact"
_EPISODE_TEXT = ("task_text", "repository", "termination_reason", "exit_status")
_EPISODE_JSON = ("metadata",)
_STEP_TEXT = ("text", "observation", "action_object", "action_command")
_STEP_JSON = ("metadata",)
_OUT_TABLES = ("redacted_episodes", "redacted_steps", "redaction_events", "redacted_tool_schemas")
#: what a layer built by this code holds (part of the layer version: a layer without its
#: redacted tool schemas is rebuilt once)
_LAYER_FORMAT = "2"


@dataclass
class RedactSummary:
    run_id: str
    batches_done: int = 0
    batches_skipped: int = 0
    episodes: int = 0
    steps: int = 0
    replacements: int = 0
    by_type: dict[str, int] = field(default_factory=dict)
    vault_written: bool = False
    vault_backfilled: int = 0  # batches redacted again to write the vault entries a missing key left out


def layer_version(scope_kind: str, normalized_version: str, private_addresses: bool = True) -> str:
    private = "" if private_addresses else ";private_addresses=kept"
    return f"{TRANSFORM}@{POLICY_VERSION};layer={_LAYER_FORMAT};scope={scope_kind}{private};from={normalized_version}"


def _scope_id(kind: str, episode: dict[str, Any]) -> str:
    if kind == "episode":
        return episode["trajectory_key"]
    if kind == "repository":
        return episode.get("repository") or f"no-repository:{episode['trajectory_key']}"
    return episode.get("source") or "dataset"


class EpisodeRedactor:
    """Redacts one episode and its steps in one scope; collects events and vault entries."""

    def __init__(self, redactor: Redactor, scope_kind: str):
        self.redactor, self.scope_kind = redactor, scope_kind
        self.scopes: dict[str, Scope] = {}

    def scope_for(self, episode: dict[str, Any]) -> tuple[str, Scope]:
        sid = _scope_id(self.scope_kind, episode)
        if sid not in self.scopes:
            self.scopes[sid] = self.redactor.scope(sid)
        return sid, self.scopes[sid]

    def redact(self, episode: dict[str, Any], steps: list[dict[str, Any]]) -> tuple[dict, list[dict], list[dict]]:
        sid, scope = self.scope_for(episode)
        r = self.redactor
        # a normalized remote (host/org/repo) is the grouping identity, not personal data: an ssh
        # remote must not become a per-episode e-mail placeholder (schemas/repository.py)
        episode_text = tuple(n for n in _EPISODE_TEXT
                             if n != "repository" or not is_normalized_remote(episode.get("repository")))
        for name in episode_text + _EPISODE_JSON:  # pass 1: learn every value of the episode
            r.learn(episode.get(name), scope)
        for s in steps:
            for name in _STEP_TEXT + _STEP_JSON:
                r.learn(s.get(name), scope)
            for c in s.get("tool_calls") or []:
                r.learn(c.get("arguments"), scope)
                r.learn(c.get("executed"), scope)
        events: list[dict] = []
        red_ep = dict(episode)
        ev: list[Replacement] = []
        for name in episode_text:
            red_ep[name] = r.text(episode.get(name), scope, name, ev)
        for name in _EPISODE_JSON:
            red_ep[name] = r.json_text(episode.get(name), scope, name, ev)
        events += self._events(ev, episode, None, "episodes")
        red_steps = []
        for s in steps:
            ev = []
            rs = dict(s)
            for name in _STEP_TEXT:
                rs[name] = r.text(s.get(name), scope, name, ev)
            for name in _STEP_JSON:
                rs[name] = r.json_text(s.get(name), scope, name, ev)
            if s.get("tool_calls"):
                rs["tool_calls"] = [{**c, "arguments": r.json_text(c.get("arguments"), scope, f"tool_calls[{i}].arguments", ev),
                                     "object": r.text(c.get("object"), scope, f"tool_calls[{i}].object", ev),
                                     "executed": (r.json_text if (c.get("executed") or "").startswith("{") else r.text)(
                                         c.get("executed"), scope, f"tool_calls[{i}].executed", ev)}
                                    for i, c in enumerate(s["tool_calls"])]
            events += self._events(ev, episode, s["step_id"], "steps")
            red_steps.append(rs)
        scope.learned.clear()  # learning-pass findings (JSON documents are redacted leaf by leaf instead)
        return red_ep, red_steps, events

    def _events(self, ev: list[Replacement], episode: dict, step_id: str | None, table: str) -> list[dict]:
        return [{"event_id": ids.short_id(episode["trajectory_key"], step_id or "", e.field, str(e.start), str(e.end)),
                 "trajectory_key": episode["trajectory_key"], "step_id": step_id, "table_name": table,
                 "field": e.field, "start": e.start, "end": e.end, "entity_type": e.entity, "detector": e.detector,
                 "placeholder": e.placeholder, "scope_kind": SCOPE_KINDS[self.scope_kind],
                 "policy_version": POLICY_VERSION} for e in ev]

    def vault_entries(self) -> list[dict]:
        return [{"placeholder": ph, "scope_kind": self.scope_kind, "scope_id": sid, "entity_type": entity,
                 "value": value, "policy_version": POLICY_VERSION}
                for sid, scope in self.scopes.items() for ph, (entity, value) in scope.values.items()]


def _lineage(row: dict, run_id: str) -> dict:
    return {**row, "_run_id": run_id, "_transform": TRANSFORM, "_transform_version": POLICY_VERSION}


#: a batch with at least this many episodes is redacted by worker processes (episode scope only:
#: a repository or dataset scope spans episodes and stays in one process)
PARALLEL_MIN_EPISODES = PARALLEL_MIN_ITEMS


def _worker_mb() -> int:
    """A redaction worker at most: libraries, a task's episodes and a row group's steps as objects
    (about 300 MB) and its detector's memo (``default_memo_chars``, scaled to the budget). Measured
    at 20,000 episodes: 388-400 MB a worker at the default budget, 363-392 MB at 1,024 MB."""
    return 300 + scaled_mb(100)


_CHUNK_EPISODES = 64
_worker: EpisodeRedactor | None = None


_OUT_MODELS = (("redacted_episodes", EpisodeRow), ("redacted_steps", StepRow),
               ("redaction_events", RedactionEventRow), ("lineage_edges", LineageEdgeRow))


def _chunk_tables(results: list[tuple[dict, list[str], list[dict]]], batch_id: str,
                  run_id: str) -> tuple[dict[str, pa.Table], dict[str, Any]]:
    """A chunk's redacted episodes (episode, its step ids, its events) as the rows of the
    episodes, events and lineage tables (Arrow), with counts; the steps are made column-wise
    (``_steps_table``)."""
    rows: dict[str, list[dict]] = {t: [] for t in ("redacted_episodes", "redaction_events", "lineage_edges")}
    counts: dict[str, Any] = {"episodes": len(results), "steps": 0, "replacements": 0, "by_type": {}}
    edge = {"transform": TRANSFORM, "transform_version": POLICY_VERSION, "run_id": run_id}
    step_ids: list[str] = []
    for ep, st, ev in results:
        key = ep["trajectory_key"]
        rows["redacted_episodes"].append(_lineage(ep, run_id))
        rows["redaction_events"].extend({**e, "_batch_id": batch_id, "_run_id": run_id} for e in ev)
        rows["lineage_edges"].append({"child_id": key, "child_table": "redacted_episodes", "parent_id": key,
                                      "parent_table": "episodes", **edge})
        step_ids += st
        counts["steps"] += len(st)
        counts["replacements"] += len(ev)
        for e in ev:
            counts["by_type"][e["entity_type"]] = counts["by_type"].get(e["entity_type"], 0) + 1
    tables = {t: pa.Table.from_pylist(r, schema=_SCHEMAS[t]) for t, r in rows.items()}
    n, ids_ = len(step_ids), pa.array(step_ids, pa.string())
    consts = {"child_table": "redacted_steps", "parent_table": "steps", **edge}
    edges = _SCHEMAS["lineage_edges"]
    step_edges = pa.Table.from_arrays(
        [ids_ if f.name in ("child_id", "parent_id") else pa.array([consts[f.name]] * n, f.type) for f in edges],
        schema=edges)
    tables["lineage_edges"] = pa.concat_tables([tables["lineage_edges"], step_edges])
    return tables, counts


def _steps_table(source: pa.Table, order: list[int], columns: dict[str, list], run_id: str) -> pa.Table:
    """The redacted steps: the normalized rows ``order`` picks, with the redacted ``columns`` and
    this run's lineage; the columns redaction does not touch never become Python objects."""
    schema = _SCHEMAS["redacted_steps"]
    out = source.take(pa.array(order, pa.int64())).select(schema.names).cast(schema)
    n = out.num_rows
    values = {**columns, "_run_id": [run_id] * n, "_transform": [TRANSFORM] * n,
              "_transform_version": [POLICY_VERSION] * n}
    for name, vals in values.items():
        i = schema.get_field_index(name)
        out = out.set_column(i, schema.field(i), pa.array(vals, type=schema.field(i).type))
    return out


_SCHEMAS = {t: arrow_schema(m) for t, m in _OUT_MODELS}
_worker_ids: tuple[str, str, str] = ("", "", "")


def _init_worker(salt: bytes, scope_kind: str, private_addresses: bool, batch_id: str, run_id: str,
                 root: str) -> None:
    global _worker, _worker_ids
    _worker = EpisodeRedactor(Redactor(salt, scope_kind=scope_kind,
                                       detector=Detector(redact_private_ips=private_addresses)), scope_kind)
    _worker_ids = (batch_id, run_id, root)


@dataclass(frozen=True)
class _Task:
    """A unit of redaction work: one normalized steps file and the episodes files that hold its
    episodes (normalize writes an episode and its steps in the same flush, so mostly one), or,
    with no steps file, the batch's episodes that have no steps (``keys``, in order). Workers
    read the files themselves: the parent sends paths and gets Arrow tables back, so it never
    turns rows into Python objects (it was the limit of two workers: 1.27x one process)."""

    steps: str | None
    episodes: tuple[str, ...]
    keys: tuple[str, ...] = ()


def _batch_tasks(wh: Warehouse, batch_id: str) -> tuple[list[_Task], int]:
    """A batch's tasks in order (its steps files as the catalog lists them, then the episodes
    without steps), and its number of episodes; reads only the trajectory-key columns."""
    episode_files = [str(p) for p in wh.files("episodes", batch_id=batch_id)]
    where: dict[str, int] = {}
    for i, path in enumerate(episode_files):
        for key in pq.read_table(path, columns=["trajectory_key"]).column(0).to_pylist():
            where[key] = i
    tasks, done = [], set()
    for path in wh.files("steps", batch_id=batch_id):
        keys = set(pq.read_table(path, columns=["trajectory_key"]).column(0).to_pylist())
        done |= keys
        tasks.append(_Task(str(path), tuple(episode_files[i] for i in sorted({where[k] for k in keys}))))
    rest = tuple(sorted(where.keys() - done, key=lambda k: (where[k], k)))
    if rest:
        tasks.append(_Task(None, tuple(episode_files[i] for i in sorted({where[k] for k in rest})), rest))
    return tasks, len(where)


#: what redaction reads of a step (``_STEP_CHANGED``: what it may change); the rest stays in Arrow
_STEP_CHANGED = (*_STEP_TEXT, *_STEP_JSON, "tool_calls")
_STEP_READ = ("step_id", "trajectory_key", "step_index", *_STEP_CHANGED)


def _task_rounds(task: _Task) -> Iterator[tuple[pa.Table | None, list[tuple[dict, list[dict]]]]]:
    """A task's episodes as (episode, its steps in order), a row group of its steps file at a time:
    each round holds the episodes whose last step that row group reads (an episode whose steps go
    on in the next row group waits for it), with the Arrow rows they come from (a step holds only
    the fields redaction reads, and its row in that table, ``_row``). Only one row group's steps
    (and the steps of episodes that span two) are ever Python objects."""
    episodes = {e["trajectory_key"]: e for path in task.episodes for e in pq.read_table(path).to_pylist()}
    if task.steps is None:
        yield None, [(episodes[key], []) for key in task.keys]
        return
    source = pq.ParquetFile(task.steps)
    last = {k: i for i, k in enumerate(source.read(columns=["trajectory_key"]).column(0).to_pylist())}
    carried: pa.Table | None = None  # rows of episodes not complete yet
    carried_steps: list[dict] = []  # the same rows as Python objects, in the same order
    seen = 0
    for g in range(source.num_row_groups):
        group = source.read_row_group(g)
        seen += group.num_rows
        table = group if carried is None else pa.concat_tables([carried, group.select(carried.schema.names)])
        by_key: dict[str, list[dict]] = {}
        # the carried rows come first in ``table``: their objects are renumbered, not made again
        for i, step in enumerate(carried_steps + group.select(list(_STEP_READ)).to_pylist()):
            step["_row"] = i
            by_key.setdefault(step["trajectory_key"], []).append(step)
        done = [k for k in by_key if last[k] < seen]
        carried_steps = [s for k in by_key if last[k] >= seen for s in by_key[k]]
        carried = table.take(pa.array([s["_row"] for s in carried_steps], pa.int64())) if carried_steps else None
        yield table, [(episodes[k], sorted(by_key[k], key=lambda s: s["step_index"])) for k in done]


def _redact_task(wh: Warehouse, worker: EpisodeRedactor, task: _Task, batch_id: str,
                 run_id: str) -> tuple[list[WrittenFile], dict[str, Any]]:
    """A task's episodes redacted and written, one file per output table (not yet visible: the
    caller commits them), with the counts. Rows are redacted a row group of the steps file at a
    time (``_task_rounds``) and kept as Arrow until written; of the steps only the fields redaction
    reads are Python objects (``_steps_table``)."""
    parts: dict[str, list[pa.Table]] = {t: [] for t, _ in _OUT_MODELS}
    counts: dict[str, Any] = {"episodes": 0, "steps": 0, "replacements": 0, "by_type": {}}
    chunk: list = []

    def close() -> None:
        tables, c = _chunk_tables(chunk, batch_id, run_id)
        for t, data in tables.items():
            parts[t].append(data)
        for k in ("episodes", "steps", "replacements"):
            counts[k] += c[k]
        for k, v in c["by_type"].items():
            counts["by_type"][k] = counts["by_type"].get(k, 0) + v
        chunk.clear()

    for source, items in _task_rounds(task):
        order: list[int] = []
        columns: dict[str, list] = {c: [] for c in _STEP_CHANGED}
        for e, steps in items:
            red_ep, red_steps, events = worker.redact(e, steps)
            for s in red_steps:
                order.append(s["_row"])
                for c in _STEP_CHANGED:
                    columns[c].append(s[c])
            chunk.append((red_ep, [s["step_id"] for s in red_steps], events))
            if len(chunk) >= _CHUNK_EPISODES:
                close()
        if chunk:
            close()
        if source is not None and order:
            parts["redacted_steps"].append(_steps_table(source, order, columns, run_id))
    files = []
    for t, _ in _OUT_MODELS:  # one file per table and task (a steps file's worth of rows)
        data = pa.concat_tables(parts[t]) if parts[t] else None
        if data is not None and data.num_rows:
            files.append(write_table_file(wh, t, data))
    return files, counts


def _redact_in_worker(tasks: list[_Task]) -> list[tuple[list[WrittenFile], dict[str, Any], list[dict]]]:
    """In a worker: tasks redacted and written, each with its vault entries."""
    assert _worker is not None
    batch_id, run_id, root = _worker_ids
    out = []
    for task in tasks:
        _worker.scopes.clear()
        files, counts = _redact_task(Warehouse(root), _worker, task, batch_id, run_id)
        out.append((files, counts, _worker.vault_entries()))
    return out


def _redacted(wh: Warehouse, tasks: list[_Task], worker: EpisodeRedactor, n_episodes: int,
              vault: list[dict], private_addresses: bool, batch_id: str,
              run_id: str) -> Iterator[tuple[list[WrittenFile], dict[str, Any]]]:
    """Redacted tasks (their written files and counts) in input order: in this process, or in
    worker processes for big batches (a bounded number of tasks in flight; a worker writes its
    own files, so only their names come back)."""
    n_workers = min(workers_wanted(), len(tasks))
    if n_workers < 2 or worker.scope_kind != "episode" or n_episodes < PARALLEL_MIN_EPISODES:
        for task in tasks:  # one redactor for them all: a repository or dataset scope spans files
            yield _redact_task(wh, worker, task, batch_id, run_id)
        vault.extend(worker.vault_entries())
        return
    # as many workers as fit the memory budget; one at least, even where it is one: what a big batch
    # leaves in the redacting process (the detector's memo, its caches, the heap) then goes with it
    n_workers = workers_within(n_workers, _worker_mb())
    red = worker.redactor
    for _, done in ordered_chunks(_redact_in_worker, tasks, chunk=1, workers=n_workers, initializer=_init_worker,
                                  initargs=(red.salt, worker.scope_kind, private_addresses, batch_id, run_id,
                                            str(wh.root))):
        for files, counts, entries in done:
            vault.extend(entries)
            yield files, counts


def _redact_tool_schemas(wh: Warehouse, batch_id: str, redactor: Redactor, run_id: str, scope_kind: str,
                         vault: list[dict]) -> tuple[pa.Table, pa.Table, dict[str, int]]:
    """The batch's tool definitions redacted as JSON, each in its own scope; their events (keyed by
    the definition's digest, table ``tool_schemas``) and vault entries."""
    rows, events, by_type = [], [], {}
    for path in wh.files("tool_schemas", batch_id=batch_id):
        for row in pq.read_table(path).to_pylist():
            digest = row["tool_schema_digest"]
            sid = f"tool_schema:{digest}"
            scope = redactor.scope(sid)
            redactor.learn(row["schema_text"], scope)
            ev: list[Replacement] = []
            text = redactor.json_text(row["schema_text"], scope, "schema_text", ev)
            scope.learned.clear()
            rows.append(_lineage({**row, "schema_text": text, "_batch_id": batch_id}, run_id))
            for e in ev:
                by_type[e.entity] = by_type.get(e.entity, 0) + 1
                events.append({"event_id": ids.short_id(digest, e.field, str(e.start), str(e.end)),
                               "trajectory_key": digest, "step_id": None, "table_name": "tool_schemas",
                               "field": e.field, "start": e.start, "end": e.end, "entity_type": e.entity,
                               "detector": e.detector, "placeholder": e.placeholder,
                               "scope_kind": "tool_schema", "policy_version": POLICY_VERSION,
                               "_batch_id": batch_id, "_run_id": run_id})
            vault.extend({"placeholder": ph, "scope_kind": scope_kind, "scope_id": sid, "entity_type": entity,
                          "value": value, "policy_version": POLICY_VERSION}
                         for ph, (entity, value) in scope.values.items())
    return (pa.Table.from_pylist(rows, schema=_TOOL_SCHEMA), pa.Table.from_pylist(events, schema=_SCHEMAS["redaction_events"]),
            by_type)


_TOOL_SCHEMA = arrow_schema(ToolSchemaRow)


def _redact_batch(wh: Warehouse, session: Any, batch_id: str, run_id: str, redactor: Redactor, scope_kind: str,
                  summary: RedactSummary, progress: Callable[[int], None] | None,
                  private_addresses: bool = True) -> tuple[list, list[dict]]:
    tasks, n_episodes = _batch_tasks(wh, batch_id)
    worker = EpisodeRedactor(redactor, scope_kind)
    files: list = []
    vault: list[dict] = []
    for written, counts in _redacted(wh, tasks, worker, n_episodes, vault, private_addresses, batch_id, run_id):
        files += written
        summary.episodes += counts["episodes"]
        summary.steps += counts["steps"]
        summary.replacements += counts["replacements"]
        for k, v in counts["by_type"].items():
            summary.by_type[k] = summary.by_type.get(k, 0) + v
        if progress:
            progress(counts["episodes"])
    if not any(f.table == "redacted_episodes" for f in files):  # a batch without episodes: one empty file
        files.append(session.write("redacted_episodes", _SCHEMAS["redacted_episodes"].empty_table()))
    schemas, events, by_type = _redact_tool_schemas(wh, batch_id, redactor, run_id, scope_kind, vault)
    if schemas.num_rows:
        files.append(session.write("redacted_tool_schemas", schemas))
    if events.num_rows:
        files.append(session.write("redaction_events", events))
    summary.replacements += events.num_rows
    for k, v in by_type.items():
        summary.by_type[k] = summary.by_type.get(k, 0) + v
    return files, vault


def _complete_batches(wh: Warehouse) -> dict[str, str]:
    """Batch -> version of its redacted layer, for batches whose outputs are all there: a batch
    with episodes but without its redaction lineage edges (lost to a crash or another stage) is
    rebuilt, not skipped."""
    rows = wh.query("""
        SELECT e.batch_id, any_value(e.transform_version) AS v, sum(e.rows) AS episodes,
               (SELECT count(*) FROM table_files l WHERE l.table_name = 'lineage_edges' AND l.batch_id = e.batch_id
                 AND l.transform_version = any_value(e.transform_version)) AS edge_files
        FROM table_files e WHERE e.table_name = 'redacted_episodes' GROUP BY e.batch_id""").to_pylist()
    return {r["batch_id"]: r["v"] for r in rows if r["episodes"] == 0 or r["edge_files"] > 0}


def _without_vault(wh: Warehouse, vault: Vault) -> set[str]:
    """Batches redacted while no vault key was set (replacements, no vault folder): with a key now,
    they are redacted again to write their vault entries (the same placeholders: they come from
    the warehouse's salt, so the redacted rows do not change)."""
    with_events = wh.manifest_query("SELECT DISTINCT batch_id FROM table_files WHERE table_name = 'redaction_events' "
                           "AND rows > 0").column(0).to_pylist()
    return {b for b in with_events if not any((vault.root / b).glob("part-*.parquet"))}


def redacted_outputs(wh: Warehouse, batch_id: str, con: Any) -> list[Any]:
    """The files of a batch's redacted layer (and its lineage edges), read through ``con`` (a
    commit's transaction)."""
    return [wh.data / p for (p,) in con.execute(
        "SELECT path FROM table_files WHERE batch_id = ? AND (list_contains(?, table_name) OR "
        "(table_name = 'lineage_edges' AND transform_version LIKE 'redact@%'))", [batch_id, list(_OUT_TABLES)]).fetchall()]


def redact_warehouse(wh: Warehouse, *, run_id: str, full: bool = False, scope_kind: str = "episode",
                     private_addresses: bool = True, lock_timeout: float = 60.0,
                     progress: Callable[[int], None] | None = None,
                     on_plan: Callable[[int], None] | None = None,
                     batches: Sequence[str] | None = None) -> RedactSummary:
    """Build the redacted layer for every batch whose normalized rows or policy changed (only
    those of ``batches`` when given: a Dagster partition run; a batch's redaction reads no other
    batch). ``private_addresses=False`` keeps private network addresses (``[redaction]`` in
    trajwh.toml)."""
    if scope_kind not in SCOPE_KINDS:
        raise ConfigError(f"unknown redaction scope {scope_kind!r}", valid=", ".join(SCOPE_KINDS))
    summary = RedactSummary(run_id)
    started = now_utc()
    with wh.write_session("redact", timeout=lock_timeout, shared=batches is not None) as session:
        mark_running(session, run_id, "redact", started)
        vault = Vault(wh, load_key())
        vault.check_key()  # a key that does not open this vault stops the build before anything is written
        summary.vault_written = vault.enabled
        sources = {r["batch_id"]: r["v"] for r in wh.query(
            "SELECT batch_id, any_value(transform_version) AS v FROM table_files WHERE table_name = 'episodes' "
            "GROUP BY 1").to_pylist()}
        built = _complete_batches(wh)
        unvaulted = _without_vault(wh, vault) if vault.enabled else set()
        todo = [(b, layer_version(scope_kind, v, private_addresses)) for b, v in sorted(sources.items())
                if full or b in unvaulted or built.get(b) != layer_version(scope_kind, v, private_addresses)]
        if batches is not None:
            todo = chosen_batches(wh, todo, batches)
        summary.vault_backfilled = len(unvaulted & {b for b, _ in todo})
        summary.batches_skipped = len(sources) - len(todo)
        if on_plan:
            on_plan(wh.query("SELECT count(*) FROM episodes WHERE list_contains(?, _batch_id)",
                             [[b for b, _ in todo]]).column(0)[0].as_py())
        if todo:  # the detectors are built only when there is something to redact
            redactor = Redactor(vault.salt(), scope_kind=scope_kind,
                                detector=Detector(redact_private_ips=private_addresses))
        for batch_id, version in todo:
            files, entries = _redact_batch(wh, session, batch_id, run_id, redactor, scope_kind, summary, progress,
                                           private_addresses)
            vault.write_batch(batch_id, entries)
            # the batch's earlier output, read in the commit's transaction (a run of the same batch may commit beside)
            session.commit(files, batch_id=batch_id, run_id=run_id, transform_version=version,
                           guard=lambda con, b=batch_id: redacted_outputs(wh, b, con))
            summary.batches_done += 1
        redacted = set(wh.manifest_query("SELECT DISTINCT batch_id FROM table_files WHERE table_name = 'redacted_episodes'")
                       .column(0).to_pylist())
        gone = redacted - set(sources) if batches is None else set()  # batches whose normalized rows no longer exist
        for batch_id in gone:
            old = [wh.data / p for p in wh.query("SELECT path FROM table_files WHERE batch_id = ? AND list_contains(?, table_name)",
                                                 [batch_id, list(_OUT_TABLES)]).column(0).to_pylist()]
            session.commit(removed=old)
        session.upsert_rows("runs", [run_row(
            run_id, "redact", started, params={"full": full, "scope": scope_kind, "policy": POLICY_VERSION,
                                               "private_addresses": private_addresses},
            counts={k: v for k, v in summary.__dict__.items() if k != "run_id"}, code_version=f"{TRANSFORM}@{POLICY_VERSION}")])
    return summary
