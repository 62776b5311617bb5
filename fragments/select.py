"""Training fragments: which step spans of which episodes to train on, why, and on what evidence.

Rules (versioned: changing them changes ``RULES_VERSION`` and so every fragment id):

- ``full_episode``: every resolved episode that is not quarantined, the whole span.
- ``productive``: in an unresolved episode, a span whose test run improves the per-test vector
  over the run before it (a gain needs a run before it: at the first run, failing tests are the
  task's and passing ones are not credited). Vectors are kept, not counts: *key* tests are those
  failing at the first test run; a segment is productive when it makes at least one key test pass
  and its gain ``fixed_key - broken_key - 0.5 * broken_other`` is positive, so breaking one
  fragile test while fixing three key ones still counts. The trained span runs from the model's
  first action after the run before to the run that proves the gain.
- ``recovery``: the loop mistake -> anomaly -> diagnosis -> recovery -> re-verification. The
  *mistake* is the edit between a run and the next one that breaks tests which passed (the
  *anomaly*: that failing run); a later run where those tests pass again with nothing newly
  broken is the *re-verification*. The trained span covers diagnosis (the reads, searches and
  reasoning after the anomaly), the recovery (the last edits before the re-verification) and the
  re-verification; the mistake and the anomaly are context, input only, so the model is never
  taught the mistake. The step indexes of each phase are recorded.
- controls (``SelectConfig.controls``): for each productive or recovery fragment, a span of the
  same length right before it (``control_adjacent``) and one at a seeded random place of the
  episode (``control_random``), never trained (``trainable`` false), so a team can check that
  selection beats chance at equal token count.

Evidence, reward and confidence (one scale per column):

- ``evidence_source``: ``verifier`` (hidden tests or the benchmark's grader, run after the
  episode), ``agent_visible_tests`` (the agent's own test runs, which it could game), ``llm_judge``
  (a model judged the result, e.g. the OpenHands resolver's success), ``agent_self_report`` (only
  the harness or agent says so).
- ``verdict_reward``: the episode's verdict (1.0 resolved, 0.0 not, None without one);
  ``progress_score``: the share of key tests the span fixed (productive) or restored (recovery).
- ``confidence = base(source) x coverage x consistency``: base is 0.95 verifier, 0.75 agent-visible
  tests, 0.6 LLM judge, 0.3 self-report; coverage = 1 - 0.5 ** n for n supporting tests (per-test
  verdicts, the fixed or restored tests; 0.8 when a verdict names no test); consistency = the
  share of later test runs in the episode that keep the span's tests passing (1 when none follow).
  A judge or a self-report can never reach a verifier's confidence, whatever its verdict says.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from trajwh.schemas import ids

RULES_VERSION = "2.0.0"  # 2.0: recovery spans start after the anomaly; evidence, rewards, context, controls
BASE_CONFIDENCE = {"verifier": 0.95, "agent_visible_tests": 0.75, "llm_judge": 0.6, "agent_self_report": 0.3}


@dataclass(frozen=True)
class SelectConfig:
    controls: bool = False  # also emit control_random / control_adjacent fragments (never trained)
    context_budget_chars: int = 48_000  # masked context per fragment (~12k tokens), task statement first
    leak_fragments: bool = False  # leak-flagged episodes give training fragments


@dataclass
class Fragment:
    trajectory_key: str
    kind: str
    context_start: int
    start: int
    end: int
    evidence_source: str
    confidence: float
    reason: str
    verdict_reward: float | None = None
    progress_score: float | None = None
    tests_before: tuple[str, ...] = ()
    tests_after: tuple[str, ...] = ()
    phases: dict[str, list[int]] = field(default_factory=dict)
    trainable: bool = True

    @property
    def fragment_id(self) -> str:
        return ids.digest([self.trajectory_key, self.kind, self.start, self.end, RULES_VERSION])


def confidence(source: str, supporting: int | None, consistency: float = 1.0) -> float:
    coverage = 0.8 if supporting is None else 1 - 0.5 ** max(0, supporting)
    return round(BASE_CONFIDENCE[source] * coverage * consistency, 4)


def episode_evidence(episode: dict[str, Any]) -> tuple[str, int | None]:
    """Where the episode's verdict comes from, and how many tests back it (None: not named)."""
    verifier = (episode.get("verifier_name") or "").lower()
    tests = episode.get("test_results") or []
    if "judge" in verifier or "llm" in verifier:
        return "llm_judge", None
    if tests or (episode.get("verifier_status") or "").lower() == "ok" or verifier:
        return "verifier", len(tests) or None
    return "agent_self_report", None


