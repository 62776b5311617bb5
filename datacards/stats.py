"""The data card's numbers, computed from the catalog (never typed by hand) into one JSON document.

Every figure comes from a SQL query over the warehouse's tables (the test recomputes them with its
own SQL). A section whose layer is not built says so (``present: false``) instead of failing.
``--split S`` scopes the episode-level sections (outcomes, redaction, fragments, packs) to the
episodes of one split; provenance, the raw-record funnel head and deletions stay warehouse-wide.

Only counts, shares, ids of transforms and public settings: never a redacted value, an opt-out's
match value, or a deleted record's content (deletions come from tombstones only).
"""

from __future__ import annotations

from contextlib import closing
from datetime import datetime
from typing import Any

import orjson
from trajwh.fragments.outcomes import INFRASTRUCTURE, NOT_THE_HARNESS, POLICY_FAILURES
from trajwh.licenses.report import opt_outs_applied, reason_counts
from trajwh.lineage.catalog import Warehouse, now_utc
from trajwh.schemas.tables import SCHEMA_VERSION

CARD_SCHEMA_VERSION = "1.0.0"
SPLITS = ("train", "valid", "test", "held_out")


def _share(n: int | float | None, total: int | float | None) -> float | None:
    return round(n / total, 4) if n is not None and total else None


#: the columns of the redacted episodes the card's sections read
_EPISODE_COLUMNS = ("trajectory_key", "started_at", "format", "harness_name", "harness_version", "policy_name",
                    "policy_checkpoint", "verifier_name", "verifier_commit", "task_id", "instance_id")


class _Q:
    """One read-only connection; ``episodes`` is the card's scope (all redacted episodes, or one split's)."""

    def __init__(self, wh: Warehouse, split: str | None):
        self.wh, self.split = wh, split
        self.con = wh.connect(read_only=True)
        built = {r[0] for r in self.con.execute("SELECT DISTINCT table_name FROM table_files").fetchall()}
        self.built = built
        scope = f"SELECT {', '.join(_EPISODE_COLUMNS)} FROM redacted_episodes"
        if split:
            scope += f" WHERE trajectory_key IN (SELECT trajectory_key FROM splits WHERE split = '{split}')"
        # read once: every section filters by it (a view read the layer's files again in each query)
        self.con.execute(f"CREATE TEMP TABLE card_episodes AS {scope}")

    def rows(self, sql: str, params: list[Any] | None = None) -> list[dict[str, Any]]:
        cur = self.con.execute(sql, params or [])
        names = [d[0] for d in cur.description]
        return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]

    def one(self, sql: str, params: list[Any] | None = None) -> Any:
        return self.con.execute(sql, params or []).fetchall()[0][0]

    def has(self, *tables: str) -> bool:
        return all(t in self.built for t in tables)

    def close(self) -> None:
        self.con.close()


def _iso(v: Any) -> Any:
    return v.isoformat() if isinstance(v, datetime) else v


def collect_card(wh: Warehouse, split: str | None = None, license_policy: dict[str, Any] | None = None) -> dict[str, Any]:
    """The card document (``generated_at`` is the only field that changes between two runs on
    the same warehouse). ``license_policy``: the ``[licenses]`` settings in force (else read from
    the warehouse's trajwh.toml), shown as the license filter applied."""
    if split is not None and split not in SPLITS:
        from trajwh.schemas.errors import ConfigError

        raise ConfigError(f"unknown split {split!r}", valid=", ".join(SPLITS))
    wh.require()
    with closing(_Q(wh, split)) as q:
        sections = {
            "provenance": _provenance(q),
            "licenses": _licenses(q, license_policy if license_policy is not None else policy_of(wh)),
            "funnel": _funnel(q),
            "outcomes": _outcomes(q),
            "redaction": _redaction(q),
            "splits": _splits(q),
            "fragments": _fragments(q),
            "packs": _packs(q),
            "deletions": _deletions(q),
        }
        episodes = q.one("SELECT count(*) FROM card_episodes")
    return {
        "card_schema_version": CARD_SCHEMA_VERSION,
        "generated_at": now_utc().isoformat(timespec="seconds"),
        "pretty_name": "Agent trajectories" + (f" ({split} split)" if split else ""),
        "scope": {"split": split, "episodes": episodes},
        "sections": sections,
        "how_to": {
            "trace": "trajwh trace ID (a fragment, step, trajectory key, record id, or PACK_ID:OFFSET) walks back to "
                     "the raw record, file, line and byte offset",
            "delete": "trajwh impact SELECTOR shows what a deletion touches; trajwh forget SELECTOR --reason TEXT "
                      "deletes it from every layer and proves it (docs/forget.md); trajwh opt-out add SELECTOR keeps "
                      "data out of training and release (docs/licenses.md)",
        },
    }


