"""Packing rendered fragments into fixed-length sequences.

Each segment (one rendered fragment) goes whole into one sequence. Three packers, all
deterministic (segments ordered longest first, ties by fragment id, so input order never matters):

- ``min-slack`` (default): best fit seen from the sequence instead of the segment (Gupta & Ho's
  minimum bin slack). A sequence opens with the longest segment left, then takes the subset of
  the remaining segments that fills its free space best, found exactly by a subset-sum over
  token counts (a bitset per candidate, Python integers as bitsets; at most ``MAX_CANDIDATES``
  candidates, the longest that fit, and it stops at the first exact fill). On the demo corpus it
  reaches 0.99+ where best-fit decreasing stops at 0.96: with three or four fragments per
  sequence, placing segments one at a time leaves gaps no later segment fits.
- ``best-fit-decreasing``: each segment, longest first, into the sequence whose free space is the
  smallest that still holds it; a new sequence opens when none does.
- ``first-fit``: each segment, in input order, into the first sequence with room (the baseline).

A sequence holds the segment table ``(fragment_id, start, end)`` and its lengths; its token ids, loss
mask and position ids (restarting at 0 for each segment, so attention implementations that take
position resets, or the segment table, keep fragments apart) are its segments' put together. A
packer reads only lengths: the pack layer packs layouts over stored tokens. Padding is not stored:
``length <= seq_len`` and a trainer pads (the efficiency figure counts what padding would cost).

Segments longer than the sequence: ``drop`` (default, counted) or ``split`` (cut into pieces of
``seq_len`` tokens, each piece its own segment ``fragment_id#k``, positions restarting per piece).
``truncate-context`` is applied before packing, where the steps are known
(``packing.render.truncate_context``); what is still too long after it is dropped here.
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Callable, Iterable
from collections.abc import Sequence as PySequence
from dataclasses import dataclass, field

import numpy as np

POLICIES = ("drop", "truncate-context", "split")
MAX_CANDIDATES = 256


@dataclass(frozen=True)
class Segment:
    """One unit to pack: its tokens and mask, or only their length and trainable count (``n``,
    ``trainable``: one count per ``seq_len``-long piece), which is all a packer reads (a layout
    over stored tokens)."""

    fragment_id: str
    ids: PySequence[int] | None  # a tuple, or array("i") / array("b") to keep a window small
    mask: PySequence[int] | None
    n: int | None = None
    trainable: tuple[int, ...] | None = None

    def __len__(self) -> int:
        return self.n if self.n is not None else len(self.ids)  # type: ignore[arg-type]

    @property
    def n_trainable(self) -> int:
        return sum(self.trainable) if self.trainable is not None else sum(self.mask)  # type: ignore[arg-type]


@dataclass
class Sequence:
    """A packed sequence: its segments (``(fragment_id, start, end)``) and lengths. ``ids``,
    ``mask`` and ``positions`` put its segments' tokens together (segments that carry them)."""

    segments: list[tuple[str, int, int]] = field(default_factory=list)
    parts: list[Segment] = field(default_factory=list)
    n_tokens: int = 0
    n_trainable: int = 0

    def add(self, seg: Segment) -> None:
        start = self.n_tokens
        self.n_tokens += len(seg)
        self.n_trainable += seg.n_trainable
        self.parts.append(seg)
        self.segments.append((seg.fragment_id, start, self.n_tokens))

    def _joined(self, typecode: str, of: Callable[[Segment], Iterable[int]]) -> array:
        out = array(typecode)
        for p in self.parts:
            out.extend(of(p))
        return out

    @property
    def ids(self) -> array:
        return self._joined("i", lambda p: p.ids)  # type: ignore[arg-type,return-value]

    @property
    def mask(self) -> array:
        return self._joined("b", lambda p: p.mask)  # type: ignore[arg-type,return-value]

    @property
    def positions(self) -> array:
        return array("i", positions(((a, b) for _, a, b in self.segments), self.n_tokens).tobytes())


