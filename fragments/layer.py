"""Build ``outcomes``, ``task_stats`` and ``fragments`` from the redacted and curated layers.

Global, like curation: the three tables are rebuilt together and swapped in one commit; a run
with unchanged inputs and rules is skipped. Each fragment carries its span, kind, reward,
evidence source and confidence, selection reason, the dedup weight, split and leak status of its
episode, and its step ids (lineage to ``redacted_steps``).

Which episodes give training fragments (ARCHITECTURE.md section 1): only ``train`` ones (or
episodes not curated yet); evaluation splits and held-out episodes never do; leak-flagged
episodes (an agent that saw the future) do not either, unless ``SelectConfig.leak_fragments``;
nor do episodes that the license policy or an opt-out does not allow for training
(``eligibility.train`` other than ``allow``; licenses.eligibility).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
from trajwh.fragments.context import choose_context
from trajwh.fragments.outcomes import OUTCOME_RULES_VERSION, classify_outcome
from trajwh.fragments.select import RULES_VERSION, Fragment, SelectConfig, select_fragments
from trajwh.fragments.task_stats import StatsConfig, task_statistics
from trajwh.lineage.catalog import Warehouse, now_utc, write_table_file
from trajwh.lineage.parallel import (
    PARALLEL_MIN_ITEMS,
    duckdb_memory,
    parts_within,
    run_parts,
    workers_wanted,
)
from trajwh.lineage.rebuild import (
    TableSetWriter,
    batch_fingerprints,
    inputs_fingerprint,
    is_current,
    joined_by_key,
    mark_running,
    run_row,
)
from trajwh.schemas import ids
from trajwh.schemas.tables import FragmentRow, OutcomeRow, TaskStatsRow

TRANSFORM = "fragments"
TABLES = ("outcomes", "task_stats", "fragments")
_MODELS = {"outcomes": OutcomeRow, "task_stats": TaskStatsRow, "fragments": FragmentRow}


@dataclass
class FragmentSummary:
    run_id: str
    skipped: bool = False
    episodes: int = 0
    causes: dict[str, int] = field(default_factory=dict)
    tasks: int = 0
    fragments: dict[str, int] = field(default_factory=dict)
    withheld: dict[str, int] = field(default_factory=dict)  # episodes giving no fragments, by why
    rebuilt: int | None = None  # an incremental run: the episodes it redid (None: all of them)
    outcomes_standing: int = 0  # of those, the episodes whose stored outcome stood (no steps read)

    def add(self, part: FragmentSummary) -> None:
        """A part's counts (``_fragments_part``) added to these."""
        self.episodes += part.episodes
        for name in ("causes", "withheld", "fragments"):
            mine = getattr(self, name)
            for k, v in getattr(part, name).items():
                mine[k] = mine.get(k, 0) + v


def version(cfg: StatsConfig, sel: SelectConfig) -> str:
    return (f"{TRANSFORM}@outcomes={OUTCOME_RULES_VERSION};select={RULES_VERSION};"
            f"prior={cfg.prior_alpha:g},{cfg.prior_beta:g};level={cfg.level};recency={cfg.recency_half_life_days:g};"
            f"pooled={cfg.pooled};refs={','.join(cfg.reference_policies)};leak_fragments={sel.leak_fragments};"
            f"controls={sel.controls};context={sel.context_budget_chars}")


def gives_fragments(split: str | None, leak_kinds: list[str], sel: SelectConfig, license_train: str = "allow") -> bool:
    return split in (None, "train") and (sel.leak_fragments or not leak_kinds) and license_train == "allow"


def withheld_reason(split: str | None, leak_kinds: list[str], sel: SelectConfig, license_train: str) -> str:
    """Why an episode gives no fragments (for the summary's counts)."""
    if split not in (None, "train"):
        return split
    return "leak_flagged" if leak_kinds and not sel.leak_fragments else f"license_{license_train}"