def _provenance(q: _Q) -> dict[str, Any]:
    if not q.has("raw_records"):
        return {"present": False, "note": "nothing ingested"}
    # (no ingest times: the card of the same data must not change with when it was ingested)
    sources = q.rows("""SELECT source, coalesce(license, '(none given)') AS license, count(*) AS batches,
                               sum(n_new)::BIGINT AS records FROM batches GROUP BY ALL ORDER BY source, license""")
    window = q.rows("SELECT min(started_at) AS first, max(started_at) AS last FROM card_episodes")[0]

    def counts(col: str, version: str) -> list[dict[str, Any]]:
        return q.rows(f"""SELECT coalesce({col}, '(unknown)') AS name, coalesce({version}, '(unknown)') AS version,
                                 count(*) AS episodes FROM card_episodes GROUP BY ALL ORDER BY episodes DESC, name, version""")

    transforms = q.rows("""SELECT table_name AS "table", list(DISTINCT split_part(transform_version, ';', 1)
                                  ORDER BY split_part(transform_version, ';', 1)) AS transforms
                           FROM table_files WHERE transform_version IS NOT NULL GROUP BY 1 ORDER BY 1""")
    return {"present": True, "sources": [{k: _iso(v) for k, v in r.items()} for r in sources],
            "collection_window": {k: _iso(v) for k, v in window.items()},
            "harnesses": counts("harness_name", "harness_version"),
            "policies": counts("policy_name", "policy_checkpoint"),
            "verifiers": counts("verifier_name", "verifier_commit"),
            "formats": q.rows("SELECT format, count(*) AS episodes FROM card_episodes GROUP BY 1 ORDER BY 2 DESC, 1"),
            "ingest_batches": q.one("SELECT count(*) FROM batches"),
            "schema_version": SCHEMA_VERSION, "transforms": transforms}


def policy_of(source: Warehouse | Any) -> dict[str, Any]:
    """The license filter in force: of ``Settings``, or of the warehouse's trajwh.toml."""
    from trajwh.schemas.config import load_settings

    lic = (load_settings(None, source.root) if isinstance(source, Warehouse) else source).licenses
    return {use: getattr(lic, use).model_dump(mode="json") for use in ("train", "release")}


def _licenses(q: _Q, policy: dict[str, Any]) -> dict[str, Any]:
    if not q.has("eligibility"):
        return {"present": False, "note": "the eligibility step has not run (trajwh build)"}
    scoped = "trajectory_key IN (SELECT trajectory_key FROM card_episodes)"
    licenses = q.rows(f"""SELECT kind, coalesce(expression, status) AS license, count(DISTINCT trajectory_key) AS episodes
                          FROM license_facts WHERE {scoped} GROUP BY ALL ORDER BY kind, episodes DESC, license""")
    eligibility = q.rows(f"""SELECT eligibility, count(*) AS episodes FROM eligibility WHERE {scoped}
                             GROUP BY 1 ORDER BY 2 DESC, 1""")
    reasons = reason_counts(q.rows, scoped)
    digests = q.rows(f"SELECT DISTINCT policy_digest FROM eligibility WHERE {scoped} ORDER BY 1")
    opt_outs = opt_outs_applied(q.rows, scoped)
    return {"present": True, "licenses": licenses, "eligibility": eligibility, "reasons": reasons,
            "policy_digests": [r["policy_digest"] for r in digests], "filter": policy, "opt_outs": opt_outs,
            "spdx": sorted({r["license"] for r in licenses if r["kind"] == "source" and r["license"] not in
                            ("unknown", "invalid")})}


