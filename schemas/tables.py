"""Row models of the warehouse tables (ARCHITECTURE.md section 1).

Each model is the single source of truth for its table: the Arrow schema (``schemas.arrow``)
and the DuckDB DDL of the metadata tables are derived from it. Lineage columns start with
``_`` (STYLE.md). Fields typed ``JsonText`` hold JSON documents as text.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION = "1.10.0"  # 1.10: pack_tokens, packs as layouts (no token columns); 1.9: the exports registry; 1.8: license_facts, eligibility, the opt-out registry; 1.7: packs carry their window and digest, segments their token key; 1.6: redacted_tool_schemas (what packing renders); 1.5: pack segments carry kind, split and the context steps cut; 1.1: canonical actions on steps and tool calls; 1.2: base_commit_at, normalized repository;
# 1.3: tool_schemas table, tool calls keep the request the harness executed when it rewrote the model's;
# 1.4: episode_features (per-batch curation inputs), outcomes.inputs_digest


class _JsonMarker:
    """Marks a ``str`` field whose text is a JSON document (kept as text in Arrow)."""


JsonText = Annotated[str, _JsonMarker()]


class ArrowWidth:
    """Marks an ``int`` field stored narrower than int64 (``schemas.arrow``): the packed layer's
    token columns, hundreds of millions of values whose range the tokenizer and ``seq_len`` bound."""

    def __init__(self, name: str) -> None:
        self.name = name  # a pyarrow type factory: "int32", "int8"


Int32 = Annotated[int, ArrowWidth("int32")]
Int8 = Annotated[int, ArrowWidth("int8")]


class _Row(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class TestResultRow(_Row):
    __test__ = False
    name: str
    status: str


class ToolCallRow(_Row):
    id: str | None = None
    name: str
    arguments: JsonText | None = None
    kind: str | None = None  # canonical action kind (ingest.actions.KINDS)
    object: str | None = None  # what it acts on: a path, a command, a URL
    #: the request as the harness executed it (a command line, or JSON text), only when the harness
    #: rewrote what the model emitted (``arguments``); None when it ran the call as emitted
    executed: str | None = None


def _lineage(name: str):
    """A lineage column: pydantic keeps ``_``-names private, so the field is aliased."""
    return Field(alias=name)


LINEAGE_COLUMNS = ("_record_id", "_batch_id", "_run_id", "_transform", "_transform_version")


# --- raw zone --------------------------------------------------------------------------------


class RawRecord(_Row):
    """One source record exactly as received. ``record_id`` = sha256(source, NUL, bytes)."""

    record_id: str
    source: str
    license: str | None = None
    batch_id: str
    file_path: str
    compression: str | None = None
    line_no: int | None = None
    byte_offset: int
    byte_length: int
    format: str
    ingested_at: datetime
    payload: bytes


class QuarantineRow(_Row):
    """A record or file that could not be used, with the reason and where it was."""

    quarantine_id: str
    batch_id: str
    stage: str  # ingest | normalize
    source: str
    file_path: str
    line_no: int | None = None
    byte_offset: int | None = None
    record_id: str | None = None
    format: str | None = None
    reason_code: str
    reason: str
    payload: bytes | None = None
    payload_size: int
    payload_sha256: str
    payload_truncated: bool
    quarantined_at: datetime
    lin_run_id: str | None = Field(None, alias="_run_id")


class BatchRow(_Row):
    batch_id: str
    source: str
    license: str | None = None
    status: str  # committed
    started_at: datetime
    committed_at: datetime | None = None
    paths: JsonText
    n_files: int
    n_records: int
    n_new: int
    n_duplicate: int
    n_quarantined: int
    bytes_read: int
    formats: JsonText
    host: str
    pid: int


class IngestedFileRow(_Row):
    batch_id: str
    file_path: str
    file_size: int
    file_sha256: str
    compression: str | None = None
    format: str | None = None
    n_records: int
    n_new: int
    n_duplicate: int
    n_quarantined: int
    error: str | None = None  # why the file could not be (fully) read


class RunRow(_Row):
    run_id: str
    job: str
    started_at: datetime
    finished_at: datetime | None = None
    status: str  # running | succeeded | failed
    params: JsonText
    counts: JsonText
    code_version: str
    error: str | None = None


class DeletionRow(_Row):
    """A deletion request and its tombstone (docs/forget.md): what was asked, the plan's ids, how far
    it got, counts per layer, the sha256 of each deleted raw payload and salted fingerprints of
    probe strings for the proof; never the content itself."""

    request_id: str
    requested_at: datetime
    selector: str
    reason: str
    status: str  # planned | sources_removed | rebuilt | compacted | verified | verify_failed
    record_ids: list[str]
    trajectory_keys: list[str]
    record_digests: list[str]  # sha256 of each deleted raw payload: re-ingest is refused by it
    probe_fingerprints: list[str]
    counts: JsonText  # rows per layer, as planned
    moved: JsonText | None = None  # episodes whose split changed because their group lost episodes
    verify_result: JsonText | None = None
    updated_at: datetime


# --- normalized zone -------------------------------------------------------------------------


class EpisodeRow(_Row):
    trajectory_key: str
    key_fields: list[str]
    key_fields_missing: list[str]
    source_episode_id: str | None = None
    source: str
    license: str | None = None
    format: str
    task_id: str | None = None
    task_digest: str | None = None
    task_text: str | None = None
    repository: str | None = None
    base_commit: str | None = None
    base_commit_at: datetime | None = None
    instance_id: str | None = None
    issue_created_at: datetime | None = None
    fix_merged_at: datetime | None = None
    initial_state_digest: str | None = None
    env_image_digest: str | None = None
    tool_schema_digest: str | None = None
    policy_name: str | None = None
    policy_checkpoint: str | None = None
    policy_version: str | None = None
    harness_name: str | None = None
    harness_version: str | None = None
    harness_commit: str | None = None
    verifier_name: str | None = None
    verifier_commit: str | None = None
    sampling: JsonText | None = None
    sampling_digest: str | None = None
    attempt: int | None = None
    started_at: datetime | None = None
    ended_at: datetime | None = None
    resolved: bool | None = None
    exit_status: str | None = None
    termination_reason: str | None = None
    reward: float | None = None
    verifier_status: str | None = None
    test_results: list[TestResultRow] | None = None
    tokens_in: int | None = None
    tokens_out: int | None = None
    cost_usd: float | None = None
    n_steps: int
    metadata: JsonText | None = None
    lin_record_id: str = _lineage("_record_id")
    lin_record_index: int = _lineage("_record_index")
    lin_batch_id: str = _lineage("_batch_id")
    lin_run_id: str = _lineage("_run_id")
    lin_transform: str = _lineage("_transform")
    lin_transform_version: str = _lineage("_transform_version")
    lin_schema_version: str = _lineage("_schema_version")


class StepRow(_Row):
    step_id: str
    trajectory_key: str
    step_index: int
    role: str
    author: str
    text: str | None = None
    tool_calls: list[ToolCallRow] | None = None
    tool_call_id: str | None = None
    observation: str | None = None
    exit_code: int | None = None
    started_at: datetime | None = None
    ended_at: datetime | None = None
    tokens_in: int | None = None
    tokens_out: int | None = None
    test_results: list[TestResultRow] | None = None
    action_kind: str | None = None  # the step's canonical action (its first tool call or command)
    action_object: str | None = None
    action_command: str | None = None  # the command as issued, for text-based harnesses
    metadata: JsonText | None = None
    lin_record_id: str = _lineage("_record_id")
    lin_batch_id: str = _lineage("_batch_id")
    lin_run_id: str = _lineage("_run_id")
    lin_transform: str = _lineage("_transform")
    lin_transform_version: str = _lineage("_transform_version")


# --- side tables -----------------------------------------------------------------------------


class ToolSchemaRow(_Row):
    """The tool definitions a model was shown, stored once per digest (episodes name it by
    ``tool_schema_digest``). ``schema_text`` is the text as the harness gave it (JSON)."""

    tool_schema_digest: str
    origin: str  # where in the source format it was found, e.g. "openhands:system.args.tools"
    schema_kind: str  # function_schemas (JSON schemas shown to the model) | harness_tool_config
    n_tools: int
    tool_names: list[str]
    schema_text: JsonText
    lin_record_id: str = _lineage("_record_id")
    lin_batch_id: str = _lineage("_batch_id")
    lin_run_id: str = _lineage("_run_id")
    lin_transform: str = _lineage("_transform")
    lin_transform_version: str = _lineage("_transform_version")


class LineageEdgeRow(_Row):
    """``child`` was made from ``parent`` by ``transform`` at ``transform_version`` in ``run_id``."""

    child_id: str
    child_table: str
    parent_id: str
    parent_table: str
    transform: str
    transform_version: str
    run_id: str


# --- redacted zone ---------------------------------------------------------------------------


class RedactionEventRow(_Row):
    """One replacement: where, what type, by which detector; never the original value."""

    event_id: str
    trajectory_key: str
    step_id: str | None = None  # None for episode-level fields
    table_name: str  # episodes | steps
    field: str  # text, observation, tool_calls[0].arguments$.command, metadata$.cwd, ...
    start: int
    end: int
    entity_type: str
    detector: str
    placeholder: str
    scope_kind: str
    policy_version: str
    lin_batch_id: str = _lineage("_batch_id")
    lin_run_id: str = _lineage("_run_id")


class VaultRow(_Row):
    """Placeholder -> encrypted original. Lives under <warehouse>/vault, outside the catalog."""

    placeholder: str
    scope_kind: str
    scope_id: str
    entity_type: str
    ciphertext: bytes
    policy_version: str
    created_at: datetime


# --- curated zone ----------------------------------------------------------------------------
# One row per redacted episode (its parent, by trajectory_key); the whole table is rebuilt by
# each curation run (global steps), and the run id and parameters are on every row.


class EpisodeFeatureRow(_Row):
    """What the global curation steps read of an episode, computed once per redacted batch (file
    per batch, like the layers it comes from): grouping keys, times, MinHash signatures, leaks."""

    trajectory_key: str
    repository: str | None = None  # as the episode spells it (normalized when grouped)
    base_commit: str | None = None
    base_commit_at: datetime | None = None
    task_id: str | None = None
    instance_id: str | None = None
    failing_tests: list[str]
    touched_files: list[str]
    patch_symbols: list[str]
    issue_created_at: datetime | None = None
    fix_merged_at: datetime | None = None
    started_at: datetime | None = None
    resolved: bool | None = None
    n_steps: int
    exact_digest: str | None = None  # actions + text; None when the episode has neither
    action_signature: bytes | None = None  # MinHash, num_perm little-endian uint32; None: too few actions
    text_signature: bytes | None = None  # None: no model text
    action_bands: bytes | None = None  # the action signature's LSH band keys, little-endian int64; None without it
    text_bands: bytes | None = None
    leaks: JsonText | None = None  # [[step_id, step_index, kind, evidence], ...]
    lin_batch_id: str = _lineage("_batch_id")
    lin_run_id: str = _lineage("_run_id")
    lin_transform: str = _lineage("_transform")
    lin_transform_version: str = _lineage("_transform_version")


class NearDupLinkRow(_Row):
    trajectory_key: str  # the other episode
    signal: str  # actions | text: the MinHash signatures whose LSH buckets met and verified
    similarity: float  # estimated Jaccard similarity of the two signatures


class NearDupClusterRow(_Row):
    trajectory_key: str
    cluster_id: str
    cluster_size: int
    is_representative: bool
    weight: float
    linked_by: list[str]  # exact | actions | text: the signals that joined it to its cluster
    max_similarity: float | None = None
    links: list[NearDupLinkRow] = []  # its verified LSH links (exact duplicates share exact_digest instead)
    lin_run_id: str = _lineage("_run_id")
    lin_transform: str = _lineage("_transform")
    lin_transform_version: str = _lineage("_transform_version")


class TaskGroupRow(_Row):
    trajectory_key: str
    group_id: str
    group_size: int
    repository: str | None = None  # normalized upstream repository
    keys: list[str]
    flags: list[str]
    lin_run_id: str = _lineage("_run_id")
    lin_transform: str = _lineage("_transform")
    lin_transform_version: str = _lineage("_transform_version")


class SplitRow(_Row):
    trajectory_key: str
    group_id: str
    cluster_id: str
    split: str
    reason: str
    eligible_for_eval: bool
    flags: list[str]
    lin_run_id: str = _lineage("_run_id")
    lin_transform: str = _lineage("_transform")
    lin_transform_version: str = _lineage("_transform_version")


class LeakFlagRow(_Row):
    trajectory_key: str
    step_id: str | None = None
    step_index: int | None = None
    kind: str
    evidence: str
    rule_version: str
    lin_run_id: str = _lineage("_run_id")
    lin_transform: str = _lineage("_transform")
    lin_transform_version: str = _lineage("_transform_version")


class OutcomeRow(_Row):
    trajectory_key: str
    outcome: str  # resolved | unresolved
    cause: str
    policy_failure: bool
    quarantined: bool  # infrastructure or unknown: kept out of training, not reward 0
    evidence_field: str
    evidence_step: int | None = None
    evidence: str
    rules_version: str
    # digest of everything the episode's outcome and fragments were made from (its redacted rows,
    # cluster weight, split, leak kinds): an incremental build redoes an episode when it changes
    inputs_digest: str | None = None
    lin_run_id: str = _lineage("_run_id")
    lin_transform: str = _lineage("_transform")
    lin_transform_version: str = _lineage("_transform_version")


class TaskStatsRow(_Row):
    task_id: str
    level: str  # task_policy | task_policy_harness | task (pooled over policies, only when asked)
    policy_name: str | None = None
    harness_name: str | None = None
    episodes: int
    attempts: int
    successes: int
    infrastructure_failures: int
    unknown_outcomes: int
    weighted_attempts: float
    weighted_successes: float
    recency_half_life_days: float
    posterior_mean: float
    posterior_low: float
    posterior_high: float
    prior: str
    pass_at_1: float | None = None
    pass_at_3: float | None = None
    pass_at_5: float | None = None
    pass_hat_1: float | None = None
    pass_hat_3: float | None = None
    pass_hat_5: float | None = None
    all_fail: str | None = None  # too_hard | usable_hard | likely_broken | no_attempts
    all_fail_evidence: str | None = None
    lin_run_id: str = _lineage("_run_id")
    lin_transform: str = _lineage("_transform")
    lin_transform_version: str = _lineage("_transform_version")


class FragmentRow(_Row):
    fragment_id: str
    trajectory_key: str
    kind: str  # full_episode | productive | recovery | control_adjacent | control_random
    context_start: int
    start_step: int
    end_step: int
    step_ids: list[str]  # the masked context, then the trained span, in order
    span_step_ids: list[str]  # the trained span (the loss is on its model-authored tokens)
    context_step_ids: list[str]  # masked context: input only
    context_reasons: JsonText | None = None  # {step_id: why it is context}
    context_dropped: JsonText | None = None  # {step_id: why it was left out (the budget)}
    context_chars: int = 0
    phases: JsonText | None = None  # {phase: [step_id]}: recovery mistake / anomaly / diagnosis / ...
    verdict_reward: float | None = None  # the episode's verdict: 1.0, 0.0, or None without one
    progress_score: float | None = None  # share of key tests the span fixed or restored
    evidence_source: str  # verifier | agent_visible_tests | llm_judge | agent_self_report
    confidence: float
    trainable: bool = True  # controls are not
    selection_reason: str
    tests_before: list[str]
    tests_after: list[str]
    dedup_weight: float | None = None
    split: str | None = None
    leak_kinds: list[str] = []  # in-episode leak flags of the episode (kept only when configured)
    rules_version: str
    lin_run_id: str = _lineage("_run_id")
    lin_transform: str = _lineage("_transform")
    lin_transform_version: str = _lineage("_transform_version")


class LicenseFactRow(_Row):
    """One license or terms that binds an episode, and where the fact came from (licenses.facts).
    ``expression`` is the normalized SPDX expression; None when the fact's kind is not known."""

    trajectory_key: str
    kind: str  # source | repository | policy_terms
    expression: str | None = None
    given: str | None = None  # as the input spelled it (when it is not valid SPDX: the reason is in status)
    status: str  # valid | invalid | unknown
    origin: str  # ingest --license | source metadata $.license | trajwh.toml [licenses.repositories] | ...
    lin_batch_id: str = _lineage("_batch_id")
    lin_run_id: str = _lineage("_run_id")
    lin_transform: str = _lineage("_transform")
    lin_transform_version: str = _lineage("_transform_version")


