"""Export and re-ingest: native JSONL reproduces the same episodes; ATIF keeps the episode's shape."""

from __future__ import annotations

from datetime import UTC, datetime

import orjson
import pytest
from conftest import SHARED_CORPUS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trajwh.ingest.export import export_episodes
from trajwh.ingest.normalize import normalize_warehouse
from trajwh.ingest.raw_store import IngestOptions, ingest_paths
from trajwh.licenses.eligibility import build_eligibility
from trajwh.lineage.catalog import Warehouse
from trajwh.redaction.layer import redact_warehouse
from trajwh.schemas.errors import ConfigError

_SKIP_EP = {"metadata", "trajectory_key"}


def content(wh: Warehouse, with_keys: bool = True) -> list[dict]:
    """Episodes with their steps, lineage columns dropped, in a stable order."""
    eps = wh.query("SELECT * FROM episodes").to_pylist()
    steps = wh.query("SELECT * FROM steps ORDER BY trajectory_key, step_index").to_pylist()
    by_key: dict[str, list] = {}
    for s in steps:
        by_key.setdefault(s["trajectory_key"], []).append(
            {k: v for k, v in s.items() if not k.startswith("_") and (with_keys or k not in ("step_id", "trajectory_key"))})
    out = []
    for e in eps:
        meta = orjson.loads(e["metadata"]) if e["metadata"] else {}
        meta.pop("exported_from", None) if isinstance(meta, dict) else None
        row = {k: v for k, v in e.items() if not k.startswith("_") and k not in _SKIP_EP}
        if not with_keys:  # compared across formats: the format name changes, nothing else may
            for k in ("key_fields", "key_fields_missing", "format"):
                row.pop(k)
        row["metadata"] = meta or None
        if with_keys:
            row["trajectory_key"] = e["trajectory_key"]
        row["steps"] = by_key.get(e["trajectory_key"], [])
        out.append(row)
    return sorted(out, key=lambda r: orjson.dumps(r, default=str, option=orjson.OPT_SORT_KEYS))


def roundtrip(tmp_path, src: Warehouse, fmt: str) -> Warehouse:
    out = tmp_path / f"export.{fmt}.jsonl"
    export_episodes(src, fmt, out, layer="normalized")
    dst = Warehouse(tmp_path / f"wh-{fmt}")
    s = ingest_paths(dst, [out], IngestOptions(source="src"))
    assert s.n_quarantined == 0
    normalize_warehouse(dst, run_id="rt")
    return dst


text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
maybe = lambda s: st.none() | s  # noqa: E731
stamp = st.datetimes(datetime(2020, 1, 1), datetime(2030, 1, 1), timezones=st.just(UTC))
tool_args = st.dictionaries(st.sampled_from(["path", "command", "pattern", "n"]), st.one_of(text, st.integers(-5, 5)), max_size=3)


@st.composite
def native_step(draw, index: int):
    kind = draw(st.sampled_from(["model", "env", "harness", "human"]))
    step = {"index": index}
    if kind == "model":
        step.update(role="assistant", author="model", text=draw(maybe(text)),
                    tool_calls=draw(maybe(st.lists(st.fixed_dictionaries(
                        {"id": st.text("abc123", min_size=1, max_size=6), "name": st.sampled_from(["bash", "Read", "edit_file"]),
                         "arguments": tool_args}), min_size=1, max_size=2))))
    elif kind == "env":
        step.update(role="tool", author="environment", observation=draw(text), exit_code=draw(maybe(st.integers(-1, 2))),
                    tool_call_id=draw(maybe(st.text("abc123", min_size=1, max_size=6))),
                    test_results=draw(maybe(st.lists(st.fixed_dictionaries(
                        {"name": text, "status": st.sampled_from(["passed", "failed"])}), max_size=2))))
    else:
        step.update(role="user" if kind == "human" else "system", author=kind, text=draw(text))
    if draw(st.booleans()):
        step["started_at"] = draw(stamp)
    return step


