"""τ-bench and τ²-bench runs (Sierra's benchmarks of a tool-using agent serving a simulated user:
retail, airline, telecom, ...).

Both put an agent between a **user simulator** (another model, playing a customer from a hidden
instruction) and a domain's tools, and score the conversation by the state it leaves (the
database, the actions taken, what the agent told the user). The user's turns are therefore the
environment's, never a person's and never the harness's: each is an environment step in the
user's role (``metadata.simulated_user``); the task is the user's hidden instruction, which the
agent never sees.

- **τ-bench** (``run.py``): one JSON array per run, a result per task and trial (``EnvRunResult``:
  ``task_id``, ``reward``, ``info`` with the ``task`` (``user_id``, ``instruction``, the expected
  ``actions`` and ``outputs``) and ``reward_info``, ``traj``: the agent's LiteLLM messages, and
  ``trial``). The file is named ``<strategy>-<model>-<temperature>_range_<start>-<end>_user-<user
  model>-<user strategy>_<time>.json``: the strategy and the model (the policy) come from there.
  With the ``tool-calling`` strategy the agent calls tools natively (a ``tool`` message answers
  each call by id) and talks to the user in text; with ``act`` / ``react`` it writes
  ``Action:`` and a JSON action (``{"name": ..., "arguments": ...}``) in its text: an action
  other than ``respond`` is a call, and the next user turn (``API output: ...``) its result; after
  ``respond`` the next user turn is the user's reply. The domain is the policy's heading
  (``# Retail agent policy``) in the system prompt.
- **τ²-bench** (``tau2 run``): one JSON document per run (``Results``: ``timestamp``, ``info``
  (``git_commit``, ``agent_info.llm``, ``user_info``, ``environment_info`` with the domain, the
  policy and the tools), ``tasks``, ``simulations``). Each simulation is an episode: its
  ``messages`` (assistant ``tool_calls`` with arguments as objects, ``tool`` messages answering
  by ``id`` with an ``error`` flag, per-message ``usage`` and ``cost``), ``reward_info`` (the
  verdict), ``termination_reason``, times and costs. The agent's system prompt is the domain's
  policy (``info.environment_info.policy``): it is the episode's first step, the harness's. The
  orchestrator opens every conversation with a fixed greeting written as the agent's (no usage,
  no cost, before any user turn): it is the harness's, not the model's. In the telecom domain the
  user acts on their own device with tools (``requestor: user``); the agent never sees those calls
  or their results: they are kept in the metadata of the user's next message (``user_device_actions``),
  not as steps.

A τ² run saved in the ``dir`` format (the default for voice runs) is ``results.json`` (info and
tasks, no simulations: the companion ``tau2-results``, told by the ``simulations/`` folder beside
it) and ``simulations/<id>.json``, a simulation per file (``tau2-simulation``), read like a
simulation of a results document with the run's facts from the companion. A τ-bench result whose
run raised (``info.error`` and its ``traceback``, an empty ``traj``, a reward of 0 that is no
verdict) is an episode of one harness step, the traceback: no verdict, the model's rate limit the
provider's quota, anything else the harness's exception.

The verdict is the reward (1 is success, as both benchmarks count it; ``verifier_name``
``tau-bench:<domain>`` / ``tau2-bench:<domain>``). τ²'s termination reasons map to the outcome
rules: ``max_steps``, ``timeout`` and ``context_window_exceeded`` are budgets, ``user_error`` and
``infrastructure_error`` the environment's, ``agent_error`` and ``unexpected_error`` the harness's.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePath
from typing import Any

import orjson
from trajwh.ingest.adapters.base import Adapter, ParsedEpisode, RecordContext
from trajwh.ingest.adapters.common import (
    RATE_LIMIT,
    episode,
    id_text,
    json_text,
    link_observations,
    number_steps,
    step,
    text_of,
    tool_call,
    tool_schema_info,
    ts,
)
from trajwh.schemas.errors import InputFormatError

_V1_HEAD = re.compile(rb'\A\s*\[\s*\{\s*"task_id"\s*:\s*-?\d+\s*,\s*"reward"\s*:')
_V2_HEAD = re.compile(rb'\A\s*\{\s*"timestamp"\s*:\s*(?:"[^"]*"|null)\s*,\s*"info"\s*:\s*\{\s*"git_commit"\s*:')
_SIM_HEAD = re.compile(rb'\A\s*\{\s*"id"\s*:\s*"[^"]*"\s*,\s*"task_id"\s*:')
_RUN_NAME = re.compile(r"^(?P<strategy>orchestrated-tool-calling|tool-calling|act|react|few-shot)-(?P<model>.+)-(?P<temperature>\d+(?:\.\d+)?)"
                       r"_range_(?P<range>-?\d+--?\d+)_user-(?P<user>.+?)(?:_(?P<time>\d{10}))?$")
_POLICY_HEADING = re.compile(r"^\s*#\s*([A-Za-z][\w ]*?)\s+agent\s+policy", re.I)
_RESPOND = "respond"
_SUCCESS = 1.0 - 1e-6
#: τ²-bench's termination reasons, as the outcome rules read them (user_stop / agent_stop end normally)
_TERMINATION = {
    "max_steps": "max steps reached (tau2-bench: max_steps)",
    "timeout": "time limit (tau2-bench: timeout)",
    "context_window_exceeded": "context window exceeded (tau2-bench: context_window_exceeded)",
    "too_many_errors": "too many tool errors in a row (tau2-bench: too_many_errors)",
    "user_error": "environment: the user simulator failed (tau2-bench: user_error)",
    "infrastructure_error": "infrastructure error (tau2-bench: infrastructure_error)",
    "agent_error": "harness exception in the agent (tau2-bench: agent_error)",
    "unexpected_error": "harness exception (tau2-bench: unexpected_error)",
}


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _verdict(reward: float | None) -> bool | None:
    return None if reward is None else reward >= _SUCCESS


def _is_v1_result(obj: Any) -> bool:
    return isinstance(obj, dict) and "task_id" in obj and isinstance(obj.get("traj"), list)


def _is_v2_results(obj: Any) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("info"), dict) and isinstance(obj.get("simulations"), list)


def _instructions(task: dict[str, Any]) -> str | None:
    """A τ² task's hidden instruction to the user simulator, as text."""
    scenario = _dict(task.get("user_scenario"))
    found = scenario.get("instructions")
    if isinstance(found, str):
        return found or None
    if isinstance(found, dict):
        lines = [f"{k}: {text_of(v) if not isinstance(v, str) else v}" for k, v in found.items() if v not in (None, "")]
        return "\n".join(lines) or None
    purpose = _dict(task.get("description")).get("purpose")
    return purpose if isinstance(purpose, str) and purpose else None