def verdict_reward(episode: dict[str, Any]) -> float | None:
    resolved = episode.get("resolved")
    return None if resolved is None else float(resolved)


@dataclass
class _Run:
    index: int
    vector: dict[str, bool]
    all_pass: bool  # the runner reported no failure (tests it did not name passed)

    def passes(self, test: str) -> bool:
        return self.vector.get(test, self.all_pass)


def _runs(steps: list[dict[str, Any]]) -> list[_Run]:
    out = []
    for s in steps:
        if s.get("author") != "environment":
            continue
        summary = s.get("tests_summary") or {}
        if not s.get("test_results") and not summary:
            continue
        vector = {t["name"]: t["status"] in ("passed", "xfail") for t in s.get("test_results") or []}
        all_pass = bool(summary) and not summary.get("failed") and not summary.get("errors") and all(vector.values())
        out.append(_Run(s["step_index"], vector, all_pass))
    return out


def _model_steps(steps: list[dict[str, Any]], lo: int, hi: int) -> list[dict[str, Any]]:
    return [s for s in steps if lo <= s["step_index"] <= hi and s.get("author") == "model"]


def _consistency(runs: list[_Run], after: int, tests: set[str]) -> float:
    later = [r for r in runs if r.index > after]
    if not later or not tests:
        return 1.0
    return sum(all(r.passes(t) for t in tests) for r in later) / len(later)


def select_fragments(episode: dict[str, Any], steps: list[dict[str, Any]], cause: str, quarantined: bool,
                     cfg: SelectConfig = SelectConfig()) -> list[Fragment]:
    key = episode["trajectory_key"]
    if not steps or quarantined:
        return []
    last = steps[-1]["step_index"]
    verdict = verdict_reward(episode)
    if cause == "resolved":
        source, n = episode_evidence(episode)
        return [Fragment(key, "full_episode", 0, 0, last, source, confidence(source, n), "resolved episode",
                         verdict_reward=verdict)]
    runs = _runs(steps)
    if not runs:
        return []
    out = _productive(key, steps, runs, episode, verdict) + _recovery(key, steps, runs, verdict)
    if cfg.controls:
        out += [c for f in list(out) for c in controls(f, steps)]
    return out


def _key_tests(runs: list[_Run], episode: dict[str, Any]) -> set[str]:
    verdict_failing = {t["name"] for t in episode.get("test_results") or [] if t["status"] != "passed"}
    # a regression: a test failing in a run that passed in the run before; at the first run there is
    # no before, and a failing test there is taken as one of the task's failing tests
    regressions = [set()] + [{t for t, ok in r.vector.items() if not ok and runs[i - 1].passes(t)}
                             for i, r in enumerate(runs) if i]
    only_regressed = set().union(*regressions) - {t for i, r in enumerate(runs) for t, ok in r.vector.items()
                                                  if not ok and t not in regressions[i]}
    return ({t for r in runs for t, ok in r.vector.items() if not ok} | verdict_failing) - only_regressed


def _productive(key: str, steps: list[dict[str, Any]], runs: list[_Run], episode: dict[str, Any],
                verdict: float | None) -> list[Fragment]:
    key_tests = _key_tests(runs, episode)
    out = []
    for before, after in zip(runs, runs[1:], strict=False):
        fixed = {t for t in key_tests if not before.passes(t) and after.passes(t)}
        broken_key = {t for t in key_tests if before.passes(t) and not after.passes(t)}
        broken_other = {t for t in after.vector if t not in key_tests and before.passes(t) and not after.vector[t]}
        gain = len(fixed) - len(broken_key) - 0.5 * len(broken_other)
        acted = _model_steps(steps, before.index + 1, after.index)
        if not fixed or gain <= 0 or not acted:
            continue
        out.append(Fragment(
            key, "productive", before.index, acted[0]["step_index"], after.index, "agent_visible_tests",
            confidence("agent_visible_tests", len(fixed), _consistency(runs, after.index, fixed)),
            f"fixed {len(fixed)} key test(s), broke {len(broken_key)} key and {len(broken_other)} other",
            verdict_reward=verdict, progress_score=round(gain / max(1, len(key_tests)), 4),
            tests_before=tuple(sorted(t for t, ok in before.vector.items() if ok)),
            tests_after=tuple(sorted(t for t, ok in after.vector.items() if ok)),
            phases={"action": [s["step_index"] for s in acted if s["step_index"] < after.index],
                    "verification": [after.index]}))
    return out


