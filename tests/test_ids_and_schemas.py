"""Ids are stable and content-derived; Arrow schemas and the JSON Schema follow the models."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st
from trajwh.schemas import ids
from trajwh.schemas.arrow import PARQUET_TABLES, arrow_schema
from trajwh.schemas.native import NativeEpisode
from trajwh.schemas.tables import EpisodeRow, StepRow

ROOT = Path(__file__).resolve().parents[1]


def test_record_id_depends_on_source_and_bytes():
    a = ids.record_id("s1", b"payload")
    assert a == ids.record_id("s1", b"payload")
    assert a != ids.record_id("s2", b"payload")
    assert a != ids.record_id("s1", b"payload ")
    assert len(a) == 64


key_values = st.dictionaries(st.sampled_from(ids.TRAJECTORY_KEY_FIELDS),
                             st.one_of(st.text(min_size=1, max_size=20), st.integers(0, 50)), min_size=1)


@given(key_values)
def test_trajectory_key_ignores_field_order_and_lists_what_it_used(fields):
    key, used, missing = ids.trajectory_key(fields, raw_origin="r:0")
    reordered = dict(reversed(list(fields.items())))
    assert ids.trajectory_key(reordered, raw_origin="r:0")[0] == key
    assert set(used) - {ids.FALLBACK_KEY_FIELD} == set(fields)
    assert set(missing) == set(ids.TRAJECTORY_KEY_FIELDS) - set(fields)


def test_trajectory_key_falls_back_to_raw_origin_only_without_attempt_or_episode_id():
    _, used, _ = ids.trajectory_key({"task_digest": "t"}, raw_origin="rec:0")
    assert ids.FALLBACK_KEY_FIELD in used
    k1, used, _ = ids.trajectory_key({"task_digest": "t", "attempt": 1}, raw_origin="rec:0")
    assert ids.FALLBACK_KEY_FIELD not in used
    assert k1 == ids.trajectory_key({"task_digest": "t", "attempt": 1}, raw_origin="other:3")[0]
    assert k1 != ids.trajectory_key({"task_digest": "t", "attempt": 2})[0]


def test_step_id_is_stable_per_key_and_index():
    assert ids.step_id("k", 0) == ids.step_id("k", 0)
    assert ids.step_id("k", 0) != ids.step_id("k", 1)


def test_arrow_schemas_carry_lineage_columns_and_version():
    for model in (EpisodeRow, StepRow):
        schema = arrow_schema(model)
        for col in ("_record_id", "_batch_id", "_run_id", "_transform", "_transform_version"):
            assert col in schema.names
            assert not schema.field(col).nullable
        assert schema.metadata[b"trajwh.schema_version"]
    for table, model in PARQUET_TABLES.items():
        assert arrow_schema(model).names == [f.alias or n for n, f in model.model_fields.items()], table


def test_committed_json_schema_matches_the_models():
    committed = json.loads((ROOT / "docs" / "native-format.schema.json").read_text())
    assert committed == NativeEpisode.model_json_schema(), "run `make schema` and commit docs/"
