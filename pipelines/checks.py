"""Asset checks. Those that must stop a bad build are blocking (a failure stops every asset
downstream of the checked one): lineage complete, no secret left in the redacted layer, one
outcome per episode, nothing across splits, fragments only from train, eligibility decided,
packs round-trip. The reconciliation of normalized with raw reports but does not block (a
quarantined record is not a bad build)."""

# no `from __future__ import annotations`: Dagster reads these annotations at runtime

import dagster as dg
from trajwh.dedup.audit import audit_cached
from trajwh.ingest.adapters.registry import adapters
from trajwh.lineage.checks import (
    cached,
    cached_per_batch,
    lineage_gaps,
    passed,
    reconcile_normalized,
)
from trajwh.packing.layer import PACK_INPUTS
from trajwh.pipelines.resources import WarehouseResource
from trajwh.redaction.audit import rescan_by_batch

# every check reads only the tables named with it; a result is reused while their files are unchanged
_LINEAGE_INPUTS = ["raw_records", "lineage_edges"]
# the normalized layer's checks read only the edges normalize wrote (later stages add their own)
_NORMALIZED_EDGES = "table_name <> 'lineage_edges' OR NOT starts_with(coalesce(transform_version, ''), 'redact@')"


def _counts(wh, sql: str) -> dict:
    """A check's one-row count query as a dict."""
    return wh.query(sql).to_pylist()[0]


def _lineage_by_batch(wh, table: str, where: str = "") -> dict:
    """``lineage_gaps`` of ``table`` batch by batch, each batch's result reused while its files
    of the table, its raw records and its edges are unchanged: a new batch is checked alone."""
    return cached_per_batch(wh, f"lineage:{table}", [table, *_LINEAGE_INPUTS],
                            lambda b: lineage_gaps(wh, table, b) if b else lineage_gaps(wh, table), where=where)


def _result(counts: dict) -> dg.AssetCheckResult:
    return dg.AssetCheckResult(passed=passed(counts), metadata={k: int(v) for k, v in counts.items()})


@dg.asset_check(asset="episodes", blocking=True, description="Every episode has lineage columns, a raw parent and an edge.")
def episodes_have_lineage(warehouse: WarehouseResource) -> dg.AssetCheckResult:
    wh = warehouse.get()
    return _result(_lineage_by_batch(wh, "episodes", _NORMALIZED_EDGES))


@dg.asset_check(asset="steps", blocking=True, description="Every step has lineage columns, a raw parent and an edge.")
def steps_have_lineage(warehouse: WarehouseResource) -> dg.AssetCheckResult:
    wh = warehouse.get()
    return _result(_lineage_by_batch(wh, "steps", _NORMALIZED_EDGES))


@dg.asset_check(asset="episodes", description="Each raw record became episodes or was quarantined; "
                "step counts match; ids are unique.")
def normalized_reconciles_with_raw(warehouse: WarehouseResource) -> dg.AssetCheckResult:
    companions = [a.name for a in adapters() if a.companion]
    wh = warehouse.get()
    return _result(reconcile_normalized(wh, companions))


@dg.asset_check(asset="redacted_steps", blocking=True, description="A re-scan of the redacted layer, batch by batch (every touched step plus a "
                "random sample) finds no secret or personal data.")
def redacted_layer_has_no_secrets(warehouse: WarehouseResource) -> dg.AssetCheckResult:
    wh = warehouse.get()
    result = rescan_by_batch(wh)
    return dg.AssetCheckResult(passed=result["secret_violations"] == 0, metadata={
        "steps_scanned": result["steps_scanned"], "secret_violations": result["secret_violations"],
        "cached": int(result["cached"]), "batches_cached": result["batches_cached"],
        "examples": dg.MetadataValue.json(result["examples"])})


@dg.asset_check(asset="redacted_steps", blocking=True, description="Every redacted step has lineage to its normalized step.")
def redacted_steps_have_lineage(warehouse: WarehouseResource) -> dg.AssetCheckResult:
    wh = warehouse.get()
    return _result(_lineage_by_batch(wh, "redacted_steps"))


