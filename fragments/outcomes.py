"""The unresolved-failure taxonomy: exactly one outcome per episode, with its evidence.

Outcomes: ``resolved``, or unresolved with a cause: ``model_gave_up``, ``budget_exhausted``,
``tests_failed``, ``harness_crash``, ``environment_failure``, ``verifier_unavailable``,
``unknown``. Only ``model_gave_up``, ``budget_exhausted`` and ``tests_failed`` (with a healthy
environment) are policy failures; the other causes are data-quality problems and the episode is
quarantined from training rather than given reward 0.

Rules, first match wins (the reported fields differ by harness; each rule names the field):

1. ``resolved`` flag true -> resolved (evidence: outcome.resolved).
2. environment failure: exit status / termination reason says so (``environment_error``,
   ``docker``, ...) or an environment observation reports an infrastructure error (container
   not running, no space left on device, package index unreachable) -> environment_failure.
3. harness crash: termination reason / exit status names a harness exception or a format /
   parse error (SWE-agent ``exit_format``, mini-swe-agent ``FormatError``, OpenHands
   ``RuntimeError`` other than the iteration limit), or the last step is a harness-authored
   traceback -> harness_crash.
4. budget: iteration / step / cost / token / context / time limits (SWE-agent ``exit_cost`` and
   ``exit_context``, mini-swe-agent ``LimitsExceeded``, OpenHands "maximum iteration") ->
   budget_exhausted.
5. gave up: ``gave_up`` / ``exit_forfeit`` / ``agent_stopped`` or a final model message that says
   it stops without submitting -> model_gave_up.
6. verifier: no verdict for a submitted episode, or verifier status unavailable / error ->
   verifier_unavailable.
7. ``resolved`` false with a verdict -> tests_failed.
8. otherwise unknown (e.g. chat sessions without any outcome).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

OUTCOME_RULES_VERSION = "1.0.0"
POLICY_FAILURES = frozenset({"model_gave_up", "budget_exhausted", "tests_failed"})
INFRASTRUCTURE = frozenset({"harness_crash", "environment_failure", "verifier_unavailable"})

_ENV_STATUS = re.compile(r"environment|docker|container|sandbox|runtime.?(?:error|died|failure)|infra", re.I)
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


def classify_outcome(episode: dict[str, Any], steps: list[dict[str, Any]]) -> Outcome:
    """One outcome for one episode (``steps`` in order, redacted rows are fine)."""
    status = " ".join(str(episode.get(k) or "") for k in ("exit_status", "termination_reason")).strip()
    if episode.get("resolved") is True:
        return _make("resolved", "outcome.resolved", None, "resolved = true")
    if status and _ENV_STATUS.search(status) and not _BUDGET.search(status):
        return _make("environment_failure", "exit_status/termination_reason", None, status)
    for s in reversed(steps):
        if s.get("author") == "environment" and s.get("observation") and _ENV_OBS.search(s["observation"]):
            return _make("environment_failure", "observation", s["step_index"], _ENV_OBS.search(s["observation"]).group(0))
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
    verifier = (episode.get("verifier_status") or "").lower()
    if verifier in ("unavailable", "error") or (episode.get("resolved") is None and submitted):
        return _make("verifier_unavailable", "outcome.verifier_status" if verifier else "outcome.resolved",
                     None, f"verifier_status = {verifier or 'missing'}, resolved = {episode.get('resolved')}")
    if episode.get("resolved") is False:
        return _make("tests_failed", "outcome.resolved", None, "resolved = false with a verdict")
    return _make("unknown", "", None, "no outcome reported")