def _funnel(q: _Q) -> dict[str, Any]:
    """From raw candidates to training tokens: each step a count and its share of the raw records."""
    if not q.has("raw_records"):
        return {"present": False, "note": "nothing ingested"}
    raw = q.one("SELECT count(*) FROM raw_records")
    quarantined = q.rows("SELECT reason_code AS reason, count(*) AS n FROM quarantine GROUP BY 1 ORDER BY 2 DESC, 1")
    for r in quarantined:  # of every candidate: the records kept and the ones quarantined
        r["share"] = _share(r["n"], raw + sum(x["n"] for x in quarantined))
    episodes = q.one("SELECT count(*) FROM card_episodes")
    out: dict[str, Any] = {"present": True, "raw_records": raw,
                           "quarantined": {"total": sum(r["n"] for r in quarantined), "by_reason": quarantined},
                           "episodes": episodes, "steps": []}
    steps = out["steps"]
    steps.append({"step": "raw records", "count": raw})
    steps.append({"step": "episodes", "count": episodes})
    if q.has("near_dup_clusters"):
        dup = q.rows("""SELECT count(*) FILTER (WHERE c.cluster_size > 1) AS members,
                               count(DISTINCT c.cluster_id) FILTER (WHERE c.cluster_size > 1) AS clusters,
                               count(*) FILTER (WHERE NOT c.is_representative) AS not_representative
                        FROM near_dup_clusters c JOIN card_episodes e USING (trajectory_key)""")[0]
        out["near_duplicates"] = dup
        steps.append({"step": "near-duplicate representatives", "count": episodes - (dup["not_representative"] or 0)})
    if q.has("splits", "outcomes"):
        out["excluded_from_training"] = q.rows("""
            SELECT why, count(*) AS episodes FROM (
                SELECT CASE WHEN s.split IS NULL THEN 'not curated'
                            WHEN s.split <> 'train' THEN 'evaluation or held out (' || s.split || ')'
                            WHEN l.trajectory_key IS NOT NULL THEN 'leak flagged'
                            WHEN g.train IS DISTINCT FROM 'allow' AND g.trajectory_key IS NOT NULL THEN 'license or opt-out'
                            WHEN o.quarantined THEN 'outcome unknown or infrastructure'
                            ELSE NULL END AS why
                FROM card_episodes e LEFT JOIN splits s USING (trajectory_key)
                LEFT JOIN (SELECT DISTINCT trajectory_key FROM leak_flags WHERE kind <> 'fix_after_cutoff') l
                     USING (trajectory_key)
                LEFT JOIN eligibility g USING (trajectory_key) LEFT JOIN outcomes o USING (trajectory_key))
            WHERE why IS NOT NULL GROUP BY 1 ORDER BY 2 DESC, 1""")
        for r in out["excluded_from_training"]:
            r["share_of_episodes"] = _share(r["episodes"], episodes)
    if q.has("fragments"):
        with_fragments = q.one("SELECT count(DISTINCT trajectory_key) FROM fragments WHERE trainable AND "
                               "trajectory_key IN (SELECT trajectory_key FROM card_episodes)")
        steps.append({"step": "episodes giving training fragments", "count": with_fragments})
        steps.append({"step": "training fragments", "count": q.one(
            "SELECT count(*) FROM fragments WHERE trainable AND trajectory_key IN (SELECT trajectory_key FROM card_episodes)")})
    if q.has("packs"):
        steps.append({"step": "trainable tokens (all pack sets)", "count": int(q.one(
            "SELECT coalesce(sum(n_trainable), 0) FROM packs" + _pack_scope(q)))})
    for s in steps:
        s["share_of_raw"] = None if "tokens" in s["step"] else _share(s["count"], raw)
    return out


