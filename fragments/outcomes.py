"""The unresolved-failure taxonomy: exactly one outcome per episode, with its evidence.

Outcomes: ``resolved``, or unresolved with a cause: ``model_gave_up``, ``budget_exhausted``,
``tests_failed``, ``harness_crash``, ``environment_failure``, ``resource_exhausted``,
``verifier_unavailable``, ``unknown``. Only ``model_gave_up``, ``budget_exhausted`` and
``tests_failed`` (with a healthy environment) are policy failures; the other causes are
data-quality problems and the episode is quarantined from training rather than given reward 0.
``unknown`` is never counted as a failed attempt anywhere (task statistics, the policy x harness
matrix, harness comparisons, the effective rate).

Rules, first match wins (the reported fields differ by harness; each rule names the field):

1. ``resolved`` flag true -> resolved (evidence: outcome.resolved).
2. resource: the sandbox was killed or lost for a resource (OOMKilled / out of memory, disk
   full, preempted / evicted / spot interruption, quota, ``resource_exhausted``) in the exit
   status / termination reason -> resource_exhausted; the evidence names the resource.
3. verifier: the status names the verifier, evaluation or grading with a timeout or error (the
   agent submitted, the grader did not answer) -> verifier_unavailable.
4. environment status: the status names the environment, sandbox, container, docker or runtime
   (a sandbox that did not start in time included) -> environment_failure.
5. environment text: an environment observation reports an infrastructure error (container not
   running, no space left on device, package index unreachable) *in a command that failed*, and
   only when the source's verifier reported no test verdict: the verdict of the verifier wins
   over text heuristics (a failing test that prints "Read timed out" is a failed test; a pip
   retry warning in a command that exited 0 is noise) -> environment_failure.
6. harness crash: the status names a harness exception or a format / parse error (SWE-agent
   ``exit_format``, mini-swe-agent ``FormatError``, OpenHands ``RuntimeError`` other than the
   iteration limit), or the last step is a harness-authored traceback -> harness_crash.
7. budget: the agent's own step / turn / iteration / cost / token / context / time limit
   (SWE-agent ``exit_cost`` and ``exit_context``, mini-swe-agent ``LimitsExceeded``, OpenHands
   "maximum iteration") -> budget_exhausted.
8. gave up: ``gave_up`` / ``exit_forfeit`` / ``agent_stopped`` or a final model message that says
   it stops without submitting -> model_gave_up.
9. verifier: no verdict for a submitted episode, or verifier status unavailable / error /
   timeout -> verifier_unavailable.
10. ``resolved`` false with a verdict -> tests_failed.
11. otherwise unknown (e.g. chat sessions without any outcome).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

OUTCOME_RULES_VERSION = "2.0.0"  # 2.0: resource and verifier causes first; verdicts beat text heuristics
POLICY_FAILURES = frozenset({"model_gave_up", "budget_exhausted", "tests_failed"})
INFRASTRUCTURE = frozenset({"harness_crash", "environment_failure", "resource_exhausted", "verifier_unavailable"})
#: causes that say nothing about a harness either (its own crash does: it is what is compared)
NOT_THE_HARNESS = frozenset({"environment_failure", "resource_exhausted", "verifier_unavailable", "unknown"})

_RESOURCES = [
    ("memory", re.compile(r"oom.?killed|out of memory|\boom\b|memoryerror|exit code 137|memory limit", re.I)),
    ("disk", re.compile(r"no space left|disk (?:full|quota)|ephemeral.?storage", re.I)),
    ("preemption", re.compile(r"preempt|evicted|spot.?(?:instance.?)?interrupt|node (?:lost|shutdown)", re.I)),
    ("quota", re.compile(r"resource.?exhausted|quota|rate.?limit(?:ed)?\b.*(?:api|provider)", re.I)),
]
_VERIFIER_STATUS = re.compile(r"(?:verif|eval(?:uation)?|grad(?:er|ing)|test.?harness).{0,40}?(?:timeout|timed.?out|error|"
                              r"fail|unavailable|crash)", re.I)
_ENV_STATUS = re.compile(r"environment|docker|container|sandbox|runtime.?(?:error|died|failure)|infra|"
                         r"image.?(?:build|pull)|rebuild", re.I)
_ENV_STRONG = re.compile(r"environment|docker|container|sandbox|image.?(?:build|pull)|rebuild", re.I)
_ENV_OBS = re.compile(r"docker: Error response from daemon|container [0-9a-f]+ is not running|No space left on device|"
                      r"Could not install packages due to an OSError|Temporary failure in name resolution|"
                      r"Connection refused.*(?:registry|pypi|index)|OCI runtime|Read timed out", re.I)
_BUDGET = re.compile(r"exit_cost|exit_context|cost.?limit|max.?(?:steps|iterations?|tokens|turns)|limits?exceeded|"
                     r"maximum iteration|context.?(?:window|length)|time.?limit|timeout|budget|token.?limit", re.I)
_CRASH = re.compile(r"exit_format|formaterror|harness_exception|exception|traceback|runtimeerror|exit_error|"
                    r"parse error|^error$", re.I)
_GAVE_UP = re.compile(r"gave.?up|exit_forfeit|forfeit|agent_stopped|give up", re.I)
_GIVE_UP_TEXT = re.compile(r"\b(?:giving up|i(?:'m| am) unable to|i cannot (?:fix|resolve|solve)|i could not find a fix|"
                           r"ending the session|stopping here)\b", re.I)


@dataclass(frozen=True)
class Outcome:
    outcome: str  # resolved | unresolved
    cause: str  # resolved, model_gave_up, ..., unknown
    evidence_field: str
    evidence_step: int | None
    evidence: str
    policy_failure: bool
    quarantined: bool  # an infrastructure or unknown failure: kept out of training


def _make(cause: str, field: str, step: int | None, evidence: str) -> Outcome:
    return Outcome("resolved" if cause == "resolved" else "unresolved", cause, field, step, evidence[:300],
                   cause in POLICY_FAILURES, cause in INFRASTRUCTURE or cause == "unknown")


def has_verdict(episode: dict[str, Any]) -> bool:
    """The source's verifier reported a test verdict (not only a flag we cannot trust)."""
    return episode.get("resolved") is not None and (
        (episode.get("verifier_status") or "").lower() == "ok" or bool(episode.get("test_results")))