class TauBenchAdapter(Adapter):
    name = "tau-bench"
    version = "1.0.0"
    framing = "document"
    row_arrays = True  # a τ-bench run too large for one record: a record per result
    description = "τ-bench results (a JSON array of task results with their traj) and τ²-bench results (info, tasks, simulations)"

    def sniff(self, path: str, head: bytes) -> bool:
        return bool(_V1_HEAD.match(head) or _V2_HEAD.match(head))

    def check_record(self, obj: Any) -> str | None:
        if _is_v2_results(obj):
            bad = next((i for i, s in enumerate(obj["simulations"]) if not isinstance(s, dict)), None)
            return None if bad is None else f"simulations[{bad}] is not an object"
        rows = obj if isinstance(obj, list) else [obj]
        if not rows:
            return "an empty array of τ-bench results"
        for i, row in enumerate(rows):
            if not _is_v1_result(row):
                return (f"row {i}: expected a τ-bench result (task_id, reward, info, traj: a list of messages, trial)"
                        " or τ²-bench results (info, tasks, simulations)")
        return None

    def parse(self, obj: Any, ctx: RecordContext) -> list[ParsedEpisode]:
        if _is_v2_results(obj):
            return self._v2(obj, ctx)
        rows = obj if isinstance(obj, list) else [obj]
        return [_v1_episode(row, ctx, i if isinstance(obj, list) else None) for i, row in enumerate(rows)]

    def _v2(self, obj: dict[str, Any], ctx: RecordContext) -> list[ParsedEpisode]:
        common = _run_common(obj)
        tasks = {str(t.get("id")): t for t in obj.get("tasks") or [] if isinstance(t, dict)}
        out = []
        for i, sim in enumerate(obj["simulations"]):
            task = tasks.get(str(sim.get("task_id")))
            out.append(_v2_episode(sim, _instructions(task) if task else None, common, f"{ctx.where()} simulations[{i}]"))
        return out