def _pack_scope(q: _Q) -> str:
    return f" WHERE split = '{q.split}'" if q.split else ""


def _outcomes(q: _Q) -> dict[str, Any]:
    if not q.has("outcomes"):
        return {"present": False, "note": "outcomes not built"}
    causes = q.rows("""SELECT o.outcome, o.cause, o.policy_failure, count(*) AS episodes
                       FROM outcomes o JOIN card_episodes e USING (trajectory_key) GROUP BY ALL ORDER BY 4 DESC, 2""")
    total = sum(r["episodes"] for r in causes)
    for r in causes:
        r["share"] = _share(r["episodes"], total)
        r["kind"] = ("resolved" if r["outcome"] == "resolved" else "policy failure" if r["cause"] in POLICY_FAILURES
                     else "infrastructure failure" if r["cause"] in INFRASTRUCTURE else "unknown")
    by_kind: dict[str, int] = {}
    for r in causes:
        by_kind[r["kind"]] = by_kind.get(r["kind"], 0) + r["episodes"]
    env = ["environment_failure", "resource_exhausted"]
    eta = q.rows("""SELECT coalesce(e.harness_name, '(none)') AS harness, count(*) AS episodes,
                           count(*) FILTER (WHERE o.cause <> 'unknown') AS known,
                           count(*) FILTER (WHERE list_contains(?, o.cause)) AS environment_errors,
                           count(*) FILTER (WHERE o.cause = 'verifier_unavailable') AS verifier_errors
                    FROM outcomes o JOIN card_episodes e USING (trajectory_key) GROUP BY 1 ORDER BY 1""", [env])
    for r in eta:
        r["eta"] = _share(r["known"] - r["environment_errors"] - r["verifier_errors"], r["known"])
    matrix = q.rows("""SELECT coalesce(e.policy_name, '(none)') AS policy, coalesce(e.harness_name, '(none)') AS harness,
                              count(*) AS episodes, count(*) FILTER (WHERE o.outcome = 'resolved') AS resolved
                       FROM outcomes o JOIN card_episodes e USING (trajectory_key)
                       WHERE NOT list_contains(?, o.cause) GROUP BY ALL ORDER BY 1, 2""", [sorted(NOT_THE_HARNESS)])
    for r in matrix:
        r["success_rate"] = _share(r["resolved"], r["episodes"])
    out: dict[str, Any] = {"present": True, "episodes": total, "by_kind": dict(sorted(by_kind.items())),
                           "causes": causes, "effective_rate": eta, "policy_harness": matrix}
    if q.has("task_stats"):
        scoped = ("task_id IN (SELECT coalesce(nullif(task_id, ''), nullif(instance_id, ''), 'episode:' || "
                  "trajectory_key) FROM card_episodes)")
        out["tasks"] = {
            "tasks": q.one(f"SELECT count(DISTINCT task_id) FROM task_stats WHERE {scoped}"),
            "all_fail": q.rows(f"""SELECT all_fail AS diagnosis, count(DISTINCT task_id) AS tasks FROM task_stats
                                   WHERE level = 'task_policy' AND all_fail IS NOT NULL AND {scoped}
                                   GROUP BY 1 ORDER BY 1"""),
            "posterior_mean_histogram": q.rows(f"""
                SELECT least(floor(posterior_mean * 10), 9)::INT AS bin, count(*) AS task_policies FROM task_stats
                WHERE level = 'task_policy' AND {scoped} GROUP BY 1 ORDER BY 1"""),
        }
    return out


