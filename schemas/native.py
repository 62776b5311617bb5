"""The native trajectory format: one JSON object per line, one episode per object.

This is the format the synthetic generator writes, the reference adapter reads and
``trajwh export --format native`` will write. ``docs/format.md`` documents it and
``docs/native-format.schema.json`` is generated from these models (``trajwh schema``).

The models are strict (unknown fields are an error naming the field) because the format is
ours: anything a producer wants to keep that has no field goes into ``metadata``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

NATIVE_FORMAT = "trajwh.native"
NATIVE_FORMAT_VERSION = "1.1"  # 1.1: tool_calls[].executed, environment.tool_schemas

Role = Literal["system", "user", "assistant", "tool"]
Author = Literal["model", "harness", "environment", "human"]
TestStatus = Literal["passed", "failed", "error", "skipped", "xfail", "xpass"]
VerifierStatus = Literal["ok", "error", "unavailable", "not_run"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class TestResult(_Strict):
    """One test's result, as a test runner reported it."""

    __test__ = False  # not a pytest class
    name: str
    status: TestStatus


class ToolCall(_Strict):
    """A call the model asked the harness to make. ``arguments`` is decoded JSON."""

    id: str | None = None
    name: str
    arguments: dict[str, Any] | str | None = None
    executed: dict[str, Any] | str | None = Field(
        None, description="The request the harness executed (a command line or an object), when it rewrote the call.")


class NativeTask(_Strict):
    task_id: str | None = None
    text: str | None = Field(None, description="The task statement the agent was given.")
    repository: str | None = Field(None, description="Upstream repository, e.g. github.com/org/repo.")
    base_commit: str | None = None
    base_commit_at: datetime | None = Field(
        None, description="Commit time of base_commit: the repository state the agent worked on.")
    instance_id: str | None = None
    issue_created_at: datetime | None = None
    fix_merged_at: datetime | None = None
    initial_state_digest: str | None = None


class NativeEnvironment(_Strict):
    image_digest: str | None = None
    tool_schema_digest: str | None = None
    tool_schemas: list[Any] | dict[str, Any] | None = Field(
        None, description="The tool definitions shown to the model (JSON schemas, or the harness's tool configuration).")


class NativePolicy(_Strict):
    name: str | None = None
    checkpoint: str | None = None
    version: str | None = None


class NativeHarness(_Strict):
    name: str | None = None
    version: str | None = None
    commit: str | None = None


class NativeVerifier(_Strict):
    name: str | None = None
    commit: str | None = None


class NativeOutcome(_Strict):
    """The outcome as the source reported it; the warehouse's own taxonomy comes later."""

    resolved: bool | None = None
    exit_status: str | None = None
    termination_reason: str | None = None
    reward: float | None = None
    verifier_status: VerifierStatus | None = None
    test_results: list[TestResult] | None = None


class NativeUsage(_Strict):
    tokens_in: int | None = None
    tokens_out: int | None = None
    cost_usd: float | None = None


class NativeStep(_Strict):
    index: int = Field(ge=0)
    role: Role
    author: Author
    text: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = Field(None, description="For observations: the call that caused it.")
    observation: str | None = None
    exit_code: int | None = None
    started_at: datetime | None = None
    ended_at: datetime | None = None
    tokens_in: int | None = None
    tokens_out: int | None = None
    test_results: list[TestResult] | None = None
    command: str | None = Field(None, description="The command as issued, when a text-based harness parsed it "
                                                  "out of the message (not a tool call).")
    metadata: dict[str, Any] | None = None


class NativeEpisode(_Strict):
    """One episode. Field groups mirror the trajectory key (ARCHITECTURE.md section 3)."""

    format: Literal["trajwh.native"] = NATIVE_FORMAT
    format_version: str = NATIVE_FORMAT_VERSION
    episode_id: str | None = Field(None, description="The producer's own id for the episode.")
    task: NativeTask = NativeTask()
    environment: NativeEnvironment = NativeEnvironment()
    policy: NativePolicy = NativePolicy()
    harness: NativeHarness = NativeHarness()
    verifier: NativeVerifier = NativeVerifier()
    sampling: dict[str, Any] | None = None
    attempt: int | None = Field(None, ge=0)
    started_at: datetime | None = None
    ended_at: datetime | None = None
    outcome: NativeOutcome = NativeOutcome()
    usage: NativeUsage = NativeUsage()
    steps: list[NativeStep]
    metadata: dict[str, Any] | None = None
