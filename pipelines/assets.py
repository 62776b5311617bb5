"""The asset graph: ``raw_records -> episodes, steps``. Bodies only call library functions."""

# no `from __future__ import annotations`: Dagster reads these annotations at runtime

import hashlib

import dagster as dg
from trajwh.dedup.layer import CurateConfig, curate_warehouse, featurize_warehouse
from trajwh.fragments.layer import build_fragments
from trajwh.ingest.normalize import normalize_warehouse
from trajwh.ingest.raw_store import IngestOptions, ingest_paths
from trajwh.licenses.eligibility import build_eligibility
from trajwh.packing.layer import STAGED, build_packs, stage_pack_tokens
from trajwh.pipelines import settings as settings_mod
from trajwh.pipelines.render import count_progress
from trajwh.pipelines.resources import WarehouseResource
from trajwh.redaction.layer import redact_warehouse


class IngestConfig(dg.Config):
    """What ``raw_records`` ingests: by default the warehouse's ``landing/`` folder."""

    paths: list[str] = []
    source: str = "landing"
    license: str | None = None
    format: str | None = None
    batch_id: str | None = None  # the batch's id when its partition was added before the run (``new_batch``)


#: one partition per committed ingest batch (its id): the per-batch assets (normalized, redacted,
#: featurized) are partitioned by it, so the UI, backfills and retries work per batch. `trajwh build` and the
#: raw_records asset add each committed batch; a run over a range of them is one step per asset
#: (``BackfillPolicy.single_run``: the stage shares its batches out over the cores itself). A run
#: that holds them must name partitions (Dagster reads a partitioned step's partitioned inputs by
#: the run's range): a run that also ingests adds its batch's partition first (``new_batch``).
BATCHES = dg.DynamicPartitionsDefinition(name="batches")
_PER_BATCH = {"partitions_def": BATCHES, "backfill_policy": dg.BackfillPolicy.single_run()}


def new_batch(instance: dg.DagsterInstance) -> tuple[str, dict[str, str]]:
    """A batch id for a run that ingests and builds (``build(include_ingest=True)``, the landing
    sensor): its partition is added first, so the run can cover every partition, the new one
    included (a partitioned step must run in a partitioned run). Returns the id and the run's
    partition range tags. A batch the ingest does not commit (nothing new) leaves a partition
    that the next ``sync_partitions`` removes."""
    import uuid

    batch_id = uuid.uuid4().hex
    instance.add_dynamic_partitions(BATCHES.name, [batch_id])
    known = instance.get_dynamic_partitions(BATCHES.name)
    return batch_id, range_tags(known[0], known[-1])


def range_tags(first: str, last: str) -> dict[str, str]:
    """A run's tags for the partitions from ``first`` to ``last`` (in the order they were added)."""
    return {"dagster/asset_partition_range_start": first, "dagster/asset_partition_range_end": last}


def run_batches(context: dg.AssetExecutionContext) -> list[str] | None:
    """The batches a per-batch step builds: its run's partitions, or None (every batch) when the run
    has none or covers every batch the instance knows (a whole build)."""
    if not (context.has_partition_key_range or context.has_partition_key):
        return None
    keys = list(context.partition_keys)
    known = context.instance.get_dynamic_partitions(BATCHES.name)
    return None if set(known) <= set(keys) else keys


class BuildConfig(dg.Config):
    full: bool = False  # rebuild every batch, not only those whose adapter or schema changed


def table_metadata(warehouse: WarehouseResource, table: str) -> dict:
    """What the table is now (not only what the run did): its rows, columns and catalog name,
    under Dagster's standard keys, so the UI shows them on the asset."""
    from trajwh.schemas.arrow import PARQUET_TABLES, arrow_schema

    rows = warehouse.get().manifest_query("SELECT coalesce(sum(rows), 0) FROM table_files WHERE table_name = ?",
                                 [table]).column(0)[0].as_py()
    columns = [dg.TableColumn(f.name, str(f.type)) for f in arrow_schema(PARQUET_TABLES[table])]
    return {"dagster/row_count": int(rows), "dagster/column_schema": dg.TableSchema(columns=columns),
            "dagster/table_name": f"catalog.{table}"}