class EligibilityRow(_Row):
    """What an episode may be used for under the license policy and the opt-out registry."""

    trajectory_key: str
    eligibility: str  # release (train and release) | train (train only) | release_only | blocked
    train: str  # allow | review | block
    release: str  # allow | review | block
    reasons: list[str]  # why a use is not allowed (empty when both are)
    opt_out_ids: list[str]  # opt-outs that match the episode
    policy_digest: str  # the [licenses] policy it was decided by
    lin_batch_id: str = _lineage("_batch_id")
    lin_run_id: str = _lineage("_run_id")
    lin_transform: str = _lineage("_transform")
    lin_transform_version: str = _lineage("_transform_version")


class OptOutRow(_Row):
    """An opt-out: data matching it is never trained on or released. Stores only what matching
    needs: an e-mail address is kept as its salted sha256, never as text."""

    opt_out_id: str
    kind: str  # repository | email | source | task | content
    value: str  # the normalized repository, the e-mail's digest, the source, the task id, the pattern
    reason: str
    created_at: datetime
    status: str  # active | removed
    removed_at: datetime | None = None


class OptOutMatchRow(_Row):
    """A raw record an opt-out matched when its batch was scanned (content and e-mail opt-outs;
    the others are matched by their episodes' fields at each build)."""

    opt_out_id: str
    batch_id: str
    record_id: str


