"""Build the ``packs`` table: the trainable fragments of each split, rendered, tokenized and packed.

A pack set is one tokenizer + template + packing configuration; building another set (another
tokenizer, another length) writes its files beside the others, never over them, and rebuilding a
set replaces only that set's files, in one commit. Fragments stream in trajectory-key order with
their steps (one episode's steps in memory at a time) and are packed window by window
(best-fit decreasing within ``window`` fragments of one split), so memory is bounded by the
window, not the layer. Which fragments: trainable ones of every split that gives fragments; with
``dedup="representative"`` (default) only the representatives of near-duplicate clusters,
``weighted`` and ``all`` take every member (each segment carries its dedup weight).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from lineage.catalog import Warehouse, now_utc
from lineage.rebuild import inputs_fingerprint, joined_by_key, mark_running, run_row
from packing.pack import POLICIES, Segment, best_fit_decreasing
from packing.render import TEMPLATE, TEMPLATE_VERSION, render
from packing.tokenizers import DEFAULT_TOKENIZER, get_tokenizer
from schemas import ids
from schemas.arrow import arrow_schema
from schemas.errors import ConfigError
from schemas.tables import PackRow

TRANSFORM = "packs"
PACKS_VERSION = "1.0.0"
DEDUP_CHOICES = ("representative", "weighted", "all")


@dataclass(frozen=True)
class PackConfig:
    tokenizer: str = DEFAULT_TOKENIZER
    seq_len: int = 8192
    policy: str = "drop"
    dedup: str = "representative"
    window: int = 1_000  # fragments packed together (memory: about window x mean tokens x 16 bytes)

    def validate(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"unknown over-length policy {self.policy!r}", valid=", ".join(POLICIES))
        if self.dedup not in DEDUP_CHOICES:
            raise ConfigError(f"unknown dedup choice {self.dedup!r}", valid=", ".join(DEDUP_CHOICES))
        if not 16 <= self.seq_len <= 1 << 20:
            raise ConfigError(f"sequence length {self.seq_len} out of range", valid="16 .. 1048576 tokens")


@dataclass
class PackSummary:
    run_id: str
    pack_set: str = ""
    seq_len: int = 0
    skipped: bool = False
    fragments: int = 0
    sequences: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    trainable: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)
    split_fragments: dict[str, int] = field(default_factory=dict)

    @property
    def efficiency(self) -> float:
        cap = sum(self.sequences.values()) * self.seq_len
        return sum(self.tokens.values()) / cap if cap else 0.0


_FRAGMENTS_SQL = """
    SELECT f.fragment_id, f.trajectory_key, f.step_ids, f.span_step_ids, f.split, f.dedup_weight, c.cluster_id
    FROM fragments f LEFT JOIN near_dup_clusters c USING (trajectory_key)
    WHERE f.trainable {dedup} ORDER BY f.trajectory_key, f.fragment_id"""
_STEPS_SQL = """
    SELECT trajectory_key, step_id, step_index, author, role, text, observation, tool_calls FROM redacted_steps
    WHERE trajectory_key IN (SELECT trajectory_key FROM fragments WHERE trainable) ORDER BY trajectory_key, step_index"""


def _fragments_with_steps(wh: Warehouse, dedup: str) -> Iterator[tuple[dict, dict[str, dict]]]:
    where = "AND coalesce(c.is_representative, true)" if dedup == "representative" else ""
    frag_stream = wh.stream(_FRAGMENTS_SQL.format(dedup=where), batch_rows=2_000, memory_limit="512MB", threads=1)
    step_stream = wh.stream(_STEPS_SQL, memory_limit="512MB", threads=1)
    try:
        for f, mine in joined_by_key(frag_stream, step_stream):
            yield f, {s["step_id"]: s for s in mine}
    finally:
        frag_stream.close()
        step_stream.close()


def pack_set_id(cfg: PackConfig, tokenizer_id: str) -> str:
    return "ps-" + ids.digest([tokenizer_id, f"{TEMPLATE}@{TEMPLATE_VERSION}", cfg.seq_len, cfg.policy, cfg.dedup,
                               PACKS_VERSION])[:16]


def build_packs(wh: Warehouse, *, run_id: str, cfg: PackConfig = PackConfig(), full: bool = False,
                lock_timeout: float = 60.0) -> PackSummary:
    cfg.validate()
    tok = get_tokenizer(cfg.tokenizer)
    summary = PackSummary(run_id, pack_set=pack_set_id(cfg, tok.id), seq_len=cfg.seq_len)
    started = now_utc()
    template_id = f"{TEMPLATE}@{TEMPLATE_VERSION}"
    version = (f"{TRANSFORM}@{PACKS_VERSION};set={summary.pack_set};tokenizer={tok.id};template={template_id};"
               f"seq_len={cfg.seq_len};policy={cfg.policy};dedup={cfg.dedup};window={cfg.window};"
               f"inputs={inputs_fingerprint(wh, ['fragments', 'redacted_steps', 'near_dup_clusters'])}")
    schema = arrow_schema(PackRow)
    with wh.write_session("packs", timeout=lock_timeout) as session:
        mark_running(session, run_id, "packs", started)
        mine = wh.query("SELECT path, transform_version FROM table_files WHERE table_name = 'packs' AND "
                        "starts_with(transform_version, ?)", [f"{TRANSFORM}@{PACKS_VERSION};set={summary.pack_set};"]
                        ).to_pylist()
        if not full and mine and {r["transform_version"] for r in mine} == {version}:
            summary.skipped = True
            session.upsert_rows("runs", [run_row(run_id, "packs", started, params={"version": version, "skipped": True},
                                                 counts=_counts(summary), code_version=f"{TRANSFORM}@{PACKS_VERSION}")])
            return summary
        lineage = {"_run_id": run_id, "_transform": TRANSFORM, "_transform_version": version}
        files: list[Any] = []
        windows: dict[str, list[tuple[Segment, dict]]] = {}

        def flush(split: str) -> None:
            segs = windows.pop(split, [])
            if not segs:
                return
            meta = {s.fragment_id: m for s, m in segs}
            result = best_fit_decreasing([s for s, _ in segs], cfg.seq_len, cfg.policy)
            summary.dropped[split] = summary.dropped.get(split, 0) + len(result.dropped)
            summary.split_fragments[split] = summary.split_fragments.get(split, 0) + len(result.split)
            rows = []
            for seq in result.sequences:
                segments = [{"fragment_id": fid, "start": a, "end": b, **meta[fid.split("#", 1)[0]]}
                            for fid, a, b in seq.segments]
                rows.append({"pack_id": "pk-" + ids.digest([summary.pack_set, split, seq.segments])[:20],
                             "pack_set": summary.pack_set, "split": split, "tokenizer_id": tok.id,
                             "template_id": template_id, "seq_len": cfg.seq_len, "n_tokens": len(seq.ids),
                             "n_trainable": sum(seq.mask), "input_ids": seq.ids, "loss_mask": seq.mask,
                             "position_ids": seq.positions, "segments": segments, **lineage})
                summary.sequences[split] = summary.sequences.get(split, 0) + 1
                summary.tokens[split] = summary.tokens.get(split, 0) + len(seq.ids)
                summary.trainable[split] = summary.trainable.get(split, 0) + sum(seq.mask)
            files.append(session.write("packs", pa.Table.from_pylist(rows, schema=schema)))

        for f, steps in _fragments_with_steps(wh, cfg.dedup):
            split = f["split"] or "unsplit"
            r = render([steps[i] for i in f["step_ids"] if i in steps], set(f["span_step_ids"]), tok)
            meta = {"trajectory_key": f["trajectory_key"], "dedup_weight": f["dedup_weight"], "cluster_id": f["cluster_id"]}
            windows.setdefault(split, []).append((Segment(f["fragment_id"], tuple(r.ids), tuple(r.mask)), meta))
            summary.fragments += 1
            if len(windows[split]) >= cfg.window:
                flush(split)
        for split in sorted(windows):
            flush(split)
        if not files:
            files.append(session.write("packs", pa.Table.from_pylist([], schema=schema)))
        session.commit(files, removed=[wh.root / r["path"] for r in mine], run_id=run_id, transform_version=version)
        session.upsert_rows("runs", [run_row(run_id, "packs", started, params={"version": version},
                                             counts=_counts(summary), code_version=f"{TRANSFORM}@{PACKS_VERSION}")])
    return summary


def _counts(s: PackSummary) -> dict[str, Any]:
    return {**{k: v for k, v in s.__dict__.items() if k != "run_id"}, "efficiency": round(s.efficiency, 4)}
