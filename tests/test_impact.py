"""`trajwh impact`: every selector kind finds what was made from the selection, and nothing else.

Each figure is checked against an independent count (SQL over the layers, or the input files read
directly), on a warehouse holding three sources: synthetic episodes, hand-made native records and
hand-made episodes of one repository written with different remote spellings."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import trajwh_cmd
from trajwh.lineage.catalog import Warehouse
from trajwh.lineage.impact import Selector, impact
from trajwh.schemas.errors import ConfigError


@pytest.fixture(scope="module")
def built(tmp_path_factory, small_corpus) -> Warehouse:
    from trajwh.ingest.raw_store import IngestOptions, ingest_paths
    from trajwh.pipelines.definitions import build

    cases = Path(__file__).resolve().parent / "cases"
    wh = Warehouse(tmp_path_factory.mktemp("impact") / "wh")
    ingest_paths(wh, [small_corpus], IngestOptions(source="synth"))
    ingest_paths(wh, [cases / "two_episodes.jsonl"], IngestOptions(source="cases", license="MIT"))
    ingest_paths(wh, [cases / "curation"], IngestOptions(source="remotes"))
    assert build(str(wh.root)).success
    return wh


def _scalar(wh: Warehouse, sql: str, params=None):
    return wh.query(sql, params or []).column(0)[0].as_py()


def test_source_selector_counts_every_layer_from_the_source_only(built):
    r = impact(built, "source:cases")
    records = set(built.query("SELECT record_id FROM raw_records WHERE source = 'cases'").column(0).to_pylist())
    assert set(r.records) == records and len(records) == 2
    keys = set(built.query("SELECT trajectory_key FROM episodes WHERE source = 'cases'").column(0).to_pylist())
    assert set(r.episodes) == keys
    in_k = "(SELECT trajectory_key FROM episodes WHERE source = 'cases')"
    for table in ("steps", "redacted_steps", "redaction_events", "splits", "outcomes", "fragments", "near_dup_clusters"):
        assert r.layers[table]["rows"] == _scalar(built, f"SELECT count(*) FROM {table} WHERE trajectory_key IN {in_k}"), table
    assert r.layers["raw_records"]["rows"] == 2
    packs = _scalar(built, f"""SELECT count(DISTINCT pack_id) FROM packs, unnest(segments) t(s)
                               WHERE t.s.trajectory_key IN {in_k}""")
    assert r.layers["packs"]["rows"] == packs
    # nothing of another source is listed
    others = set(built.query("SELECT trajectory_key FROM episodes WHERE source <> 'cases'").column(0).to_pylist())
    assert not others & set(r.episodes)
    assert sum(r.layers["splits"]["by_split"].values()) == len(keys)


def test_license_batch_and_file_selectors(built):
    assert set(impact(built, "license:MIT").records) == set(impact(built, "source:cases").records)
    batch = _scalar(built, "SELECT batch_id FROM raw_records WHERE source = 'remotes' LIMIT 1")
    by_batch = impact(built, f"batch:{batch}")
    assert set(by_batch.records) == set(built.query("SELECT record_id FROM raw_records WHERE batch_id = ?",
                                                    [batch]).column(0).to_pylist())
    path = _scalar(built, "SELECT file_path FROM raw_records WHERE source = 'cases' LIMIT 1")
    rel = Path(path).relative_to(Path.cwd()) if Path(path).is_relative_to(Path.cwd()) else Path(path)
    assert impact(built, f"file:{rel}").records == impact(built, f"file:{path}").records == impact(built, "source:cases").records


def test_content_selector_matches_the_raw_bytes(built, small_corpus):
    needle = "AKIA"
    expected = 0
    import gzip

    for f in sorted(small_corpus.glob("*.jsonl*")):
        opener = gzip.open if f.suffix == ".gz" else open
        with opener(f, "rt", encoding="utf-8") as fh:
            expected += sum(1 for line in fh if needle in line)
    r = impact(built, f"content:{needle}")
    assert expected > 0 and len(r.records) == expected
    assert impact(built, "content:(?i)no such text anywhere 1f3e").empty


def test_episode_level_selectors(built):
    key = _scalar(built, "SELECT trajectory_key FROM episodes WHERE source = 'synth' ORDER BY 1 LIMIT 1")
    r = impact(built, f"episode:{key[:12]}")
    assert r.episodes == [key] and len(r.records) == 1
    assert r.layers["steps"]["rows"] == _scalar(built, "SELECT count(*) FROM steps WHERE trajectory_key = ?", [key])
    task = _scalar(built, "SELECT task_id FROM episodes WHERE source = 'synth' AND task_id IS NOT NULL LIMIT 1")
    by_task = impact(built, f"task:{task}")
    assert set(by_task.episodes) == set(built.query("SELECT trajectory_key FROM episodes WHERE task_id = ?",
                                                    [task]).column(0).to_pylist())
    assert task in by_task.layers["task_stats"]["recomputed_tasks"]


def test_repository_selector_normalizes_spellings(built):
    remotes = set(built.query("SELECT trajectory_key FROM episodes WHERE source = 'remotes'").column(0).to_pylist())
    repo = _scalar(built, "SELECT any_value(repository) FROM task_groups WHERE trajectory_key IN (SELECT unnest(?))",
                   [sorted(remotes)])
    # the same repository as the task groups see it (the synthetic corpus may hold it too)
    expected = set(built.query("SELECT trajectory_key FROM task_groups WHERE repository = ?", [repo]).column(0).to_pylist())
    assert remotes <= expected
    for spelling in ("github.com/acme/widgetlib", "https://github.com/Acme/WidgetLib.git", "git@github.com:Acme/WidgetLib.git"):
        assert set(impact(built, f"repository:{spelling}").episodes) == expected, spelling


def test_a_representative_that_goes_is_reported(built):
    row = built.query("""SELECT cluster_id, trajectory_key FROM near_dup_clusters
                         WHERE is_representative AND cluster_size > 1 ORDER BY cluster_id LIMIT 1""").to_pylist()
    if not row:
        pytest.skip("the corpus has no near-duplicate cluster with more than one member")
    r = impact(built, f"episode:{row[0]['trajectory_key']}")
    assert row[0]["cluster_id"] in r.layers["near_dup_clusters"]["representative_reelected"]
    assert r.layers["near_dup_clusters"]["emptied"] == 0


@pytest.mark.parametrize("bad", ["nothing", "planet:earth", "source:", "content:([", "episode:abc"])
def test_bad_selectors_are_refused_with_what_is_valid(bad):
    with pytest.raises(ConfigError) as err:
        Selector.parse(bad)
    assert "source:" in str(err.value) or "regular expression" in str(err.value) or "characters" in str(err.value)


def test_cli_json_and_exit_codes(built):
    out = subprocess.run([*trajwh_cmd(), "impact", "source:cases", "--json", "-w", str(built.root)],
                         capture_output=True, text=True, check=True)
    doc = json.loads(out.stdout)
    assert doc["selector"] == "source:cases" and doc["layers"]["episodes"]["rows"] == len(doc["episodes"])
    bad = subprocess.run([*trajwh_cmd(), "impact", "planet:earth", "-w", str(built.root)], capture_output=True, text=True)
    assert bad.returncode == 2 and "source:" in bad.stderr
