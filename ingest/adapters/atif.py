"""ATIF ``trajectory.json`` (Agent Trajectory Interchange Format, Harbor / Terminal-Bench, 1.x).

Steps have a ``source`` (``user`` / ``agent`` / ``system``), a ``message``, optional
``tool_calls`` and an ``observation``. Two spellings are accepted: the spec's
(``tool_call_id`` / ``function_name`` / ``observation.results[].source_call_id``) and the
home-made one seen in the corpus (``id`` / ``name`` / ``"Tool result for <id>"`` messages).
Results may come before the call that caused them (the corpus file does this): the order is
kept and the link is the call id. A ``metrics.json`` beside the trajectory is a companion, and so is
Harbor's trial ``result.json`` (in the folder above ``agent/trajectory.json``): the verifier's reward
is the verdict (resolved at 1), the exception that ended the trial the termination.

Authorship: agent steps are ``model``; a system step carrying a tool result is ``environment``;
other system steps are ``harness``; the user message that is the benchmark's instruction is
``harness``, any other user message ``human``.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePath
from typing import Any

from trajwh.ingest.adapters.base import (
    Adapter,
    KeptFile,
    KeptTextFile,
    ParsedEpisode,
    RecordContext,
)
from trajwh.ingest.adapters.common import (
    count_of,
    episode,
    exit_code_in,
    json_text,
    link_observations,
    number_steps,
    step,
    tool_call,
    tool_schema_info,
    ts,
)

_RESULT_FOR = re.compile(r"Tool result for (\S+)")


def _calls(raw: Any) -> list[dict[str, Any]]:
    out = []
    for c in raw or []:
        if isinstance(c, dict):
            name = c.get("function_name") or c.get("name") or "unknown"
            out.append(tool_call(name, c.get("arguments"), c.get("tool_call_id") or c.get("id")))
    return out


def _observations(s: dict[str, Any]) -> list[tuple[str | None, str | None, dict[str, Any]]]:
    """(call id, content, extra) for each result in a step's observation."""
    obs = s.get("observation")
    if not isinstance(obs, dict):
        return []
    if isinstance(obs.get("results"), list):  # spec spelling
        return [(r.get("source_call_id"), r.get("content") if isinstance(r.get("content"), str) else json_text(r.get("content")), {})
                for r in obs["results"] if isinstance(r, dict)]
    m = _RESULT_FOR.search(s.get("message") or "")
    result = obs.get("result") if isinstance(obs.get("result"), dict) else {}
    return [(m.group(1) if m else None, obs.get("content"), {"success": result.get("success")})]


