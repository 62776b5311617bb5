"""Per-test results read from test-runner output in environment observations.

Harnesses rarely report per-test verdicts for the agent's own test runs; the runners print them.
Read at normalize time into the step's ``test_results`` (when the source gave none), with the
runner named in the step metadata (``tests_parsed_from``) and the run's summary counts
(``tests_summary``: passed / failed / errors / complete), so credit assignment can see which
tests a run fixed. Formats, each from the runner's own output conventions:

- pytest: ``-v`` lines (``path::test PASSED``), the short summary / ``-rA`` lines
  (``FAILED path::test - msg``), and the final ``N passed, M failed`` line. Without ``-v`` only
  failures are named; the summary says whether the run had none (``complete`` is then false).
- unittest and Django's runner (verbose): ``test_x (module.Class) ... ok|FAIL|ERROR|skipped``,
  a docstring line allowed between, and ``Ran N tests`` / ``FAILED (failures=1)``.
- sympy's ``bin/test``: ``== tests finished: N passed, M failed, K exceptions, in Xs ==`` and a
  ``___ path.py:test_name ___`` header per failure or exception.
- go test -v: ``--- PASS|FAIL|SKIP: TestName``.
- cargo test: ``test path::name ... ok|FAILED|ignored``.
- jest / vitest: ``✓ name`` / ``✕ name`` (and the Windows ``√`` / ``×``), only in output that
  has the runner's own file lines (``PASS src/x.test.js``) and its ``Tests:`` summary: a script
  that prints check marks is not a test run.
"""

from __future__ import annotations

import re
from typing import Any

_STATUS = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped", "XFAIL": "xfail",
           "XPASS": "xpass", "ok": "passed", "FAIL": "failed", "skipped": "skipped", "expected failure": "xfail",
           "unexpected success": "xpass", "PASS": "passed", "SKIP": "skipped", "ignored": "skipped",
           "✓": "passed", "✔": "passed", "√": "passed", "✕": "failed", "✖": "failed", "×": "failed"}

_PYTEST_V = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", re.M)
_PYTEST_SHORT = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS) (\S+::\S+)", re.M)
_PYTEST_SUMMARY = re.compile(r"^(?:=+ )?(\d+ (?:passed|failed|error|errors|skipped|xfailed|deselected)\b.*?) in "
                             r"[\d.]+s(?: \([\d:]+\))?(?: =+)?\s*$", re.M)  # -q prints it without the rule
_UNITTEST = re.compile(r"^(\w+) \(([\w.]+)\)(?:\n[^\n]*?)? \.\.\. (ok|FAIL|ERROR|skipped|expected failure|"
                       r"unexpected success)", re.M)
_UNITTEST_RAN = re.compile(r"^Ran (\d+) tests? in [\d.]+s\s*\n+\s*(OK|FAILED)(?: \(([^)]*)\))?", re.M)
_SYMPY_SUMMARY = re.compile(r"^=+ tests finished: (.*?), in [\d.]+ seconds =+\s*$", re.M)
_SYMPY_FAILURE = re.compile(r"^_{3,} (\S+\.py:test\w*) _{3,}\s*$", re.M)
_GO = re.compile(r"^\s*--- (PASS|FAIL|SKIP): (\S+)", re.M)
_CARGO = re.compile(r"^test (\S+) \.\.\. (ok|FAILED|ignored)\s*$", re.M)
_JEST = re.compile(r"^\s+([✓✔√✕✖×]) (.+?)(?: \(\d+(?:\.\d+)? ?m?s\))?\s*$", re.M)
_JEST_FILE = re.compile(r"^\s*(?:PASS|FAIL) +\S+\.(?:test|spec)\.[jt]sx?\b|^\s*Test Files\s+\d", re.M)
_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)")

MAX_SCAN = 4_000_000  # characters of one observation scanned (the 868 KB real observation fits)