def json_text(value: dict) -> str:
    return orjson.dumps(value).decode()


def fragment_row(f: Fragment, steps: list[dict], step_id: dict[int, str], sel: SelectConfig) -> dict:
    """A fragment's row: its span, its chosen context (with reasons) and its phases, by step id."""
    ctx = choose_context(f, steps, sel.context_budget_chars)
    span = [step_id[i] for i in range(f.start, f.end + 1) if i in step_id]
    context_ids = [step_id[i] for i in ctx.included if i in step_id]
    return {
        "fragment_id": f.fragment_id, "trajectory_key": f.trajectory_key, "kind": f.kind,
        "context_start": min([f.start, *ctx.included]), "start_step": f.start, "end_step": f.end,
        "step_ids": context_ids + span, "span_step_ids": span, "context_step_ids": context_ids,
        "context_reasons": json_text({step_id[i]: r for i, r in ctx.included.items() if i in step_id}) or None,
        "context_dropped": json_text({step_id[i]: r for i, r in ctx.dropped.items() if i in step_id})
        if ctx.dropped else None, "context_chars": ctx.chars,
        "phases": json_text({p: [step_id[i] for i in idx if i in step_id] for p, idx in f.phases.items()})
        if f.phases else None,
        "verdict_reward": f.verdict_reward, "progress_score": f.progress_score, "evidence_source": f.evidence_source,
        "confidence": f.confidence, "trainable": f.trainable, "selection_reason": f.reason,
        "tests_before": list(f.tests_before), "tests_after": list(f.tests_after), "rules_version": RULES_VERSION}


#: an episode's task as task_stats groups by it (``e``: the episodes table's alias and dot, or "")
TASK_OF = "coalesce(nullif({e}task_id, ''), nullif({e}instance_id, ''), 'episode:' || {e}trajectory_key)"
#: the eligibility step's training decision; an episode it has not decided counts as blocked, and
#: every episode as allowed while no eligibility was ever built (a library call without that step)
_LICENSE = """CASE WHEN g.train IS NOT NULL THEN g.train WHEN EXISTS (SELECT 1 FROM eligibility) THEN 'undecided'
                   ELSE 'allow' END AS license_train"""
_LEAK_KINDS = """(SELECT trajectory_key, list(DISTINCT kind ORDER BY kind) AS kinds FROM leak_flags
                  WHERE kind <> 'fix_after_cutoff' GROUP BY trajectory_key)"""
# joins, not a correlated subquery: at 107,000 episodes DuckDB runs these within the stream's
# memory limit (spilling the sort), where the subquery ran out of memory
_EPISODES_SQL = """
    SELECT e.*, c.weight AS dedup_weight, s.split, coalesce(l.kinds, []) AS leak_kinds, """ + _LICENSE + """
    FROM redacted_episodes e
    LEFT JOIN near_dup_clusters c USING (trajectory_key) LEFT JOIN splits s USING (trajectory_key)
    LEFT JOIN """ + _LEAK_KINDS + """ l USING (trajectory_key) LEFT JOIN eligibility g USING (trajectory_key)
    {where} ORDER BY e.trajectory_key"""
_STEPS_SQL = """
    SELECT trajectory_key, step_id, step_index, author, role, text, observation, exit_code,
           action_kind, action_object, action_command, test_results,
           json_extract(metadata, '$.tests_summary') AS tests_summary
    FROM {steps} {where} ORDER BY trajectory_key, step_index"""
#: what an episode's outcome and fragments are made from, per episode (its batch's redacted files
#: stand for its rows); the task expression is the one task_stats groups by
_INPUTS_SQL = """
    SELECT e.trajectory_key, e._batch_id AS batch_id, c.weight, s.split,
           coalesce(l.kinds, []) AS leak_kinds, """ + _LICENSE + """,
           """ + TASK_OF.format(e="e.") + """ AS task
    FROM redacted_episodes e
    LEFT JOIN near_dup_clusters c USING (trajectory_key) LEFT JOIN splits s USING (trajectory_key)
    LEFT JOIN """ + _LEAK_KINDS + """ l USING (trajectory_key) LEFT JOIN eligibility g USING (trajectory_key)"""
