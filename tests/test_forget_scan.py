"""The proof's probe search (lineage.forget._Search): exact whatever the text repeats or where a
probe falls, on the cases a leftmost-first automaton over slices of a buffer could miss; the same
with either matcher (Hyperscan, and the Aho-Corasick automaton used where it is not installed)."""

from __future__ import annotations

import gzip

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from trajwh.lineage import forget as F

A = "alpha bravo charlie delta echo f"  # 32 characters, as the plan draws them
B = "charlie delta echo foxtrot golf "  # starts inside A: a leftmost-first pass sees only A
C = "path/to/some/file_name.py and 12"  # holds "/": JSON may write it "\/"


NO_HYPERSCAN = "hyperscan is not installed on this platform: the Aho-Corasick automaton is used"


@pytest.fixture
def fresh_matchers():
    """No matcher built by an earlier test (``_automaton`` keeps the last few), before and after."""
    F._automaton.cache_clear()
    yield
    F._automaton.cache_clear()


@pytest.fixture(params=["hyperscan", "aho-corasick"])
def engine(request, monkeypatch, fresh_matchers):
    """The search's matcher: Hyperscan (skipped where it is not installed), or the fallback."""
    if request.param == "hyperscan":
        if F.hyperscan is None:
            pytest.skip(NO_HYPERSCAN)
    else:
        monkeypatch.setattr(F, "hyperscan", None)
    return request.param


def test_probes_are_32_characters():
    assert {len(A), len(B), len(C)} == {F._PROBE_LEN}


def test_a_probe_that_overlaps_another_is_found_too(engine):
    text = "xx alpha bravo charlie delta echo foxtrot golf yy"
    assert A in text and B in text
    assert F._Search([A, B]).text(text) == {A, B}


def test_a_probe_across_slices_is_found(monkeypatch, engine):
    monkeypatch.setattr(F, "_SLICE", 40)
    for at in range(0, 60):  # every offset across the first slice boundaries
        text = "." * at + B + "." * 50
        assert F._Search([A, B]).text(text) == {B}, at


def test_text_that_repeats_a_probe_still_finds_the_others(monkeypatch, engine):
    monkeypatch.setattr(F, "_SLICE", 64)
    text = (A + " ") * 500 + B
    assert F._Search([A, B]).text(text) == {A, B}


def test_json_escaped_slashes_are_found(engine):
    escaped = C.replace("/", "\\/").encode()
    assert F._Search([C]).text(b'{"x": "' + escaped + b'"}') == {C}


def test_two_values_that_make_a_probe_together_do_not_count_one_that_holds_it_does(engine):
    half = F._PROBE_LEN // 2
    apart = pa.array([A[:half], A[half:], "other"])
    assert F._Search([A]).leaf(apart) == set()
    assert F._Search([A]).leaf(pa.array(["x", "yy " + A + " zz", None])) == {A}
    assert F._Search([A]).leaf(pa.array([b"x", b"yy " + A.encode()], pa.binary())) == {A}


def test_a_found_probe_is_not_reported_again_by_the_same_search(engine):
    search = F._Search([A, B])
    assert search.text(A) == {A}
    assert search.text(A + B) == {B}
    assert search.done