def landing_dir(warehouse: WarehouseResource) -> str:
    return str(warehouse.get().root / "landing")


@dg.asset(group_name="raw", description="Append-only raw records exactly as received, one batch per ingest.")
def raw_records(context: dg.AssetExecutionContext, config: IngestConfig,
                warehouse: WarehouseResource) -> dg.MaterializeResult:
    wh = warehouse.get()
    paths = config.paths or [landing_dir(warehouse)]
    for p in paths:
        if p == landing_dir(warehouse):
            wh.root.joinpath("landing").mkdir(parents=True, exist_ok=True)
    opts = IngestOptions(source=config.source, license=config.license, format=config.format,
                         lock_timeout=warehouse.lock_timeout, batch_id=config.batch_id)
    with count_progress("ingesting files") as advance:
        s = ingest_paths(wh, paths, opts, run_id=context.run_id,
                         on_files=lambda files: advance.set_total(len(files)))
    if s.recorded and not context.instance.has_dynamic_partition(BATCHES.name, s.batch_id):  # (added before, usually)
        context.instance.add_dynamic_partitions(BATCHES.name, [s.batch_id])
    return dg.MaterializeResult(metadata={
        **table_metadata(warehouse, "raw_records"), "batch_id": s.batch_id, "files": len(s.files), "new": s.n_new, "already_present": s.n_duplicate,
        "quarantined": s.n_quarantined, "bytes": dg.MetadataValue.int(s.bytes_read)})


@dg.multi_asset(
    specs=[
        dg.AssetSpec("episodes", deps=[raw_records], group_name="normalized",
                     description="Canonical episodes with trajectory keys and lineage."),
        dg.AssetSpec("steps", deps=[raw_records], group_name="normalized",
                     description="Canonical steps (messages, tool calls, observations) with lineage."),
    ],
    can_subset=False,
    **_PER_BATCH,
)
def normalized(context: dg.AssetExecutionContext, config: BuildConfig, warehouse: WarehouseResource):
    with count_progress("normalizing records") as advance:
        s = normalize_warehouse(warehouse.get(), run_id=context.run_id, full=config.full,
                                lock_timeout=warehouse.lock_timeout, progress=advance,
                                on_plan=advance.set_total, batches=run_batches(context))
    common = {"batches_built": s.batches_done, "batches_unchanged": s.batches_skipped,
              "quarantined": s.quarantined}
    yield dg.MaterializeResult(asset_key="episodes", metadata={**table_metadata(warehouse, "episodes"), **common, "episodes_built": s.episodes})
    yield dg.MaterializeResult(asset_key="steps", metadata={**table_metadata(warehouse, "steps"), **common, "steps_built": s.steps})


class RedactConfig(dg.Config):
    full: bool = False
    scope: str = "episode"  # episode | repository | dataset: where one value keeps one placeholder


@dg.multi_asset(
    specs=[
        dg.AssetSpec("redacted_episodes", deps=["episodes"], group_name="redacted",
                     description="Episodes with typed, scoped placeholders; the only layer downstream reads."),
        dg.AssetSpec("redacted_steps", deps=["steps"], group_name="redacted",
                     description="Steps with typed, scoped placeholders; tool-call arguments stay valid JSON."),
        dg.AssetSpec("redaction_events", deps=["steps"], group_name="redacted",
                     description="One row per replacement (field, offsets, type, detector, placeholder), never the value."),
    ],
    can_subset=False,
    **_PER_BATCH,
)
def redacted(context: dg.AssetExecutionContext, config: RedactConfig, warehouse: WarehouseResource):
    with count_progress("redacting episodes") as advance:
        s = redact_warehouse(warehouse.get(), run_id=context.run_id, full=config.full, scope_kind=config.scope,
                             private_addresses=warehouse.settings().redaction.private_addresses,
                             lock_timeout=warehouse.lock_timeout, progress=advance, on_plan=advance.set_total,
                             batches=run_batches(context))
    if not s.vault_written:  # info, not a warning: `trajwh build` says it once, before the build
        context.log.info("vault not written: no key (set TRAJWH_VAULT_KEY or TRAJWH_VAULT_KEY_FILE); the next build "
                         "with a key writes it for the batches redacted without one")
    common = {"batches_built": s.batches_done, "batches_unchanged": s.batches_skipped, "vault_written": s.vault_written,
              "vault_backfilled_batches": s.vault_backfilled}
    yield dg.MaterializeResult(asset_key="redacted_episodes", metadata={**table_metadata(warehouse, "redacted_episodes"), **common, "episodes": s.episodes})
    yield dg.MaterializeResult(asset_key="redacted_steps", metadata={**table_metadata(warehouse, "redacted_steps"), **common, "steps": s.steps})
    yield dg.MaterializeResult(asset_key="redaction_events", metadata={**table_metadata(warehouse, "redaction_events"),
        **common, "replacements": s.replacements, **{f"type:{k}": v for k, v in sorted(s.by_type.items())}})