class AtifAdapter(Adapter):
    name = "atif"
    version = "1.2.0"  # 1.2: Harbor's trial result.json (verdict, exception) read
    framing = "jsonl"  # a pretty-printed trajectory.json is one document; `trajwh export` writes JSONL
    description = "ATIF trajectory.json (Harbor / Terminal-Bench style, schema 1.x)"
    consumes_facts = True

    def sniff(self, path: str, head: bytes) -> bool:
        return head.lstrip()[:1] == b"{" and b'"schema_version"' in head and b'"steps"' in head and b'"source"' in head

    def check_record(self, obj: Any) -> str | None:
        if not isinstance(obj, dict) or not isinstance(obj.get("steps"), list):
            return "expected an object with a 'steps' list"
        return None

    def parse(self, obj: dict[str, Any], ctx: RecordContext) -> list[ParsedEpisode]:
        extra = obj.get("extra") if isinstance(obj.get("extra"), dict) else {}
        instruction = extra.get("instruction")
        steps: list[dict[str, Any]] = []
        for s in obj["steps"]:
            source, when = s.get("source"), ts(s.get("timestamp"))
            meta = {"step_id": s.get("step_id")}
            ours = s.get("extra") if isinstance(s.get("extra"), dict) else {}
            if ours.get("author") in ("model", "harness", "environment", "human") and ours.get("role"):
                steps.extend(self._exported_step(s, ours, when))  # written by `trajwh export --format atif`
                continue
            metrics = s.get("metrics") if isinstance(s.get("metrics"), dict) else {}
            if source == "agent":
                steps.append(step("assistant", "model", text=s.get("message"), tool_calls=_calls(s.get("tool_calls")),
                                  started_at=when, tokens_in=metrics.get("prompt_tokens"),
                                  tokens_out=metrics.get("completion_tokens"),
                                  metadata={**meta, "reasoning": s.get("reasoning_content")}))
                for call_id, content, more in _observations(s):  # results attached to the agent step
                    steps.append(step("tool", "environment", observation=content, tool_call_id=call_id,
                                      exit_code=exit_code_in(content), started_at=when, metadata={**meta, **more}))
            elif source == "user":
                author = "harness" if instruction and s.get("message", "").strip() == instruction.strip() else "human"
                steps.append(step("user", author, text=s.get("message"), started_at=when, metadata=meta))
            else:
                results = _observations(s)
                if not results:
                    steps.append(step("system", "harness", text=s.get("message"), started_at=when, metadata=meta))
                for call_id, content, more in results:
                    steps.append(step("tool", "environment", observation=content, tool_call_id=call_id,
                                      exit_code=exit_code_in(content), started_at=when, metadata={**meta, **more}))
        counts = link_observations(steps)
        number_steps(steps)
        agent = obj.get("agent") if isinstance(obj.get("agent"), dict) else {}
        final = obj.get("final_metrics") if isinstance(obj.get("final_metrics"), dict) else {}
        facts = ctx.facts("dir", str(PurePath(ctx.file_path).parent))
        companion = facts.get("atif_metrics", {})
        trial = facts.get("harbor_trial", {})  # Harbor's trial result.json: the verifier's reward, the exception
        tokens = companion.get("tokens") or {}
        times = [s["started_at"] for s in steps if s.get("started_at")]
        first_user = next((s["text"] for s in steps if s["role"] == "user"), None)
        success = extra.get("success", companion.get("success"))
        reward = trial.get("reward")
        ep = episode(
            source_episode_id=obj.get("session_id"), task_text=instruction or first_user,
            harness_name=agent.get("name") or trial.get("agent"), harness_version=agent.get("version"),
            policy_name=agent.get("model") or agent.get("model_name") or trial.get("model"),
            task_id=extra.get("task_id") or trial.get("task_name"),
            resolved=extra.get("resolved") if reward is None else reward >= 1, reward=reward,
            verifier_name=f"harbor:{trial.get('source') or 'verifier'}" if reward is not None else None,
            started_at=ts(extra.get("start_time") or companion.get("start_time") or trial.get("started_at"))
            or (min(times) if times else None),
            ended_at=ts(extra.get("end_time") or companion.get("end_time") or trial.get("finished_at"))
            or (max(times) if times else None),
            tokens_in=final.get("total_prompt_tokens", tokens.get("input", trial.get("tokens_in"))),
            tokens_out=final.get("total_completion_tokens", tokens.get("output", trial.get("tokens_out"))),
            cost_usd=final.get("total_cost_usd", companion.get("cost", trial.get("cost_usd"))),
            termination_reason=trial.get("exception"),
            exit_status=extra.get("exit_status") or ("error" if trial.get("exception") else None)
            or (None if success is None else ("success" if success else "failure")),
            metadata={"schema_version": obj.get("schema_version"), "provider": agent.get("provider"),
                      "agent_reported_success": success, "turns": companion.get("turns"),
                      "cache_read_tokens": tokens.get("cache_read"), **counts},
        )
        tools = agent.get("tool_definitions")  # ATIF >= 1.5: the tools the agent was given
        return [ParsedEpisode(ep, steps, tool_schema_info(tools, "atif:agent.tool_definitions"))]

    @staticmethod
    def _exported_step(s: dict[str, Any], ours: dict[str, Any], when: Any) -> list[dict[str, Any]]:
        results = _observations(s)
        call_id, content, _ = results[0] if results else (None, None, {})
        return [step(ours["role"], ours["author"], text=s.get("message") or None, tool_calls=_calls(s.get("tool_calls")),
                     tool_call_id=call_id, observation=content, started_at=when)]