#: the inputs numbered by their distinct (batch, split, leak kinds, license) values
_INPUTS_COMBOS_SQL = ("SELECT *, dense_rank() OVER (ORDER BY batch_id, split, leak_kinds, license_train) - 1 AS combo "
                      f"FROM ({_INPUTS_SQL})")
_KEYS = "(SELECT unnest(?::VARCHAR[]))"


#: at most this many episodes' steps (about 20 each) are sorted with two threads
_FEW_EPISODES = 5_000


def _episodes_with_steps(wh: Warehouse, keys: list[str] | None = None, memory_mb: int = 512,
                         batches: Collection[str | None] | None = None):
    """(episode, its steps) in trajectory-key order, merged from two ordered streams (only the
    episodes in ``keys`` when given; ``batches``: theirs, when the caller knows them: their steps
    are read in those batches' files without a query to find them)."""
    params = None if keys is None else [keys]
    # both queries run in one DuckDB instance and share its memory limit; one thread each: at
    # 107,000 episodes two threads' sort runs needed more than 640 MB side by side (peak 1.5 GB),
    # one thread sorts within 512 MB (peak 1.0 GB, 10 % slower). The steps of a few episodes (an
    # incremental build's) are a small sort after a scan of every step: two threads scan it (at
    # 107,000 + 1 %, 1,242 episodes' steps: 1.07 -> 0.60 s)
    limit = duckdb_memory(memory_mb)
    few = keys is not None and len(keys) <= _FEW_EPISODES
    steps = "redacted_steps" if keys is None else wh.rows_of("redacted_steps", keys, batches)
    step_stream = wh.stream(_STEPS_SQL.format(where="" if keys is None else f"WHERE trajectory_key IN {_KEYS}",
                                              steps=steps), params,
                            memory_limit=limit, threads=2 if few else 1)
    episode_stream = wh.stream(_EPISODES_SQL.format(where="" if keys is None else f"WHERE e.trajectory_key IN {_KEYS}"),
                               params, batch_rows=2_000, memory_limit=limit, threads=1)
    try:
        for e, mine in joined_by_key(episode_stream, step_stream):
            for step in mine:
                if isinstance(step["tests_summary"], str):
                    step["tests_summary"] = orjson.loads(step["tests_summary"])
            yield e, mine
    finally:  # the catalog connections close here, before the stage commits
        step_stream.close()
        episode_stream.close()


def _inputs_digest(source: str | None, split: str | None, kinds: list[str], train: str) -> str:
    """What an episode's outcome and fragments are made from: its batch's redacted files
    (``source``: their fingerprint), its split, leak kinds and training license. The dedup weight
    is not an input: fragments carry it as it is now (``_kept``), so a cluster that grows
    re-weights its members without selecting their fragments again."""
    parts = [source, split, kinds]
    if train != "allow":  # (allowed episodes keep the digest they had before eligibility)
        parts.append(train)
    return ids.digest(parts)[:16]


@dataclass
class Inputs:
    """Per episode what ``episode_inputs`` read beside the digests: its batch, and whether it gives
    fragments now; the distinct splits, leak kinds and licenses; the batches' fingerprints."""

    batch_of: dict[str, str] = field(default_factory=dict)
    giving: set[str] = field(default_factory=set)
    values: tuple[set, set, set] = field(default_factory=lambda: (set(), set(), set()))
    sources: dict[str, str] = field(default_factory=dict)