@dg.asset_check(asset="splits", blocking=True,
                description="Nothing leaks across splits: no task group or near-duplicate cluster crosses train and "
                            "evaluation, no train episode works on a repository state later than the fix of an "
                            "evaluation task of the same repository, no leak-flagged episode is evaluated.")
def no_group_crosses_splits(warehouse: WarehouseResource) -> dg.AssetCheckResult:
    a = audit_cached(warehouse.get())
    return dg.AssetCheckResult(passed=a["violations"] == 0, metadata={
        "groups_across_splits": a["groups_across_splits"], "clusters_across_splits": a["clusters_across_splits"],
        "train_after_eval_fix_pairs": a["train_after_eval_fix_pairs"], "leak_flagged_in_eval": a["leak_flagged_in_eval"],
        "held_out": a["held_out"], "largest_group_share": a["largest_group_share"],
        "time_flagged_episodes": len({t["trajectory_key"] for t in a["time_flagged"]}),
        "not_eligible_no_times": a["not_eligible_no_times"], "warnings": dg.MetadataValue.json(a["warnings"]),
        "cached": int(a.get("cached", False))})


@dg.asset_check(asset="outcomes", blocking=True, description="Exactly one outcome per redacted episode; infrastructure "
                "failures never feed a fragment.")
def one_outcome_per_episode(warehouse: WarehouseResource) -> dg.AssetCheckResult:
    wh = warehouse.get()
    return _result(cached(wh, "one_outcome", ["redacted_episodes", "outcomes", "fragments"], lambda: _outcome_counts(wh)))


def _outcome_counts(wh) -> dict:
    r = _counts(wh, """SELECT (SELECT count(*) FROM redacted_episodes) AS episodes, (SELECT count(*) FROM outcomes) AS outcomes,
                           (SELECT count(*) - count(DISTINCT trajectory_key) FROM outcomes) AS duplicate_violations,
                           (SELECT count(*) FROM fragments f JOIN outcomes o USING (trajectory_key) WHERE o.quarantined)
                               AS quarantined_fragment_violations""")
    r["missing_violations"] = r["episodes"] - r["outcomes"]
    return r


@dg.asset_check(asset="fragments", blocking=True,
                description="Training fragments come only from train episodes: none from valid, test or held-out "
                            "episodes, none from leak-flagged ones unless [leaks] train_fragments allows it, none "
                            "from episodes the license policy or an opt-out keeps out of training.")
def fragments_only_from_train(warehouse: WarehouseResource) -> dg.AssetCheckResult:
    allow_leaks = warehouse.settings().leaks.train_fragments
    wh = warehouse.get()
    return _result(cached(wh, f"fragments_only_from_train:{allow_leaks}", ["fragments", "splits", "leak_flags", "eligibility"],
                          lambda: _fragment_counts(wh, allow_leaks)))


def _fragment_counts(wh, allow_leaks: bool) -> dict:
    r = _counts(wh, """
        SELECT (SELECT count(*) FROM fragments f JOIN splits s USING (trajectory_key) WHERE s.split <> 'train')
                   AS not_train_violations,
               (SELECT count(DISTINCT f.fragment_id) FROM fragments f JOIN leak_flags l USING (trajectory_key)
                 WHERE l.kind <> 'fix_after_cutoff') AS leak_flagged_fragments,
               (SELECT count(*) FROM fragments f JOIN eligibility g USING (trajectory_key) WHERE g.train <> 'allow')
                   AS not_eligible_violations,
               (SELECT count(*) FROM fragments) AS fragments""")
    if not allow_leaks:
        r["leak_flagged_violations"] = r.pop("leak_flagged_fragments")
    return r


_PACK_INPUTS = ["packs", *PACK_INPUTS]
#: the build's check scans one unit in this many for secret shapes (every segment is still checked
#: against its rendering); at 107,000 episodes scanning every rendering cost more than packing them
PACK_SECRET_SAMPLE = 20
#: ... and encodes one unit in this many again, token for token; every other one is checked by its
#: layout (exact text, special tokens and mask: ``packing.verify``): encoding them all was 40 % of
#: the check, and the merges inside a piece are the encoder's own
PACK_TOKEN_SAMPLE = 20


