"""Leak-free, time-aware train / valid / test assignment of groups.

Time rule (with a cutoff date): evaluation splits hold only groups all of whose episodes have an
issue created after the cutoff *and* were generated after it; every other group goes to train
(train holds what predates the cutoff). Among eligible groups, a hash of the group id decides
valid vs test by the configured fractions, so the assignment is deterministic and does not
depend on input order. Episodes with no usable times are not eligible for evaluation (counted
in the audit); a task whose issue predates the cutoff but whose fix merged after it is flagged
``fix_after_cutoff``. Without the time rule, the group hash alone decides, by the fractions.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import UTC, datetime

from dedup.features import EpisodeFeatures

SPLIT_VERSION = "1.0.0"


@dataclass(frozen=True)
class SplitConfig:
    train: float = 0.8
    valid: float = 0.1
    test: float = 0.1
    cutoff: datetime | None = datetime(2025, 6, 1, tzinfo=UTC)
    salt: str = "trajwh-splits-v1"

    def validate(self) -> None:
        from schemas.errors import ConfigError

        total = self.train + self.valid + self.test
        if min(self.train, self.valid, self.test) < 0 or abs(total - 1) > 1e-9:
            raise ConfigError(f"split fractions {self.train}/{self.valid}/{self.test} do not sum to 1",
                              valid="three non-negative fractions that sum to 1, e.g. 0.8/0.1/0.1")


def unit_hash(text: str) -> float:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2**64


@dataclass
class SplitRow:
    trajectory_key: str
    group_id: str
    split: str
    reason: str
    eligible_for_eval: bool
    flags: list[str]


def assign_splits(features: list[EpisodeFeatures], group_of: dict[str, str], cfg: SplitConfig = SplitConfig()) -> list[SplitRow]:
    cfg.validate()
    members: dict[str, list[EpisodeFeatures]] = {}
    for f in features:
        members.setdefault(group_of[f.key], []).append(f)
    out = []
    for gid in sorted(members):
        eps = members[gid]
        u = unit_hash(f"{cfg.salt}:{gid}")
        flags_of = {f.key: [] for f in eps}
        for f in eps:
            if cfg.cutoff and f.issue_created_at and f.issue_created_at <= cfg.cutoff and f.fix_merged_at \
                    and f.fix_merged_at > cfg.cutoff:
                flags_of[f.key].append("fix_after_cutoff")
            if cfg.cutoff and (f.issue_created_at is None or f.started_at is None):
                flags_of[f.key].append("no_usable_times")
        if cfg.cutoff is None:
            split = "train" if u < cfg.train else "valid" if u < cfg.train + cfg.valid else "test"
            reason, eligible = f"hash {u:.4f} by fractions {cfg.train}/{cfg.valid}/{cfg.test}", True
        else:
            eligible = all(f.issue_created_at and f.started_at and f.issue_created_at > cfg.cutoff
                           and f.started_at > cfg.cutoff for f in eps)
            if eligible:
                share = cfg.valid / (cfg.valid + cfg.test) if cfg.valid + cfg.test else 0.5
                split = "valid" if u < share else "test"
                reason = f"issue and generation after cutoff {cfg.cutoff.date()}; hash {u:.4f}"
            else:
                missing = any(f.issue_created_at is None or f.started_at is None for f in eps)
                split = "train"
                reason = ("no usable times: not eligible for evaluation" if missing else
                          f"issue or generation on/before cutoff {cfg.cutoff.date()}")
        for f in eps:
            out.append(SplitRow(f.key, gid, split, reason, eligible, flags_of[f.key]))
    return out