class CurateAssetConfig(dg.Config):
    """Overrides of trajwh.toml's [splits] / [near_dup] for one run; unset keeps the file's value."""

    full: bool = False
    cutoff: str | None = None  # ISO date, or "none" to turn the time rule off
    fractions: str | None = None  # "train,valid,test", e.g. "0.8,0.1,0.1"
    threshold: float | None = None  # Jaccard threshold for near duplicates
    whole_repository: bool | None = None
    engine: str | None = None  # what runs the global graph steps: duckdb or daft (same tables)


def curate_config(config: CurateAssetConfig, warehouse: WarehouseResource) -> CurateConfig:
    return settings_mod.curate_config(settings_mod.with_overrides(
        warehouse.settings(), cutoff=config.cutoff, fractions=config.fractions,
        whole_repository=config.whole_repository, threshold=config.threshold, engine=config.engine))


@dg.multi_asset(
    specs=[dg.AssetSpec("episode_features", deps=["redacted_episodes", "redacted_steps"], group_name="curated",
                        description="Per episode: MinHash signatures (actions and text), grouping keys, times and leak "
                                    "evidence; computed per batch, what the global curation reads.")],
    **_PER_BATCH,
)
def featurized(context: dg.AssetExecutionContext, config: CurateAssetConfig,
               warehouse: WarehouseResource) -> dg.MaterializeResult:
    with count_progress("featurizing") as advance:
        s = featurize_warehouse(warehouse.get(), run_id=context.run_id, cfg=curate_config(config, warehouse),
                                full=config.full, lock_timeout=warehouse.lock_timeout, batches=run_batches(context),
                                progress=lambda m: advance.describe(f"featurizing: {m}"))
    return dg.MaterializeResult(asset_key="episode_features", metadata={**table_metadata(warehouse, "episode_features"),
                                          "batches_built": s.batches_featurized, "batches_unchanged": s.batches_unchanged,
                                          "episodes_built": s.episodes_featurized})


