"""Record framing: offsets, CRLF, blank lines, oversize records, compressed streams (gzip, zstd, xz,
bzip2) whole and cut short."""

from __future__ import annotations

import gzip
import io

import pytest
from trajwh.ingest.reader import TruncatedInput, find_input_files, iter_lines, open_input


def lines(data: bytes, max_bytes: int = 1000, keep: int = 10):
    return list(iter_lines(io.BytesIO(data), max_bytes, keep))


def test_offsets_and_line_numbers_point_at_the_record():
    data = b'{"a":1}\n\n{"b":22}\r\n{"c":3}'
    recs = lines(data)
    assert [(r.line_no, r.data) for r in recs] == [(1, b'{"a":1}'), (3, b'{"b":22}'), (4, b'{"c":3}')]
    for r in recs:
        assert data[r.offset:r.offset + len(r.data)] == r.data


def test_records_spanning_chunks(monkeypatch):
    monkeypatch.setattr("trajwh.ingest.reader.CHUNK", 7)
    data = b"".join(b'{"n":%d,"pad":"%s"}\n' % (i, b"x" * i) for i in range(20))
    recs = lines(data)
    assert len(recs) == 20
    for r in recs:
        assert data[r.offset:r.offset + r.size] == r.data


def test_oversize_record_keeps_prefix_length_and_hash():
    import hashlib

    big = b"y" * 5000
    recs = lines(b'{"ok":1}\n' + big + b"\n" + b'{"ok":2}\n', max_bytes=1000, keep=10)
    assert [r.oversize for r in recs] == [False, True, False]
    assert recs[1].size == 5000 and recs[1].data == b"y" * 10
    assert recs[1].sha256 == hashlib.sha256(big).hexdigest()


def test_truncated_gzip_raises_after_the_good_records(tmp_path):
    payload = b"".join(b'{"n":%d}\n' % i for i in range(5000))
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(gzip.compress(payload)[:-200])
    stream, comp, _raw = open_input(path)
    assert comp == "gzip"
    seen = []
    with pytest.raises(TruncatedInput):
        for r in iter_lines(stream, 1000, 10):
            seen.append(r)
    assert len(seen) > 100


def test_find_input_files_skips_hidden_and_rejects_missing(tmp_path):
    (tmp_path / "a.jsonl").write_text("{}")
    (tmp_path / ".truth").mkdir()
    (tmp_path / ".truth" / "labels.jsonl").write_text("{}")
    (tmp_path / ".hidden.jsonl").write_text("{}")
    assert [p.name for p in find_input_files([tmp_path])] == ["a.jsonl"]
    from trajwh.schemas.errors import ConfigError

    with pytest.raises(ConfigError, match="does not exist"):
        find_input_files([tmp_path / "nope"])


def _zstd(data: bytes) -> bytes:
    import pyarrow as pa

    out = pa.BufferOutputStream()
    with pa.CompressedOutputStream(out, "zstd") as stream:
        stream.write(data)
    return out.getvalue().to_pybytes()


CODECS = {"gzip": gzip.compress, "zstd": _zstd, "xz": __import__("lzma").compress, "bz2": __import__("bz2").compress}


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_compressed_streams_are_told_by_their_bytes_and_cut_ones_keep_what_came_before(tmp_path, codec):
    payload = b"".join(b'{"n":%d,"pad":"%s"}\n' % (i, b"x" * (i % 50)) for i in range(100_000))
    path = tmp_path / "records.data"  # no telling name: the magic bytes decide
    path.write_bytes(CODECS[codec](payload))
    stream, comp, raw = open_input(path)
    assert comp == codec
    recs = list(iter_lines(stream, 1000, 10))
    assert b"".join(r.data + b"\n" for r in recs) == payload
    assert all(payload[r.offset:r.offset + r.size] == r.data for r in recs[::997])
    path.write_bytes(CODECS[codec](payload)[:-300])
    stream, comp, raw = open_input(path)
    seen = []
    with pytest.raises(TruncatedInput):
        for r in iter_lines(stream, 1000, 10):
            seen.append(r)
    assert len(seen) > 50_000 and all(payload[r.offset:r.offset + r.size] == r.data for r in seen[::997])


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_a_compressed_file_lands_the_records_of_the_plain_one(tmp_path, cases, codec):
    from trajwh.ingest.raw_store import IngestOptions, ingest_paths
    from trajwh.lineage.catalog import Warehouse

    plain = (cases / "two_episodes.jsonl").read_bytes()
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / f"two.jsonl.{codec}").write_bytes(CODECS[codec](plain))
    got = {}
    for name, folder in (("plain", cases / "two_episodes.jsonl"), (codec, tmp_path / "in")):
        wh = Warehouse(tmp_path / name)
        ingest_paths(wh, [folder], IngestOptions(source="cases"))
        got[name] = wh.query("SELECT record_id, line_no, byte_offset, byte_length, compression FROM raw_records "
                             "ORDER BY line_no").to_pylist()
    assert [{**r, "compression": None} for r in got[codec]] == got["plain"] and len(got["plain"]) == 2
    assert {r["compression"] for r in got[codec]} == {codec}


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_a_stream_cut_before_anything_could_be_read_says_so(tmp_path, cases, codec):
    """A small file compressed in one block and cut short yields no bytes at all (zstd, bzip2): it is
    quarantined as a cut stream, not as a file of an unknown format with empty first bytes."""
    from trajwh.ingest.raw_store import IngestOptions, ingest_paths
    from trajwh.lineage.catalog import Warehouse

    whole = CODECS[codec]((cases / "two_episodes.jsonl").read_bytes())
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / f"two.jsonl.{codec}").write_bytes(whole[: len(whole) // 2])
    wh = Warehouse(tmp_path / "wh")
    s = ingest_paths(wh, [tmp_path / "in"], IngestOptions(source="cases"))
    [q] = wh.query("SELECT reason_code, reason FROM quarantine").to_pylist()
    assert s.n_new == 0 and q["reason_code"] == "truncated_file", q
    assert "ends early or is corrupt" in q["reason"] and "first bytes" not in q["reason"]