def _pytest(text: str) -> tuple[dict[str, str], dict[str, Any] | None]:
    results = {name: _STATUS[s] for name, s in _PYTEST_V.findall(text)}
    for s, name in _PYTEST_SHORT.findall(text):
        results.setdefault(name, _STATUS[s])
    summaries = _PYTEST_SUMMARY.findall(text)
    if not summaries:
        return results, None
    counts: dict[str, int] = {}
    for n, kind in _COUNT.findall(summaries[-1]):
        counts[kind.rstrip("s") if kind.startswith("error") else kind] = int(n)
    total = sum(counts.get(k, 0) for k in ("passed", "failed", "error", "skipped", "xfailed", "xpassed"))
    return results, {"passed": counts.get("passed", 0), "failed": counts.get("failed", 0),
                     "errors": counts.get("error", 0), "complete": bool(total) and len(results) >= total}


def _unittest(text: str) -> tuple[dict[str, str], dict[str, Any] | None]:
    results = {f"{cls}.{name}" if not cls.endswith(f".{name}") else cls: _STATUS[s]
               for name, cls, s in _UNITTEST.findall(text)}
    ran = _UNITTEST_RAN.findall(text)
    if not ran:
        return results, None
    n, verdict, detail = ran[-1]
    bad = {k: int(v) for k, v in re.findall(r"(?<!expected )(failures|errors)=(\d+)", detail or "")}
    other = sum(int(v) for v in re.findall(r"(?:skipped|expected failures)=(\d+)", detail or ""))
    return results, {"passed": max(0, int(n) - sum(bad.values()) - other), "failed": bad.get("failures", 0),
                     "errors": bad.get("errors", 0), "complete": len(results) >= int(n) and verdict in ("OK", "FAILED")}


def _sympy(text: str) -> tuple[dict[str, str], dict[str, Any] | None]:
    summaries = _SYMPY_SUMMARY.findall(text)
    if not summaries:
        return {}, None
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|exceptions?|skipped)", summaries[-1])}
    results = {name: "failed" for name in _SYMPY_FAILURE.findall(text)}
    errors = counts.get("exceptions", counts.get("exception", 0))
    return results, {"passed": counts.get("passed", 0), "failed": counts.get("failed", 0), "errors": errors,
                     "complete": False}


def _simple(pattern: re.Pattern[str], text: str, name_first: bool) -> dict[str, str]:
    pairs = pattern.findall(text)
    return {(a if name_first else b).strip(): _STATUS[b if name_first else a] for a, b in pairs}


def parse_test_output(text: str | None) -> tuple[str, list[dict[str, str]], dict[str, Any]] | None:
    """``(runner, [{name, status}], summary)`` for the first runner whose output this is, or None."""
    if not text or len(text) < 8:
        return None
    text = text[:MAX_SCAN]
    if "tests finished:" in text:
        results, summary = _sympy(text)
        if summary:
            return "sympy", [{"name": k, "status": v} for k, v in results.items()], summary
    if "::" in text or " passed" in text or " failed" in text:
        results, summary = _pytest(text)
        if results or summary:
            return "pytest", [{"name": k, "status": v} for k, v in results.items()], summary or _counts(results)
    if " ... " in text or "Ran " in text:
        results, summary = _unittest(text)
        if results or summary:
            return "unittest", [{"name": k, "status": v} for k, v in results.items()], summary or _counts(results)
    for runner, pattern, name_first, marker in (("go", _GO, False, "--- "), ("cargo", _CARGO, True, "test "),
                                                 ("jest", _JEST, False, "Tests:")):
        if marker in text and (runner != "jest" or _JEST_FILE.search(text)):
            results = _simple(pattern, text, name_first)
            if results:
                return runner, [{"name": k, "status": v} for k, v in results.items()], _counts(results)
    return None


def _counts(results: dict[str, str]) -> dict[str, Any]:
    statuses = list(results.values())
    return {"passed": statuses.count("passed"), "failed": statuses.count("failed"),
            "errors": statuses.count("error"), "complete": True}
