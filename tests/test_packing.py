"""Packed token layer, first part (issue 15): offline tokenizers and template rendering with an
exact loss mask, checked on every source format (real corpus and synthetic)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
from conftest import SHARED_CORPUS

from ingest.raw_store import IngestOptions, ingest_paths
from lineage.catalog import Warehouse
from packing.render import model_content, render, trained_text
from packing.tokenizers import get_tokenizer
from pipelines.definitions import build
from schemas.errors import ConfigError


def test_qwen_tokenizer_matches_published_ids_and_never_reads_control_tokens_from_text():
    tok = get_tokenizer("qwen2.5")
    assert tok.encode("Hello world") == [9707, 1879]  # Qwen2.5's tokenizer.json gives these ids
    assert tok.token("<|im_start|>") == 151644 and tok.token("<|im_end|>") == 151645
    assert tok.token("<tool_call>") == 151657
    ids = tok.encode("print('<|im_end|>')")
    assert tok.token("<|im_end|>") not in ids and tok.decode(ids) == "print('<|im_end|>')"
    assert tok.id.startswith("qwen2.5@") and get_tokenizer("cl100k").id.startswith("cl100k@")
    assert tok.id != get_tokenizer("cl100k").id
    with pytest.raises(ConfigError, match="unknown tokenizer"):
        get_tokenizer("gpt-17")


@pytest.fixture(scope="module")
def built(tmp_path_factory, small_corpus: Path) -> Warehouse:
    wh = Warehouse(tmp_path_factory.mktemp("packing") / "wh")
    paths = [small_corpus] + ([SHARED_CORPUS] if SHARED_CORPUS.is_dir() else [])
    ingest_paths(wh, paths, IngestOptions(source="mixed"))
    build(str(wh.root))
    return wh


def _steps(wh: Warehouse, key: str) -> list[dict]:
    return wh.query("SELECT step_id, step_index, author, role, text, observation, tool_calls FROM redacted_steps "
                    "WHERE trajectory_key = ? ORDER BY step_index", [key]).to_pylist()


def _check(rendered, steps: list[dict], span: set[str], tok) -> None:
    authors = {s["step_id"]: s["author"] for s in steps}
    seen_trained = set()
    for step_id, first, end, _role in rendered.steps:
        trained = sum(rendered.mask[first:end])
        if authors[step_id] != "model" or step_id not in span:
            assert trained == 0, f"{authors[step_id]} step {step_id} has tokens under the loss"
        elif trained:
            seen_trained.add(step_id)
    for s in steps:  # every model step of the span with content is trained
        if s["author"] == "model" and s["step_id"] in span and model_content(s):
            assert s["step_id"] in seen_trained, f"model step {s['step_id']} has no trained token"
    assert rendered.steps[-1][2] == len(rendered.ids) == len(rendered.mask)
    unmasked = [t for t, m in zip(rendered.ids, rendered.mask, strict=True) if m]
    assert tok.decode(unmasked) == trained_text(steps, span, tok)


@pytest.mark.parametrize("tokenizer", ["qwen2.5", "cl100k"])
def test_every_source_format_masks_exactly_the_model_tokens(built: Warehouse, tokenizer: str):
    """Whole episodes (every step in the span) of every format: no harness, environment, human or
    system token is trained; every model step is; the trained tokens decode to the model's content."""
    tok = get_tokenizer(tokenizer)
    by_format: dict[str, int] = defaultdict(int)
    for e in built.query("SELECT trajectory_key, format FROM redacted_episodes ORDER BY trajectory_key").to_pylist():
        steps = _steps(built, e["trajectory_key"])
        if not steps:
            continue
        span = {s["step_id"] for s in steps}
        r = render(steps, span, tok)
        _check(r, steps, span, tok)
        # round trip: the rendered text holds every step's content in order
        text = tok.decode(r.ids)
        pos = 0
        for s in steps:
            content = s["text"] if s["author"] == "model" else (s["observation"] or s["text"])
            if content:
                pos = text.index(content, pos)
        by_format[e["format"]] += 1
    formats = set(built.query("SELECT DISTINCT format FROM redacted_episodes").column(0).to_pylist())
    assert set(by_format) == formats and len(formats) >= (8 if SHARED_CORPUS.is_dir() else 1)


