"""OSWorld runs: ``traj.jsonl`` and the files beside it (``result.txt``, ``instruction.txt``).

OSWorld (and the benchmarks built on its runner: Spider2-V, OS-Map, RiOSWorld, ...) evaluates
computer-use agents on a desktop. Its runner writes one folder per task,
``<results>/<action space>/<observation type>/<model>/<domain>/<example id>/``, holding:

- ``traj.jsonl``: a line per action the environment ran: ``step_num`` (the model's turn; a turn
  may give several actions, one line each), ``action_timestamp`` (``%Y%m%d@%H%M%S``, local
  time, read as UTC), ``action`` (pyautogui code, a ``computer_13`` dict such as
  ``{"action_type": "CLICK", "x": 10, "y": 20}``, or ``DONE`` / ``FAIL`` / ``WAIT``), the
  model's ``response`` for that turn (some runners leave it out), ``reward``, ``done``, ``info``
  and ``screenshot_file`` (the screen after the action: named, never kept). A run that failed
  writes ``{"Error": "..."}`` (a time limit, an exception). Some runners add the task
  (``instruction``) to every line and log the environment's reset as an ``__init__`` action (the
  first screen, the environment's). The file may be named otherwise (``trajectory.jsonl``).
- ``result.txt``: the evaluator's score (a number; 1 is success), written when the run ended:
  the episode's verdict (``osworld-evaluator``, a checker of the final state, not a model).
- ``instruction.txt``: the task, written by some runners. Both are companions (``osworld-result``,
  ``osworld-instruction``): facts for the trajectory in the same folder, no episode.
- ``runtime.log`` (the runner's log: kept, read by no one), the screenshots and ``recording.mp4``
  (images and video: skipped at ingest).

The model's turn is one model step (its response as text, its actions as calls of ``computer``;
``DONE`` is the agent's submit, ``FAIL`` its claim that the task cannot be done, a submit too),
each action's outcome one environment step. The folder names give the task (``domain/example
id``), and the model when the path has the runner's layout (the episode id is then the path from the
action space down: one model's run of one task in one setting).
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import PurePath
from typing import Any

from trajwh.ingest.adapters.base import (
    Adapter,
    JsonlSessionAdapter,
    KeptTextFile,
    ParsedEpisode,
    RecordContext,
)
from trajwh.ingest.adapters.common import (
    episode,
    json_text,
    link_observations,
    number_steps,
    step,
    tool_call,
)

_FIRST = re.compile(rb'\A\s*\{\s*"(?:step_num|Error)"\s*:')
_SCORE = re.compile(rb"\s*[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?\s*")
#: the runner's observation types: the folder above the model's in its layout
_OBSERVATIONS = {"screenshot", "a11y_tree", "screenshot_a11y_tree", "som"}


def _when(text: Any) -> datetime | None:
    if not isinstance(text, str):
        return None
    for fmt in ("%Y%m%d@%H%M%S_%f", "%Y%m%d@%H%M%S"):
        try:
            return datetime.strptime(text, fmt).replace(tzinfo=UTC)
        except ValueError:
            continue
    return None


def _call(action: Any, call_id: str) -> dict[str, Any]:
    """An action as a call: DONE / FAIL are the agent's answer, the rest act on the screen."""
    if isinstance(action, str) and action.strip().upper() in ("DONE", "FAIL"):
        return tool_call("done", {"answer": action.strip().upper()}, call_id)
    if isinstance(action, dict):
        args = {("action" if k == "action_type" else k): v for k, v in action.items()}
        return tool_call("computer", args, call_id)
    return tool_call("computer", {"action": action if isinstance(action, str) else json_text(action)}, call_id)


def _outcome(line: dict[str, Any]) -> str | None:
    parts = []
    if isinstance(line.get("screenshot_file"), str) and line["screenshot_file"]:
        parts.append(f"[screenshot] {line['screenshot_file']}")
    info = line.get("info")
    if info:
        parts.append(info if isinstance(info, str) else json_text(info) or "")
    return "\n".join(p for p in parts if p) or None


def _layout(path: str) -> tuple[str | None, str | None, str | None, str | None]:
    """(run id, task id, example id, model) from the runner's folders, when the path has them: the
    run is the path from the action space down (one model's run of one task in one setting)."""
    folder = PurePath(path).parent
    parents = [p.name for p in folder.parents]
    example, domain = folder.name or None, parents[0] if parents else None
    task = f"{domain}/{example}" if example and domain else example
    if len(parents) > 3 and parents[2] in _OBSERVATIONS:
        return "/".join([parents[3], parents[2], parents[1], task or ""]), task, example, parents[1]
    return task, task, example, None