def _trial_facts(obj: dict[str, Any]) -> dict[str, Any]:
    """What a Harbor trial's ``result.json`` says about its trajectory: the verifier's reward (the
    ``reward`` key of ``verifier_result.rewards``, else its only value), the agent and model, the
    tokens and cost, the times, and the exception that ended the trial (its type and message)."""
    verdict = obj.get("verifier_result") if isinstance(obj.get("verifier_result"), dict) else {}
    rewards = verdict.get("rewards") if isinstance(verdict.get("rewards"), dict) else {}
    numbers = {k: v for k, v in rewards.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    reward = numbers.get("reward", next(iter(numbers.values())) if len(numbers) == 1 else None)
    agent = obj.get("agent_info") if isinstance(obj.get("agent_info"), dict) else {}
    model = agent.get("model_info") if isinstance(agent.get("model_info"), dict) else {}
    result = obj.get("agent_result") if isinstance(obj.get("agent_result"), dict) else {}
    exc = obj.get("exception_info") if isinstance(obj.get("exception_info"), dict) else None
    said = f"{exc.get('exception_type') or 'exception'}: {exc.get('exception_message') or ''}".strip(": ") if exc else None
    return {k: v for k, v in {
        "reward": float(reward) if reward is not None else None, "task_name": obj.get("task_name"),
        "source": obj.get("source"), "agent": agent.get("name"), "model": model.get("name"),
        "tokens_in": count_of(result.get("n_input_tokens")), "tokens_out": count_of(result.get("n_output_tokens")),
        "cost_usd": result.get("cost_usd") if isinstance(result.get("cost_usd"), int | float) else None,
        "started_at": obj.get("started_at"), "finished_at": obj.get("finished_at"),
        "exception": said[:300] if said else None}.items() if v is not None}


class HarborTrialResultAdapter(Adapter):
    """Harbor's ``<job>/<trial>/result.json`` (Terminal-Bench 2 and the other Harbor datasets): the
    trial's outcome beside ``agent/trajectory.json`` (ATIF). A companion: its facts are the
    trial folder's and its ``agent`` folder's (where the trajectory is)."""

    name = "harbor-trial-result"
    version = "1.0.0"
    framing = "document"
    description = "Harbor trial result.json (the verifier's reward, the agent, tokens, the exception)"
    companion = True

    def sniff(self, path: str, head: bytes) -> bool:
        return (head.lstrip()[:1] == b"{" and b'"trial_name"' in head and b'"task_name"' in head
                and (b'"verifier_result"' in head or b'"agent_info"' in head))

    def check_record(self, obj: Any) -> str | None:
        return None if isinstance(obj, dict) and "trial_name" in obj else "expected a Harbor trial result object"

    def parse(self, obj: Any, ctx: RecordContext) -> list[ParsedEpisode]:
        return []

    def facts(self, obj: Any, ctx: RecordContext) -> list[tuple[str, str, dict[str, Any]]]:
        folder = PurePath(ctx.file_path).parent
        said = {"harbor_trial": _trial_facts(obj)}
        return [("dir", str(folder), said), ("dir", str(folder / "agent"), said)]


class LiteLLMCallLogAdapter(KeptFile):
    """A model call's log as LiteLLM's ``logger_fn`` hands it over (``model``, ``messages``,
    ``litellm_params``, ``additional_args``, ``log_event_type``, ``original_response``): what
    Terminus and other Harbor / Terminal-Bench agents write as ``episode-<n>/debug.json`` beside
    their trajectory. Each holds the conversation so far, so read as messages it would be one
    spurious partial episode per call: it is kept, not read (the trajectory is the episode)."""

    name = "litellm-call-log"
    description = "a model call's LiteLLM log (Terminus' episode-<n>/debug.json; kept, not read)"

    def sniff(self, path: str, head: bytes) -> bool:
        return head.lstrip()[:1] == b"{" and b'"log_event_type"' in head and (
            b'"litellm_params"' in head or b'"litellm_call_id"' in head or b'"additional_args"' in head)

    def check_record(self, obj: Any) -> str | None:
        return None if isinstance(obj, dict) and "log_event_type" in obj else "expected a LiteLLM call log object"


#: a Harbor trial's other files, by their place in the trial folder: an agent's per-call prompt and
#: response, its terminal pane, the verifier's reward and test output
_HARBOR_FILE = re.compile(r"(?:^|[/\\])(?:agent[/\\]episode-\d+[/\\](?:prompt\.txt|response\.txt|response\.json)|"
                          r"agent[/\\][\w.-]+\.pane|verifier[/\\](?:reward\.txt|reward\.json|test-stdout\.txt|"
                          r"test-stderr\.txt))$")


class HarborTrialFileAdapter(KeptTextFile):
    """The text files a Harbor trial keeps beside ``result.json`` and ``agent/trajectory.json``:
    ``agent/episode-<n>/prompt.txt`` and ``response.txt`` (each call's prompt and answer, which the
    trajectory holds), ``agent/<agent>.pane`` (the terminal), ``verifier/reward.txt`` and
    ``test-stdout.txt`` (the result and the tests' output, which ``result.json`` sums up), known by
    their place in the trial folder; ``trial.log`` and ``job.log``; and the job's and the trial's
    ``config.json`` and the job's ``result.json`` (its counts), known by their keys. Kept, read by
    no one."""

    name = "harbor-trial-file"
    description = "a Harbor job's other files: per-call prompts and responses, panes, verifier output, logs, configs (kept, not read)"

    def sniff(self, path: str, head: bytes) -> bool:
        if b"\x00" in head:
            return False
        if _HARBOR_FILE.search(path) or PurePath(path).name in ("trial.log", "job.log"):
            return True
        # the job's and the trial's configuration and the job's result (its counts): JSON objects
        return head.lstrip()[:1] == b"{" and b'"task_name"' not in head and (
            b'"n_total_trials"' in head or (b'"job_name"' in head and b'"jobs_dir"' in head)
            or (b'"trial_name"' in head and b'"trials_dir"' in head))



def _trial_agent_folder(path: str) -> Path | None:
    """The ``agent/`` folder of a Harbor trial that holds ``path`` (at any depth), when that folder
    has Harbor's ``trajectory.json`` and the trial its ``result.json``; else None."""
    parts = PurePath(path).parts
    if "agent" not in parts[:-1]:
        return None
    i = len(parts) - 2 - parts[:-1][::-1].index("agent")
    agent = Path(*parts[:i + 1])
    try:
        return agent if (agent / "trajectory.json").is_file() and (agent.parent / "result.json").is_file() else None
    except OSError:
        return None


class HarborAgentLogAdapter(KeptTextFile):
    """An installed agent's own logs in a Harbor trial's ``agent/`` folder, when Harbor converted
    the run to ``agent/trajectory.json`` beside them: Claude Code's ``claude-code.txt`` (its
    stream-json output) and ``sessions/`` (its session files), Codex's ``codex.txt`` and rollouts,
    the setup commands' output. They hold the same run as the trajectory: read as episodes too, one
    trial would be two or three episodes (each attempt counted again in the task statistics). They
    are kept, read by no one; the trial is its trajectory, with the verdict of its ``result.json``.
    In a trial without ``trajectory.json`` (an agent Harbor does not convert) they are read."""

    name = "harbor-agent-log"
    description = "an agent's own logs beside a Harbor trial's trajectory.json (the same run: kept, not read)"

    def sniff(self, path: str, head: bytes) -> bool:
        name = PurePath(path).name
        if b"\x00" in head or name.startswith("trajectory") or name in ("metrics.json", "debug.json") \
                or _HARBOR_FILE.search(path):
            return False
        return _trial_agent_folder(path) is not None


class AtifMetricsAdapter(Adapter):
    name = "atif-metrics"
    version = "1.0.0"
    framing = "document"
    description = "metrics.json beside an ATIF trajectory (tokens, cost, agent-reported success)"
    companion = True

    def sniff(self, path: str, head: bytes) -> bool:
        return (head.lstrip()[:1] == b"{" and b'"instruction"' in head and b'"tokens"' in head
                and (b'"turns"' in head or b'"duration_ms"' in head))

    def check_record(self, obj: Any) -> str | None:
        return None if isinstance(obj, dict) else "expected a JSON object"

    def parse(self, obj: Any, ctx: RecordContext) -> list[ParsedEpisode]:
        return []

    def facts(self, obj: Any, ctx: RecordContext) -> list[tuple[str, str, dict[str, Any]]]:
        return [("dir", str(PurePath(ctx.file_path).parent), {"atif_metrics": obj})]