def _recovery(key: str, steps: list[dict[str, Any]], runs: list[_Run], verdict: float | None) -> list[Fragment]:
    out = []
    for i in range(1, len(runs)):
        before, anomaly = runs[i - 1], runs[i]
        broken = {t for t, ok in anomaly.vector.items() if not ok and before.passes(t)}
        if not broken:
            continue
        passing_before = {t for t, ok in before.vector.items() if ok}
        for again in runs[i + 1:]:
            if not (all(again.passes(t) for t in broken) and all(again.passes(t) for t in passing_before)):
                continue
            phases = _recovery_phases(steps, before.index, anomaly.index, again.index)
            if phases:
                span = [*phases["diagnosis"], *phases["recovery"], *phases["reverification"]]
                out.append(Fragment(
                    key, "recovery", before.index, min(span), again.index, "agent_visible_tests",
                    confidence("agent_visible_tests", len(broken), _consistency(runs, again.index, broken)),
                    f"{len(broken)} test(s) broken at step {anomaly.index}, restored at step {again.index}",
                    verdict_reward=verdict, progress_score=1.0, tests_before=tuple(sorted(broken)),
                    tests_after=tuple(sorted(t for t, ok in again.vector.items() if ok)), phases=phases))
            break
    return out


def _recovery_phases(steps: list[dict[str, Any]], before: int, anomaly: int, again: int) -> dict[str, list[int]] | None:
    """Step indexes of each phase; None when the loop has no diagnosis-to-fix actions to train on."""
    between = [s for s in steps if anomaly < s["step_index"] < again]
    model = [s for s in between if s.get("author") == "model"]
    edits = [s["step_index"] for s in model if s.get("action_kind") == "edit"]
    if not model or not edits:
        return None
    first_fix = edits[-1]
    for s in reversed(model):  # the recovery: the last run of edits before the re-verification
        if s["step_index"] < first_fix and s.get("action_kind") == "edit":
            first_fix = s["step_index"]
        elif s["step_index"] < first_fix:
            break
    runner = [s["step_index"] for s in model if s["step_index"] > edits[-1]]
    reverify_from = runner[0] if runner else again
    # the mistake: what the model did after the run before; its last action (the test command that
    # showed the breakage) and the failing output are the anomaly evidence
    acted = [s["step_index"] for s in steps if before < s["step_index"] < anomaly and s.get("author") == "model"]
    shown_by = acted[-1] if len(acted) > 1 and any(
        s["step_index"] == acted[-1] and s.get("action_kind") in ("test", "run") for s in steps) else anomaly
    return {
        "mistake": [i for i in range(before + 1, shown_by) if any(s["step_index"] == i for s in steps)],
        "anomaly": [i for i in range(shown_by, anomaly + 1) if any(s["step_index"] == i for s in steps)],
        "diagnosis": [s["step_index"] for s in between if s["step_index"] < first_fix],
        "recovery": [s["step_index"] for s in between if first_fix <= s["step_index"] < reverify_from],
        "reverification": [s["step_index"] for s in steps if reverify_from <= s["step_index"] <= again],
    }


def controls(f: Fragment, steps: list[dict[str, Any]]) -> list[Fragment]:
    """Same-length control spans for a productive or recovery fragment (never trained)."""
    if f.kind not in ("productive", "recovery"):
        return []
    first, last = steps[0]["step_index"], steps[-1]["step_index"]
    length = f.end - f.start
    out = []
    if f.start - 1 - length >= first:
        s = f.start - 1 - length
        out.append(Fragment(f.trajectory_key, "control_adjacent", s, s, s + length, f.evidence_source, 0.0,
                            f"control for {f.fragment_id[:16]}: the same length right before it", trainable=False))
    if last - first > length:
        rng = random.Random(f.fragment_id)
        s = rng.randint(first, last - length)
        out.append(Fragment(f.trajectory_key, "control_random", s, s, s + length, f.evidence_source, 0.0,
                            f"control for {f.fragment_id[:16]}: the same length at a random place", trainable=False))
    return out