def episode_inputs(wh: Warehouse, sel: SelectConfig | None = None, withheld: dict[str, int] | None = None,
                   seen_inputs: Inputs | None = None) -> dict[str, tuple[str, str]]:
    """Trajectory key -> (digest of its inputs, its task), for every redacted episode; with
    ``withheld``, also counts there the episodes that give no fragments under ``sel``, by why; with
    ``seen_inputs``, fills it (``Inputs``; ``sel`` is then needed)."""
    src = batch_fingerprints(wh, ["redacted_episodes", "redacted_steps"])
    # the inputs take few distinct values (batches x splits x leak kinds x licenses, numbered by the
    # query): each is digested and judged once, and the rows are mapped to theirs as columns
    # (108,070 episodes: a Python loop over the rows took 0.39 s)
    t = wh.query(_INPUTS_COMBOS_SQL)
    keys = t.column("trajectory_key").to_pylist()
    combo = t.column("combo").to_numpy()
    firsts, counts = np.unique(combo, return_index=True, return_counts=True)[1:]
    values = [tuple(t.column(n)[int(i)].as_py() for n in ("batch_id", "split", "leak_kinds", "license_train"))
              for i in firsts]
    digests = [_inputs_digest(src.get(batch), split, kinds or [], train) for batch, split, kinds, train in values]
    out = dict(zip(keys, zip(np.array(digests, dtype=object)[combo].tolist(), t.column("task").to_pylist(),
                             strict=True), strict=True))
    for (_, split, kinds, train), n in zip(values, counts.tolist(), strict=True) if withheld is not None else ():
        if not gives_fragments(split, kinds or [], sel, train):
            why = withheld_reason(split, kinds or [], sel, train)
            withheld[why] = withheld.get(why, 0) + n
    if seen_inputs is not None:
        seen_inputs.batch_of = dict(zip(keys, t.column("batch_id").to_pylist(), strict=True))
        giving = np.array([gives_fragments(split, kinds or [], sel, train) for _, split, kinds, train in values])
        seen_inputs.giving = set(np.array(keys, dtype=object)[giving[combo]].tolist()) if len(keys) else set()
        seen_inputs.values = ({v[1] for v in values}, {tuple(v[2] or []) for v in values}, {v[3] for v in values})
        seen_inputs.sources = src
    return out


def _outcomes_standing(keys: list[str], previous: dict[str, tuple[str, str]], seen: Inputs) -> list[str]:
    """Of the episodes to redo, those whose stored outcome stands and that need no steps: known
    before, giving no fragments now, and whose stored inputs digest was made from their batch's
    redacted files as they are now (it is the digest of that batch's fingerprint with one of the
    splits, leak kinds and licenses this run sees: their steps, and so their outcome, are the same;
    their split, leak flags or license moved). An incremental build then reads the steps of the
    new batch's episodes alone (``Warehouse.rows_of``) when older episodes only changed split."""
    splits, kinds, trains = seen.values
    made: dict[str, set[str]] = {}
    out = []
    for k in keys:
        if k not in previous or k in seen.giving:
            continue
        batch = seen.batch_of[k]
        if batch not in made:
            source = seen.sources.get(batch)
            made[batch] = {_inputs_digest(source, s, list(kk), t) for s in splits | {None} for kk in kinds for t in trains}
        if previous[k][0] in made[batch]:
            out.append(k)
    return out


#: the stored outcomes of episodes whose outcome stands (``_outcomes_standing``), with their inputs
#: digest now and this run's lineage, as a rebuild would write them
_STANDING_OUTCOMES = """
    SELECT o.* REPLACE (d.inputs_digest AS inputs_digest, ? AS _run_id, ? AS _transform, ? AS _transform_version)
    FROM outcomes o JOIN (SELECT unnest(?::VARCHAR[]) AS trajectory_key, unnest(?::VARCHAR[]) AS inputs_digest) d
    USING (trajectory_key)"""