@dg.asset_check(asset="packs", blocking=True,
                description="The configured pack set round-trips: every segment decodes to its unit's rendering "
                            "exactly, with the template's special tokens at the template's places and the mask on "
                            "exactly the trained pieces (one unit in 20 encoded again and compared token for token), "
                            "its trained tokens decode to the span's model text; no pack mixes splits or holds "
                            "another split's episode; the redaction detector finds nothing in the decoded text "
                            "(also `trajwh verify-packs`, which encodes every unit again). Segments "
                            "whose tokens an earlier passing check verified for the same inputs are not rendered "
                            "again (their splits and structure are).")
def packs_round_trip(warehouse: WarehouseResource) -> dg.AssetCheckResult:
    from trajwh.packing.layer import pack_set_id
    from trajwh.packing.verify import verify_packs
    from trajwh.pipelines.assets import PacksConfig, pack_config

    wh = warehouse.get()
    cfg = pack_config(PacksConfig(), warehouse)
    pack_set = pack_set_id(cfg)
    if not wh.query("SELECT count(*) FROM packs WHERE pack_set = ?", [pack_set]).column(0)[0].as_py():
        # nothing to verify: no unit was eligible, or every one was dropped (the packs run counts them)
        return dg.AssetCheckResult(passed=True, metadata={
            "pack_set": pack_set, "segments": 0,
            "note": "the pack set holds no sequences: no trainable unit, or every unit dropped as over-length"})
    r = cached(wh, f"verify_packs:{pack_set}", _PACK_INPUTS,
               lambda: verify_packs(wh, pack_set, secret_sample=PACK_SECRET_SAMPLE,
                                    token_sample=PACK_TOKEN_SAMPLE, ledger=True))
    return dg.AssetCheckResult(passed=passed(r), metadata={
        "pack_set": pack_set, **{k: int(v) for k, v in r.items() if isinstance(v, int | bool)},
        "examples": dg.MetadataValue.json(r["examples"])})


@dg.asset_check(asset="eligibility", blocking=True,
                description="Every redacted episode has exactly one eligibility row and at least one license fact; "
                            "an episode an active opt-out matches is blocked for both uses; a row not allowed for a "
                            "use says why.")
def every_episode_decided(warehouse: WarehouseResource) -> dg.AssetCheckResult:
    wh = warehouse.get()
    return _result(cached(wh, "every_episode_decided", ["redacted_episodes", "eligibility", "license_facts"],
                          lambda: _eligibility_counts(wh)))


def _eligibility_counts(wh) -> dict:
    return _counts(wh, """
        SELECT (SELECT count(*) FROM redacted_episodes e WHERE NOT EXISTS
                    (SELECT 1 FROM eligibility g WHERE g.trajectory_key = e.trajectory_key)) AS undecided_violations,
               (SELECT count(*) FROM (SELECT trajectory_key FROM eligibility GROUP BY 1 HAVING count(*) > 1))
                   AS duplicate_violations,
               (SELECT count(*) FROM eligibility g WHERE NOT EXISTS
                    (SELECT 1 FROM license_facts f WHERE f.trajectory_key = g.trajectory_key)) AS no_fact_violations,
               (SELECT count(*) FROM eligibility WHERE len(opt_out_ids) > 0 AND (train <> 'block' OR release <> 'block'))
                   AS opted_out_not_blocked_violations,
               (SELECT count(*) FROM eligibility WHERE (train <> 'allow' OR release <> 'allow') AND len(reasons) = 0)
                   AS no_reason_violations,
               (SELECT count(*) FROM eligibility) AS episodes""")


# --- integrity of every other asset: each asset has at least one check -------------------------


@dg.asset_check(asset="raw_records", blocking=True,
                description="Record ids are unique; each record's byte length is its payload's; each belongs to a "
                            "committed batch.")