def _redaction(q: _Q) -> dict[str, Any]:
    if not q.has("redaction_events"):
        return {"present": False, "note": "the redacted layer is not built"}
    scoped = "trajectory_key IN (SELECT trajectory_key FROM card_episodes)"
    by_type = q.rows(f"""SELECT entity_type, detector, count(*) AS replacements FROM redaction_events WHERE {scoped}
                         GROUP BY ALL ORDER BY 3 DESC, 1, 2""")
    scopes = q.rows(f"SELECT scope_kind, count(*) AS replacements FROM redaction_events WHERE {scoped} GROUP BY 1 ORDER BY 1")
    policies = q.rows(f"SELECT DISTINCT policy_version FROM redaction_events WHERE {scoped} ORDER BY 1")
    audit = q.rows("""SELECT params, counts FROM runs WHERE job = 'redact' AND status = 'succeeded'
                      ORDER BY finished_at DESC LIMIT 1""")
    return {"present": True, "replacements": sum(r["replacements"] for r in by_type),
            "episodes_with_replacements": q.one(f"SELECT count(DISTINCT trajectory_key) FROM redaction_events WHERE {scoped}"),
            "by_type_and_detector": by_type, "placeholder_scopes": scopes,
            "policy_versions": [r["policy_version"] for r in policies],
            "audit": _audit(q) if audit else None}


def _audit(q: _Q) -> dict[str, Any]:
    """The build's re-scan of the redacted layer (its cached result: what the check found)."""
    from trajwh.lineage.checks import stored_result

    r = stored_result(q.wh, "rescan:")
    if r is None:
        return {"result": "not recorded (run trajwh build)"}
    return {"result": "passed" if r.get("secret_violations") == 0 else "failed",
            "secret_violations": r.get("secret_violations")}


def _splits(q: _Q) -> dict[str, Any]:
    if not q.has("splits"):
        return {"present": False, "note": "the curated layer is not built"}
    from trajwh.dedup.audit import audit_cached

    sizes = q.rows("""SELECT s.split, count(*) AS episodes, count(DISTINCT s.group_id) AS groups,
                             count(*) FILTER (WHERE s.eligible_for_eval) AS eligible_for_eval
                      FROM splits s JOIN card_episodes e USING (trajectory_key) GROUP BY 1 ORDER BY 1""")
    total = sum(r["episodes"] for r in sizes)
    for r in sizes:
        r["share"] = _share(r["episodes"], total)
    a = audit_cached(q.wh)
    req = a.get("requested") or {}
    return {"present": True, "sizes": sizes, "cutoff": req.get("cutoff"), "requested_fractions": req.get("fractions"),
            "audit": {"violations": a["violations"], "groups_across_splits": a["groups_across_splits"],
                      "clusters_across_splits": a["clusters_across_splits"],
                      "leak_flagged_in_eval": a["leak_flagged_in_eval"], "held_out": a["held_out"],
                      "result": "passed" if a["violations"] == 0 else "failed"},
            # two meanings, two numbers: the agent saw the future in a step, or the task's fix was merged
            # after the cutoff (the same definitions as the demo's summary)
            "episodes_that_saw_the_future": q.one("""SELECT count(DISTINCT trajectory_key) FROM leak_flags
                WHERE step_index IS NOT NULL AND trajectory_key IN (SELECT trajectory_key FROM card_episodes)"""),
            "episodes_fixed_after_cutoff": q.one("""SELECT count(DISTINCT trajectory_key) FROM leak_flags
                WHERE kind = 'fix_after_cutoff' AND trajectory_key IN (SELECT trajectory_key FROM card_episodes)""")}


