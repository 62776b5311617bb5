"""Build ``license_facts`` and ``eligibility``: what each episode may be used for, and why.

Run after redaction (it reads the redacted episodes, the policy and the opt-out registry), batch
by batch: a batch's files carry the version they were decided with (policy digest, registry of
active opt-outs and their matches, the batch's redacted episodes), and only the batches whose
version changed are decided again, so a new batch costs its own episodes. A policy or registry
change decides every batch again (one streamed pass over the episodes' license columns); what depends on
it (fragments, packs) redoes only the episodes whose ``train`` decision changed, because the
fragments' per-episode inputs digest carries that decision.

Before deciding, any (opt-out, batch) pair not scanned yet is scanned (``licenses.optout``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from trajwh.licenses.optout import active_opt_outs, opt_out_episodes, scan_pending
from trajwh.licenses.policy import POLICY_VERSION, LicensePolicy
from trajwh.lineage.catalog import Warehouse, now_utc
from trajwh.lineage.parallel import duckdb_memory
from trajwh.lineage.rebuild import batch_fingerprints, mark_running, run_row
from trajwh.schemas import ids
from trajwh.schemas.arrow import arrow_schema
from trajwh.schemas.config import LicenseSettings
from trajwh.schemas.tables import EligibilityRow, LicenseFactRow

TRANSFORM = "eligibility"
TABLES = ("license_facts", "eligibility")
_MODELS = {"license_facts": LicenseFactRow, "eligibility": EligibilityRow}
_EPISODES_SQL = """
    SELECT trajectory_key, _batch_id, license, repository, instance_id, policy_name,
           json_extract_string(metadata, '$.license') AS meta_license,
           coalesce(json_extract_string(metadata, '$.repository_license'),
                    json_extract_string(metadata, '$.repo_license')) AS meta_repository_license
    FROM {source} ORDER BY trajectory_key"""


@dataclass
class EligibilitySummary:
    run_id: str
    skipped: bool = False
    episodes: int = 0
    eligibility: dict[str, int] = field(default_factory=dict)
    reasons: dict[str, int] = field(default_factory=dict)  # reason (opt-out ids folded) -> episodes
    licenses: dict[str, int] = field(default_factory=dict)  # source license (or "unknown") -> episodes
    opted_out: int = 0
    new_matches: int = 0


def registry_digest(wh: Warehouse) -> str:
    """Digest of the active opt-outs and what they matched (a change -> a new digest)."""
    row = wh.query("""
        SELECT (SELECT string_agg(opt_out_id || '/' || kind || '/' || value, ',' ORDER BY opt_out_id)
                FROM opt_outs WHERE status = 'active') AS o,
               (SELECT string_agg(opt_out_id || '/' || record_id, ',' ORDER BY opt_out_id, record_id)
                FROM opt_out_matches) AS m""").to_pylist()[0]
    return ids.digest([row["o"] or "", row["m"] or ""])[:16]


def reason_class(reason: str) -> str:
    """A reason without the opt-out id, for counts (``train: block opted out (email)``)."""
    head, sep, _ = reason.partition(", oo-")
    return head + ")" if sep else reason


def build_eligibility(wh: Warehouse, *, run_id: str, policy: LicensePolicy | None = None, full: bool = False,
                      lock_timeout: float = 60.0) -> EligibilitySummary:
    """Decide every redacted episode's eligibility under ``policy`` and the opt-out registry,
    batch by batch: a batch's files are made again only when its redacted episodes, the policy or
    the registry changed (each file's version says which), so a new batch costs its own episodes."""
    policy = policy or LicensePolicy.from_settings(LicenseSettings())
    summary = EligibilitySummary(run_id)
    started = now_utc()
    with wh.write_session(TRANSFORM, timeout=lock_timeout) as session:
        mark_running(session, run_id, TRANSFORM, started)
        summary.new_matches = scan_pending(wh, session)
        rules = f"{TRANSFORM}@{POLICY_VERSION};policy={policy.digest};registry={registry_digest(wh)}"
        sources = batch_fingerprints(wh, ["redacted_episodes"])
        stored: dict[str | None, list[dict]] = {}
        for r in wh.query("SELECT path, batch_id, transform_version FROM table_files WHERE list_contains(?, table_name)",
                          [list(TABLES)]).to_pylist():
            stored.setdefault(r["batch_id"], []).append(r)
        wanted = {b: f"{rules};inputs={src}" for b, src in sources.items()}
        todo = sorted(b for b, v in wanted.items()
                      if full or {r["transform_version"] for r in stored.get(b, [])} != {v})
        gone = [b for b in stored if b not in sources]  # batches forgotten, or files of the whole-table layout
        if not todo and not gone:
            summary.skipped = True
        else:
            opt_outs = active_opt_outs(wh)
            opted = opt_out_episodes(wh, opt_outs)
            kinds = {o["opt_out_id"]: o["kind"] for o in opt_outs}
            if gone:
                session.commit(removed=[wh.data / r["path"] for b in gone for r in stored[b]], run_id=run_id)
            for batch_id in todo:
                files = _decide_batch(wh, session, batch_id, policy, opted, kinds,
                                      {"_run_id": run_id, "_transform": TRANSFORM, "_transform_version": wanted[batch_id]})
                session.commit(files, removed=[wh.data / r["path"] for r in stored.get(batch_id, [])], batch_id=batch_id,
                               run_id=run_id, transform_version=wanted[batch_id])
        _totals(wh, summary)
        session.upsert_rows("runs", [run_row(run_id, TRANSFORM, started,
                                             params={"rules": rules, "batches_decided": len(todo),
                                                     "skipped": summary.skipped},
                                             counts=summary.__dict__, code_version=f"{TRANSFORM}@{POLICY_VERSION}")])
    return summary


def _decide_batch(wh: Warehouse, session: Any, batch_id: str, policy: LicensePolicy, opted: dict[str, list[str]],
                  kinds: dict[str, str], lineage: dict[str, str]) -> list[Any]:
    """One batch's ``license_facts`` and ``eligibility`` rows, written (not yet visible) a file per
    50,000 rows; reads only that batch's redacted episodes files."""
    paths = [str(p) for p in wh.files("redacted_episodes", batch_id=batch_id)]
    buffers: dict[str, list[dict]] = {t: [] for t in TABLES}
    files: list[Any] = []

    def flush(table: str) -> None:
        if buffers[table]:
            files.append(session.write(table, pa.Table.from_pylist(buffers[table], schema=arrow_schema(_MODELS[table]))))
            buffers[table] = []

    for batch in wh.stream(_EPISODES_SQL.format(source="read_parquet(?, union_by_name = true)"), [paths],
                           batch_rows=10_000, memory_limit=duckdb_memory(256)):
        for e in batch:
            key = e["trajectory_key"]
            facts = policy.facts(e)
            d = policy.decide(facts, [(oid, kinds[oid]) for oid in opted.get(key, [])])
            base = {"trajectory_key": key, "_batch_id": e["_batch_id"], **lineage}
            buffers["license_facts"] += [{**base, "kind": f.kind, "expression": f.expression, "given": f.given,
                                          "status": f.status, "origin": f.origin} for f in facts]
            buffers["eligibility"].append({**base, "eligibility": d.eligibility, "train": d.train,
                                           "release": d.release, "reasons": list(d.reasons),
                                           "opt_out_ids": list(d.opt_out_ids), "policy_digest": policy.digest})
        for table in TABLES:
            if len(buffers[table]) >= 50_000:
                flush(table)
    for table in TABLES:
        flush(table)
    return files


def _totals(wh: Warehouse, summary: EligibilitySummary) -> None:
    summary.episodes = wh.query("SELECT count(*) FROM eligibility").column(0)[0].as_py()
    summary.eligibility = {r["eligibility"]: r["n"] for r in wh.query(
        "SELECT eligibility, count(*) AS n FROM eligibility GROUP BY 1 ORDER BY 1").to_pylist()}
    summary.reasons = {}
    for r in wh.query("SELECT unnest(reasons) AS reason, count(*) AS n FROM eligibility GROUP BY 1").to_pylist():
        cls = reason_class(r["reason"])
        summary.reasons[cls] = summary.reasons.get(cls, 0) + r["n"]
    summary.reasons = dict(sorted(summary.reasons.items()))
    summary.licenses = {r["lic"]: r["n"] for r in wh.query(
        "SELECT coalesce(expression, status) AS lic, count(*) AS n FROM license_facts WHERE kind = 'source' "
        "GROUP BY 1 ORDER BY 1").to_pylist()}
    summary.opted_out = wh.query("SELECT count(*) FROM eligibility WHERE len(opt_out_ids) > 0").column(0)[0].as_py()


def not_releasable(wh: Warehouse, where: str | None = None, policy_digest: str | None = None) -> dict[str, list[str]]:
    """Redacted episodes (those ``where`` selects) that may not leave the warehouse, with why:
    the last build's release decision, plus opt-outs added since (matched now). Refuses when
    nothing was decided yet, or when ``policy_digest`` (the policy in force) is not the one the
    decisions were made by: a release must never rest on a stale decision."""
    from trajwh.schemas.errors import ConfigError

    if not wh.manifest_query("SELECT count(*) FROM table_files WHERE table_name = 'eligibility'").column(0)[0].as_py():
        raise ConfigError(f"what may be released is not decided in {wh.root}",
                          valid="run `trajwh build` first (its eligibility step applies [licenses] and the opt-outs)")
    if policy_digest is not None:
        stale = wh.query("SELECT DISTINCT policy_digest FROM eligibility WHERE policy_digest <> ?",
                         [policy_digest]).column(0).to_pylist()
        if stale:
            raise ConfigError("the license policy ([licenses] in trajwh.toml) changed since the last build",
                              valid="run `trajwh build` so that eligibility follows the policy in force")
    filt = f"WHERE {where}" if where else ""
    rows = wh.query(f"""
        SELECT e.trajectory_key, g.release, g.reasons FROM (SELECT trajectory_key FROM redacted_episodes {filt}) e
        LEFT JOIN eligibility g USING (trajectory_key) WHERE g.release IS DISTINCT FROM 'allow'""").to_pylist()
    out = {r["trajectory_key"]: [x for x in (r["reasons"] or []) if x.startswith("release:")]
           or ["release: not decided yet (ingested after the last build)"] for r in rows}
    selected = set(wh.query(f"SELECT trajectory_key FROM redacted_episodes {filt}").column(0).to_pylist())
    _add_live_opt_outs(wh, out, selected, "release")
    return dict(sorted(out.items()))


def not_trainable_in_packs(wh: Warehouse, pack_set: str, split: str) -> dict[str, list[str]]:
    """Episodes in a pack set's split that may not be trained on now: the last build's decision
    (the packs check already holds it at 0), and opt-outs added since the packs were built."""
    keys = set(wh.query("SELECT DISTINCT t.s.trajectory_key FROM packs p, unnest(p.segments) AS t(s) "
                        "WHERE p.pack_set = ? AND p.split = ?", [pack_set, split]).column(0).to_pylist())
    out: dict[str, list[str]] = {}
    for r in wh.query("SELECT trajectory_key, reasons FROM eligibility WHERE train <> 'allow' AND "
                      "list_contains(?, trajectory_key)", [sorted(keys)]).to_pylist():
        out[r["trajectory_key"]] = [x for x in r["reasons"] if x.startswith("train:")]
    _add_live_opt_outs(wh, out, keys, "train")
    return dict(sorted(out.items()))


def _add_live_opt_outs(wh: Warehouse, out: dict[str, list[str]], keys: set[str], use: str) -> None:
    """The opt-outs active now (perhaps added since the last build) among ``keys``, as reasons."""
    opt_outs = active_opt_outs(wh)
    if not opt_outs:
        return
    kinds = {o["opt_out_id"]: o["kind"] for o in opt_outs}
    for key, oids in opt_out_episodes(wh, opt_outs).items():
        if key in keys:
            out[key] = sorted(set(out.get(key, [])) | {f"{use}: block opted out ({kinds[o]}, {o})" for o in oids})


def releasable_only(wh: Warehouse, where: str | None, policy_digest: str | None, eligible_only: bool) -> set[str]:
    """What an export leaves out: nothing, or it refuses with the reasons when a selected episode
    may not be released (``eligible_only``: those episodes are left out instead)."""
    from trajwh.schemas.errors import ConfigError

    blocked = not_releasable(wh, where, policy_digest)
    if blocked and not eligible_only:
        first = list(blocked.items())[:3]
        raise ConfigError(
            f"{len(blocked)} selected episode(s) may not be released: " + "; ".join(
                f"{k[:16]}: {', '.join(r)}" for k, r in first) + (" ..." if len(blocked) > 3 else ""),
            valid="--eligible-only to leave them out; or a license for them ([licenses.release] in trajwh.toml, "
                  "`trajwh ingest --license`), then `trajwh build` (`trajwh licenses` lists the reasons)")
    return set(blocked)
