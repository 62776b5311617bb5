"""``trajwh.toml``: the one settings file the CLI and the Dagster assets both read.

Where it is found, first match wins: ``--config FILE`` (``TRAJWH_CONFIG``), then
``<warehouse>/trajwh.toml``, then ``./trajwh.toml``; with none, the defaults below hold. Unknown
keys and bad values are errors that name the key and say what is valid. Every run that uses the
settings records their digest (``runs.params``), so two builds can be told apart by their rules.

Example (all keys optional)::

    [redaction]
    private_addresses = true       # redact private network addresses (10/8, 172.16/12, 192.168/16, fc00::/7)

    [splits]
    cutoff = "2025-06-01"          # ISO date or time; "none" turns the time rule off
    fractions = [0.8, 0.1, 0.1]    # train, valid, test
    whole_repository = false       # every repository one group (the most conservative split)

    [groups]
    keys = ["repository_task", "base_commit", "task", "failing_test", "touched_file", "patch_symbol", "near_dup"]
    max_key_share = 0.2            # a weak key shared by more of a repository's tasks is dropped
    min_key_tasks = 3              # ... unless it is shared by at most this many tasks
    max_group_share = 0.25         # the audit warns when one group holds more of the episodes
    max_merge_share = 0.02         # weak keys merge groups up to this share of the tasks ...
    min_merge_tasks = 8            # ... or this many tasks, whichever is larger

    [near_dup]
    threshold = 0.8                # Jaccard similarity for near-duplicate episodes

    [leaks]
    hold_out_of_eval = true        # leak-flagged episodes never enter valid / test
    train_fragments = false        # leak-flagged episodes give no training fragments

    [fragments]
    controls = false               # emit control_random / control_adjacent fragments (never trained)
    context_budget_chars = 48000   # masked context per fragment: task statement, localization, ...

    [packing]
    tokenizer = "qwen2.5"          # qwen2.5, cl100k, or a Hugging Face tokenizer folder
    seq_len = 8192                 # tokens per packed sequence
    policy = "drop"                # longer fragments: drop, truncate-context or split
    dedup = "representative"       # near-duplicates: representative, weighted or all
    packer = "min-slack"           # min-slack, best-fit-decreasing or first-fit
    evaluation = true              # also pack the resolved episodes of valid / test (an evaluation loss)

    [engine]
    name = "duckdb"                # runs the global graph steps: duckdb, or daft (docs/scale.md)

    [licenses]                     # docs/licenses.md
    repositories = { "github.com/psf/requests" = "Apache-2.0" }   # task repository -> SPDX
    repository_file = "repo-licenses.csv"   # more of them: "repository,license" lines (relative to this file)
    policy_terms = { "gpt-4*" = "LicenseRef-OpenAI-Terms" }       # policy name pattern -> its output terms

    [licenses.train]               # what may be trained on
    allow = ["*"]                  # SPDX ids or patterns ("*", "CC-BY-*", "LicenseRef-*")
    review = []                    # ids that need a person's review first (not allowed until moved to allow)
    unknown = "allow"              # a required license that is missing or not valid SPDX: allow, review, block
    require = []                   # fact kinds that must be known: source, repository, policy_terms

    [licenses.release]             # what may leave the warehouse (exports, cards)
    allow = ["MIT", "Apache-2.0", "BSD-2-Clause", "BSD-3-Clause", "ISC", "0BSD", "CC0-1.0", "CC-BY-4.0", ...]
    review = ["GPL-*", "LGPL-*", "AGPL-*", "MPL-*", "EPL-*", "CC-BY-SA-*"]
    unknown = "block"
    require = ["source"]

    [outcomes]
    rules_version = "2.0.0"        # the taxonomy rules this file was written for (checked)

    [stats]
    prior = [1.0, 1.0]             # Beta prior of the task success rate
    level = 0.9                    # posterior interval
    recency_half_life_days = 0     # > 0: older attempts weigh less (a changing policy)
    pooled = false                 # also one task_stats row per task over every policy
    reference_policies = ["reference", "oracle", "gold"]
"""

from __future__ import annotations

import hashlib
import os
import tomllib
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from trajwh.schemas.errors import ConfigError

CONFIG_NAME = "trajwh.toml"
ENGINES = ("duckdb", "daft")  # what can run the global graph steps (dedup.engines)
GROUP_KEYS = ("repository_task", "base_commit", "task", "failing_test", "touched_file", "patch_symbol", "near_dup")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SplitSettings(_Section):
    cutoff: datetime | None = datetime(2025, 6, 1, tzinfo=UTC)
    fractions: tuple[float, float, float] = (0.8, 0.1, 0.1)
    whole_repository: bool = False
    salt: str = "trajwh-splits-v1"

    @field_validator("cutoff", mode="before")
    @classmethod
    def _cutoff(cls, v: Any) -> Any:
        return parse_cutoff(v)

    @field_validator("fractions", mode="before")
    @classmethod
    def _fractions(cls, v: Any) -> Any:
        return parse_fractions(v)