def raw_records_are_whole(warehouse: WarehouseResource) -> dg.AssetCheckResult:
    wh = warehouse.get()
    return _result(cached(wh, "raw_records_are_whole", ["raw_records"], lambda: _counts(wh, """
        SELECT count(*) AS records, count(*) - count(DISTINCT record_id) AS duplicate_violations,
               count(*) FILTER (WHERE byte_length <> octet_length(payload)) AS length_violations,
               count(*) FILTER (WHERE batch_id NOT IN (SELECT batch_id FROM batches)) AS batch_violations
        FROM raw_records""")))


@dg.asset_check(asset="redacted_episodes", blocking=True,
                description="One redacted episode per key, each made from a normalized episode.")
def redacted_episodes_are_one_per_episode(warehouse: WarehouseResource) -> dg.AssetCheckResult:
    wh = warehouse.get()
    return _result(cached(wh, "redacted_one_per_episode", ["redacted_episodes", "episodes"], lambda: _counts(wh, """
        SELECT count(*) AS episodes, count(*) - count(DISTINCT trajectory_key) AS duplicate_violations,
               count(*) FILTER (WHERE trajectory_key NOT IN (SELECT trajectory_key FROM episodes)) AS orphan_violations
        FROM redacted_episodes""")))


@dg.asset_check(asset="redaction_events", description="Every replacement names a redacted episode and a non-empty span.")
def redaction_events_point_at_redacted_rows(warehouse: WarehouseResource) -> dg.AssetCheckResult:
    wh = warehouse.get()
    return _result(cached(wh, "events_point_at_rows", ["redaction_events", "redacted_episodes"], lambda: _counts(wh, """
        SELECT count(*) AS events,
               count(*) FILTER (WHERE trajectory_key NOT IN (SELECT trajectory_key FROM redacted_episodes))
                   AS orphan_violations,
               count(*) FILTER (WHERE "end" <= start) AS span_violations
        FROM redaction_events""")))


@dg.asset_check(asset="episode_features", blocking=True,
                description="Each featurized batch has one features row per redacted episode of that batch, and none "
                            "for an episode it does not hold (a batch not yet featurized, in a run of other batches' "
                            "partitions, is not counted).")
def features_one_per_episode(warehouse: WarehouseResource) -> dg.AssetCheckResult:
    wh = warehouse.get()
    return _result(cached(wh, "features_one_per_episode", ["episode_features", "redacted_episodes"], lambda: _counts(wh, """
        WITH f AS (SELECT _batch_id AS b, trajectory_key FROM episode_features),
             r AS (SELECT _batch_id AS b, trajectory_key FROM redacted_episodes WHERE _batch_id IN (SELECT b FROM f))
        SELECT (SELECT count(*) FROM f) AS features,
               (SELECT count(*) - count(DISTINCT trajectory_key) FROM f) AS duplicate_violations,
               (SELECT count(*) FROM (SELECT * FROM r EXCEPT SELECT * FROM f)) AS missing_violations,
               (SELECT count(*) FROM (SELECT * FROM f EXCEPT SELECT * FROM r)) AS orphan_violations""")))


@dg.asset_check(asset="near_dup_clusters",
                description="Each episode in one cluster; each cluster has exactly one representative and the size "
                            "its rows say.")
def one_representative_per_cluster(warehouse: WarehouseResource) -> dg.AssetCheckResult:
    wh = warehouse.get()
    return _result(cached(wh, "one_representative", ["near_dup_clusters"], lambda: _counts(wh, """
        SELECT (SELECT count(*) - count(DISTINCT trajectory_key) FROM near_dup_clusters) AS duplicate_violations,
               count(*) AS clusters, count(*) FILTER (WHERE reps <> 1) AS representative_violations,
               count(*) FILTER (WHERE n <> size) AS size_violations
        FROM (SELECT cluster_id, count(*) FILTER (WHERE is_representative) AS reps, count(*) AS n,
                     any_value(cluster_size) AS size FROM near_dup_clusters GROUP BY 1)""")))


@dg.asset_check(asset="task_groups", description="Each episode in one task group, of the size its rows say.")
def one_group_per_episode(warehouse: WarehouseResource) -> dg.AssetCheckResult:
    wh = warehouse.get()
    return _result(cached(wh, "one_group", ["task_groups"], lambda: _counts(wh, """
        SELECT (SELECT count(*) - count(DISTINCT trajectory_key) FROM task_groups) AS duplicate_violations,
               count(*) AS groups, count(*) FILTER (WHERE n <> size) AS size_violations
        FROM (SELECT group_id, count(*) AS n, any_value(group_size) AS size FROM task_groups GROUP BY 1)""")))