def _previous(wh: Warehouse, rules: str) -> dict[str, tuple[str, str]]:
    """What the stored tables were made from, when they were made by these rules (else nothing:
    everything is rebuilt)."""
    versions = wh.manifest_query("SELECT DISTINCT transform_version FROM table_files WHERE list_contains(?, table_name)",
                        [list(TABLES)]).column(0).to_pylist()
    if not versions or any(v.split(";inputs=")[0] != rules for v in versions):
        return {}
    t = wh.query(f"""SELECT o.trajectory_key, o.inputs_digest, {TASK_OF.format(e="e.")} AS task
                     FROM outcomes o JOIN redacted_episodes e USING (trajectory_key)""")
    if t.column("inputs_digest").null_count:
        return {}
    # as columns (108,070 rows as dicts: 0.2 s)
    return dict(zip(t.column("trajectory_key").to_pylist(),
                    zip(t.column("inputs_digest").to_pylist(), t.column("task").to_pylist(), strict=True), strict=True))


#: kept fragments with their episode's dedup weight now; a row whose weight changed takes this run's lineage
_KEPT_FRAGMENTS = """
    SELECT f.* REPLACE (c.weight AS dedup_weight,
                        CASE WHEN f.dedup_weight IS NOT DISTINCT FROM c.weight THEN f._run_id ELSE ? END AS _run_id,
                        CASE WHEN f.dedup_weight IS NOT DISTINCT FROM c.weight THEN f._transform_version ELSE ? END
                            AS _transform_version)
    FROM fragments f LEFT JOIN near_dup_clusters c USING (trajectory_key)
    WHERE f.trajectory_key NOT IN """ + _KEYS


def _resized_tasks(wh: Warehouse, current: dict[str, tuple[str, str]]) -> set[str]:
    """Tasks whose stored statistics count other episodes than the task has now: episodes taken
    away (a forget) while none of the task's others changed, down to none (the task's rows go).
    Their statistics are made again from the episodes they have now."""
    stored = wh.query("SELECT task_id, sum(episodes) AS n FROM task_stats WHERE level = 'task_policy' GROUP BY 1")
    now = Counter(task for _, task in current.values())
    return {t for t, n in zip(stored.column(0).to_pylist(), stored.column(1).to_pylist(), strict=True)
            if now.get(t, 0) != n}


def _copied(wh: Warehouse, table: str, sql: str, params: list[Any]) -> list[Any]:
    """The rows of a query, written as they come as files of ``table`` (not yet visible)."""
    return [write_table_file(wh, table, pa.Table.from_batches([rb]))
            for rb in wh.stream(sql, params, batch_rows=50_000, arrow=True) if rb.num_rows]


def _kept(wh: Warehouse, redo: list[str], redo_tasks: list[str], lineage: dict[str, str],
          standing: dict[str, str]) -> tuple[list[tuple[str, list[Any]]], list[dict]]:
    """Copy the rows of episodes (and tasks) that need no rebuild as they are (fragments with
    their episode's current dedup weight), and the outcomes of those of ``redo`` whose outcome
    stands (``standing``: key -> its inputs digest now). Returns the files written, by table (not
    yet visible), and the task-statistics inputs of the kept and standing episodes of the tasks
    redone."""
    copies = [("outcomes", f"SELECT * FROM outcomes WHERE trajectory_key NOT IN {_KEYS}", [redo]),
              ("fragments", _KEPT_FRAGMENTS, [lineage["_run_id"], lineage["_transform_version"], redo]),
              ("task_stats", f"SELECT * FROM task_stats WHERE task_id NOT IN {_KEYS}", [redo_tasks])]
    if standing:
        copies.append(("outcomes", _STANDING_OUTCOMES, [lineage["_run_id"], lineage["_transform"],
                                                        lineage["_transform_version"], list(standing),
                                                        list(standing.values())]))
    # side by side: a scan and a Parquet write each, mostly outside the GIL (107,000 + 1 %: 1.3 -> 0.8 s)
    with ThreadPoolExecutor(len(copies)) as pool:
        written = [(table, files) for (table, _, _), files in
                   zip(copies, pool.map(lambda c: _copied(wh, *c), copies), strict=True)]
    fresh = [k for k in redo if k not in standing]
    return written, wh.query(_STAT_INPUTS.format(
        where=f"o.trajectory_key NOT IN {_KEYS} AND {TASK_OF.format(e='e.')} IN {_KEYS}"), [fresh, redo_tasks]).to_pylist()