@dg.multi_asset(
    specs=[
        dg.AssetSpec("near_dup_clusters", deps=["episode_features", "redacted_episodes", "redacted_steps"], group_name="curated",
                     description="MinHash near-duplicate clusters (actions and text), one representative, weights."),
        dg.AssetSpec("task_groups", deps=["redacted_episodes", "redacted_steps"], group_name="curated",
                     description="Repository / task groups: never split across train and evaluation."),
        dg.AssetSpec("splits", deps=["redacted_episodes"], group_name="curated",
                     description="Time-aware, group-level train / valid / test with the reason per episode."),
        dg.AssetSpec("leak_flags", deps=["redacted_steps"], group_name="curated",
                     description="Episodes whose agent saw the future, with the step; fixes merged after the cutoff."),
    ],
    can_subset=False,
)
def curated(context: dg.AssetExecutionContext, config: CurateAssetConfig, warehouse: WarehouseResource):
    with count_progress("curating") as advance:
        def say(message: str) -> None:  # the phase, on the terminal and in the run's log
            context.log.info(message)
            advance.describe(f"curating: {message}")

        s = curate_warehouse(warehouse.get(), run_id=context.run_id, cfg=curate_config(config, warehouse),
                             full=config.full, lock_timeout=warehouse.lock_timeout, progress=say)
    common = {"skipped_unchanged": s.skipped, "episodes": s.episodes}
    yield dg.MaterializeResult(asset_key="near_dup_clusters", metadata={**table_metadata(warehouse, "near_dup_clusters"), **common, "clusters": s.clusters,
                                                                        "episodes_in_dup_clusters": s.duplicates})
    yield dg.MaterializeResult(asset_key="task_groups", metadata={**table_metadata(warehouse, "task_groups"),
        **common, "groups": s.groups, "largest_group": s.largest_group, "episodes_with_weak_key_dropped": s.weak_key_episodes})
    if s.moved:  # a merge moved episodes that an earlier build had placed: said, never silent
        context.log.warning(f"episodes changed side since the last curation: {s.moved} (docs/dedup.md)")
    yield dg.MaterializeResult(asset_key="splits", metadata={**table_metadata(warehouse, "splits"),
        **common, **{f"split:{k}": v for k, v in sorted(s.splits.items())},
        **{f"moved:{k}": v for k, v in s.moved.items()}})
    yield dg.MaterializeResult(asset_key="leak_flags", metadata={**table_metadata(warehouse, "leak_flags"), **common, "flags": s.leaks})


class EligibilityConfig(dg.Config):
    full: bool = False


@dg.multi_asset(
    specs=[
        dg.AssetSpec("license_facts", deps=["redacted_episodes"], group_name="curated",
                     description="The licenses and terms that bind each episode, with where each fact came from."),
        dg.AssetSpec("eligibility", deps=["redacted_episodes"], group_name="curated",
                     description="Per episode: may it be trained on, released, or neither (license policy and "
                                 "opt-outs), with the reasons."),
    ],
    can_subset=False,
)
def licensed(context: dg.AssetExecutionContext, config: EligibilityConfig, warehouse: WarehouseResource):
    s = build_eligibility(warehouse.get(), run_id=context.run_id, full=config.full,
                          policy=settings_mod.license_policy(warehouse.settings()), lock_timeout=warehouse.lock_timeout)
    yield dg.MaterializeResult(asset_key="license_facts", metadata={**table_metadata(warehouse, "license_facts"),
        "skipped_unchanged": s.skipped, **{f"source_license:{k}": v for k, v in s.licenses.items()}})
    yield dg.MaterializeResult(asset_key="eligibility", metadata={**table_metadata(warehouse, "eligibility"),
        "skipped_unchanged": s.skipped, "episodes": s.episodes, "opted_out": s.opted_out,
        **{f"eligibility:{k}": v for k, v in s.eligibility.items()},
        **{f"reason:{k}": v for k, v in s.reasons.items()}})


class FragmentsConfig(dg.Config):
    full: bool = False


@dg.multi_asset(
    specs=[
        dg.AssetSpec("outcomes", deps=["redacted_episodes", "redacted_steps"], group_name="curated",
                     description="One outcome per episode: resolved or the cause of failure, with evidence."),
        dg.AssetSpec("task_stats", deps=["redacted_episodes"], group_name="curated",
                     description="Per task: attempts, posterior success rate, pass@k, pass^k, all-fail diagnosis."),
        dg.AssetSpec("fragments", deps=["near_dup_clusters", "splits", "redacted_steps", "eligibility"], group_name="fragments",
                     description="Training units: full episodes, productive and recovery segments, with reasons."),
    ],
    can_subset=False,
)
def fragment_layer(context: dg.AssetExecutionContext, config: FragmentsConfig, warehouse: WarehouseResource):
    settings = warehouse.settings()  # read trajwh.toml once for both configs
    with count_progress("outcomes and fragments") as advance:
        s = build_fragments(warehouse.get(), run_id=context.run_id, full=config.full,
                            cfg=settings_mod.stats_config(settings), select=settings_mod.select_config(settings),
                            lock_timeout=warehouse.lock_timeout, progress=advance, on_plan=advance.set_total)
    common = {"skipped_unchanged": s.skipped, "episodes": s.episodes,
              "episodes_rebuilt": s.episodes if s.rebuilt is None else s.rebuilt}
    yield dg.MaterializeResult(asset_key="outcomes", metadata={**table_metadata(warehouse, "outcomes"), **common, **{f"cause:{k}": v for k, v in sorted(s.causes.items())}})
    yield dg.MaterializeResult(asset_key="task_stats", metadata={**table_metadata(warehouse, "task_stats"), **common, "tasks": s.tasks})
    yield dg.MaterializeResult(asset_key="fragments", metadata={**table_metadata(warehouse, "fragments"),
        **common, **{f"kind:{k}": v for k, v in sorted(s.fragments.items())},
        **{f"withheld:{k}": v for k, v in sorted(s.withheld.items())}})