def test_fragments_train_only_their_span_never_the_context(built: Warehouse):
    tok = get_tokenizer()
    frags = built.query("SELECT trajectory_key, kind, step_ids, span_step_ids, context_step_ids FROM fragments "
                        "ORDER BY fragment_id").to_pylist()
    assert {"productive", "full_episode"} <= {f["kind"] for f in frags}
    context_model_steps = 0
    for f in frags:
        by_id = {s["step_id"]: s for s in _steps(built, f["trajectory_key"])}
        steps = [by_id[i] for i in f["step_ids"]]
        span = set(f["span_step_ids"])
        r = render(steps, span, tok)
        _check(r, steps, span, tok)
        ranges = {step_id: (a, b) for step_id, a, b, _ in r.steps}
        for sid in f["context_step_ids"]:
            a, b = ranges[sid]
            assert sum(r.mask[a:b]) == 0
            context_model_steps += by_id[sid]["author"] == "model"
    assert context_model_steps > 0  # the context really held model steps, and they stayed input only


def test_end_of_turn_is_trained_only_when_asked(built: Warehouse):
    tok = get_tokenizer()
    key = built.query("SELECT trajectory_key FROM fragments LIMIT 1").column(0)[0].as_py()
    steps = _steps(built, key)
    span = {s["step_id"] for s in steps}
    plain, eot = render(steps, span, tok), render(steps, span, tok, train_end_of_turn=True)
    assert plain.ids == eot.ids
    end = tok.token("<|im_end|>")
    model_turns = sum(1 for s in steps if s["author"] == "model")
    assert eot.trainable - plain.trainable == model_turns
    assert all(m == 0 for t, m in zip(plain.ids, plain.mask, strict=True) if t == end)


def _segments(n: int, seed: int, longest: int = 3000) -> list:
    import random

    from packing.pack import Segment

    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(1, longest)
        mask = tuple(rng.randint(0, 1) for _ in range(length))
        out.append(Segment(f"f{i:05d}", tuple(range(i, i + length)), mask))
    return out


def test_best_fit_decreasing_places_every_segment_once_within_the_length():
    import math

    from packing.pack import best_fit_decreasing, first_fit

    segs = _segments(400, seed=3)
    r = best_fit_decreasing(segs, 8192)
    placed = [fid for s in r.sequences for fid, _, _ in s.segments]
    assert sorted(placed) == sorted(s.fragment_id for s in segs) and not r.dropped
    by_id = {s.fragment_id: s for s in segs}
    for s in r.sequences:
        assert len(s.ids) <= 8192 and len(s.ids) == len(s.mask) == len(s.positions)
        for fid, start, end in s.segments:  # each segment's tokens, mask and restarted positions
            assert tuple(s.ids[start:end]) == by_id[fid].ids and tuple(s.mask[start:end]) == by_id[fid].mask
            assert s.positions[start:end] == list(range(end - start))
    total = sum(len(s) for s in segs)
    assert len(r.sequences) >= math.ceil(total / 8192)
    ff = first_fit(segs, 8192)
    assert len(r.sequences) <= len(ff.sequences) and r.efficiency >= ff.efficiency and r.efficiency > 0.97
    # deterministic whatever the input order
    again = best_fit_decreasing(list(reversed(segs)), 8192)
    assert [s.segments for s in again.sequences] == [s.segments for s in r.sequences]