def positions(bounds: Iterable[tuple[int, int]], n: int) -> np.ndarray:
    """Position ids of a sequence of ``n`` tokens whose segments are ``bounds`` ((start, end)
    pairs): 0, 1, ... restarting at each segment's start."""
    out = np.arange(n, dtype=np.int32)
    for a, b in bounds:
        out[a:b] -= a
    return out


@dataclass
class PackResult:
    sequences: list[Sequence]
    seq_len: int
    dropped: list[str] = field(default_factory=list)  # fragment ids longer than a sequence (policy drop)
    split: list[str] = field(default_factory=list)  # fragment ids cut into pieces (policy split)

    @property
    def tokens(self) -> int:
        return sum(s.n_tokens for s in self.sequences)

    @property
    def efficiency(self) -> float:
        """Share of non-padding tokens if every sequence were padded to ``seq_len``."""
        return self.tokens / (len(self.sequences) * self.seq_len) if self.sequences else 0.0


def fit(segments: Iterable[Segment], seq_len: int, policy: str = "drop") -> tuple[list[Segment], list[str], list[str]]:
    """The segments that fit, after the over-length policy; (segments, dropped ids, split ids)."""
    if policy not in POLICIES:
        from trajwh.schemas.errors import ConfigError

        raise ConfigError(f"unknown over-length policy {policy!r}", valid=", ".join(POLICIES))
    out, dropped, split = [], [], []
    for seg in segments:
        if len(seg) <= seq_len:
            out.append(seg)
        elif policy != "split":
            dropped.append(seg.fragment_id)
        else:
            split.append(seg.fragment_id)
            for k, start in enumerate(range(0, len(seg), seq_len)):
                if seg.ids is None:  # a layout: the piece's length and trainable count
                    out.append(Segment(f"{seg.fragment_id}#{k}", None, None, min(seq_len, len(seg) - start),
                                       (seg.trainable[k],)))  # type: ignore[index]
                else:
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
            if s.n_tokens + len(seg) <= seq_len:
                s.add(seg)
                break
        else:
            sequences.append(Sequence())
            sequences[-1].add(seg)
    return PackResult(sequences, seq_len, dropped, split)


def min_slack(segments: Iterable[Segment], seq_len: int, policy: str = "drop") -> PackResult:
    """Minimum bin slack: each new sequence is filled as fully as a subset of the remaining segments can."""
    fitted, dropped, split = fit(segments, seq_len, policy)
    remaining = sorted(fitted, key=lambda s: (-len(s), s.fragment_id))
    neg = [-len(s) for s in remaining]  # ascending: the segments that fit a room are a suffix
    sequences: list[Sequence] = []
    while remaining:
        seq = Sequence()
        seq.add(remaining[0])
        room = seq_len + neg[0]
        # the first MAX_CANDIDATES segments after the first that fit the room (a run: sorted by length)
        first = max(1, bisect.bisect_left(neg, -room))
        cand = range(first, min(len(remaining), first + MAX_CANDIDATES))
        full = (1 << (room + 1)) - 1
        reach, r = [1], 1  # reach[k]: the sums the first k candidates can make (bit t set: t tokens)
        for i in cand:
            r = (r | (r << -neg[i])) & full
            reach.append(r)
            if r >> room:  # an exact fill: no better subset exists
                break
        target, chosen = r.bit_length() - 1, []
        for k in range(len(reach) - 2, -1, -1):  # walk back: candidate k is needed when its prefix cannot make it
            if target and not (reach[k] >> target) & 1:
                chosen.append(cand[k])
                target += neg[cand[k]]
        for i in sorted(chosen):
            seq.add(remaining[i])
        for i in sorted({0, *chosen}, reverse=True):  # (a few: deleted in place, not the lists copied)
            del remaining[i], neg[i]
        sequences.append(seq)
    return PackResult(sequences, seq_len, dropped, split)


PACKERS = {"min-slack": min_slack, "best-fit-decreasing": best_fit_decreasing, "first-fit": first_fit}