class OsworldAdapter(JsonlSessionAdapter):
    name = "osworld"
    version = "1.1.0"  # 1.1: a response's actions are marked as written in its text
    description = "OSWorld runner's traj.jsonl (a computer-use agent's actions, with result.txt's score beside it)"
    consumes_facts = True

    def sniff(self, path: str, head: bytes) -> bool:
        if not _FIRST.match(head):
            return False
        return b'"action_timestamp"' in head or PurePath(path).name == "traj.jsonl"

    def check_record(self, obj: Any) -> str | None:
        lines = obj.get("entries") if isinstance(obj, dict) else None
        if not lines or not any("step_num" in x or "Error" in x for x in lines):
            return "expected OSWorld trajectory lines (step_num, action, screenshot_file) or an Error line"
        return None

    def parse(self, obj: dict[str, Any], ctx: RecordContext) -> list[ParsedEpisode]:
        lines = obj["entries"]
        steps: list[dict[str, Any]] = []
        owner: dict[str, Any] | None = None  # the model step of the turn being read
        turn: Any = None
        errors: list[str] = []
        rewards: list[float] = []
        for n, line in enumerate(lines):
            if "Error" in line and "step_num" not in line:
                errors.append(str(line["Error"]))
                steps.append(step("system", "harness", text=str(line["Error"]), metadata={"runner_error": True}))
                owner = None
                continue
            when = _when(line.get("action_timestamp"))
            if line.get("action") == "__init__":  # some runners log the environment's reset: the first screen
                steps.append(step("user", "environment", observation=_outcome(line), started_at=when,
                                  metadata={"initial_state": True}))
                continue
            call_id = f"action-{n}"
            if owner is None or line.get("step_num", f"line {n}") != turn:  # a new turn of the model
                turn = line.get("step_num", f"line {n}")
                response = line.get("response")
                text = response if isinstance(response, str) else json_text(response) if response else None
                # the response holds the actions the runner parsed from it: written once, in the text
                owner = step("assistant", "model", text=text, tool_calls=[_call(line.get("action"), call_id)],
                             started_at=when, metadata={"step_num": turn, **({"calls_in_text": True} if text else {})})
                steps.append(owner)
            else:  # another action of the same turn: a call of the turn's model step
                owner["tool_calls"].append(_call(line.get("action"), call_id))
            if isinstance(line.get("reward"), int | float) and not isinstance(line.get("reward"), bool):
                rewards.append(float(line["reward"]))
            flags = {k: v for k, v in (("reward", line.get("reward")), ("done", line.get("done") or None),
                                       ("screenshot", line.get("screenshot_file"))) if v is not None}
            steps.append(step("tool", "environment", observation=_outcome(line), tool_call_id=call_id, ended_at=when,
                              metadata=flags))
        counts = link_observations(steps)
        number_steps(steps)
        folder = str(PurePath(ctx.file_path).parent)
        facts = ctx.facts("dir", folder)
        score = facts.get("osworld_result")
        run, task, example, model = _layout(ctx.file_path)
        acted = [x for x in lines if "step_num" in x and x.get("action") != "__init__"]
        said = next((x["instruction"] for x in lines if isinstance(x.get("instruction"), str) and x["instruction"]), None)
        last = acted[-1] if acted else {}
        answer = last.get("action").strip().upper() if isinstance(last.get("action"), str) else None
        exit_status = termination = None
        if errors:
            exit_status, termination = "error", errors[-1].strip().splitlines()[0][:300] if errors[-1].strip() else "error"
        elif answer in ("DONE", "FAIL"):
            exit_status = "submitted"
        elif last.get("done"):
            exit_status = "done"
        times = [s[k] for s in steps for k in ("started_at", "ended_at") if s.get(k)]
        ep = episode(
            source_episode_id=run, task_id=task, instance_id=example, task_text=facts.get("osworld_instruction") or said,
            harness_name="osworld", policy_name=model, started_at=min(times) if times else None,
            ended_at=max(times) if times else None, exit_status=exit_status, termination_reason=termination,
            resolved=None if score is None else score >= 1.0, reward=score,
            verifier_name="osworld-evaluator" if score is not None else None,
            metadata={"agent_answer": answer if answer in ("DONE", "FAIL") else None, "actions": len(acted),
                      "turns": len({x.get("step_num") for x in acted}) or None, "step_rewards": sum(rewards) if rewards else None,
                      "bad_lines": len(obj.get("bad_lines") or []) or None, **counts},
        )
        return [ParsedEpisode(ep, steps)]


class _FolderFile(Adapter):
    """A text file the OSWorld runner writes beside ``traj.jsonl``: one fact for that folder."""

    framing = "document"
    companion = True
    file_name: str
    fact: str

    def parse(self, obj: Any, ctx: RecordContext) -> list[ParsedEpisode]:
        return []

    def decode(self, data: bytes) -> Any:
        return data.decode("utf-8")

    def facts(self, obj: Any, ctx: RecordContext) -> list[tuple[str, str, dict[str, Any]]]:
        return [("dir", str(PurePath(ctx.file_path).parent), {self.fact: self.value(obj)})]

    def value(self, text: str) -> Any:
        return text.strip()


class OsworldResultAdapter(_FolderFile):
    name = "osworld-result"
    version = "1.0.0"
    description = "result.txt beside an OSWorld traj.jsonl (the evaluator's score)"
    file_name, fact = "result.txt", "osworld_result"

    def sniff(self, path: str, head: bytes) -> bool:
        return PurePath(path).name == self.file_name and bool(_SCORE.fullmatch(head))

    def check_record(self, obj: Any) -> str | None:
        return None if _SCORE.fullmatch(obj.encode()) else "expected one number (the evaluator's score)"

    def value(self, text: str) -> Any:
        return float(text)


class OsworldInstructionAdapter(_FolderFile):
    name = "osworld-instruction"
    version = "1.0.0"
    description = "instruction.txt beside an OSWorld traj.jsonl (the task)"
    file_name, fact = "instruction.txt", "osworld_instruction"

    def sniff(self, path: str, head: bytes) -> bool:
        return PurePath(path).name == self.file_name and bool(head.strip()) and b"\x00" not in head

    def check_record(self, obj: Any) -> str | None:
        return None if obj.strip() else "an empty instruction"


class OsworldRuntimeLogAdapter(KeptTextFile):
    """``runtime.log``, the runner's log of one task beside ``traj.jsonl``: kept, read by no one."""

    name = "osworld-runtime-log"
    description = "runtime.log beside an OSWorld traj.jsonl (the runner's log; kept, not read)"

    def sniff(self, path: str, head: bytes) -> bool:
        return PurePath(path).name == "runtime.log" and b"\x00" not in head
