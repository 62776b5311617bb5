"""Training fragments: which step spans of which episodes to train on, and why.

Rules (versioned: changing them changes ``RULES_VERSION`` and so every fragment id):

- ``full_episode``: every resolved episode that is not quarantined, the whole span. Evidence:
  hidden tests when the verifier reported per-test results, else the verifier's flag.
- ``productive``: in an unresolved episode with per-test results, a span whose test run improves
  the per-test vector over the run before it (a gain needs a run before it: at the first run,
  failing tests are the task's and passing ones are not credited). Vectors are kept, not counts: *key* tests are those failing at the first
  test run; a segment is productive when it makes at least one key test pass and its gain
  ``fixed_key - broken_key - 0.5 * broken_other`` is positive, so breaking one fragile test while
  fixing three key ones still counts. The span starts at the test observation the model acted on
  (the minimal context that makes its first action judgeable) and ends at the test run that
  proves the gain.
- ``recovery``: a test run that breaks tests which passed before (a wrong edit and its evidence),
  followed later by a run where those tests pass again without new breakage (diagnosis, revert or
  fix, re-verification). Kept even when the episode finally failed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from schemas import ids

RULES_VERSION = "1.1.0"  # 1.1: failing tests of the first run are the task's; later breakage is a regression
POLICY_CAUSES = frozenset({"tests_failed", "model_gave_up", "budget_exhausted"})


@dataclass(frozen=True)
class Fragment:
    trajectory_key: str
    kind: str
    context_start: int
    start: int
    end: int
    reward: float
    evidence_source: str  # hidden_tests | verifier | value_model | heuristic | human
    confidence: float
    reason: str
    tests_before: tuple[str, ...] = ()
    tests_after: tuple[str, ...] = ()

    @property
    def fragment_id(self) -> str:
        return ids.digest([self.trajectory_key, self.kind, self.start, self.end, RULES_VERSION])


def _vector(step: dict[str, Any]) -> dict[str, bool]:
    return {t["name"]: t["status"] == "passed" for t in step.get("test_results") or []}


def _previous_model_step(steps: list[dict[str, Any]], after: int) -> int:
    for s in steps:
        if s["step_index"] > after and s.get("author") == "model":
            return s["step_index"]
    return after + 1


def select_fragments(episode: dict[str, Any], steps: list[dict[str, Any]], cause: str, quarantined: bool) -> list[Fragment]:
    key = episode["trajectory_key"]
    if not steps:
        return []
    last = steps[-1]["step_index"]
    out: list[Fragment] = []
    if cause == "resolved" and not quarantined:
        hidden = bool(episode.get("test_results"))
        out.append(Fragment(key, "full_episode", 0, 0, last, 1.0, "hidden_tests" if hidden else "verifier",
                            1.0 if hidden else 0.9, "resolved episode"))
        return out
    runs = [s for s in steps if s.get("author") == "environment" and s.get("test_results")]
    if not runs or quarantined:
        return out
    vectors = [_vector(r) for r in runs]
    verdict_failing = {t["name"] for t in episode.get("test_results") or [] if t["status"] != "passed"}
    # a regression: a test failing in a run that passed in the run before. At the first run there is
    # no before, and a failing test there is taken as one of the task's failing tests
    regressions = [set()] + [{t for t, ok in v.items() if not ok and vectors[i - 1].get(t, False)}
                             for i, v in enumerate(vectors) if i]
    only_regressed = set().union(*regressions) - {t for i, v in enumerate(vectors) for t, ok in v.items()
                                                  if not ok and t not in regressions[i]}
    # key tests: those that fail somewhere for another reason than a regression (the task's failing tests)
    key_tests = ({t for v in vectors for t, ok in v.items() if not ok} | verdict_failing) - only_regressed
    prev_vec = vectors[0]
    prev_index = runs[0]["step_index"]
    for run, after in zip(runs[1:], vectors[1:], strict=True):
        before = prev_vec
        fixed_key = {t for t in key_tests if not before.get(t, False) and after.get(t, False)}
        broken_key = {t for t in key_tests if before.get(t, False) and not after.get(t, False)}
        broken_other = {t for t in after if t not in key_tests and before.get(t, True) and not after[t]}
        gain = len(fixed_key) - len(broken_key) - 0.5 * len(broken_other)
        if fixed_key and gain > 0:
            context = prev_index
            out.append(Fragment(
                key, "productive", context, _previous_model_step(steps, context), run["step_index"],
                round(gain / max(1, len(key_tests)), 4), "hidden_tests", 0.8,
                f"fixed {len(fixed_key)} key test(s), broke {len(broken_key)} key and {len(broken_other)} other",
                tuple(sorted(t for t, ok in before.items() if ok)), tuple(sorted(t for t, ok in after.items() if ok))))
        prev_vec, prev_index = after, run["step_index"]
    # recovery: a run with regressions, then a later run where they pass again with no new breakage
    for i, broken in enumerate(regressions):
        if not broken:
            continue
        passing_before = {t for t, ok in vectors[i - 1].items() if ok}
        for j in range(i + 1, len(runs)):
            v = vectors[j]
            if all(v.get(t, False) for t in broken) and all(v.get(t, True) for t in passing_before):
                context = runs[i - 1]["step_index"]
                out.append(Fragment(key, "recovery", context, _previous_model_step(steps, context), runs[j]["step_index"],
                                    0.5, "hidden_tests", 0.7,
                                    f"{len(broken)} test(s) broken at step {runs[i]['step_index']}, restored at step "
                                    f"{runs[j]['step_index']}", tuple(sorted(broken)),
                                    tuple(sorted(t for t, ok in v.items() if ok))))
                break
    return out