#: what task statistics read of stored outcomes
_STAT_INPUTS = """
    SELECT o.trajectory_key, """ + TASK_OF.format(e="e.") + """ AS task_id, o.cause, e.policy_name, e.harness_name, e.started_at
    FROM outcomes o JOIN redacted_episodes e USING (trajectory_key) WHERE {where} ORDER BY o.trajectory_key"""


def _totals(wh: Warehouse, summary: FragmentSummary, withheld: dict[str, int]) -> None:
    """The summary's counts over the whole tables (an incremental run rebuilt only some episodes;
    ``withheld``: counted over every episode by ``episode_inputs``)."""
    summary.causes = {r["cause"]: r["n"] for r in wh.query(
        "SELECT cause, count(*) AS n FROM outcomes GROUP BY ALL ORDER BY 1").to_pylist()}
    summary.fragments = {r["kind"]: r["n"] for r in wh.query(
        "SELECT kind, count(*) AS n FROM fragments GROUP BY ALL ORDER BY 1").to_pylist()}
    summary.withheld = withheld
    summary.tasks = wh.query("SELECT count(DISTINCT task_id) FROM task_stats").column(0)[0].as_py()
    summary.episodes = wh.query("SELECT count(*) FROM outcomes").column(0)[0].as_py()


#: below this many episodes to redo, one pass in this process (a worker's start costs about a second)
PARALLEL_MIN_EPISODES = PARALLEL_MIN_ITEMS
#: at most this many episodes in a part (a stream sorting its steps): a part of 54,000 episodes
#: did not sort in 256 MB of DuckDB memory, one of 27,000 did (108,070 episodes, in 4 parts)
PART_EPISODES = 30_000
#: a part's DuckDB memory at the default budget (its two streams share it; 192 MB failed to pin a block)
_PART_MEMORY_MB = 256
#: a process's working set for its parts beyond its libraries (measured at 108,070 episodes in 4
#: parts: a worker doing two of them peaked at 731 MB, about 130 of them libraries)
PART_MB = 600


def _processes(n_episodes: int) -> int:
    """How many processes (this one and workers, ``lineage.parallel.run_parts``) redo
    ``n_episodes``: the cores' worth when there are enough episodes and their parts fit the
    memory budget beside what this process holds (``parts_within``); 1: one pass here."""
    if n_episodes < PARALLEL_MIN_EPISODES:
        return 1
    return max(1, min(parts_within(workers_wanted(), PART_MB), n_episodes))