class PacksConfig(dg.Config):
    """Overrides of trajwh.toml's [packing] for one run (empty / 0: the file's value)."""

    full: bool = False
    tokenizer: str = ""
    seq_len: int = 0
    policy: str = ""
    dedup: str = ""
    packer: str = ""
    engine: str = ""  # what runs the bin assignment: duckdb or daft (same packs); empty: trajwh.toml's [engine]


def pack_config(config: PacksConfig, warehouse: WarehouseResource):
    return settings_mod.pack_config(warehouse.settings(), tokenizer=config.tokenizer or None,
                                    seq_len=config.seq_len or None, policy=config.policy or None,
                                    dedup=config.dedup or None, packer=config.packer or None)


#: the pack_tokens check (run in the packing step: ``_token_check``)
TOKEN_ROWS_CHECK = "token_rows_whole"
_PACK_DEPS = ["fragments", "outcomes", "splits", "near_dup_clusters", "redacted_steps", "eligibility"]


def _pack_metadata(warehouse: WarehouseResource, s, cfg) -> dict:
    return {**table_metadata(warehouse, "packs"), "pack_set": s.pack_set, "tokenizer": cfg.tokenizer, "seq_len": s.seq_len,
            "policy": cfg.policy, "packer": cfg.packer, "dedup": cfg.dedup, "skipped_unchanged": s.skipped,
            "units": s.fragments, "efficiency": round(s.efficiency, 4),
            **{f"sequences:{k}": v for k, v in sorted(s.sequences.items())},
            **{f"tokens:{k}": v for k, v in sorted(s.tokens.items())},
            **{f"trainable:{k}": v for k, v in sorted(s.trainable.items())},
            **{f"dropped:{k}": v for k, v in sorted(s.dropped.items()) if v},
            **{f"truncated:{k}": v for k, v in sorted(s.truncated.items()) if v},
            **{f"split_fragments:{k}": v for k, v in sorted(s.split_fragments.items()) if v}}


