"""Build ``outcomes``, ``task_stats`` and ``fragments`` from the redacted and curated layers.

Global, like curation: the three tables are rebuilt together and swapped in one commit; a run
with unchanged inputs and rules is skipped. Each fragment carries its span, kind, reward,
evidence source and confidence, selection reason, the dedup weight, split and leak status of its
episode, and its step ids (lineage to ``redacted_steps``).

Which episodes give training fragments (ARCHITECTURE.md section 1): only ``train`` ones (or
episodes not curated yet); evaluation splits and held-out episodes never do; leak-flagged
episodes (an agent that saw the future) do not either, unless ``SelectConfig.leak_fragments``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson

from fragments.context import choose_context
from fragments.outcomes import OUTCOME_RULES_VERSION, classify_outcome
from fragments.select import RULES_VERSION, Fragment, SelectConfig, select_fragments
from fragments.task_stats import StatsConfig, task_statistics
from lineage.catalog import Warehouse, now_utc
from lineage.rebuild import TableSetWriter, inputs_fingerprint, is_current, mark_running, run_row
from schemas.tables import FragmentRow, OutcomeRow, TaskStatsRow

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


def version(cfg: StatsConfig, sel: SelectConfig) -> str:
    return (f"{TRANSFORM}@outcomes={OUTCOME_RULES_VERSION};select={RULES_VERSION};"
            f"prior={cfg.prior_alpha:g},{cfg.prior_beta:g};level={cfg.level};recency={cfg.recency_half_life_days:g};"
            f"pooled={cfg.pooled};refs={','.join(cfg.reference_policies)};leak_fragments={sel.leak_fragments};"
            f"controls={sel.controls};context={sel.context_budget_chars}")


def gives_fragments(split: str | None, leak_kinds: list[str], sel: SelectConfig) -> bool:
    return split in (None, "train") and (sel.leak_fragments or not leak_kinds)


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


_EPISODES_SQL = """
    SELECT e.*, c.weight AS dedup_weight, s.split,
           coalesce((SELECT list(DISTINCT l.kind ORDER BY l.kind) FROM leak_flags l
                     WHERE l.trajectory_key = e.trajectory_key AND l.kind <> 'fix_after_cutoff'), []) AS leak_kinds
    FROM redacted_episodes e
    LEFT JOIN near_dup_clusters c USING (trajectory_key) LEFT JOIN splits s USING (trajectory_key)
    ORDER BY e.trajectory_key"""
_STEPS_SQL = """
    SELECT trajectory_key, step_id, step_index, author, role, text, observation, exit_code,
           action_kind, action_object, action_command, test_results,
           json_extract(metadata, '$.tests_summary') AS tests_summary
    FROM redacted_steps ORDER BY trajectory_key, step_index"""


def _episodes_with_steps(wh: Warehouse):
    """(episode, its steps) in trajectory-key order, merged from two ordered streams."""
    step_stream, episode_stream = wh.stream(_STEPS_SQL), wh.stream(_EPISODES_SQL, batch_rows=2_000)
    try:
        steps = (s for batch in step_stream for s in batch)
        pending = next(steps, None)
        for batch in episode_stream:
            for e in batch:
                key, mine = e["trajectory_key"], []
                while pending is not None and pending["trajectory_key"] < key:
                    pending = next(steps, None)  # steps of an episode that is gone: skipped
                while pending is not None and pending["trajectory_key"] == key:
                    if pending["tests_summary"]:
                        pending["tests_summary"] = orjson.loads(pending["tests_summary"])
                    mine.append(pending)
                    pending = next(steps, None)
                yield e, mine
    finally:  # the catalog connections close here, before the stage commits
        step_stream.close()
        episode_stream.close()


def build_fragments(wh: Warehouse, *, run_id: str, cfg: StatsConfig | None = None, full: bool = False,
                    lock_timeout: float = 60.0, select: SelectConfig | None = None) -> FragmentSummary:
    cfg = cfg or StatsConfig()
    sel = select or SelectConfig()
    summary = FragmentSummary(run_id)
    started = now_utc()
    with wh.write_session("fragments", timeout=lock_timeout) as session:
        mark_running(session, run_id, "fragments", started)
        inputs = inputs_fingerprint(wh, ["redacted_episodes", "redacted_steps", "near_dup_clusters", "splits",
                                         "leak_flags"])
        v = f"{version(cfg, sel)};inputs={inputs}"
        if not full and is_current(wh, "fragments", v):
            summary.skipped = True
            session.upsert_rows("runs", [run_row(run_id, "fragments", started, params={"version": v, "skipped": True},
                                                 counts=summary.__dict__, code_version=f"{TRANSFORM}@{RULES_VERSION}")])
            return summary
        lineage = {"_run_id": run_id, "_transform": TRANSFORM, "_transform_version": v}
        writer = TableSetWriter(session, _MODELS)
        stat_rows = []
        # episodes and their steps stream in trajectory-key order, side by side: one episode's
        # steps in memory at a time, never the layer (DuckDB sorts and spills within its limit)
        for e, steps in _episodes_with_steps(wh):
            summary.episodes += 1
            o = classify_outcome(e, steps)
            writer.add("outcomes", {"trajectory_key": e["trajectory_key"], "outcome": o.outcome, "cause": o.cause,
                                    "policy_failure": o.policy_failure, "quarantined": o.quarantined,
                                    "evidence_field": o.evidence_field, "evidence_step": o.evidence_step,
                                    "evidence": o.evidence, "rules_version": OUTCOME_RULES_VERSION, **lineage})
            summary.causes[o.cause] = summary.causes.get(o.cause, 0) + 1
            stat_rows.append({"task_id": e["task_id"] or e["instance_id"] or f"episode:{e['trajectory_key']}",
                              "cause": o.cause, "policy_name": e["policy_name"], "harness_name": e["harness_name"],
                              "started_at": e["started_at"]})
            step_id = {s["step_index"]: s["step_id"] for s in steps}
            if not gives_fragments(e["split"], e["leak_kinds"], sel):
                why = "leak_flagged" if e["split"] == "train" else e["split"]
                summary.withheld[why] = summary.withheld.get(why, 0) + 1
                continue
            for f in select_fragments(e, steps, o.cause, o.quarantined, sel):
                writer.add("fragments", {**fragment_row(f, steps, step_id, sel), "dedup_weight": e["dedup_weight"],
                                         "split": e["split"], "leak_kinds": e["leak_kinds"], **lineage})
                summary.fragments[f.kind] = summary.fragments.get(f.kind, 0) + 1
        task_stats = [{**r, **lineage} for r in task_statistics(stat_rows, cfg)]
        writer.add("task_stats", task_stats)
        writer.commit(run_id=run_id, version=v)
        summary.tasks = len({r["task_id"] for r in task_stats})
        params = {"version": v, "config_digest": cfg.config_digest}
        session.upsert_rows("runs", [run_row(run_id, "fragments", started, params=params,
                                             counts=summary.__dict__, code_version=f"{TRANSFORM}@{RULES_VERSION}")])
    return summary