def test_a_search_that_rebuilds_its_matcher_finds_exactly_the_probes_present(engine, monkeypatch):
    """Many probes, most of them in the buffers (shared text): found ones leave the matcher, which
    is built again and again without them (a small stale limit forces it for both matchers); what
    is found is exactly what a plain substring test finds, and a probe is reported once."""
    import random

    rng = random.Random(7)
    words = [f"{w}{n}" for w in ("alpha", "bravo", "delta", "kilo", "lima", "oscar", "tango") for n in range(40)]
    probes = sorted({" ".join(rng.choice(words) for _ in range(12))[:F._PROBE_LEN] for _ in range(600)})
    present = rng.sample(probes, 400)
    slashed = [p for p in probes if p not in present][:20]
    present_slashed = [p[:10] + "/" + p[11:] for p in slashed]  # written "\/" in the buffer
    monkeypatch.setattr(F._HyperscanSet, "stale_limit", 25)
    monkeypatch.setattr(F, "_REBUILD_FOUND", 50)
    search = F._Search(probes + present_slashed, confirm=False)
    found, seen, fed = set(), [], set()
    for i in range(0, len(present), 40):  # buffers that repeat what earlier ones held, and overlap
        chunk, escaped = present[:i + 40], present_slashed[:i // 20]
        fed |= set(chunk) | set(escaped)
        text = " | ".join(chunk[::-1] + chunk) + " ".join(p.replace("/", "\\/") for p in escaped)
        new = search.leaf(pa.array([text.encode()], pa.binary()))
        assert not new & found
        found |= new
        seen.append(len(found))
    assert found == search.found == fed and len(fed & set(present_slashed)) == 18
    assert seen == sorted(seen) and seen[0] < seen[-1]


@pytest.mark.skipif(F.hyperscan is None, reason=NO_HYPERSCAN)
def test_a_matcher_hyperscan_cannot_build_falls_back_to_the_automaton(monkeypatch, fresh_matchers):
    def refuse(self, patterns):
        raise F.hyperscan.error("out of memory")

    monkeypatch.setattr(F._HyperscanSet, "__init__", refuse)
    assert isinstance(F._automaton(F._patterns((A, B))[0]), F._AhoCorasickSet)
    assert F._Search([A, B]).text("xx alpha bravo charlie delta echo foxtrot golf yy") == {A, B}


@pytest.mark.parametrize("plain", [True, False])
def test_files_are_scanned_decoded_nested_and_compressed(tmp_path, plain, engine):
    salt = b"s" * 32
    matcher = F._Matcher([A, C] if plain else None, {F.fingerprint(A, salt), F.fingerprint(C, salt)}, salt)
    nested = pa.table({"n": [1, 2], "steps": [[{"text": "x", "tags": ["y"]}], [{"text": "q", "tags": [A]}]]})
    pq.write_table(nested, tmp_path / "t.parquet")
    (tmp_path / "e.jsonl.gz").write_bytes(gzip.compress(('{"p": "' + C.replace("/", "\\/") + '"}').encode()))
    (tmp_path / "clean.parquet").write_bytes(b"")  # unreadable as Parquet: read as bytes, no hit
    assert F._scan_file(str(tmp_path / "t.parquet"), matcher) == {F.fingerprint(A, salt)}
    assert F._scan_file(str(tmp_path / "e.jsonl.gz"), matcher) == {F.fingerprint(C, salt)}
    assert F._scan_file(str(tmp_path / "clean.parquet"), matcher) == set()


def test_the_scan_counts_forgotten_rows_and_leaves_a_file_without_its_key_column_to_the_old_read(tmp_path):
    """A data file's rows that carry a forgotten id are counted as the scan reads it (its key
    columns read beside its text); one that lacks its table's key column is not counted (the proof
    reads it with the table's schema afterwards) and is still searched decoded, not as bytes."""
    salt = b"s" * 32
    matcher = F._Matcher([A], {F.fingerprint(A, salt)}, salt)
    gone = pa.array(["ep-gone"], pa.string())
    keys = {"keys": gone, "records": gone, "any": gone, "digests": gone, "quarantine": gone}
    pq.write_table(pa.table({"trajectory_key": ["ep-gone", "ep-stays", "ep-gone"], "n": [1, 2, 3]}), tmp_path / "e.parquet")
    pq.write_table(pa.table({"step_id": ["s1"], "text": ["yy " + A]}), tmp_path / "s.parquet")
    rows = F._RowCheck({str(tmp_path / "e.parquet"): "episodes", str(tmp_path / "s.parquet"): "steps"}, keys)
    assert F._scan_file(str(tmp_path / "e.parquet"), matcher, rows) == set()
    assert F._scan_file(str(tmp_path / "s.parquet"), matcher, rows) == {F.fingerprint(A, salt)}
    assert rows.left == {"episodes": 2} and rows.counted == {str(tmp_path / "e.parquet")}


def test_probe_windows_are_distinctive_spread_and_deterministic():
    import random

    rng = random.Random(5)
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo"]
    text = " ".join(f"{rng.choice(words)}{rng.randrange(1000)}" for _ in range(2_000))
    ws = F.probe_windows(text, "record-1", 8)
    assert len(ws) == len(set(ws)) == 8 and ws == F.probe_windows(text, "record-1", 8)
    assert ws != F.probe_windows(text, "record-2", 8)
    for w in ws:
        at = text.index(w)
        assert len(w) == F._PROBE_LEN and (at == 0 or not text[at - 1].isalnum())
        assert len(w.translate(F._NOT_ALNUM)) >= 20 and len(set(w)) >= 10
    eighths = {text.index(w) * 8 // len(text) for w in ws}
    assert len(eighths) >= 6  # spread over the text, not bunched at the seed's place
    assert F.probe_windows("aaaa " * 50_000, "x", 16) == [] and F.probe_windows("", "x") == []
    tail = "aaaa! " * 400 + "the one distinctive window, 12345 here"  # no window spans "!"
    assert set(F.probe_windows(tail, "x", 4)) == {"the one distinctive window, 1234", "one distinctive window, 12345 he"}
    # text the record repeats counts once: its one distinctive sentence is as likely as the boilerplate
    boiler = "You are a helpful assistant that edits files. " * 2_000
    own = "The traceback names parse_header in module mail/utils.py line 88"
    picks = {w for seed in range(20) for w in F.probe_windows(boiler + own + " " + boiler, str(seed), 2)}
    assert any(w in own for w in picks)


def _windows_by_regex(text: str) -> list[str]:
    """The definition: every window ``_SAFE`` finds, distinct, in the order of first occurrence."""
    return list(dict.fromkeys(F._SAFE.findall(text)))


@pytest.mark.parametrize("block", [None, 1, 7, 33, 64])
def test_distinct_windows_are_the_regular_expressions(block, monkeypatch):
    """The array search finds the windows the regular expression defines, in the same order: on
    random text over the characters that matter (letters, digits, the safe punctuation, characters
    that end a window, non-ASCII ones, a text repeated), around texts of the window's length; with
    the text taken in blocks of a few characters too (a window, a word's start across a block's edge)."""
    import random

    if block is not None:
        monkeypatch.setattr(F, "_BLOCK", block)
    rng = random.Random(11)
    alphabet = "ab cD19,.:;_()/=+-\n\"\\é😀\u0300x"
    for _ in range(2_000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 120)))
        if rng.random() < 0.5:
            text = (text + " the quick brown fox jumps over 12 lazy dogs; ") * rng.randint(1, 3)
        got = [text[i:i + F._PROBE_LEN] for i in F._distinct_windows(text)]
        assert got == _windows_by_regex(text), repr(text)
    exact = "a" * F._PROBE_LEN
    assert [int(i) for i in F._distinct_windows(exact)] == [0] and len(F._distinct_windows(exact[1:])) == 0
    assert len(F._distinct_windows("\ud800" + exact)) == 1  # a lone surrogate (counted as one code point)


def test_distinct_windows_on_real_trajectories():
    from conftest import SHARED_CORPUS

    files = sorted(p for p in SHARED_CORPUS.rglob("*") if p.is_file() and p.suffix in (".json", ".jsonl", ".md", ".txt"))
    if not files:
        pytest.skip(f"the shared corpus is not here ({SHARED_CORPUS})")
    for path in files[:40]:
        text = path.read_text(errors="replace")
        assert [text[i:i + F._PROBE_LEN] for i in F._distinct_windows(text)] == _windows_by_regex(text), path