@dg.multi_asset(
    specs=[
        dg.AssetSpec("pack_tokens", deps=_PACK_DEPS, group_name="packed", partitions_def=BATCHES,
                     description="Each packed unit's rendering through the chat template, tokenized once, with its loss "
                                 "mask: the token store the packs are layouts over, in chunks of one ingest batch. A "
                                 "partition run alone (backfill, retry) renders its batch's changed chunks ahead "
                                 "(pack_tokens_staged); the next packs build takes them as they are."),
        dg.AssetSpec("packs", deps=["pack_tokens", *_PACK_DEPS], group_name="packed",
                     description="Token sequences a trainer reads: the trainable fragments (and the resolved episodes "
                                 "of the evaluation splits) rendered through the chat template, loss-masked and packed "
                                 "per split; one pack set per tokenizer + template + packing configuration."),
    ],
    check_specs=[dg.AssetCheckSpec(
        TOKEN_ROWS_CHECK, asset="pack_tokens", blocking=True,
        description="The token files the step wrote are whole: each row's lengths agree with its token and mask "
                    "lists, its trained count with its mask and its pieces; a file holds one chunk of the run's "
                    "batches; no unit has two rows in them (in the whole staged set, for staged rows). The packs "
                    "check verifies every row of the set against its layout and rendering.")],
    can_subset=True,  # pack_tokens alone: a batch's tokens rendered ahead of the layouts
    backfill_policy=dg.BackfillPolicy.single_run(),
)
def packed(context: dg.AssetExecutionContext, config: PacksConfig, warehouse: WarehouseResource):
    """Tokens and layouts in one step and one commit when ``packs`` is selected (a build); the
    chosen batches' tokens staged when only ``pack_tokens`` is (``stage_pack_tokens``)."""
    cfg = pack_config(config, warehouse)
    selected = {k.to_user_string() for k in context.selected_asset_keys}
    if "packs" not in selected:
        batches = run_batches(context)
        with count_progress("rendering tokens ahead") as advance:
            advance.describe("rendering tokens ahead: their batches' token chunks")
            s = stage_pack_tokens(warehouse.get(), run_id=context.run_id, cfg=cfg, batches=batches,
                                  lock_timeout=warehouse.lock_timeout)
        yield dg.MaterializeResult(asset_key="pack_tokens", metadata={
            **table_metadata(warehouse, "pack_tokens_staged"), "pack_set": s.pack_set, "units": s.fragments,
            "units_rendered": s.units_rendered, **{f"chunks:{k}": v for k, v in sorted(s.chunks.items())}})
        yield from _token_check(context, warehouse, s, STAGED, batches)
        return
    s = build_packs(warehouse.get(), run_id=context.run_id, cfg=cfg, full=config.full,
                    lock_timeout=warehouse.lock_timeout, engine=config.engine or warehouse.settings().engine.name)
    if "pack_tokens" in selected:
        yield dg.MaterializeResult(asset_key="pack_tokens", metadata={
            **table_metadata(warehouse, "pack_tokens"), "pack_set": s.pack_set, "units_rendered": s.units_rendered,
            "units_reused": s.units_reused, **{f"chunks:{k}": v for k, v in sorted(s.chunks.items())}})
        yield from _token_check(context, warehouse, s, "pack_tokens", None)
    yield dg.MaterializeResult(asset_key="packs", metadata=_pack_metadata(warehouse, s, cfg))


def _token_check(context: dg.AssetExecutionContext, warehouse: WarehouseResource, s, table: str,
                 batches: list[str] | None):
    """The pack_tokens check, in the step (no step of its own): over the files the step wrote or
    took; the last result while ``table``'s files are unchanged (a no-op build reads nothing)."""
    from trajwh.lineage.checks import cached
    from trajwh.packing.verify import check_token_files, token_file_violations

    if dg.AssetCheckKey(dg.AssetKey("pack_tokens"), TOKEN_ROWS_CHECK) not in context.selected_asset_check_keys:
        return
    wh = warehouse.get()
    # (the build's set: units twice are the packs check's to find, over the whole set)
    r = cached(wh, f"{TOKEN_ROWS_CHECK}:{s.pack_set}:{table}", [table],
               lambda: check_token_files(wh, s.pack_set, s.written, table, batches, whole_table=table != "pack_tokens"))
    yield dg.AssetCheckResult(asset_key="pack_tokens", check_name=TOKEN_ROWS_CHECK,
                              passed=token_file_violations(r) == 0,
                              metadata={"pack_set": s.pack_set, "table": table, **{k: int(v) for k, v in r.items()}})


@dg.asset(name="data_card", deps=["packs", "fragments", "outcomes", "task_stats", "splits", "eligibility",
                                  "license_facts", "redaction_events"], group_name="cards",
          description="The data card, computed from the warehouse: README.md (Hugging Face style, YAML header), "
                      "card.json and card.html (plots inline) in <warehouse>/card.")
def data_card(warehouse: WarehouseResource) -> dg.MaterializeResult:
    from trajwh.datacards.card import build_card
    from trajwh.datacards.stats import policy_of

    r = build_card(warehouse.get(), license_policy=policy_of(warehouse.settings()))
    # the card's digest, not its text: a copy of the card in the run's event log would stay there
    # after a forget withdraws the card (datacards.card.withdraw_card_copies)
    return dg.MaterializeResult(metadata={
        "path": dg.MetadataValue.path(str(r.out)), "skipped_unchanged": r.skipped,
        "card_sha256": hashlib.sha256(r.files["markdown"].read_bytes()).hexdigest()})