def test_over_length_segments_are_dropped_or_split_never_silently():
    from packing.pack import best_fit_decreasing

    segs = _segments(50, seed=5, longest=200)
    from packing.pack import Segment

    long = Segment("long", tuple(range(700)), tuple([1] * 700))
    r = best_fit_decreasing([*segs, long], 256)
    assert r.dropped == ["long"] and all(fid != "long" for s in r.sequences for fid, _, _ in s.segments)
    r = best_fit_decreasing([*segs, long], 256, policy="split")
    pieces = sorted((fid, end - start) for s in r.sequences for fid, start, end in s.segments if fid.startswith("long#"))
    assert r.split == ["long"] and pieces == [("long#0", 256), ("long#1", 256), ("long#2", 188)]
    with pytest.raises(ConfigError, match="over-length policy"):
        best_fit_decreasing(segs, 256, policy="squeeze")


def test_rendered_fragments_pack_densely(built: Warehouse):
    from packing.pack import Segment, best_fit_decreasing, first_fit

    tok = get_tokenizer()
    segs = []
    for f in built.query("SELECT fragment_id, trajectory_key, step_ids, span_step_ids FROM fragments "
                         "ORDER BY fragment_id").to_pylist():
        by_id = {s["step_id"]: s for s in _steps(built, f["trajectory_key"])}
        r = render([by_id[i] for i in f["step_ids"]], set(f["span_step_ids"]), tok)
        segs.append(Segment(f["fragment_id"], tuple(r.ids), tuple(r.mask)))
    bfd, ff = best_fit_decreasing(segs, 8192), first_fit(segs, 8192)
    assert bfd.efficiency >= ff.efficiency and len(bfd.sequences) <= len(ff.sequences)
    kept = {fid for s in bfd.sequences for fid, _, _ in s.segments}
    assert kept | set(bfd.dropped) == {s.fragment_id for s in segs}


def test_packs_table_per_split_beside_other_pack_sets(built: Warehouse):
    from packing.layer import PackConfig, build_packs

    s = build_packs(built, run_id="p1", cfg=PackConfig(seq_len=8192))
    assert s.fragments > 0 and sum(s.sequences.values()) > 0 and 0.5 < s.efficiency <= 1.0
    packs = built.query("SELECT * FROM packs").to_pylist()
    frag = {r["fragment_id"]: r for r in built.query(
        "SELECT fragment_id, trajectory_key, split, step_ids, span_step_ids FROM fragments").to_pylist()}
    reps = {r["trajectory_key"] for r in built.query(
        "SELECT trajectory_key FROM near_dup_clusters WHERE is_representative").to_pylist()}
    tok = get_tokenizer()
    checked = 0
    for p in packs:
        assert p["n_tokens"] == len(p["input_ids"]) == len(p["loss_mask"]) <= 8192
        for seg in p["segments"]:
            f = frag[seg["fragment_id"]]
            assert f["split"] == p["split"] and f["trajectory_key"] in reps  # no split mixing; representatives
            assert p["position_ids"][seg["start"]:seg["end"]] == list(range(seg["end"] - seg["start"]))
            if checked < 40:  # the segment is the fragment, rendered: token for token, mask for mask
                by_id = {x["step_id"]: x for x in _steps(built, f["trajectory_key"])}
                r = render([by_id[i] for i in f["step_ids"]], set(f["span_step_ids"]), tok)
                assert p["input_ids"][seg["start"]:seg["end"]] == r.ids
                assert p["loss_mask"][seg["start"]:seg["end"]] == r.mask
                checked += 1
    assert checked == 40
    again = build_packs(built, run_id="p2", cfg=PackConfig(seq_len=8192))
    assert again.skipped
    other = build_packs(built, run_id="p3", cfg=PackConfig(seq_len=4096, tokenizer="cl100k"))
    sets = built.query("SELECT pack_set, any_value(tokenizer_id) AS t, count(*) AS n FROM packs GROUP BY 1").to_pylist()
    assert {r["pack_set"] for r in sets} == {s.pack_set, other.pack_set}  # beside, not over
    assert {r["t"].split("@")[0] for r in sets} == {"qwen2.5", "cl100k"}
    with pytest.raises(ConfigError, match="dedup choice"):
        build_packs(built, run_id="p4", cfg=PackConfig(dedup="some"))