def _resource(status: str) -> str | None:
    return next((name for name, rule in _RESOURCES if rule.search(status)), None)


def _env_observation(steps: list[dict[str, Any]]) -> tuple[dict[str, Any], str] | None:
    for s in reversed(steps):
        if s.get("author") != "environment" or not s.get("observation") or s.get("exit_code") == 0:
            continue
        m = _ENV_OBS.search(s["observation"])
        if m:
            return s, m.group(0)
    return None


def classify_outcome(episode: dict[str, Any], steps: list[dict[str, Any]]) -> Outcome:
    """One outcome for one episode (``steps`` in order, redacted rows are fine)."""
    status = " ".join(str(episode.get(k) or "") for k in ("exit_status", "termination_reason")).strip()
    verifier = (episode.get("verifier_status") or "").lower()
    if episode.get("resolved") is True:
        return _make("resolved", "outcome.resolved", None, "resolved = true")
    resource = _resource(status)
    if resource:
        return _make("resource_exhausted", "exit_status/termination_reason", None, f"resource={resource}: {status}")
    if status and _VERIFIER_STATUS.search(status):
        return _make("verifier_unavailable", "exit_status/termination_reason", None, status)
    if status and _ENV_STATUS.search(status) and (_ENV_STRONG.search(status) or not _BUDGET.search(status)):
        return _make("environment_failure", "exit_status/termination_reason", None, status)
    found = None if has_verdict(episode) else _env_observation(steps)
    if found:
        return _make("environment_failure", "observation", found[0]["step_index"], found[1])
    if status and _CRASH.search(status) and not _BUDGET.search(status):
        return _make("harness_crash", "exit_status/termination_reason", None, status)
    last = steps[-1] if steps else None
    if last and last.get("author") == "harness" and "Traceback (most recent call last)" in (last.get("text") or ""):
        return _make("harness_crash", "last step", last["step_index"], (last.get("text") or "").strip().splitlines()[-1])
    if status and _BUDGET.search(status):
        return _make("budget_exhausted", "exit_status/termination_reason", None, status)
    if status and _GAVE_UP.search(status):
        return _make("model_gave_up", "exit_status/termination_reason", None, status)
    last_model = next((s for s in reversed(steps) if s.get("author") == "model"), None)
    submitted = any(s.get("action_kind") == "submit" for s in steps) or "submit" in status.lower()
    if last_model is not None and not submitted and _GIVE_UP_TEXT.search(last_model.get("text") or ""):
        return _make("model_gave_up", "last model message", last_model["step_index"],
                     _GIVE_UP_TEXT.search(last_model["text"]).group(0))
    if verifier in ("unavailable", "error", "timeout") or (episode.get("resolved") is None and submitted):
        return _make("verifier_unavailable", "outcome.verifier_status" if verifier else "outcome.resolved",
                     None, f"verifier_status = {verifier or 'missing'}, resolved = {episode.get('resolved')}")
    if episode.get("resolved") is False:
        return _make("tests_failed", "outcome.resolved", None, "resolved = false with a verdict")
    return _make("unknown", "", None, "no outcome reported")