def _fragments(q: _Q) -> dict[str, Any]:
    if not q.has("fragments"):
        return {"present": False, "note": "fragments not built"}
    scoped = "trajectory_key IN (SELECT trajectory_key FROM card_episodes)"
    kinds = q.rows(f"""SELECT kind, count(*) AS fragments, count(DISTINCT trajectory_key) AS episodes,
                              round(avg(confidence), 4) AS mean_confidence,
                              round(avg(len(span_step_ids)), 2) AS mean_span_steps
                       FROM fragments WHERE {scoped} GROUP BY 1 ORDER BY 1""")
    evidence = q.rows(f"""SELECT evidence_source, count(*) AS fragments FROM fragments WHERE {scoped}
                          GROUP BY 1 ORDER BY 2 DESC, 1""")
    total = sum(r["fragments"] for r in evidence)
    for r in evidence:
        r["share"] = _share(r["fragments"], total)
    train = q.one("SELECT count(*) FROM splits WHERE split = 'train' AND trajectory_key IN "
                  "(SELECT trajectory_key FROM card_episodes)") if q.has("splits") else None
    giving = q.one(f"SELECT count(DISTINCT trajectory_key) FROM fragments WHERE {scoped}")
    lengths = q.rows(f"""SELECT least(len(span_step_ids), 40) // 5 * 5 AS span_steps_from, count(*) AS fragments
                         FROM fragments WHERE {scoped} GROUP BY 1 ORDER BY 1""")
    return {"present": True, "fragments": total, "kinds": kinds, "evidence_sources": evidence,
            "episodes_giving_fragments": giving, "train_episodes": train,
            "retention_of_train_episodes": _share(giving, train),
            "span_length_histogram": lengths}


def _packs(q: _Q) -> dict[str, Any]:
    if not q.has("packs"):
        return {"present": False, "note": "the packed layer is not built (trajwh pack or trajwh build)"}
    sets = q.rows("""SELECT pack_set, any_value(tokenizer_id) AS tokenizer_id, any_value(template_id) AS template_id,
                            any_value(seq_len) AS seq_len, split, count(*) AS sequences, sum(n_tokens)::BIGINT AS tokens,
                            sum(n_trainable)::BIGINT AS trainable_tokens,
                            round(sum(n_tokens) / (count(*) * any_value(seq_len)), 4) AS efficiency
                     FROM packs""" + _pack_scope(q) + " GROUP BY pack_set, split ORDER BY pack_set, split")
    runs = q.rows("""SELECT counts FROM runs WHERE job = 'packs' AND status = 'succeeded' ORDER BY finished_at DESC""")
    dropped: dict[str, dict[str, int]] = {}
    for r in runs:  # the newest run of each pack set
        c = orjson.loads(r["counts"] or "{}")
        if c.get("pack_set") and c["pack_set"] not in dropped:
            dropped[c["pack_set"]] = {"dropped": sum((c.get("dropped") or {}).values()),
                                      "truncated": sum((c.get("truncated") or {}).values()),
                                      "split_fragments": sum((c.get("split_fragments") or {}).values())}
    return {"present": True, "by_pack_set_and_split": sets,
            "over_length": [{"pack_set": k, **v} for k, v in sorted(dropped.items())
                            if k in {s["pack_set"] for s in sets}]}


def _deletions(q: _Q) -> dict[str, Any]:
    rows = q.rows("SELECT request_id, requested_at, reason, status, counts FROM deletions ORDER BY requested_at, request_id")
    requests = []
    for r in rows:
        counts = {k: v for k, v in orjson.loads(r["counts"] or "{}").items() if not k.startswith("_") and v}
        requests.append({"request_id": r["request_id"], "requested_at": _iso(r["requested_at"]), "reason": r["reason"],
                         "status": r["status"], "rows_per_layer": dict(sorted(counts.items()))})
    by_reason: dict[str, int] = {}
    for r in requests:
        by_reason[r["reason"]] = by_reason.get(r["reason"], 0) + 1
    return {"present": True, "requests": len(requests), "by_reason": dict(sorted(by_reason.items())),
            "details": requests}