class GroupSettings(_Section):
    keys: tuple[str, ...] = GROUP_KEYS
    max_key_share: float = Field(0.2, gt=0, le=1)
    min_key_tasks: int = Field(3, ge=1)
    max_group_share: float = Field(0.25, gt=0, le=1)
    max_merge_share: float = Field(0.02, gt=0, le=1)
    min_merge_tasks: int = Field(8, ge=1)

    @field_validator("keys")
    @classmethod
    def _keys(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        bad = [k for k in v if k not in GROUP_KEYS]
        if bad:
            raise ValueError(f"unknown grouping key(s) {bad}; valid: {', '.join(GROUP_KEYS)}")
        return v


class NearDupSettings(_Section):
    threshold: float = Field(0.8, gt=0, lt=1)


class LeakSettings(_Section):
    hold_out_of_eval: bool = True
    train_fragments: bool = False


class FragmentSettings(_Section):
    controls: bool = False
    context_budget_chars: int = Field(48_000, ge=0)


class PackingSettings(_Section):
    tokenizer: str = "qwen2.5"
    seq_len: int = Field(8192, ge=16, le=1 << 20)
    policy: str = "drop"
    dedup: str = "representative"
    packer: str = "min-slack"
    evaluation: bool = True
    window: int = Field(500, ge=1, le=1_000_000)  # units packed together: what an incremental build repacks

    @field_validator("policy")
    @classmethod
    def _policy(cls, v: str) -> str:
        return _one_of(v, ("drop", "truncate-context", "split"))

    @field_validator("dedup")
    @classmethod
    def _dedup(cls, v: str) -> str:
        return _one_of(v, ("representative", "weighted", "all"))

    @field_validator("packer")
    @classmethod
    def _packer(cls, v: str) -> str:
        return _one_of(v, ("min-slack", "best-fit-decreasing", "first-fit"))


def _one_of(v: str, valid: tuple[str, ...]) -> str:
    if v not in valid:
        raise ValueError(f"{v!r} is not one of {', '.join(valid)}")
    return v


class OutcomeSettings(_Section):
    rules_version: str | None = None


class EngineSettings(_Section):
    # what runs the global graph steps (connected components of the near-duplicate and grouping
    # graphs): "duckdb" in-process, or "daft" (its local runner, or Ray across machines). Engines
    # give identical tables, so switching rebuilds nothing (docs/scale.md)
    name: str = "duckdb"

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if v not in ENGINES:
            raise ValueError(f"unknown engine {v!r}; valid: {', '.join(ENGINES)}")
        return v


class StatsSettings(_Section):
    prior: tuple[float, float] = (1.0, 1.0)
    level: float = Field(0.9, gt=0, lt=1)
    recency_half_life_days: float = Field(0.0, ge=0)
    pooled: bool = False
    reference_policies: tuple[str, ...] = ("reference", "oracle", "gold")

    @field_validator("prior")
    @classmethod
    def _prior(cls, v: tuple[float, float]) -> tuple[float, float]:
        if min(v) <= 0:
            raise ValueError("both Beta prior parameters must be > 0, e.g. [1.0, 1.0]")
        return v


class RedactionSettings(_Section):
    private_addresses: bool = Field(True, description="redact RFC 1918 / CGNAT / IPv6 ULA addresses (internal topology)")


LICENSE_FACT_KINDS = ("source", "repository", "policy_terms")
DECISIONS = ("allow", "review", "block")
#: permissive licenses and public-domain dedications: released by default
RELEASE_ALLOW = ("MIT", "MIT-0", "Apache-2.0", "BSD-2-Clause", "BSD-3-Clause", "ISC", "0BSD", "Zlib", "Unlicense",
                 "CC0-1.0", "CC-BY-4.0", "PSF-2.0", "Python-2.0", "BSL-1.0", "PostgreSQL", "ODC-By-1.0", "PDDL-1.0")
#: copyleft and share-alike: a person decides before a release
RELEASE_REVIEW = ("GPL-*", "LGPL-*", "AGPL-*", "MPL-*", "EPL-*", "CDDL-*", "EUPL-*", "CC-BY-SA-*", "ODbL-*")


class LicenseUse(_Section):
    allow: tuple[str, ...] = ("*",)
    review: tuple[str, ...] = ()
    unknown: str = "allow"
    require: tuple[str, ...] = ()

    @field_validator("unknown")
    @classmethod
    def _unknown(cls, v: str) -> str:
        return _one_of(v, DECISIONS)

    @field_validator("require")
    @classmethod
    def _require(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        bad = [k for k in v if k not in LICENSE_FACT_KINDS]
        if bad:
            raise ValueError(f"unknown license fact kind(s) {bad}; valid: {', '.join(LICENSE_FACT_KINDS)}")
        return v

    @field_validator("allow", "review")
    @classmethod
    def _patterns(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        bad = [p for p in v if not p or any(c.isspace() for c in p)]
        if bad:
            raise ValueError(f"{bad} are not license ids or patterns; valid: e.g. MIT, CC-BY-*, LicenseRef-*, *")
        return v


class LicenseSettings(_Section):
    train: LicenseUse = LicenseUse()
    release: LicenseUse = LicenseUse(allow=RELEASE_ALLOW, review=RELEASE_REVIEW, unknown="block", require=("source",))
    repositories: dict[str, str] = {}
    repository_file: str | None = None
    policy_terms: dict[str, str] = {}


class Settings(_Section):
    redaction: RedactionSettings = RedactionSettings()
    splits: SplitSettings = SplitSettings()
    groups: GroupSettings = GroupSettings()
    near_dup: NearDupSettings = NearDupSettings()
    leaks: LeakSettings = LeakSettings()
    fragments: FragmentSettings = FragmentSettings()
    packing: PackingSettings = PackingSettings()
    outcomes: OutcomeSettings = OutcomeSettings()
    stats: StatsSettings = StatsSettings()
    licenses: LicenseSettings = LicenseSettings()
    engine: EngineSettings = EngineSettings()
    source: str | None = Field(None, exclude=True)  # the file it came from, if any

    def digest(self) -> str:
        # the engine is left out: engines give the same tables, so a switch is not a new setting
        return hashlib.sha256(self.model_dump_json(exclude={"source", "engine"}).encode()).hexdigest()[:16]


def parse_cutoff(v: Any) -> datetime | None:
    """ISO date or time (no zone = UTC), or none / off / "" for no time rule."""
    if v is None:
        return None
    if isinstance(v, datetime):
        return v if v.tzinfo else v.replace(tzinfo=UTC)
    if isinstance(v, date):
        return datetime(v.year, v.month, v.day, tzinfo=UTC)
    text = str(v).strip()
    if text.lower() in ("", "none", "off", "no"):
        return None
    try:
        dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"cutoff {text!r} is not a date; valid: an ISO date such as 2025-06-01, or 'none'") from None
    return dt if dt.tzinfo else dt.replace(tzinfo=UTC)


def parse_fractions(v: Any) -> tuple[float, float, float]:
    """``"0.8,0.1,0.1"``, ``[0.8, 0.1, 0.1]`` or ``{train, valid, test}``: three shares summing to 1."""
    if isinstance(v, dict):
        v = [v.get("train", 0), v.get("valid", 0), v.get("test", 0)]
    if isinstance(v, str):
        v = [p for p in v.replace("/", ",").split(",") if p.strip()]
    try:
        t = tuple(float(x) for x in v)
    except (TypeError, ValueError):
        raise ValueError(f"fractions {v!r} are not numbers; valid: three shares such as 0.8,0.1,0.1") from None
    if len(t) != 3 or min(t) < 0 or abs(sum(t) - 1) > 1e-6:
        raise ValueError(f"fractions {v!r} must be three non-negative shares (train, valid, test) summing to 1, "
                         "e.g. 0.8,0.1,0.1")
    return t  # type: ignore[return-value]


def find_config(explicit: str | None = None, warehouse: Path | None = None) -> Path | None:
    named = explicit or os.environ.get("TRAJWH_CONFIG")
    if named:
        if not Path(named).is_file():
            raise ConfigError(f"config file {named} does not exist", valid="a readable trajwh.toml")
        return Path(named)
    for candidate in (warehouse / CONFIG_NAME if warehouse else None, Path.cwd() / CONFIG_NAME):
        if candidate is not None and candidate.is_file():
            return candidate
    return None


def load_settings(explicit: str | None = None, warehouse: Path | None = None) -> Settings:
    """The settings in force: the file found by ``find_config``, else the defaults."""
    path = find_config(explicit, warehouse)
    if path is None:
        return Settings()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}", valid="a TOML file (docs/config.md)") from None
    return settings_from(data, str(path))


def settings_from(data: dict[str, Any], where: str = "settings") -> Settings:
    try:
        return Settings(**data, source=where)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            key = ".".join(str(p) for p in err["loc"]) or "(file)"
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                msg = "unknown key"
            problems.append(f"{key}: {msg}")
        raise ConfigError("; ".join(problems), where=where,
                          valid="the keys and values documented in docs/config.md") from None
