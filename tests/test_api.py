"""The Python API (`trajwh.open`): the same operations as the CLI, from any working directory."""

from __future__ import annotations

import io

import trajwh


def test_open_ingest_build_query_trace(tmp_path, cases, monkeypatch):
    monkeypatch.delenv("TRAJWH_VAULT_KEY", raising=False)
    wh = trajwh.open(tmp_path / "wh")
    s = wh.ingest(cases / "licenses" / "episodes.jsonl", source="cases", license="MIT")
    assert s.n_new == 5
    result = wh.build()
    assert result.success
    assert (wh.root / "_dagster" / "dagster.yaml").exists()  # recorded where `trajwh ui` looks
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the views resolve from any working directory
    assert wh.sql("SELECT count(*) AS n FROM episodes").to_pylist() == [{"n": 5}]
    assert wh.sql("SELECT trajectory_key FROM episodes", out="keys.csv", fmt="csv") == 5  # relative to the cwd
    assert len((elsewhere / "keys.csv").read_text().splitlines()) == 6
    with wh.connect() as con:
        assert con.execute("SELECT count(*) FROM redacted_steps").fetchall()[0][0] > 0
    step_id = wh.sql("SELECT step_id FROM steps ORDER BY step_id LIMIT 1").column(0)[0].as_py()
    t = wh.trace(step_id[:12])
    assert t.kind == "step" and t.record["file_path"].endswith("episodes.jsonl")
    assert set(wh.impact("source:cases").episodes) == set(wh.sql("SELECT trajectory_key FROM episodes").column(0).to_pylist())
    card = wh.card(tmp_path / "card")
    assert (tmp_path / "card" / "card.json").exists() and not card.skipped
    assert wh.status()["totals"]["episodes"] == 5
    piped = wh.ingest("-", source="piped", stdin=io.BytesIO((cases / "two_episodes.jsonl").read_bytes()))
    assert piped.n_new == 2 and [f.path for f in piped.files] == ["<stdin>"]