class OptOutScanRow(_Row):
    """A batch's raw records were scanned for an opt-out (at ingest, when added, or by a build)."""

    opt_out_id: str
    batch_id: str
    scanned_at: datetime
    n_matches: int


class ExportRow(_Row):
    """An export the tool wrote out of the warehouse (lineage/exports.py): where, how to make it
    again, and which episodes it holds (None: a data card or a query result, which may hold any),
    so a deletion request can write it again without them (docs/forget.md)."""

    export_id: str
    kind: str  # episodes | hf | packs | card | sql
    path: str  # absolute; a later export to the same path replaces this row
    params: JsonText
    created_at: datetime
    status: str  # current | regenerated (by a forget) | stale (could not be written again) | missing
    note: str | None = None
    n_episodes: int | None = None
    trajectory_keys: list[str] | None = None


# --- packed zone -----------------------------------------------------------------------------


class PackTokenRow(_Row):
    """One unit's rendering, tokenized, in one pack set: written once per token key (what the
    rendering is made from), in chunks of the units of one ingest batch by trajectory key (a unit
    that changes split keeps its row where it is). The packs are layouts over these rows."""

    pack_set: str
    unit_id: str  # a fragment id, or "ev-..." an evaluation episode
    token_key: str
    trajectory_key: str
    chunk_id: str  # batch / key range: the file the row is written in (packing.windows)
    chunk_digest: str  # the chunk's units and token keys: equal digests give equal chunks
    tokenizer_id: str
    seq_len: int
    n_tokens: int
    n_trainable: int
    piece_trainable: list[Int32]  # the trainable tokens of each seq_len-long piece (one piece when it fits)
    input_ids: list[Int32]  # a vocabulary fits 31 bits
    loss_mask: list[Int8]  # 0 or 1
    removed_step_ids: list[str] = []  # policy truncate-context: the context steps cut (not rendered)
    lin_run_id: str = _lineage("_run_id")
    lin_transform: str = _lineage("_transform")
    lin_transform_version: str = _lineage("_transform_version")


