"""Packing rendered fragments into fixed-length sequences: best-fit decreasing.

Each segment (one rendered fragment) goes whole into one sequence. Segments are placed longest
first (ties by fragment id, so the result never depends on input order) into the sequence whose
free space is the smallest that still holds them (best fit); a new sequence opens when none does.
First fit in input order is kept as the baseline the benchmark compares with.

A sequence holds the concatenated token ids, the loss mask, position ids that restart at 0 for each
segment (so attention implementations that take position resets, or the segment table, keep
fragments apart), and the segment table ``(fragment_id, start, end)``. Padding is not stored:
``length <= seq_len`` and a trainer pads (the efficiency figure counts what padding would cost).

Segments longer than the sequence: ``drop`` (default, counted) or ``split`` (cut into pieces of
``seq_len`` tokens, each piece its own segment ``fragment_id#k``, positions restarting per piece).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field

POLICIES = ("drop", "split")


@dataclass(frozen=True)
class Segment:
    fragment_id: str
    ids: tuple[int, ...]
    mask: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.ids)


@dataclass
class Sequence:
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    segments: list[tuple[str, int, int]] = field(default_factory=list)

    def add(self, seg: Segment) -> None:
        start = len(self.ids)
        self.ids += seg.ids
        self.mask += seg.mask
        self.positions += range(len(seg))
        self.segments.append((seg.fragment_id, start, len(self.ids)))


@dataclass
class PackResult:
    sequences: list[Sequence]
    seq_len: int
    dropped: list[str] = field(default_factory=list)  # fragment ids longer than a sequence (policy drop)
    split: list[str] = field(default_factory=list)  # fragment ids cut into pieces (policy split)

    @property
    def tokens(self) -> int:
        return sum(len(s.ids) for s in self.sequences)

    @property
    def efficiency(self) -> float:
        """Share of non-padding tokens if every sequence were padded to ``seq_len``."""
        return self.tokens / (len(self.sequences) * self.seq_len) if self.sequences else 0.0


def fit(segments: Iterable[Segment], seq_len: int, policy: str = "drop") -> tuple[list[Segment], list[str], list[str]]:
    """The segments that fit, after the over-length policy; (segments, dropped ids, split ids)."""
    if policy not in POLICIES:
        from schemas.errors import ConfigError

        raise ConfigError(f"unknown over-length policy {policy!r}", valid=", ".join(POLICIES))
    out, dropped, split = [], [], []
    for seg in segments:
        if len(seg) <= seq_len:
            out.append(seg)
        elif policy == "drop":
            dropped.append(seg.fragment_id)
        else:
            split.append(seg.fragment_id)
            for k, start in enumerate(range(0, len(seg), seq_len)):
                out.append(Segment(f"{seg.fragment_id}#{k}", seg.ids[start:start + seq_len],
                                   seg.mask[start:start + seq_len]))
    return out, dropped, split


def best_fit_decreasing(segments: Iterable[Segment], seq_len: int, policy: str = "drop") -> PackResult:
    fitted, dropped, split = fit(segments, seq_len, policy)
    order = sorted(fitted, key=lambda s: (-len(s), s.fragment_id))
    sequences: list[Sequence] = []
    free: list[tuple[int, int]] = []  # (free space, sequence index), sorted
    for seg in order:
        i = bisect.bisect_left(free, (len(seg), -1))
        if i < len(free):
            space, idx = free.pop(i)
        else:
            space, idx = seq_len, len(sequences)
            sequences.append(Sequence())
        sequences[idx].add(seg)
        bisect.insort(free, (space - len(seg), idx))
    return PackResult(sequences, seq_len, dropped, split)


def first_fit(segments: Iterable[Segment], seq_len: int, policy: str = "drop") -> PackResult:
    """The baseline: each segment, in input order, into the first sequence with room."""
    fitted, dropped, split = fit(segments, seq_len, policy)
    sequences: list[Sequence] = []
    for seg in fitted:
        for s in sequences:
            if len(s.ids) + len(seg) <= seq_len:
                s.add(seg)
                break
        else:
            sequences.append(Sequence())
            sequences[-1].add(seg)
    return PackResult(sequences, seq_len, dropped, split)