def _has_simulations(path: str) -> bool:
    """A τ²-bench results.json of the ``dir`` format: its simulations are files in ``simulations/`` beside it."""
    try:
        return Path(path).with_name("simulations").is_dir()
    except OSError:
        return False


class Tau2RunAdapter(Adapter):
    """A τ²-bench run saved in the ``dir`` format (the default for voice runs): ``results.json``
    holds the run's info and tasks (no simulations); each simulation is ``simulations/<id>.json``.
    A companion: the run's facts (domain, policy, tools, models) and each task's instruction, for
    the simulation files beside it."""

    name = "tau2-results"
    version = "1.0.0"
    framing = "document"
    companion = True
    description = "a τ²-bench results.json beside its simulations/ folder (the run's info and tasks)"

    def sniff(self, path: str, head: bytes) -> bool:
        return bool(_V2_HEAD.match(head)) and _has_simulations(path)

    def check_record(self, obj: Any) -> str | None:
        return None if isinstance(obj, dict) and isinstance(obj.get("info"), dict) else \
            "expected τ²-bench results (timestamp, info, tasks)"

    def parse(self, obj: Any, ctx: RecordContext) -> list[ParsedEpisode]:
        return []

    def facts(self, obj: Any, ctx: RecordContext) -> list[tuple[str, str, dict[str, Any]]]:
        folder = str(PurePath(ctx.file_path).parent)
        out = [("tau2-run", folder, {"tau2_run": _run_common(obj)})]
        for t in obj.get("tasks") or []:
            if isinstance(t, dict) and (text := _instructions(t)):
                out.append(("tau2-task", f"{folder}#{t.get('id')}", {"task_text": text}))
        return out


class Tau2SimulationAdapter(Adapter):
    """One simulation of a τ²-bench run saved in the ``dir`` format (``simulations/<id>.json``): an
    episode, read as a simulation of a results document is, with the run's facts from the
    ``results.json`` beside the folder (``tau2-results``); without it, the episode has no domain,
    policy or model."""

    name = "tau2-simulation"
    version = "1.0.0"
    framing = "document"
    consumes_facts = True
    description = "a τ²-bench simulation file (simulations/<id>.json of a run saved as a folder)"

    def sniff(self, path: str, head: bytes) -> bool:
        return PurePath(path).parent.name == "simulations" and bool(_SIM_HEAD.match(head))

    def check_record(self, obj: Any) -> str | None:
        if not isinstance(obj, dict) or "task_id" not in obj or "termination_reason" not in obj:
            return "expected a τ²-bench simulation (id, task_id, termination_reason, messages)"
        return None

    def parse(self, obj: Any, ctx: RecordContext) -> list[ParsedEpisode]:
        folder = str(PurePath(ctx.file_path).parent.parent)
        common = ctx.facts("tau2-run", folder).get("tau2_run") or _run_common({})
        task_text = ctx.facts("tau2-task", f"{folder}#{obj.get('task_id')}").get("task_text")
        return [_v2_episode(obj, task_text, common, ctx.where())]


# --- τ-bench ---------------------------------------------------------------------------------


def _v1_action(text: str | None) -> dict[str, Any] | None:
    """The JSON action an ``act`` / ``react`` agent wrote after ``Action:``, if it is one."""
    if not text or "Action:" not in text:
        return None
    try:  # the harness reads what follows the last "Action:"
        action = orjson.loads(text.split("Action:")[-1].strip())
    except orjson.JSONDecodeError:
        return None
    return action if isinstance(action, dict) and isinstance(action.get("name"), str) else None