@st.composite
def native_episode(draw, n: int):
    n_steps = draw(st.integers(1, 5))
    return {
        "format": "trajwh.native", "episode_id": f"ep-{n}",
        "task": {"task_id": draw(maybe(text)), "text": draw(maybe(text)), "repository": draw(maybe(text))},
        "policy": {"name": draw(maybe(text))}, "harness": {"name": draw(maybe(text))},
        "attempt": draw(maybe(st.integers(0, 9))), "sampling": draw(maybe(st.fixed_dictionaries({"temperature": st.floats(0, 2)}))),
        "outcome": {"resolved": draw(maybe(st.booleans())), "reward": draw(maybe(st.floats(0, 1))),
                    "verifier_status": draw(maybe(st.sampled_from(["ok", "unavailable"])))},
        "usage": {"tokens_in": draw(maybe(st.integers(0, 10**6)))},
        "steps": [draw(native_step(i)) for i in range(n_steps)],
        "metadata": draw(maybe(st.dictionaries(st.sampled_from(["a", "b"]), text, max_size=2))),
    }


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(1, 4).flatmap(lambda n: st.tuples(*[native_episode(i) for i in range(n)])))
def test_native_export_reingests_to_the_same_episodes(tmp_path_factory, episodes):
    tmp = tmp_path_factory.mktemp("rt")
    src_file = tmp / "in.jsonl"
    src_file.write_bytes(b"".join(orjson.dumps(e, option=orjson.OPT_UTC_Z) + b"\n" for e in episodes))
    src = Warehouse(tmp / "wh")
    ingest_paths(src, [src_file], IngestOptions(source="src"))
    normalize_warehouse(src, run_id="a")
    dst = roundtrip(tmp, src, "native")
    assert content(dst) == content(src)


@pytest.mark.skipif(not SHARED_CORPUS.is_dir(), reason=f"real corpus not found at {SHARED_CORPUS}")
def test_real_corpus_round_trips_through_native_and_atif(tmp_path):
    src = Warehouse(tmp_path / "src")
    ingest_paths(src, [SHARED_CORPUS], IngestOptions(source="src"))
    normalize_warehouse(src, run_id="a")
    # episodes keyed by a fallback (no attempt, no episode id: aider sessions) get a new raw origin, so
    # they are compared by content, without keys
    assert content(roundtrip(tmp_path, src, "native"), with_keys=False) == content(src, with_keys=False)
    atif = roundtrip(tmp_path, src, "atif")
    shape = "SELECT e.n_steps, list(s.author ORDER BY s.step_index) AS authors FROM episodes e JOIN steps s " \
            "USING (trajectory_key) GROUP BY e.trajectory_key, e.n_steps ORDER BY 1, 2"
    assert atif.query(shape).to_pylist() == src.query(shape).to_pylist()


def test_export_refuses_layers_that_are_not_built(wh, cases, tmp_path):
    ingest_paths(wh, [cases / "two_episodes.jsonl"], IngestOptions(source="c", license="MIT"))
    normalize_warehouse(wh, run_id="a")
    with pytest.raises(ConfigError, match="not built"):
        export_episodes(wh, "native", tmp_path / "x.jsonl")  # default: the redacted layer, not built yet
    redact_warehouse(wh, run_id="r")
    with pytest.raises(ConfigError, match="what may be released is not decided"):
        export_episodes(wh, "native", tmp_path / "r.jsonl")  # a release needs the eligibility step's decision
    build_eligibility(wh, run_id="g")
    assert export_episodes(wh, "native", tmp_path / "r.jsonl") == 2
    with pytest.raises(ConfigError, match="unknown export format"):
        export_episodes(wh, "csv", tmp_path / "x.jsonl", layer="normalized")
    assert export_episodes(wh, "native", tmp_path / "x.jsonl.gz", layer="normalized") == 2


@pytest.mark.skipif(not SHARED_CORPUS.is_dir(), reason=f"real corpus not found at {SHARED_CORPUS}")
@pytest.mark.parametrize("fmt", ["mini-swe-agent", "swe-agent", "openhands-output"])
def test_atif_export_of_one_harness_reingests_as_atif_without_a_flag(tmp_path, fmt):
    """An export's head quotes the harness's name: detection must still see ATIF."""
    src = Warehouse(tmp_path / "src")
    ingest_paths(src, [SHARED_CORPUS], IngestOptions(source="src"))
    normalize_warehouse(src, run_id="a")
    out = tmp_path / "only.jsonl"
    n = export_episodes(src, "atif", out, layer="normalized", where=f"format = '{fmt}'")
    dst = Warehouse(tmp_path / "dst")
    s = ingest_paths(dst, [out], IngestOptions(source="src"))
    assert n > 0 and s.n_quarantined == 0 and s.n_new == n
    assert dst.query("SELECT DISTINCT format FROM raw_records").to_pylist() == [{"format": "atif"}]