@dg.asset_check(asset="leak_flags", description="Every leak flag names an episode of the splits.")
def leak_flags_name_split_episodes(warehouse: WarehouseResource) -> dg.AssetCheckResult:
    wh = warehouse.get()
    return _result(cached(wh, "leak_flags_known", ["leak_flags", "splits"], lambda: _counts(wh, """
        SELECT count(*) AS flags,
               count(*) FILTER (WHERE trajectory_key NOT IN (SELECT trajectory_key FROM splits)) AS unknown_episode_violations
        FROM leak_flags""")))


@dg.asset_check(asset="task_stats", description="Statistics only for tasks the redacted layer holds; attempts never "
                "fewer than successes.")
def task_stats_are_of_known_tasks(warehouse: WarehouseResource) -> dg.AssetCheckResult:
    wh = warehouse.get()
    return _result(cached(wh, "task_stats_known", ["task_stats", "redacted_episodes"], lambda: _counts(wh, """
        SELECT count(*) AS rows,
               count(*) FILTER (WHERE task_id NOT IN (SELECT task_id FROM redacted_episodes)) AS unknown_task_violations,
               count(*) FILTER (WHERE successes > attempts) AS count_violations
        FROM task_stats""")))


@dg.asset_check(asset="license_facts", description="Every license fact has a known status; a valid one its expression.")
def license_facts_are_explained(warehouse: WarehouseResource) -> dg.AssetCheckResult:
    wh = warehouse.get()
    return _result(cached(wh, "license_facts_explained", ["license_facts"], lambda: _counts(wh, """
        SELECT count(*) AS facts,
               count(*) FILTER (WHERE status NOT IN ('valid', 'invalid', 'unknown')) AS status_violations,
               count(*) FILTER (WHERE status = 'valid' AND expression IS NULL) AS expression_violations
        FROM license_facts""")))


@dg.asset_check(asset="data_card", description="The card's figures are the warehouse's (raw records and episodes), and "
                "its page holds no script.")
def card_agrees_with_warehouse(warehouse: WarehouseResource) -> dg.AssetCheckResult:
    import hashlib
    import json

    wh = warehouse.get()
    folder = wh.root / "card"
    if not (folder / "card.json").exists():
        return dg.AssetCheckResult(passed=False, metadata={"missing": str(folder / "card.json")})
    doc, page = (folder / "card.json").read_bytes(), (folder / "card.html").read_bytes()

    def compute() -> dict:
        funnel = json.loads(doc)["sections"]["funnel"]
        have = _counts(wh, "SELECT (SELECT count(*) FROM raw_records) AS raw, "
                           "(SELECT count(*) FROM redacted_episodes) AS episodes")
        return {"raw_records": have["raw"], "episodes": have["episodes"],
                "raw_violations": int(funnel.get("present", False) and funnel["raw_records"] != have["raw"]),
                "episode_violations": int(funnel.get("present", False) and funnel["episodes"] != have["episodes"]),
                "script_violations": int(b"<script" in page.lower())}

    digest = hashlib.sha256(doc + page).hexdigest()[:16]  # the card as written: another card, another result
    return _result(cached(wh, f"card_agrees:{digest}", ["raw_records", "redacted_episodes"], compute))


ALL_CHECKS = [raw_records_are_whole, redacted_episodes_are_one_per_episode, redaction_events_point_at_redacted_rows,
              features_one_per_episode,
              one_representative_per_cluster, one_group_per_episode, leak_flags_name_split_episodes,
              task_stats_are_of_known_tasks, license_facts_are_explained, card_agrees_with_warehouse,
              every_episode_decided, packs_round_trip, fragments_only_from_train, one_outcome_per_episode, no_group_crosses_splits, redacted_layer_has_no_secrets, redacted_steps_have_lineage, episodes_have_lineage, steps_have_lineage, normalized_reconciles_with_raw]