def _v1_episode(row: dict[str, Any], ctx: RecordContext, index: int | None) -> ParsedEpisode:
    info = _dict(row.get("info"))
    task = _dict(info.get("task"))
    messages = [m for m in row["traj"] if isinstance(m, dict)]
    system = next((text_of(m.get("content")) for m in messages if m.get("role") == "system"), None) or ""
    heading = _POLICY_HEADING.match(system)
    domain = heading.group(1).strip().lower().replace(" ", "_") if heading else None
    stem = PurePath(ctx.file_path).name.removesuffix(".json")
    run = _RUN_NAME.match(stem)
    steps: list[dict[str, Any]] = []
    pending: dict[str, Any] | None = None  # an act / react agent's last action, which the next user turn answers
    for n, m in enumerate(messages):
        role, text = m.get("role"), text_of(m.get("content"))
        if role == "system":
            steps.append(step("system", "harness", text=text))
        elif role == "assistant":
            calls = [tool_call(_dict(c.get("function")).get("name") or "", _dict(c.get("function")).get("arguments"),
                               id_text(c.get("id")))
                     for c in m.get("tool_calls") or [] if isinstance(c, dict)]
            action = None if calls else _v1_action(text)
            if action is not None and action["name"] != _RESPOND:
                calls = [tool_call(action["name"], action.get("arguments"), f"action-{n}")]
            pending = calls[0] if action is not None and calls else None
            steps.append(step("assistant", "model", text=text, tool_calls=calls,
                              metadata={"calls_in_text": True} if pending is not None else None))
        elif role == "tool":
            steps.append(step("tool", "environment", observation=text, tool_call_id=id_text(m.get("tool_call_id")),
                              metadata={"tool": m.get("name")} if m.get("name") else None))
        elif role == "user" and pending is not None:  # the result of a text action: "API output: ..."
            output = text.removeprefix("API output: ") if text else text
            steps.append(step("tool", "environment", observation=output, tool_call_id=pending["id"],
                              metadata={"tool": pending["name"]}))
            pending = None
        elif role == "user":
            steps.append(step("user", "environment", text=text, metadata={"simulated_user": True}))
        else:
            raise InputFormatError(f"traj[{n}] has the role {role!r}", where=ctx.where(),
                                   valid="system, user, assistant, tool")
    failure = info.get("error") if isinstance(info.get("error"), str) else None
    termination = None
    if failure is not None:  # the run raised (the model's API, the user simulator, the harness): no verdict
        steps.append(step("system", "harness", text=str(info.get("traceback") or failure), metadata={"error": failure}))
        kind = "provider quota" if RATE_LIMIT.search(failure) else "harness exception"
        termination = f"{kind} (tau-bench: the run raised): {failure}"[:300]
    counts = link_observations(steps)
    number_steps(steps)
    task_id = row.get("task_id")
    trial = row.get("trial") if isinstance(row.get("trial"), int) else None
    reward = None if failure is not None else _number(row.get("reward"))
    last = next((s for s in reversed(steps) if s["author"] == "environment" and s["role"] == "user"), None)
    user_stopped = bool(last and "###STOP###" in (last["text"] or ""))
    ep = episode(
        source_episode_id=f"{stem}/{task_id}#{trial if trial is not None else index}",
        task_id=f"{domain or 'tau-bench'}/{task_id}", instance_id=str(task_id),
        task_text=task.get("instruction") if isinstance(task.get("instruction"), str) else None,
        policy_name=run.group("model") if run else None, harness_name="tau-bench", attempt=trial,
        resolved=_verdict(reward), reward=reward, verifier_name=f"tau-bench:{domain}" if domain else "tau-bench",
        verifier_status="ok" if reward is not None else None,
        exit_status="error" if failure is not None else "user_stop" if user_stopped else None,
        termination_reason=termination,
        metadata={"domain": domain, "recorded_reward": _number(row.get("reward")) if failure is not None else None, "strategy": run.group("strategy") if run else None,
                  "temperature": run.group("temperature") if run else None,
                  "user_model": run.group("user") if run else None, "user_id": task.get("user_id"),
                  "expected_actions": json_text(task.get("actions")), "expected_outputs": json_text(task.get("outputs")),
                  "reward_info": json_text(info.get("reward_info")), "user_cost_usd": _number(info.get("user_cost")),
                  "row_index": index, **counts})
    return ParsedEpisode(ep, steps)


