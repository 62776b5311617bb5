"""`trajwh export --format hf`: TRL-style messages in Parquet shards per split, loadable by `datasets`;
only releasable episodes; fragments with the trained messages marked."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from trajwh.ingest.export import export_episodes
from trajwh.ingest.raw_store import IngestOptions, ingest_paths
from trajwh.lineage.catalog import Warehouse
from trajwh.packing.hf_export import export_hf
from trajwh.pipelines.definitions import build
from trajwh.schemas.errors import ConfigError

TOML = """
[splits]
fractions = [1.0, 0.0, 0.0]
cutoff = "none"
[packing]
seq_len = 2048
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from conftest import CASES

    wh = Warehouse(tmp_path_factory.mktemp("hf") / "wh")
    wh.root.mkdir(parents=True)
    (wh.root / "trajwh.toml").write_text(TOML)
    ingest_paths(wh, [CASES / "licenses" / "episodes.jsonl"], IngestOptions(source="cases", license="MIT"))
    ingest_paths(wh, [CASES / "two_episodes.jsonl"], IngestOptions(source="unlicensed"))
    assert build(str(wh.root)).success
    return wh


def _rows(folder) -> list[dict]:
    return [r for p in sorted((folder / "data").glob("*.parquet")) for r in pq.read_table(p).to_pylist()]


def test_episodes_as_messages(built, tmp_path):
    with pytest.raises(ConfigError, match="may not be released"):  # the unlicensed source's episodes
        export_hf(built, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    s = export_hf(built, tmp_path / "hf", eligible_only=True)
    releasable = set(built.query("SELECT trajectory_key FROM eligibility WHERE release = 'allow'").column(0).to_pylist())
    rows = _rows(tmp_path / "hf")
    assert s.rows == {"train": len(rows)} and {r["trajectory_key"] for r in rows} == releasable
    assert s.left_out == built.query("SELECT count(*) FROM eligibility WHERE release <> 'allow'").column(0)[0].as_py() > 0
    manifest = json.loads((tmp_path / "hf" / "manifest.json").read_text())
    assert manifest["files"] == ["data/train-00000-of-00001.parquet"]
    for r in rows:
        steps = built.query("SELECT author, role, text, observation, tool_calls, tool_call_id FROM redacted_steps "
                            "WHERE trajectory_key = ? ORDER BY step_index", [r["trajectory_key"]]).to_pylist()
        assert len(r["messages"]) == len(steps)
        for m, st in zip(r["messages"], steps, strict=True):
            if st["author"] == "model":
                assert m["role"] == "assistant" and m["content"] == (st["text"] or "")
                calls = st["tool_calls"] or []
                assert [c["function"]["name"] for c in m["tool_calls"] or []] == [c["name"] for c in calls]
                for c, orig in zip(m["tool_calls"] or [], calls, strict=True):
                    assert json.loads(c["function"]["arguments"]) == json.loads(orig["arguments"])
                    assert c["type"] == "function" and c["id"] == orig["id"]
            elif st["author"] == "environment":
                assert m["role"] == "tool" and m["content"] == st["observation"]
                assert m["tool_call_id"] == st["tool_call_id"]
    try:
        import datasets
    except ImportError:
        return
    ds = datasets.load_dataset("parquet", data_dir=str(tmp_path / "hf" / "data"), cache_dir=str(tmp_path / "cache"))
    assert set(ds) == {"train"} and len(ds["train"]) == len(rows)
    assert ds["train"][0]["messages"][0]["role"] == "system"


def test_fragments_mark_the_trained_messages(built, tmp_path):
    export_hf(built, tmp_path / "fr", unit="fragments", eligible_only=True)
    rows = _rows(tmp_path / "fr")
    want = built.query("""SELECT count(*) FROM fragments f JOIN eligibility g USING (trajectory_key)
                          WHERE f.trainable AND g.release = 'allow'""").column(0)[0].as_py()
    assert len(rows) == want > 0
    for r in rows:
        span = built.query("SELECT span_step_ids, step_ids FROM fragments WHERE fragment_id = ?",
                           [r["fragment_id"]]).to_pylist()[0]
        assert len(r["messages"]) == len(r["trained"]) == len(span["step_ids"])
        authors = built.query("SELECT step_id, author FROM redacted_steps WHERE list_contains(?, step_id)",
                              [span["step_ids"]]).to_pylist()
        model = {a["step_id"] for a in authors if a["author"] == "model"}
        assert r["trained"] == [sid in span["span_step_ids"] and sid in model for sid in span["step_ids"]]
        assert any(r["trained"]) and all(m["role"] == "assistant" for m, t in zip(r["messages"], r["trained"],
                                                                                    strict=True) if t)


def test_a_bad_filter_is_a_clear_error(built, tmp_path):
    for call in (lambda: export_hf(built, tmp_path / "x", where="no_such_column = 1"),
                 lambda: export_episodes(built, "native", tmp_path / "x.jsonl", where="no_such_column = 1")):
        with pytest.raises(ConfigError, match=r"no_such_column.*not a valid filter"):
            call()
    with pytest.raises(ConfigError, match="unknown export unit"):
        export_hf(built, tmp_path / "y", unit="packs")
