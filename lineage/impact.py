"""``trajwh impact SELECTOR``: everything a forget of the selected data would touch, layer by layer.

Read only. A selector names raw records (``source:``, ``license:``, ``batch:``, ``file:``,
``record:``, ``content:REGEX`` over the raw bytes) or episodes (``episode:``, ``task:``,
``repository:``, normalized as the task groups normalize it). Records lead forward to the episodes
made from them (lineage edges), episodes back to their records; from those two sets every derived
row is found by its keys: steps, tool schemas, the redacted layer and its events, vault entries,
lineage edges, curated rows (and the near-duplicate clusters whose representative would go, the
task groups left empty, the tasks whose statistics would be recomputed), fragments and packs, and
the exports the tool wrote that hold one of the episodes (lineage/exports.py) and the data card.

Ids are returned in full (JSON) so a reviewer can check the plan a forget would carry out.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
from trajwh.lineage.catalog import Warehouse
from trajwh.schemas.errors import ConfigError
from trajwh.schemas.repository import normalize_repository

#: selector kind -> what it names
SELECTOR_KINDS: dict[str, str] = {
    "source": "a source name given at ingest (--source)",
    "license": "a license given at ingest (--license)",
    "batch": "an ingest batch id",
    "file": "an ingested file's path, as `trajwh status` lists it",
    "record": "a raw record id (or a unique 8+ character prefix)",
    "content": "a regular expression searched in every raw record's bytes",
    "episode": "a trajectory key (or a unique 8+ character prefix)",
    "task": "a task id",
    "repository": "a repository URL or owner/name (normalized like the task groups)",
    "opt-out": "an opt-out id (`trajwh opt-out list`): the episodes it matches",
}
_EPISODE_KINDS = frozenset({"episode", "task", "repository", "opt-out"})
_MIN_PREFIX = 8
_SAMPLE = 10


def check_content_pattern(value: str) -> None:
    """A ``content:`` pattern must compile (it is matched against raw bytes)."""
    try:
        re.compile(value.encode())
    except re.error as exc:
        raise ConfigError(f"content:{value} is not a regular expression: {exc}",
                          valid="a Python regular expression, matched against the raw bytes") from None


@dataclass(frozen=True)
class Selector:
    kind: str
    value: str

    @classmethod
    def parse(cls, text: str) -> Selector:
        kind, sep, value = (text or "").partition(":")
        kind = kind.strip().lower()
        if not sep or kind not in SELECTOR_KINDS or not value.strip():
            raise ConfigError(f"selector {text!r} is not KIND:VALUE with a known kind",
                              valid="; ".join(f"{k}:… ({v})" for k, v in SELECTOR_KINDS.items()))
        value = value.strip()
        if kind == "content":
            check_content_pattern(value)
        if kind in ("record", "episode") and len(value) < _MIN_PREFIX:
            raise ConfigError(f"{kind}:{value} is too short", valid=f"a full id or at least {_MIN_PREFIX} characters of one")
        return cls(kind, value)

    def __str__(self) -> str:
        return f"{self.kind}:{self.value}"


@dataclass
class Impact:
    selector: str
    records: list[str] = field(default_factory=list)
    episodes: list[str] = field(default_factory=list)
    layers: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.records and not self.episodes and not any(v["rows"] for v in self.layers.values())

    def as_dict(self) -> dict[str, Any]:
        return {"selector": self.selector, "records": self.records, "episodes": self.episodes,
                "layers": self.layers, "notes": self.notes}


def _ids(con: Any, sql: str, params: list[Any] | None = None) -> list[str]:
    return sorted({r[0] for r in con.execute(sql, params or []).fetchall() if r[0] is not None})


def _selected_records(wh: Warehouse, con: Any, sel: Selector) -> list[str]:
    if sel.kind == "content":
        pattern = re.compile(sel.value.encode())
        found = []
        for rb in wh.stream("SELECT record_id, payload FROM raw_records", batch_rows=2_000, arrow=True):
            ids, payloads = rb.column(0).to_pylist(), rb.column(1).to_pylist()
            found += [i for i, p in zip(ids, payloads, strict=True) if p is not None and pattern.search(p)]
        return sorted(found)
    column = {"source": "source", "license": "license", "batch": "batch_id", "file": "file_path"}.get(sel.kind)
    if column:
        return _ids(con, f"SELECT record_id FROM raw_records WHERE {column} IN (SELECT unnest(?))", [_spelled(sel)])
    found = _ids(con, "SELECT record_id FROM raw_records WHERE starts_with(record_id, ?)", [sel.value.lower()])
    if len(found) > 1 and len(sel.value) < 64:
        raise ConfigError(f"record:{sel.value} matches {len(found)} records", valid="a longer prefix or the full id")
    return found


def _spelled(sel: Selector) -> list[str]:
    """The values a selector matches: a file as given and as the absolute path ingest recorded."""
    if sel.kind == "file":
        return sorted({sel.value, str(Path(sel.value).expanduser().resolve())})
    return [sel.value]


def _selected_episodes(con: Any, sel: Selector) -> list[str]:
    if sel.kind == "task":
        return _ids(con, "SELECT trajectory_key FROM episodes WHERE task_id = ?", [sel.value])
    if sel.kind == "episode":
        found = _ids(con, "SELECT trajectory_key FROM episodes WHERE starts_with(trajectory_key, ?)", [sel.value.lower()])
        if len(found) > 1 and len(sel.value) < 64:
            raise ConfigError(f"episode:{sel.value} matches {len(found)} episodes", valid="a longer prefix or the full key")
        return found
    wanted = normalize_repository(sel.value) or sel.value
    pairs = con.execute("SELECT DISTINCT repository, instance_id FROM episodes WHERE repository IS NOT NULL "
                        "OR instance_id IS NOT NULL").fetchall()
    spellings = [(r, i) for r, i in pairs if (normalize_repository(r, i) or r) == wanted]
    if not spellings:
        return []
    con.register("_spellings", pa.table({"r": [r for r, _ in spellings], "i": [i for _, i in spellings]}))
    return _ids(con, "SELECT trajectory_key FROM episodes e JOIN _spellings s ON e.repository IS NOT DISTINCT FROM s.r "
                     "AND e.instance_id IS NOT DISTINCT FROM s.i")


def _opted_out(wh: Warehouse, opt_out_id: str) -> list[str]:
    from trajwh.licenses.optout import opt_out_episodes

    rows = wh.query("SELECT * FROM opt_outs WHERE opt_out_id = ? AND status = 'active'", [opt_out_id]).to_pylist()
    if not rows:
        raise ConfigError(f"no active opt-out {opt_out_id!r}", valid="an id that `trajwh opt-out list` shows")
    return sorted(opt_out_episodes(wh, rows, episodes="episodes"))


def _count(con: Any, sql: str, params: list[Any] | None = None) -> int:
    return con.execute(f"SELECT count(*) FROM ({sql})", params or []).fetchall()[0][0]


def impact(wh: Warehouse, selector: Selector | str, selected: Callable[[Impact], Any] | None = None) -> Impact:
    """What a forget of ``selector`` would remove or recompute, per layer (read only). ``selected``
    is called with the impact once its records and episodes are known, before the layers are
    counted (a forget starts work that needs only those)."""
    sel = Selector.parse(selector) if isinstance(selector, str) else selector
    wh.require()
    con = wh.connect(read_only=True)
    try:
        out = Impact(str(sel))
        if sel.kind in _EPISODE_KINDS:
            keys = _opted_out(wh, sel.value) if sel.kind == "opt-out" else _selected_episodes(con, sel)
            con.register("_k", pa.table({"k": pa.array(keys, pa.string())}))
            records = _ids(con, "SELECT parent_id FROM lineage_edges WHERE child_table = 'episodes' AND "
                                "parent_table = 'raw_records' AND child_id IN (SELECT k FROM _k)")
            shared = _ids(con, "SELECT DISTINCT child_id FROM lineage_edges WHERE child_table = 'episodes' AND "
                               "parent_id IN (SELECT unnest(?)) AND child_id NOT IN (SELECT k FROM _k)", [records])
            if shared:
                out.notes.append(f"{len(shared)} other episode(s) come from the same raw records: the records stay "
                                 "until those episodes are forgotten too; the selected episodes go")
                records = _ids(con, "SELECT parent_id FROM lineage_edges WHERE child_table = 'episodes' AND "
                                    "parent_id IN (SELECT unnest(?)) GROUP BY parent_id HAVING bool_and(child_id IN "
                                    "(SELECT k FROM _k))", [records])
        else:
            records = _selected_records(wh, con, sel)
            con.register("_r0", pa.table({"id": pa.array(records, pa.string())}))
            edges = wh.rows_in("lineage_edges", _ids(con, "SELECT DISTINCT batch_id FROM raw_records WHERE record_id IN "
                                                          "(SELECT id FROM _r0)"))
            keys = _ids(con, f"SELECT child_id FROM {edges} WHERE child_table = 'episodes' AND "
                             "parent_table = 'raw_records' AND parent_id IN (SELECT id FROM _r0)")
        out.records, out.episodes = records, keys
        if selected is not None:
            selected(out)
        con.register("_r", pa.table({"id": pa.array(records, pa.string())}))
        con.register("_k", pa.table({"k": pa.array(keys, pa.string())}))
        _layers(wh, con, sel, out)
        return out
    finally:
        con.close()


def _layer(out: Impact, name: str, rows: int, ids: list[str] | None = None, **extra: Any) -> None:
    entry: dict[str, Any] = {"rows": rows}
    if ids is not None:
        entry["ids"] = ids
    entry.update(extra)
    out.layers[name] = entry


#: tables written batch by batch whose rows of an episode or raw record are in that batch's files
_PER_BATCH = ("episodes", "steps", "tool_schemas", "redacted_steps", "redaction_events", "lineage_edges",
              "episode_features")


def _layers(wh: Warehouse, con: Any, sel: Selector, out: Impact) -> None:
    in_r, in_k = "(SELECT id FROM _r)", "(SELECT k FROM _k)"
    # the per-batch tables are read in the files of the selection's batches only (forgetting 1,070
    # episodes of 108,070: the lineage edges' count 0.5 -> 0.05 s)
    batches = _ids(con, f"SELECT batch_id FROM raw_records WHERE record_id IN {in_r} UNION "
                        f"SELECT _batch_id FROM redacted_episodes WHERE trajectory_key IN {in_k}")
    src = {t: wh.rows_in(t, batches) for t in _PER_BATCH}
    _layer(out, "raw_records", len(out.records), out.records)
    quarantine_where = f"record_id IN {in_r}"
    if sel.kind in ("source", "batch", "file"):  # records that never became raw rows belong to the selection too
        column = {"source": "source", "batch": "batch_id", "file": "file_path"}[sel.kind]
        quarantine_where += f" OR {column} IN (SELECT unnest(?))"
    q_params = [_spelled(sel)] if sel.kind in ("source", "batch", "file") else []
    _layer(out, "quarantine", con.execute(f"SELECT count(*) FROM quarantine WHERE {quarantine_where}", q_params).fetchall()[0][0],
           _ids(con, f"SELECT quarantine_id FROM quarantine WHERE {quarantine_where}", q_params))
    _layer(out, "episodes", len(out.episodes), out.episodes)
    step_ids = f"(SELECT step_id FROM {src['steps']} WHERE trajectory_key IN {in_k})"
    _layer(out, "steps", _count(con, f"SELECT 1 FROM {src['steps']} WHERE trajectory_key IN {in_k}"))
    _layer(out, "tool_schemas", _count(con, f"SELECT 1 FROM {src['tool_schemas']} WHERE _record_id IN {in_r}"))
    _layer(out, "redacted_episodes", _count(con, f"SELECT 1 FROM redacted_episodes WHERE trajectory_key IN {in_k}"))
    _layer(out, "redacted_steps", _count(con, f"SELECT 1 FROM {src['redacted_steps']} WHERE trajectory_key IN {in_k}"))
    _layer(out, "redaction_events", _count(con, f"SELECT 1 FROM {src['redaction_events']} WHERE trajectory_key IN {in_k}"))
    only_theirs = (f"SELECT tool_schema_digest FROM redacted_episodes WHERE tool_schema_digest IS NOT NULL "
                   f"GROUP BY 1 HAVING bool_and(trajectory_key IN {in_k})")
    _layer(out, "redacted_tool_schemas", _count(con, f"SELECT 1 FROM redacted_tool_schemas WHERE tool_schema_digest IN "
                                                     f"({only_theirs})"))
    _vault(wh, con, out)
    _layer(out, "lineage_edges", _count(con, f"""
        SELECT 1 FROM {src['lineage_edges']} WHERE child_id IN {in_k} OR parent_id IN {in_k} OR parent_id IN {in_r}
           OR child_id IN {step_ids}"""))
    for table in ("episode_features", "splits", "leak_flags", "outcomes", "task_groups"):
        _layer(out, table, _count(con, f"SELECT 1 FROM {src.get(table, table)} WHERE trajectory_key IN {in_k}"))
    by_split = dict(con.execute(f"SELECT split, count(*) FROM splits WHERE trajectory_key IN {in_k} GROUP BY 1").fetchall())
    out.layers["splits"]["by_split"] = by_split
    emptied = _ids(con, f"SELECT group_id FROM task_groups GROUP BY 1 HAVING bool_and(trajectory_key IN {in_k})")
    touched = _ids(con, f"SELECT group_id FROM task_groups WHERE trajectory_key IN {in_k}")
    out.layers["task_groups"].update(groups_touched=len(touched), groups_emptied=len(emptied))
    clusters = con.execute(f"""
        SELECT cluster_id, bool_or(is_representative AND trajectory_key IN {in_k}) AS rep_goes,
               count(*) FILTER (WHERE trajectory_key IN {in_k}) AS going, count(*) AS size
        FROM near_dup_clusters GROUP BY 1 HAVING count(*) FILTER (WHERE trajectory_key IN {in_k}) > 0""").fetchall()
    _layer(out, "near_dup_clusters", sum(c[2] for c in clusters), clusters=len(clusters),
           emptied=sum(1 for c in clusters if c[2] == c[3]),
           representative_reelected=sorted(c[0] for c in clusters if c[1] and c[2] < c[3]))
    tasks = _ids(con, f"SELECT DISTINCT task_id FROM {src['episodes']} WHERE trajectory_key IN {in_k}")
    _layer(out, "task_stats", _count(con, "SELECT 1 FROM task_stats WHERE task_id IN (SELECT unnest(?))", [tasks])
           if tasks else 0, recomputed_tasks=tasks)
    _layer(out, "fragments", _count(con, f"SELECT 1 FROM fragments WHERE trajectory_key IN {in_k}"),
           _ids(con, f"SELECT fragment_id FROM fragments WHERE trajectory_key IN {in_k}"))
    packs = con.execute(f"""SELECT DISTINCT p.pack_id, p.pack_set FROM packs p, unnest(p.segments) AS t(s)
                            WHERE t.s.trajectory_key IN {in_k}""").fetchall()
    _layer(out, "packs", len(packs), sorted(p[0] for p in packs), pack_sets=sorted({p[1] for p in packs}))
    from trajwh.lineage.exports import affected

    held = affected(wh, out.episodes)
    _layer(out, "exports", len(held), [e["path"] for e in held],
           kinds={k: sum(e["kind"] == k for e in held) for k in sorted({e["kind"] for e in held})},
           missing=[e["path"] for e in held if not e["exists"]])
    _layer(out, "card", 1 if (wh.root / "card" / "card.json").exists() and out.episodes else 0,
           note="<warehouse>/card is withdrawn by the forget and written again by the next build")


def _vault(wh: Warehouse, con: Any, out: Impact) -> None:
    """Vault entries scoped to the selected episodes (the scope id of an episode scope is its key;
    repository and dataset scopes are shared and are reported, not counted as going)."""
    files = sorted(str(p) for p in (wh.root / "vault").glob("*/part-*.parquet"))
    if not files:
        _layer(out, "vault", 0, note="no vault written (no key configured when the batches were redacted)")
        return
    listing = ", ".join("'" + f.replace("'", "''") + "'" for f in files)
    rows = con.execute(f"""SELECT count(*) FILTER (WHERE scope_id IN (SELECT k FROM _k)),
                                  count(*) FILTER (WHERE scope_kind <> 'episode')
                           FROM read_parquet([{listing}])""").fetchall()[0]
    _layer(out, "vault", rows[0], shared_scope_entries=rows[1])