def _redo(wh: Warehouse, keys: list[str] | None, sel: SelectConfig, lineage: dict[str, str],
          digests: dict[str, str], writer: TableSetWriter, summary: FragmentSummary, stat_rows: list[dict],
          progress: Callable[[int], None] | None, memory_mb: int = 512,
          batches: Collection[str | None] | None = None) -> None:
    """One pass over the episodes of ``keys`` (all: None): their outcomes and fragments into
    ``writer``, their rows for task statistics into ``stat_rows``, the counts into ``summary``
    (``batches``: the episodes' batches, when known)."""
    for e, steps in _episodes_with_steps(wh, keys, memory_mb, batches):
        summary.episodes += 1
        if progress:
            progress(1)
        o = classify_outcome(e, steps)
        writer.add("outcomes", {"trajectory_key": e["trajectory_key"], "outcome": o.outcome, "cause": o.cause,
                                "policy_failure": o.policy_failure, "quarantined": o.quarantined,
                                "evidence_field": o.evidence_field, "evidence_step": o.evidence_step,
                                "evidence": o.evidence, "rules_version": OUTCOME_RULES_VERSION,
                                "inputs_digest": digests[e["trajectory_key"]], **lineage})
        summary.causes[o.cause] = summary.causes.get(o.cause, 0) + 1
        stat_rows.append({"trajectory_key": e["trajectory_key"],
                          "task_id": e["task_id"] or e["instance_id"] or f"episode:{e['trajectory_key']}",
                          "cause": o.cause, "policy_name": e["policy_name"], "harness_name": e["harness_name"],
                          "started_at": e["started_at"]})
        step_id = {s["step_index"]: s["step_id"] for s in steps}
        if not gives_fragments(e["split"], e["leak_kinds"], sel, e["license_train"]):
            why = withheld_reason(e["split"], e["leak_kinds"], sel, e["license_train"])
            summary.withheld[why] = summary.withheld.get(why, 0) + 1
            continue
        for f in select_fragments(e, steps, o.cause, o.quarantined, sel):
            writer.add("fragments", {**fragment_row(f, steps, step_id, sel), "dedup_weight": e["dedup_weight"],
                                     "split": e["split"], "leak_kinds": e["leak_kinds"], **lineage})
            summary.fragments[f.kind] = summary.fragments.get(f.kind, 0) + 1


class _FileWriter:
    """What ``TableSetWriter`` writes through in a part's process: content-named files, not yet
    visible (the stage's session commits them with the rest)."""

    def __init__(self, wh: Warehouse):
        self.wh = wh

    def write(self, table: str, data: Any) -> Any:
        return write_table_file(self.wh, table, data)


def _fragments_part(task: dict[str, Any]) -> tuple[list[Any], list[dict], FragmentSummary]:
    """One process's parts of the episodes (key ranges, one stream each), in this process or a
    worker: the outcome and fragment files written, the task-statistics rows and the counts."""
    wh = Warehouse(task["root"])
    writer = TableSetWriter(_FileWriter(wh), {t: _MODELS[t] for t in ("outcomes", "fragments")})  # type: ignore[arg-type]
    counts = FragmentSummary("")
    rows: list[dict] = []
    for keys in task["ranges"]:
        _redo(wh, keys, task["sel"], task["lineage"], task["digests"], writer, counts, rows, None, task["memory_mb"])
    writer.flush_written()
    return writer.files, rows, counts