class PackSegmentRow(_Row):
    fragment_id: str  # "fragment_id#k" for the k-th piece of a split fragment; "ev-..." an evaluation episode
    start: int  # token offsets in the sequence, end exclusive
    end: int
    trajectory_key: str
    kind: str  # the fragment's kind, or "eval_episode" (a whole resolved episode of an evaluation split)
    split: str
    dedup_weight: float | None = None
    cluster_id: str | None = None
    piece: int | None = None  # policy split: which seq_len-long piece of the rendering (0-based)
    removed_step_ids: list[str] = []  # policy truncate-context: the context steps cut (not rendered)
    token_key: str | None = None  # digest of what the unit's tokens were rendered from (packing.windows)


class PackRow(_Row):
    """One packed sequence of one split, in one pack set (tokenizer + template + packing config): its
    layout. The tokens are the ``pack_tokens`` rows of its segments' units, in segment order (a
    piece ``k`` of a split unit is tokens ``k * seq_len`` onward); positions restart at 0 per
    segment (``packing.sequences`` assembles a sequence)."""

    pack_id: str
    pack_set: str
    split: str
    tokenizer_id: str
    template_id: str
    seq_len: int
    n_tokens: int
    n_trainable: int
    segments: list[PackSegmentRow]
    window_id: str | None = None  # the packing window: split / batch / key range (packing.windows)
    window_digest: str | None = None  # the window's packing inputs: equal digests give equal packs
    lin_run_id: str = _lineage("_run_id")
    lin_transform: str = _lineage("_transform")
    lin_transform_version: str = _lineage("_transform_version")

