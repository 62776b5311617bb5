"""Data cards (docs/cards.md): every number recomputed here from SQL on the same warehouse; stable
across runs; sections of absent layers say so; the HTML renders in headless Chromium."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess

import pytest
import yaml
from trajwh.datacards.card import build_card
from trajwh.datacards.stats import collect_card
from trajwh.ingest.raw_store import IngestOptions, ingest_paths
from trajwh.lineage.catalog import Warehouse
from trajwh.pipelines.definitions import build


@pytest.fixture(scope="module")
def carded(tmp_path_factory, small_corpus):
    """The small synthetic corpus, ingested (CC-BY-4.0) and built through Dagster (the card included)."""
    wh = Warehouse(tmp_path_factory.mktemp("card") / "wh")
    result = build(str(wh.root), include_ingest=True,
                   ingest_config={"paths": [str(small_corpus)], "source": "synthetic", "license": "CC-BY-4.0"})
    assert result.success
    mats = {m.asset_key.to_user_string(): m.materialization.metadata for m in result.get_asset_materialization_events()}
    return wh, mats


def _one(wh: Warehouse, sql: str, params=None):
    return wh.query(sql, params).column(0)[0].as_py()


def _pairs(wh: Warehouse, sql: str) -> dict:
    return {tuple(r.values())[:-1] if len(r) > 2 else next(iter(r.values())): list(r.values())[-1]
            for r in wh.query(sql).to_pylist()}


def test_the_build_writes_the_card_and_records_its_digest_in_dagster(carded):
    wh, mats = carded
    for name in ("card.json", "README.md", "card.html"):
        assert (wh.root / "card" / name).stat().st_size > 1000
    md = (wh.root / "card" / "README.md").read_text()
    # its digest, not its text: a copy in a run's event log would outlive a forget (datacards.card.withdraw_card_copies)
    assert "card" not in mats["data_card"]
    assert mats["data_card"]["card_sha256"].value == hashlib.sha256(md.encode()).hexdigest()
    header = yaml.safe_load(md.split("---\n")[1])
    assert header["license"] == "cc-by-4.0" and header["size_categories"] == ["n<1K"]
    assert {f["split"] for f in header["configs"][0]["data_files"]} == set(
        wh.query("SELECT DISTINCT split FROM packs").column(0).to_pylist())


def test_every_number_is_the_warehouses(carded):
    wh, _ = carded
    card = json.loads((wh.root / "card" / "card.json").read_text())
    s = card["sections"]
    assert card["scope"]["episodes"] == _one(wh, "SELECT count(*) FROM redacted_episodes")
    # provenance
    assert {(r["source"], r["license"]): r["records"] for r in s["provenance"]["sources"]} == {
        (r["source"], r["license"]): r["n"] for r in wh.query(
            "SELECT source, license, sum(n_new) AS n FROM batches GROUP BY ALL").to_pylist()}
    assert {(h["name"], h["version"]): h["episodes"] for h in s["provenance"]["harnesses"]} == {
        (r["h"], r["v"]): r["n"] for r in wh.query("SELECT harness_name AS h, harness_version AS v, count(*) AS n "
                                                   "FROM redacted_episodes GROUP BY ALL").to_pylist()}
    # funnel
    f = s["funnel"]
    assert f["raw_records"] == _one(wh, "SELECT count(*) FROM raw_records")
    assert f["quarantined"]["total"] == _one(wh, "SELECT count(*) FROM quarantine")
    steps = {x["step"]: x["count"] for x in f["steps"]}
    assert steps["near-duplicate representatives"] == _one(wh, "SELECT count(*) FROM near_dup_clusters WHERE is_representative")
    assert steps["training fragments"] == _one(wh, "SELECT count(*) FROM fragments WHERE trainable")
    assert steps["trainable tokens (all pack sets)"] == _one(wh, "SELECT sum(n_trainable) FROM packs")
    excluded = {x["why"]: x["episodes"] for x in f["excluded_from_training"]}
    for split in ("valid", "test"):
        assert excluded.get(f"evaluation or held out ({split})", 0) == _one(
            wh, "SELECT count(*) FROM splits WHERE split = ?", [split])
    # outcomes
    o = s["outcomes"]
    assert {c["cause"]: c["episodes"] for c in o["causes"]} == {r["cause"]: r["n"] for r in wh.query(
        "SELECT cause, count(*) AS n FROM outcomes GROUP BY 1").to_pylist()}
    assert o["by_kind"]["resolved"] == _one(wh, "SELECT count(*) FROM outcomes WHERE outcome = 'resolved'")
    assert o["by_kind"].get("policy failure", 0) == _one(wh, "SELECT count(*) FROM outcomes WHERE policy_failure")
    for r in o["effective_rate"]:
        known, bad = wh.query("""SELECT count(*) FILTER (WHERE cause <> 'unknown'), count(*) FILTER (WHERE cause IN
                                 ('environment_failure', 'resource_exhausted', 'verifier_unavailable'))
                                 FROM outcomes JOIN redacted_episodes USING (trajectory_key) WHERE harness_name = ?""",
                              [r["harness"]]).to_pylist()[0].values()
        assert r["eta"] == round((known - bad) / known, 4)
    cell = o["policy_harness"][0]
    assert cell["success_rate"] == round(_one(wh, """
        SELECT avg((outcome = 'resolved')::INT) FROM outcomes JOIN redacted_episodes USING (trajectory_key)
        WHERE policy_name = ? AND harness_name = ? AND cause NOT IN
              ('environment_failure', 'resource_exhausted', 'verifier_unavailable', 'unknown')""",
        [cell["policy"], cell["harness"]]), 4)
    assert sum(b["task_policies"] for b in o["tasks"]["posterior_mean_histogram"]) == _one(
        wh, "SELECT count(*) FROM task_stats WHERE level = 'task_policy'")
    # redaction: counts by type and detector, never a value
    r = s["redaction"]
    assert r["replacements"] == _one(wh, "SELECT count(*) FROM redaction_events")
    assert {(x["entity_type"], x["detector"]): x["replacements"] for x in r["by_type_and_detector"]} == {
        (x["entity_type"], x["detector"]): x["n"] for x in wh.query(
            "SELECT entity_type, detector, count(*) AS n FROM redaction_events GROUP BY ALL").to_pylist()}
    assert r["audit"]["result"] == "passed"
    # splits and the leak audit
    sp = s["splits"]
    assert {x["split"]: (x["episodes"], x["groups"]) for x in sp["sizes"]} == {
        x["split"]: (x["n"], x["g"]) for x in wh.query(
            "SELECT split, count(*) AS n, count(DISTINCT group_id) AS g FROM splits GROUP BY 1").to_pylist()}
    assert sp["audit"]["groups_across_splits"] == _one(wh, """SELECT count(*) FROM (SELECT group_id FROM splits
        GROUP BY 1 HAVING bool_or(split = 'train') AND bool_or(split IN ('valid', 'test')))""") == 0
    # fragments
    fr = s["fragments"]
    assert {k["kind"]: k["fragments"] for k in fr["kinds"]} == {
        x["kind"]: x["n"] for x in wh.query("SELECT kind, count(*) AS n FROM fragments GROUP BY 1").to_pylist()}
    assert fr["retention_of_train_episodes"] == round(
        _one(wh, "SELECT count(DISTINCT trajectory_key) FROM fragments")
        / _one(wh, "SELECT count(*) FROM splits WHERE split = 'train'"), 4)
    assert sum(b["fragments"] for b in fr["span_length_histogram"]) == fr["fragments"]
    # packs
    for p in s["packs"]["by_pack_set_and_split"]:
        tokens, trainable, n = wh.query("SELECT sum(n_tokens)::BIGINT, sum(n_trainable)::BIGINT, count(*) FROM packs "
                                        "WHERE pack_set = ? AND split = ?", [p["pack_set"], p["split"]]).to_pylist()[0].values()
        assert (p["tokens"], p["trainable_tokens"], p["sequences"]) == (tokens, trainable, n)
        assert p["efficiency"] == round(float(tokens) / (n * p["seq_len"]), 4)
    # licenses and deletions
    assert {x["eligibility"]: x["episodes"] for x in s["licenses"]["eligibility"]} == {
        x["eligibility"]: x["n"] for x in wh.query("SELECT eligibility, count(*) AS n FROM eligibility GROUP BY 1").to_pylist()}
    assert s["deletions"]["requests"] == _one(wh, "SELECT count(*) FROM deletions") == 0


def test_the_remaining_numbers_too(carded):
    wh, _ = carded
    s = json.loads((wh.root / "card" / "card.json").read_text())["sections"]
    first, last = wh.query("SELECT min(started_at), max(started_at) FROM redacted_episodes").to_pylist()[0].values()
    assert s["provenance"]["collection_window"] == {"first": first.isoformat(), "last": last.isoformat()}
    assert {f["format"]: f["episodes"] for f in s["provenance"]["formats"]} == _pairs(
        wh, "SELECT format, count(*) FROM redacted_episodes GROUP BY 1")
    assert s["provenance"]["ingest_batches"] == _one(wh, "SELECT count(*) FROM batches")
    dup = s["funnel"]["near_duplicates"]
    assert (dup["members"], dup["clusters"]) == tuple(wh.query(
        "SELECT count(*), count(DISTINCT cluster_id) FROM near_dup_clusters WHERE cluster_size > 1").to_pylist()[0].values())
    excluded = {x["why"]: x["episodes"] for x in s["funnel"]["excluded_from_training"]}
    assert excluded.get("leak flagged", 0) == _one(wh, """SELECT count(DISTINCT s.trajectory_key) FROM splits s
        JOIN leak_flags l USING (trajectory_key) WHERE s.split = 'train' AND l.kind <> 'fix_after_cutoff'""")
    assert {(x["diagnosis"]): x["tasks"] for x in s["outcomes"]["tasks"]["all_fail"]} == _pairs(wh, """
        SELECT all_fail, count(DISTINCT task_id) FROM task_stats WHERE level = 'task_policy' AND all_fail IS NOT NULL
        GROUP BY 1""")
    assert s["outcomes"]["tasks"]["tasks"] == _one(wh, "SELECT count(DISTINCT task_id) FROM task_stats")
    assert {x["scope_kind"]: x["replacements"] for x in s["redaction"]["placeholder_scopes"]} == _pairs(
        wh, "SELECT scope_kind, count(*) FROM redaction_events GROUP BY 1")
    assert s["splits"]["episodes_that_saw_the_future"] == _one(
        wh, "SELECT count(DISTINCT trajectory_key) FROM leak_flags WHERE step_index IS NOT NULL")
    assert s["splits"]["episodes_fixed_after_cutoff"] == _one(
        wh, "SELECT count(DISTINCT trajectory_key) FROM leak_flags WHERE kind = 'fix_after_cutoff'")
    assert {x["split"]: x["eligible_for_eval"] for x in s["splits"]["sizes"]} == _pairs(
        wh, "SELECT split, count(*) FILTER (WHERE eligible_for_eval) FROM splits GROUP BY 1")
    for k in s["fragments"]["kinds"]:
        conf, span = wh.query("SELECT round(avg(confidence), 4), round(avg(len(span_step_ids)), 2) FROM fragments "
                              "WHERE kind = ?", [k["kind"]]).to_pylist()[0].values()
        assert (k["mean_confidence"], k["mean_span_steps"]) == (conf, span)
    total = _one(wh, "SELECT count(*) FROM fragments")
    for e in s["fragments"]["evidence_sources"]:
        assert e["share"] == round(_one(wh, "SELECT count(*) FROM fragments WHERE evidence_source = ?",
                                        [e["evidence_source"]]) / total, 4)
    runs = {}
    for r in wh.query("SELECT counts FROM runs WHERE job = 'packs' AND status = 'succeeded' "
                      "ORDER BY finished_at").to_pylist():
        c = json.loads(r["counts"])
        runs[c["pack_set"]] = sum((c.get("dropped") or {}).values())
    assert {x["pack_set"]: x["dropped"] for x in s["packs"]["over_length"]} == runs


def test_the_card_is_stable_across_runs(carded):
    wh, _ = carded
    first = collect_card(wh)
    assert build(str(wh.root)).success  # a no-op build in between
    again = build_card(wh, wh.root / "card-again", force=True)
    second = json.loads(again.files["json"].read_text())
    first.pop("generated_at"), second.pop("generated_at")
    assert json.dumps(first, sort_keys=True, default=str) == json.dumps(second, sort_keys=True, default=str)
    unchanged = build_card(wh)  # the asset's card is current: not written again
    assert unchanged.skipped


def test_one_split_and_absent_layers(carded, tmp_path, cases):
    wh, _ = carded
    train = collect_card(wh, "train")
    assert train["scope"]["episodes"] == _one(wh, "SELECT count(*) FROM splits WHERE split = 'train'")
    assert {p["split"] for p in train["sections"]["packs"]["by_pack_set_and_split"]} == {"train"}
    bare = Warehouse(tmp_path / "bare")
    ingest_paths(bare, [cases / "two_episodes.jsonl"], IngestOptions(source="cases"))
    card = build_card(bare)
    doc = json.loads(card.files["json"].read_text())
    for name in ("outcomes", "redaction", "splits", "fragments", "packs", "licenses"):
        assert doc["sections"][name]["present"] is False and doc["sections"][name]["note"]
    assert doc["sections"]["funnel"]["raw_records"] == 2
    assert "not built" in card.files["markdown"].read_text()


@pytest.mark.skipif(not (shutil.which("chromium") or shutil.which("chromium-browser")),
                    reason="Chromium is not installed (Debian: apt-get install chromium)")
def test_the_page_renders_in_chromium_without_console_errors(carded, tmp_path):
    wh, _ = carded
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    shot = tmp_path / "card.png"
    r = subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--enable-logging=stderr",
                        "--v=0", "--window-size=1200,4000", f"--screenshot={shot}",
                        (wh.root / "card" / "card.html").as_uri()], capture_output=True, text=True, timeout=120)
    assert shot.stat().st_size > 50_000, r.stderr[-2000:]
    assert [line for line in r.stderr.splitlines() if ":CONSOLE" in line] == []
    html = (wh.root / "card" / "card.html").read_text()
    assert "<script" not in html and "<link" not in html  # self-contained: nothing fetched
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)|url\(\s*["']?https?:""", html)
    assert html.count("<svg") >= 4