def build_fragments(wh: Warehouse, *, run_id: str, cfg: StatsConfig | None = None, full: bool = False,
                    lock_timeout: float = 60.0, select: SelectConfig | None = None,
                    progress: Callable[[int], None] | None = None,
                    on_plan: Callable[[int], None] | None = None) -> FragmentSummary:
    """Outcomes, task statistics and fragments. Incremental: an episode is redone only when its
    inputs changed (its batch's redacted rows, split, leak flags or training license; a new
    cluster weight is copied onto its kept fragments), a task's statistics only when one of its
    episodes was or when its stored statistics count other episodes than it has now (episodes
    forgotten: a task none is left of loses its rows); the other rows are kept as they are (with
    the run that made them), and the three tables are swapped in one commit. The result equals a
    full rebuild's (a test compares them)."""
    cfg = cfg or StatsConfig()
    sel = select or SelectConfig()
    summary = FragmentSummary(run_id)
    started = now_utc()
    with wh.write_session("fragments", timeout=lock_timeout) as session:
        mark_running(session, run_id, "fragments", started)
        inputs = inputs_fingerprint(wh, ["redacted_episodes", "redacted_steps", "near_dup_clusters", "splits",
                                         "leak_flags", "eligibility"])
        rules = version(cfg, sel)
        v = f"{rules};inputs={inputs}"
        if not full and is_current(wh, "fragments", v):
            summary.skipped = True
            session.upsert_rows("runs", [run_row(run_id, "fragments", started, params={"version": v, "skipped": True},
                                                 counts=summary.__dict__, code_version=f"{TRANSFORM}@{RULES_VERSION}")])
            return summary
        withheld: dict[str, int] = {}
        seen = Inputs()
        with ThreadPoolExecutor(1) as pool:  # the stored inputs read beside the current ones (DuckDB, outside the GIL)
            stored = pool.submit(lambda: {} if full else _previous(wh, rules))
            current = episode_inputs(wh, sel, withheld, seen)
            previous = stored.result()
        if previous and len(previous) != wh.query("SELECT count(*) FROM outcomes").column(0)[0].as_py():
            previous = {}  # episodes are gone (their tasks are no longer known): everything is redone
        lineage = {"_run_id": run_id, "_transform": TRANSFORM, "_transform_version": v}
        writer = TableSetWriter(session, _MODELS)
        keys, stat_rows, kept = None, [], None
        pool = ThreadPoolExecutor(1)
        if previous:
            keys = sorted(k for k, (d, _) in current.items() if previous.get(k, (None,))[0] != d)
            tasks = sorted({current[k][1] for k in keys} | {previous[k][1] for k in keys if k in previous}
                           | _resized_tasks(wh, current))
            summary.rebuilt = len(keys)
            standing = {k: current[k][0] for k in _outcomes_standing(keys, previous, seen)}
            # the kept rows are copied in a thread while the episodes to redo are redone here (copies
            # are scans and Parquet writes, mostly outside the GIL; 107,000 + 1 %: the stage 3.16 -> 2.56 s)
            kept = pool.submit(_kept, wh, keys, tasks, lineage, standing)
            summary.outcomes_standing = len(standing)
            keys = [k for k in keys if k not in standing]  # redone from their steps
        try:
            todo = sorted(current) if keys is None else keys
            if on_plan:  # the episodes this run redoes
                on_plan(len(todo))
            procs = _processes(len(todo))
            if procs == 1:
                # (their batches as episode_inputs read them: at 108,070 episodes, finding them took
                # 0.1 s alone and up to 0.8 s beside a forget's search)
                _redo(wh, keys, sel, lineage, {k: current[k][0] for k in todo}, writer, summary, stat_rows, progress,
                      batches=None if keys is None else {seen.batch_of.get(k) for k in keys})
            else:  # the episodes dealt out by key range: ranges i, i + procs, ... to process i (this one first)
                n = max(procs, -(-len(todo) // PART_EPISODES))
                ranges = [todo[i * len(todo) // n:(i + 1) * len(todo) // n] for i in range(n)]
                tasks = [{"root": str(wh.root), "ranges": ranges[j::procs], "sel": sel, "lineage": lineage,
                          "digests": {k: current[k][0] for r in ranges[j::procs] for k in r}, "memory_mb": _PART_MEMORY_MB}
                         for j in range(procs)]
                for files, rows, counts in run_parts(_fragments_part, tasks):
                    writer.files += files
                    writer.written |= {f.table for f in files}
                    stat_rows += rows
                    summary.add(counts)
                if progress:
                    progress(len(todo))
            if kept is not None:
                copied, kept_stats = kept.result()
                for table, files in copied:
                    writer.add_written(table, files)
                stat_rows = kept_stats + stat_rows
        finally:  # (on an error too: nothing written after the session)
            pool.shutdown(wait=True, cancel_futures=True)
        if previous or procs > 1:
            stat_rows.sort(key=lambda r: r["trajectory_key"])  # the order one pass over every episode sees them in
        task_stats = [{**r, **lineage} for r in task_statistics(stat_rows, cfg)]
        writer.add("task_stats", task_stats)
        writer.commit(run_id=run_id, version=v)
        summary.tasks = len({r["task_id"] for r in task_stats})
        if previous:
            _totals(wh, summary, withheld)
        params = {"version": v, "config_digest": cfg.config_digest}
        session.upsert_rows("runs", [run_row(run_id, "fragments", started, params=params,
                                             counts=summary.__dict__, code_version=f"{TRANSFORM}@{RULES_VERSION}")])
    return summary
