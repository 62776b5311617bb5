"""Export one split of a pack set for a trainer: Parquet shards (Hugging Face) or a Megatron indexed dataset.

Both stream the packs (a few dozen sequences in memory at a time) into a private folder inside
``out`` and move the files into place only when everything is written, manifest last: a reader
never sees half an export, and an existing export is never overwritten silently.

**Parquet** (``data/{split}-{k:05d}-of-{n:05d}.parquet``, loadable by
``datasets.load_dataset("parquet", data_dir=OUT)``): per packed sequence ``input_ids``, ``labels``
(the token id where the loss mask is 1, -100 elsewhere: the Hugging Face convention),
``position_ids`` (restarting per segment), ``cu_seqlens`` (segment boundaries ``[0, e1, ..., n]``,
what variable-length attention takes to keep segments apart), ``fragment_ids`` (one per segment)
and ``pack_id``.

**Megatron** (Megatron-Core ``IndexedDataset`` / ``MMapIndexedDataset`` layout): ``{split}_text_document.bin``
holds the token ids of every packed sequence back to back (int32, or uint16 when the vocabulary
fits); ``.idx`` holds the magic ``MMIDIDX\\x00\\x00``, version 1 (``<Q``), the dtype code (``<B``:
4 int32, 8 uint16, 1 uint8), the sequence count and document count (``<Q`` each), then the
sequence lengths (int32), byte pointers (int64) and document indices (int64: ``[0, 1, ..., n]``,
one document per packed sequence). Sidecars in the same layout: ``{split}_loss_mask`` (uint8, one
per token) and ``{split}_cu_seqlens`` (int32 segment boundaries per sequence).

**Manifest** (``manifest.json``): tokenizer and template ids, pack set and its configuration,
counts (sequences, tokens, trainable tokens), packing efficiency, every file with its sha256, and
the fragment ids in the export (lineage).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from trajwh.lineage.catalog import Warehouse, now_utc
from trajwh.packing.sequences import pack_sequences
from trajwh.schemas.errors import ConfigError

FORMATS = ("parquet", "megatron")
MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_DTYPES = {np.dtype(np.uint8): 1, np.dtype(np.int32): 4, np.dtype(np.uint16): 8}
EXPORT_VERSION = "1.0.0"
_PARQUET_SCHEMA = pa.schema([
    ("pack_id", pa.string()), ("input_ids", pa.list_(pa.int32())), ("labels", pa.list_(pa.int32())),
    ("position_ids", pa.list_(pa.int32())), ("cu_seqlens", pa.list_(pa.int32())),
    ("fragment_ids", pa.list_(pa.string()))])


@dataclass
class ExportSummary:
    out: Path
    pack_set: str
    split: str
    fmt: str
    sequences: int = 0
    tokens: int = 0
    trainable: int = 0
    seq_len: int = 0
    files: list[str] = field(default_factory=list)

    @property
    def efficiency(self) -> float:
        return self.tokens / (self.sequences * self.seq_len) if self.sequences else 0.0


def resolve_pack_set(wh: Warehouse, pack_set: str | None) -> str:
    """The set named, else the only one, else the one the configuration builds."""
    sets = wh.query("SELECT DISTINCT pack_set FROM packs ORDER BY 1").column(0).to_pylist() \
        if wh.manifest_query("SELECT count(*) FROM table_files WHERE table_name = 'packs'").column(0)[0].as_py() else []
    if not sets:
        raise ConfigError(f"no packs in {wh.root}", valid="run `trajwh pack` (or `trajwh build`) first")
    if pack_set:
        if pack_set not in sets:
            raise ConfigError(f"no pack set {pack_set!r} in {wh.root}", valid=", ".join(sets))
        return pack_set
    if len(sets) == 1:
        return sets[0]
    from trajwh.packing.layer import pack_set_id
    from trajwh.pipelines.settings import pack_config
    from trajwh.schemas.config import load_settings

    cfg = pack_config(load_settings(None, wh.root))
    configured = pack_set_id(cfg)
    if configured in sets:
        return configured
    raise ConfigError("several pack sets and none is the configured one", valid="--pack-set " + " | ".join(sets))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class MegatronWriter:
    """One ``.bin`` + ``.idx`` pair in the Megatron-Core indexed-dataset layout, one document per sequence."""

    def __init__(self, prefix: Path, dtype: np.dtype) -> None:
        self.prefix, self.dtype = prefix, np.dtype(dtype)
        self.bin = open(prefix.with_suffix(".bin"), "wb")
        self.lengths: list[int] = []

    def add(self, values: Any) -> None:
        arr = np.asarray(values, dtype=self.dtype)
        self.bin.write(arr.tobytes(order="C"))
        self.lengths.append(len(arr))

    def close(self) -> list[Path]:
        self.bin.close()
        lengths = np.asarray(self.lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            pointers[1:] = np.cumsum(lengths[:-1], dtype=np.int64) * self.dtype.itemsize
        documents = np.arange(len(lengths) + 1, dtype=np.int64)
        with open(self.prefix.with_suffix(".idx"), "wb") as f:
            f.write(MEGATRON_MAGIC)
            f.write(struct.pack("<Q", 1))
            f.write(struct.pack("<B", MEGATRON_DTYPES[self.dtype]))
            f.write(struct.pack("<Q", len(lengths)))
            f.write(struct.pack("<Q", len(documents)))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(documents.tobytes())
        return [self.prefix.with_suffix(".bin"), self.prefix.with_suffix(".idx")]


def _cu_seqlens(segments: list[dict[str, Any]], n: int) -> list[int]:
    return [0] + [s["end"] for s in segments[:-1]] + [n] if segments else [0, n]


def export_packs(wh: Warehouse, *, split: str, fmt: str, out: str | Path, pack_set: str | None = None,
                 rows_per_shard: int = 1_000, overwrite: bool = False,
                 progress: Callable[[int], None] | None = None) -> ExportSummary:
    if fmt not in FORMATS:
        raise ConfigError(f"unknown export format {fmt!r}", valid=", ".join(FORMATS))
    wh.require()
    pack_set = resolve_pack_set(wh, pack_set)
    info = wh.query("""SELECT count(*) AS n, any_value(tokenizer_id) AS tokenizer_id, any_value(template_id) AS template_id,
                              any_value(seq_len) AS seq_len, any_value(_transform_version) AS version,
                              (SELECT max(list_max(t.input_ids)) FROM pack_tokens t WHERE t.pack_set = ?
                               AND t.unit_id IN (SELECT split_part(x.s.fragment_id, '#', 1) FROM packs q,
                                                 unnest(q.segments) AS x(s) WHERE q.pack_set = ? AND q.split = ?)) AS max_id
                       FROM packs WHERE pack_set = ? AND split = ?""", [pack_set, pack_set, split, pack_set, split]
                    ).to_pylist()[0]
    if not info["n"]:
        splits = wh.query("SELECT DISTINCT split FROM packs WHERE pack_set = ? ORDER BY 1", [pack_set]).column(0)
        raise ConfigError(f"pack set {pack_set} has no {split!r} packs", valid=", ".join(splits.to_pylist()))
    from trajwh.licenses.eligibility import not_trainable_in_packs

    barred = not_trainable_in_packs(wh, pack_set, split)
    if barred:  # an opt-out added since the packs were built: they must be built again first
        first = "; ".join(f"{k[:16]}: {', '.join(r)}" for k, r in list(barred.items())[:3])
        raise ConfigError(f"{len(barred)} episode(s) in the {split} packs may not be trained on now: {first}",
                          valid="run `trajwh build` (the packs are built again without them), then export")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise ConfigError(f"{out} exists and is not empty", valid="an empty or new folder, or --overwrite")
    work = out / f".partial-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    summary = ExportSummary(out, pack_set, split, fmt, seq_len=info["seq_len"])
    fragments: list[str] = []
    written: list[Path] = []
    rows = pack_sequences(wh, "p.pack_set = ? AND p.split = ?", [pack_set, split])
    try:
        if fmt == "parquet":
            written = _write_parquet(rows, work, split, info["n"], rows_per_shard, summary, fragments, progress)
        else:
            written = _write_megatron(rows, work, split, info["max_id"], summary, fragments, progress)
    finally:
        rows.close()
    manifest = {
        "export_version": EXPORT_VERSION, "format": fmt, "split": split, "created_at": now_utc().isoformat(),
        "pack_set": pack_set, "tokenizer_id": info["tokenizer_id"], "template_id": info["template_id"],
        "config": dict(kv.split("=", 1) for kv in info["version"].split(";")[1:] if "=" in kv),
        "counts": {"sequences": summary.sequences, "tokens": summary.tokens, "trainable_tokens": summary.trainable,
                   "segments": len(fragments)},
        "seq_len": info["seq_len"], "packing_efficiency": round(summary.efficiency, 6),
        "files": {str(p.relative_to(work)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in written},
        "fragment_ids": sorted(set(fragments)),
    }
    (work / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    # publish: clear what an --overwrite replaces, move the data in, the manifest last
    for old in out.iterdir():
        if old != work:
            shutil.rmtree(old) if old.is_dir() else old.unlink()
    for p in sorted(written, key=lambda p: len(p.parts), reverse=False):
        dest = out / p.relative_to(work)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(p, dest)
    os.replace(work / "manifest.json", out / "manifest.json")
    shutil.rmtree(work, ignore_errors=True)
    summary.files = [*manifest["files"], "manifest.json"]
    return summary


def _account(p: dict[str, Any], summary: ExportSummary, fragments: list[str],
             progress: Callable[[int], None] | None) -> None:
    summary.sequences += 1
    summary.tokens += p["n_tokens"]
    summary.trainable += p["n_trainable"]
    fragments.extend(s["fragment_id"] for s in p["segments"])
    if progress:
        progress(1)


def _write_parquet(rows: Any, work: Path, split: str, total: int, per_shard: int, summary: ExportSummary,
                   fragments: list[str], progress: Callable[[int], None] | None) -> list[Path]:
    shards = max(1, -(-total // per_shard))
    (work / "data").mkdir()
    written: list[Path] = []
    buffer: list[dict[str, Any]] = []

    def flush() -> None:
        path = work / "data" / f"{split}-{len(written):05d}-of-{shards:05d}.parquet"
        pq.write_table(pa.Table.from_pylist(buffer, schema=_PARQUET_SCHEMA), path, compression="zstd")
        written.append(path)
        buffer.clear()

    for batch in rows:
        for p in batch:
            ids = np.asarray(p["input_ids"], dtype=np.int32)
            labels = np.where(np.asarray(p["loss_mask"], dtype=bool), ids, -100)
            buffer.append({"pack_id": p["pack_id"], "input_ids": ids, "labels": labels,
                           "position_ids": p["position_ids"], "cu_seqlens": _cu_seqlens(p["segments"], len(ids)),
                           "fragment_ids": [s["fragment_id"] for s in p["segments"]]})
            _account(p, summary, fragments, progress)
            if len(buffer) >= per_shard:
                flush()
    if buffer:
        flush()
    return written


def _write_megatron(rows: Any, work: Path, split: str, max_id: int, summary: ExportSummary,
                    fragments: list[str], progress: Callable[[int], None] | None) -> list[Path]:
    token_dtype = np.uint16 if max_id is not None and max_id < 65_500 else np.int32
    tokens = MegatronWriter(work / f"{split}_text_document", token_dtype)
    masks = MegatronWriter(work / f"{split}_loss_mask", np.uint8)
    bounds = MegatronWriter(work / f"{split}_cu_seqlens", np.int32)
    for batch in rows:
        for p in batch:
            tokens.add(p["input_ids"])
            masks.add(p["loss_mask"])
            bounds.add(_cu_seqlens(p["segments"], len(p["input_ids"])))
            _account(p, summary, fragments, progress)
    return [*tokens.close(), *masks.close(), *bounds.close()]
