"""Episodes out in a standard format: the inverse of the adapters.

``native`` writes our JSONL format (docs/format.md); re-ingesting it reproduces the same
episodes and steps (a property test checks this). ``atif`` writes one ATIF-style
``trajectory.json`` object per line (schema ``ATIF-v1.2`` spelling: ``tool_call_id``,
``function_name``, ``observation.results[].source_call_id``), with our exact authorship in each
step's ``extra.author`` so that our ATIF reader brings it back unchanged.

Only the ``redacted`` layer may leave the warehouse by default (ARCHITECTURE.md s. 1); the
``normalized`` layer holds secrets and is exported only when asked for by name.
"""

from __future__ import annotations

import gzip
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import duckdb
import orjson
from trajwh.licenses.eligibility import releasable_only
from trajwh.lineage.catalog import Warehouse
from trajwh.schemas.errors import ConfigError
from trajwh.schemas.native import NATIVE_FORMAT, NATIVE_FORMAT_VERSION

FORMATS = ("native", "atif")
LAYERS = {"normalized": ("episodes", "steps"), "redacted": ("redacted_episodes", "redacted_steps")}
_OPTS = orjson.OPT_UTC_Z | orjson.OPT_NAIVE_UTC


def _loads(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return text


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def check_filter(wh: Warehouse, table: str, where: str | None) -> None:
    """A ``--where`` filter must be a valid condition on ``table``: else a ConfigError (exit 2)
    naming the filter and DuckDB's reason, never a traceback."""
    if not where:
        return
    try:
        wh.query(f"SELECT count(*) FROM {table} WHERE {where}")
    except duckdb.Error as exc:
        raise ConfigError(f"--where {where!r} is not a valid filter on {table}: {str(exc).splitlines()[0]}",
                          valid=f"a SQL condition on the columns of {table} (docs/sql.md)") from None


def iter_episodes(wh: Warehouse, layer: str, where: str | None = None,
                  exclude: set[str] | frozenset[str] = frozenset()) -> Iterator[tuple[dict, list[dict]]]:
    """(episode row, its step rows) for every episode of ``layer`` (but ``exclude``), in trajectory-key order."""
    if layer not in LAYERS:
        raise ConfigError(f"unknown layer {layer!r}", valid=", ".join(LAYERS))
    ep_table, step_table = LAYERS[layer]
    built = wh.manifest_query("SELECT count(*) FROM table_files WHERE table_name = ?", [ep_table]).column(0)[0].as_py()
    if not built:
        raise ConfigError(f"layer {layer!r} is not built in {wh.root}",
                          valid="a built layer: run `trajwh build` first (--layer normalized exports unredacted data)")
    filt = f"WHERE {where}" if where else ""
    keys = wh.query(f"SELECT trajectory_key FROM {ep_table} {filt} ORDER BY trajectory_key").column(0).to_pylist()
    keys = [k for k in keys if k not in exclude]
    for start in range(0, len(keys), 500):
        chunk = keys[start:start + 500]
        eps = wh.query(f"SELECT * FROM {ep_table} WHERE list_contains(?, trajectory_key) ORDER BY trajectory_key",
                       [chunk]).to_pylist()
        steps = wh.query(f"SELECT * FROM {step_table} WHERE list_contains(?, trajectory_key) "
                         "ORDER BY trajectory_key, step_index", [chunk]).to_pylist()
        by_key: dict[str, list[dict]] = {}
        for s in steps:
            by_key.setdefault(s["trajectory_key"], []).append(s)
        schemas = _tool_schemas(wh, {e["tool_schema_digest"] for e in eps if e["tool_schema_digest"]})
        for e in eps:
            e["_tool_schemas"] = schemas.get(e["tool_schema_digest"])
            yield e, by_key.get(e["trajectory_key"], [])


def _tool_schemas(wh: Warehouse, digests: set[str]) -> dict[str, Any]:
    if not digests or not wh.files("tool_schemas"):
        return {}
    rows = wh.query("SELECT tool_schema_digest, any_value(schema_text) AS schema_text FROM tool_schemas "
                    "WHERE list_contains(?, tool_schema_digest) GROUP BY 1", [sorted(digests)]).to_pylist()
    return {r["tool_schema_digest"]: _loads(r["schema_text"]) for r in rows}


def to_native(e: dict[str, Any], steps: list[dict[str, Any]]) -> dict[str, Any]:
    meta = _loads(e["metadata"]) or {}
    if not isinstance(meta, dict):
        meta = {"metadata": meta}
    meta.setdefault("exported_from", {"trajectory_key": e["trajectory_key"], "format": e["format"],
                                      "record_id": e["_record_id"]})
    return _drop_none({
        "format": NATIVE_FORMAT, "format_version": NATIVE_FORMAT_VERSION, "episode_id": e["source_episode_id"],
        "task": _drop_none({"task_id": e["task_id"], "text": e["task_text"], "repository": e["repository"],
                            "base_commit": e["base_commit"], "base_commit_at": e.get("base_commit_at"), "instance_id": e["instance_id"],
                            "issue_created_at": e["issue_created_at"], "fix_merged_at": e["fix_merged_at"],
                            "initial_state_digest": e["initial_state_digest"]}),
        "environment": _drop_none({"image_digest": e["env_image_digest"], "tool_schema_digest": e["tool_schema_digest"],
                                   "tool_schemas": e.get("_tool_schemas")}),
        "policy": _drop_none({"name": e["policy_name"], "checkpoint": e["policy_checkpoint"], "version": e["policy_version"]}),
        "harness": _drop_none({"name": e["harness_name"], "version": e["harness_version"], "commit": e["harness_commit"]}),
        "verifier": _drop_none({"name": e["verifier_name"], "commit": e["verifier_commit"]}),
        "sampling": _loads(e["sampling"]), "attempt": e["attempt"],
        "started_at": e["started_at"], "ended_at": e["ended_at"],
        "outcome": _drop_none({"resolved": e["resolved"], "exit_status": e["exit_status"],
                               "termination_reason": e["termination_reason"], "reward": e["reward"],
                               "verifier_status": e["verifier_status"], "test_results": e["test_results"]}),
        "usage": _drop_none({"tokens_in": e["tokens_in"], "tokens_out": e["tokens_out"], "cost_usd": e["cost_usd"]}),
        "steps": [_native_step(s) for s in steps],
        "metadata": meta,
    })


def _native_step(s: dict[str, Any]) -> dict[str, Any]:
    calls = None
    if s["tool_calls"] is not None:
        calls = [_drop_none({"id": c["id"], "name": c["name"], "arguments": _loads(c["arguments"]),
                             "executed": _loads(c["executed"]) if (c.get("executed") or "").startswith("{") else c.get("executed")}) for c in s["tool_calls"]]
    return _drop_none({
        "index": s["step_index"], "role": s["role"], "author": s["author"], "text": s["text"], "tool_calls": calls,
        "tool_call_id": s["tool_call_id"], "observation": s["observation"], "exit_code": s["exit_code"],
        "started_at": s["started_at"], "ended_at": s["ended_at"], "tokens_in": s["tokens_in"],
        "tokens_out": s["tokens_out"], "test_results": s["test_results"], "command": s["action_command"],
        "metadata": _loads(s["metadata"]),
    })


def to_atif(e: dict[str, Any], steps: list[dict[str, Any]]) -> dict[str, Any]:
    out_steps = []
    for s in steps:
        source = {"model": "agent", "human": "user", "environment": "system"}.get(s["author"], "system")
        if s["author"] == "harness" and s["role"] == "user":
            source = "user"
        item: dict[str, Any] = {"step_id": s["step_index"] + 1, "timestamp": s["started_at"], "source": source,
                                "message": s["text"] or "", "extra": {"author": s["author"], "role": s["role"]}}
        if s["tool_calls"]:
            item["tool_calls"] = [{"tool_call_id": c["id"], "function_name": c["name"], "arguments": _loads(c["arguments"])}
                                  for c in s["tool_calls"]]
        if s["observation"] is not None:
            item["observation"] = {"results": [{"source_call_id": s["tool_call_id"], "content": s["observation"]}]}
        out_steps.append(_drop_none(item))
    return _drop_none({
        "schema_version": "ATIF-v1.2", "session_id": e["source_episode_id"] or e["trajectory_key"],
        "agent": _drop_none({"name": e["harness_name"], "version": e["harness_version"], "model_name": e["policy_name"]}),
        "steps": out_steps,
        "final_metrics": _drop_none({"total_prompt_tokens": e["tokens_in"], "total_completion_tokens": e["tokens_out"],
                                     "total_cost_usd": e["cost_usd"], "total_steps": len(steps)}),
        "extra": _drop_none({"instruction": e["task_text"], "task_id": e["task_id"], "resolved": e["resolved"],
                             "exit_status": e["exit_status"], "trajectory_key": e["trajectory_key"]}),
    })


CONVERTERS: dict[str, Callable[[dict, list[dict]], dict]] = {"native": to_native, "atif": to_atif}


def export_episodes(wh: Warehouse, fmt: str, out: str | Path, *, layer: str = "redacted", where: str | None = None,
                    progress: Callable[[int], None] | None = None, eligible_only: bool = False,
                    policy_digest: str | None = None, members: set[str] | None = None) -> int:
    """Write every episode of ``layer`` as JSONL in ``fmt`` to ``out`` (``.gz`` compresses);
    ``members`` collects the trajectory keys written (the exports registry records them).

    The redacted layer is what leaves the warehouse: an episode the license policy or an opt-out
    does not allow for release is refused, with the reasons (``licenses.eligibility.not_releasable``),
    or left out with ``eligible_only``. The normalized layer stays in the restricted zone."""
    if fmt not in CONVERTERS:
        raise ConfigError(f"unknown export format {fmt!r}", valid=", ".join(FORMATS))
    exclude: set[str] = set()
    check_filter(wh, LAYERS.get(layer, ("redacted_episodes",))[0], where)
    if layer == "redacted":
        next(iter_episodes(wh, layer, "false"), None)  # a layer that is not built fails first, and says so
        exclude = releasable_only(wh, where, policy_digest, eligible_only)
    convert = CONVERTERS[fmt]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    n = 0
    opener = gzip.open if out.suffix == ".gz" else open
    with opener(tmp, "wb") as f:
        for e, steps in iter_episodes(wh, layer, where, exclude):
            f.write(orjson.dumps(convert(e, steps), option=_OPTS) + b"\n")
            n += 1
            if members is not None:
                members.add(e["trajectory_key"])
            if progress:
                progress(1)
    tmp.replace(out)
    return n