# --- τ²-bench --------------------------------------------------------------------------------


def _v2_calls(m: dict[str, Any]) -> list[dict[str, Any]]:
    return [tool_call(str(c.get("name") or "unknown"), c.get("arguments"), id_text(c.get("id")))
            for c in m.get("tool_calls") or [] if isinstance(c, dict)]


def _tool_messages(m: dict[str, Any]) -> list[dict[str, Any]]:
    """A tool message, or the ones a ``MultiToolMessage`` holds."""
    inner = m.get("tool_messages")
    return [t for t in inner if isinstance(t, dict)] if isinstance(inner, list) else [m]


def _usage(m: dict[str, Any]) -> tuple[int | None, int | None]:
    usage = _dict(m.get("usage"))
    tin, tout = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return (tin if isinstance(tin, int) else None), (tout if isinstance(tout, int) else None)


def _reasoning(m: dict[str, Any]) -> str | None:
    """A reasoning model's thinking, from the raw response τ² keeps (``raw_data``)."""
    raw = _dict(m.get("raw_data"))
    message = _dict(_dict((raw.get("choices") or [None])[0] if isinstance(raw.get("choices"), list) else None).get("message"))
    found = message.get("reasoning_content") or raw.get("reasoning_content")
    return found if isinstance(found, str) and found else None


def _run_common(obj: dict[str, Any]) -> dict[str, Any]:
    """What every simulation of a τ² run shares: the domain, the policy (the agent's system
    prompt), the tool definitions, the models and the harness commit (``Results.info``)."""
    info = _dict(obj.get("info"))
    env = _dict(info.get("environment_info"))
    agent, user = _dict(info.get("agent_info")), _dict(info.get("user_info"))
    defs = env.get("tool_defs")
    return {"harness": "tau2-bench", "domain": env.get("domain_name") if isinstance(env.get("domain_name"), str) else None,
            "policy": env.get("policy"), "model": agent.get("llm"), "commit": info.get("git_commit"),
            "tools": tool_schema_info(list(defs.values()) if isinstance(defs, dict) else defs, "tau2-bench:tool_defs"),
            "meta": {"agent_implementation": agent.get("implementation"), "user_implementation": user.get("implementation"),
                     "user_model": user.get("llm"), "max_steps": info.get("max_steps"),
                     "max_errors": info.get("max_errors"), "run_timestamp": obj.get("timestamp")}}


