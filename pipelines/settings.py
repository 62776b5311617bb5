"""From ``trajwh.toml`` settings (plus command-line overrides) to the library's config objects.

The library packages take plain frozen dataclasses (``CurateConfig``, ``StatsConfig``); this
module is the one place that maps the validated file onto them, so the CLI and the Dagster
assets cannot read the settings two ways.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from trajwh.dedup.groups import GroupConfig
from trajwh.dedup.layer import CurateConfig
from trajwh.dedup.minhash import MinHashParams
from trajwh.dedup.splits import SplitConfig
from trajwh.fragments.outcomes import OUTCOME_RULES_VERSION
from trajwh.fragments.select import SelectConfig
from trajwh.fragments.task_stats import StatsConfig
from trajwh.licenses.policy import LicensePolicy
from trajwh.packing.layer import PackConfig
from trajwh.schemas.config import Settings, parse_cutoff, parse_fractions, settings_from
from trajwh.schemas.errors import ConfigError


def with_overrides(settings: Settings, *, cutoff: str | None = None, fractions: str | None = None,
                   whole_repository: bool | None = None, threshold: float | None = None,
                   engine: str | None = None) -> Settings:
    """Command-line / run-config values win over the file; None leaves the file's value."""
    data: dict[str, Any] = settings.model_dump(exclude={"source"})
    try:
        if cutoff is not None:
            data["splits"]["cutoff"] = parse_cutoff(cutoff)
        if fractions is not None:
            data["splits"]["fractions"] = parse_fractions(fractions)
    except ValueError as exc:
        raise ConfigError(str(exc), where="command line") from None
    if whole_repository is not None:
        data["splits"]["whole_repository"] = whole_repository
    if threshold is not None:
        data["near_dup"]["threshold"] = threshold
    if engine is not None:
        data["engine"]["name"] = engine
    changed = any(v is not None for v in (cutoff, fractions, whole_repository, threshold, engine))
    where = settings.source or "defaults"
    return settings_from(data, f"{where} + command line" if changed else where)


def curate_config(settings: Settings) -> CurateConfig:
    sp, g = settings.splits, settings.groups
    return CurateConfig(
        minhash=MinHashParams(threshold=settings.near_dup.threshold),
        groups=GroupConfig(keys=g.keys, whole_repository=sp.whole_repository, max_key_share=g.max_key_share,
                           min_key_tasks=g.min_key_tasks, max_group_share=g.max_group_share,
                           max_merge_share=g.max_merge_share, min_merge_tasks=g.min_merge_tasks),
        splits=SplitConfig(train=sp.fractions[0], valid=sp.fractions[1], test=sp.fractions[2], cutoff=sp.cutoff,
                           salt=sp.salt, hold_out_leaks=settings.leaks.hold_out_of_eval),
        digest=settings.digest(), engine=settings.engine.name)


def stats_config(settings: Settings) -> StatsConfig:
    want = settings.outcomes.rules_version
    if want and want != OUTCOME_RULES_VERSION:
        raise ConfigError(f"outcomes.rules_version {want!r} is not the installed taxonomy's", where=settings.source,
                          valid=f"{OUTCOME_RULES_VERSION!r} (or leave the key out)")
    st = settings.stats
    return replace(StatsConfig(), prior_alpha=st.prior[0], prior_beta=st.prior[1], level=st.level,
                   reference_policies=st.reference_policies, recency_half_life_days=st.recency_half_life_days,
                   pooled=st.pooled, config_digest=settings.digest())


def select_config(settings: Settings) -> SelectConfig:
    fr = settings.fragments
    return SelectConfig(controls=fr.controls, context_budget_chars=fr.context_budget_chars,
                        leak_fragments=settings.leaks.train_fragments)


def pack_config(settings: Settings, **overrides: Any) -> PackConfig:
    """The ``[packing]`` section, with command-line values (None leaves the file's) on top."""
    pk = settings.packing
    base = {"tokenizer": pk.tokenizer, "seq_len": pk.seq_len, "policy": pk.policy, "dedup": pk.dedup,
            "packer": pk.packer, "evaluation": pk.evaluation, "window": pk.window}
    cfg = PackConfig(**{**base, **{k: v for k, v in overrides.items() if v is not None}})
    cfg.validate()
    return cfg


def license_policy(settings: Settings) -> LicensePolicy:
    """The ``[licenses]`` section as a policy (mapping files read relative to the config file)."""
    return LicensePolicy.from_settings(settings.licenses, settings.source)