def _v2_episode(sim: dict[str, Any], task_text: str | None, common: dict[str, Any], where: str) -> ParsedEpisode:
    if not isinstance(sim.get("messages"), list):
        raise InputFormatError("a simulation without messages (a full-duplex run keeps ticks: not read)",
                               where=where, valid="a half-duplex simulation with its messages")
    steps: list[dict[str, Any]] = []
    if isinstance(common["policy"], str) and common["policy"]:
        steps.append(step("system", "harness", text=common["policy"], metadata={"from": "info.environment_info.policy"}))
    device: list[dict[str, Any]] = []  # the user's own tool calls and their results, out of the agent's sight
    user_side: set[str] = set()
    tokens = [0, 0]
    seen_usage = False
    spoke = False  # has the user said anything yet (the greeting before it is the orchestrator's)
    for n, m in enumerate(sim["messages"]):
        if not isinstance(m, dict):
            raise InputFormatError(f"messages[{n}] is not an object", where=where, valid="a message object")
        role, text, when = m.get("role"), text_of(m.get("content")), ts(m.get("timestamp"))
        meta = {k: m[k] for k in ("turn_idx", "cost") if m.get(k) is not None}
        if role == "assistant":
            tin, tout = _usage(m)
            if not spoke and tin is None and tout is None and not m.get("cost") and not m.get("tool_calls"):
                steps.append(step("assistant", "harness", text=text, started_at=when,
                                  metadata={**meta, "orchestrator_greeting": True}))
                continue
            seen_usage |= tin is not None or tout is not None
            tokens = [tokens[0] + (tin or 0), tokens[1] + (tout or 0)]
            reasoning = _reasoning(m)
            steps.append(step("assistant", "model", text=text, tool_calls=_v2_calls(m), started_at=when,
                              tokens_in=tin, tokens_out=tout,
                              metadata={**meta, **({"reasoning": reasoning} if reasoning else {})}))
        elif role == "user":
            spoke = True
            calls = _v2_calls(m)
            user_side.update(c["id"] or "" for c in calls)
            device += [{"call": c} for c in calls]
            if text:  # what the user says; the device actions before it (the agent saw none of them) go with it
                steps.append(step("user", "environment", text=text, started_at=when,
                                  metadata={**meta, "simulated_user": True,
                                            **({"user_device_actions": device} if device else {})}))
                device = []
        elif role == "tool":
            for t in _tool_messages(m):
                cid = id_text(t.get("id") or t.get("tool_call_id"))
                output = text_of(t.get("content"))
                if t.get("requestor") == "user" or (cid in user_side and t.get("requestor") != "assistant"):
                    device.append({"result": {"id": cid, "content": output, "error": bool(t.get("error"))}})
                    continue  # the user's device answering the user: the agent never sees it
                steps.append(step("tool", "environment", observation=output, tool_call_id=cid,
                                  started_at=ts(t.get("timestamp")) or when,
                                  metadata={"is_error": True} if t.get("error") is True else None))
        elif role == "system":
            steps.append(step("system", "harness", text=text, started_at=when, metadata=meta or None))
        else:
            raise InputFormatError(f"messages[{n}] has the role {role!r}", where=where,
                                   valid="system, user, assistant, tool")
    counts = link_observations(steps)
    number_steps(steps)
    reward_info = _dict(sim.get("reward_info"))
    reward = _number(reward_info.get("reward"))
    reason = sim.get("termination_reason") if isinstance(sim.get("termination_reason"), str) else None
    domain = common["domain"]
    task_id = sim.get("task_id")
    times = [s["started_at"] for s in steps if s.get("started_at")]
    basis = reward_info.get("reward_basis")
    ep = episode(
        source_episode_id=id_text(sim.get("id")), task_id=f"{domain or 'tau2-bench'}/{task_id}",
        instance_id=str(task_id), task_text=task_text, policy_name=common["model"],
        harness_name=common["harness"], harness_commit=common["commit"],
        attempt=sim.get("trial") if isinstance(sim.get("trial"), int) else None,
        started_at=ts(sim.get("start_time")) or (min(times) if times else None),
        ended_at=ts(sim.get("end_time")) or (max(times) if times else None),
        resolved=_verdict(reward), reward=reward, verifier_name=f"tau2-bench:{domain}" if domain else "tau2-bench",
        verifier_status="ok" if reward is not None else None, exit_status=reason,
        termination_reason=_TERMINATION.get(reason or ""),
        tokens_in=tokens[0] if seen_usage else None, tokens_out=tokens[1] if seen_usage else None,
        cost_usd=_number(sim.get("agent_cost")),
        metadata={**common["meta"], "domain": domain, "user_device_actions_at_end": device or None, "seed": sim.get("seed"), "user_cost_usd": _number(sim.get("user_cost")),
                  "reward_basis": json_text(basis), "reward_info": json_text(reward_info or None),
                  "llm_judged": bool(isinstance(basis, list) and "NL_ASSERTION" in basis) or None, **counts})
    return ParsedEpisode(ep, steps, common["tools"])
