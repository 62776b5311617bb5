"""Per-test results from real runner output: hand-made cases in each runner's own format, and
the real corpus (tests that the agents ran become per-test vectors at normalize time)."""

from __future__ import annotations

import pytest
from conftest import SHARED_CORPUS
from hypothesis import given, settings
from hypothesis import strategies as st
from trajwh.ingest.test_output import parse_test_output

PYTEST_V = """============================= test session starts ==============================
collected 4 items

tests/test_io.py::test_read PASSED                                       [ 25%]
tests/test_io.py::test_write FAILED                                      [ 50%]
tests/test_io.py::test_param[a-1] PASSED                                 [ 75%]
tests/test_io.py::test_skip SKIPPED (no network)                         [100%]

=================================== FAILURES ===================================
____________________________________ test_write ________________________________
E   AssertionError: assert 1 == 2
=========================== short test summary info ============================
FAILED tests/test_io.py::test_write - AssertionError: assert 1 == 2
==================== 1 failed, 2 passed, 1 skipped in 0.12s ====================
"""

PYTEST_Q = """..F.                                                                     [100%]
=================================== FAILURES ===================================
=========================== short test summary info ============================
FAILED testing/test_config.py::TestPytestPluginsVariable::test_pyargs[True] - AssertionError
=================== 1 failed, 3 passed, 1 xfailed in 3.79s ===================
"""

DJANGO = """test_merge (forms_tests.tests.test_media.FormsMediaTestCase) ... ok
test_merge_js_three_way (forms_tests.tests.test_media.FormsMediaTestCase)
Ensure the order is right. ... FAIL
test_media_dsl (forms_tests.tests.test_media.FormsMediaTestCase) ... ERROR
test_skip (forms_tests.tests.test_media.FormsMediaTestCase) ... skipped 'no db'

----------------------------------------------------------------------
Ran 4 tests in 0.021s

FAILED (failures=1, errors=1, skipped=1)
"""

GO = """=== RUN   TestParse
--- PASS: TestParse (0.00s)
=== RUN   TestEncode
    encode_test.go:12: got 1 want 2
--- FAIL: TestEncode (0.00s)
FAIL
"""

CARGO = """running 3 tests
test parser::tests::parses_header ... ok
test parser::tests::rejects_empty ... FAILED
test slow::big ... ignored

test result: FAILED. 1 passed; 1 failed; 1 ignored; 0 measured
"""

JEST = """ FAIL  src/sum.test.js
  sum
    ✓ adds 1 + 2 to equal 3 (3 ms)
    ✕ adds negative numbers (2 ms)

Tests:       1 failed, 1 passed, 2 total
"""

DJANGO_QUIET = """Creating test database for alias 'default'...
.....
----------------------------------------------------------------------
Ran 5 tests in 0.003s

OK
"""


def statuses(text):
    runner, results, summary = parse_test_output(text)
    return runner, {r["name"]: r["status"] for r in results}, summary


def test_pytest_verbose_and_short_summary():
    runner, got, summary = statuses(PYTEST_V)
    assert runner == "pytest"
    assert got == {"tests/test_io.py::test_read": "passed", "tests/test_io.py::test_write": "failed",
                   "tests/test_io.py::test_param[a-1]": "passed", "tests/test_io.py::test_skip": "skipped"}
    assert summary == {"passed": 2, "failed": 1, "errors": 0, "complete": True}


def test_pytest_quiet_names_only_failures():
    runner, got, summary = statuses(PYTEST_Q)
    assert got == {"testing/test_config.py::TestPytestPluginsVariable::test_pyargs[True]": "failed"}
    assert summary["passed"] == 3 and summary["failed"] == 1 and summary["complete"] is False


def test_django_and_unittest_verbose():
    runner, got, summary = statuses(DJANGO)
    assert runner == "unittest"
    assert got == {"forms_tests.tests.test_media.FormsMediaTestCase.test_merge": "passed",
                   "forms_tests.tests.test_media.FormsMediaTestCase.test_merge_js_three_way": "failed",
                   "forms_tests.tests.test_media.FormsMediaTestCase.test_media_dsl": "error",
                   "forms_tests.tests.test_media.FormsMediaTestCase.test_skip": "skipped"}
    assert summary == {"passed": 1, "failed": 1, "errors": 1, "complete": True}  # a skip is not a pass


def test_django_quiet_run_is_a_summary_without_names():
    runner, got, summary = statuses(DJANGO_QUIET)
    assert (runner, got) == ("unittest", {}) and summary == {"passed": 5, "failed": 0, "errors": 0, "complete": False}


SYMPY_FAILED = """============================= test process starts ==============================
executable:         /usr/bin/python3  (3.9.19-final-0) [CPython]
sympy/combinatorics/tests/test_perm_groups.py[61] ...............F..............
.f................w............                                             [FAIL]

________________________________________________________________________________
____ sympy/combinatorics/tests/test_perm_groups.py:test_sylow_subgroup _____
Traceback (most recent call last):
  File "/testbed/sympy/combinatorics/perm_groups.py", line 2203, in minimal_blocks
IndexError: list assignment index out of range

== tests finished: 57 passed, 1 failed, 1 skipped, 2 expected to fail, in 1.82 seconds ==
DO *NOT* COMMIT!
"""


def test_sympy_bin_test_and_skips_are_not_passes():
    runner, got, summary = statuses(SYMPY_FAILED)
    assert runner == "sympy" and got == {"sympy/combinatorics/tests/test_perm_groups.py:test_sylow_subgroup": "failed"}
    assert summary == {"passed": 57, "failed": 1, "errors": 0, "complete": False}
    _, _, ok = statuses("Ran 609 tests in 3.566s\n\nOK (skipped=37, expected failures=2)\n")
    assert ok["passed"] == 570 and ok["failed"] == 0


@pytest.mark.parametrize("text, runner, expected", [
    (GO, "go", {"TestParse": "passed", "TestEncode": "failed"}),
    (CARGO, "cargo", {"parser::tests::parses_header": "passed", "parser::tests::rejects_empty": "failed",
                      "slow::big": "skipped"}),
    (JEST, "jest", {"adds 1 + 2 to equal 3": "passed", "adds negative numbers": "failed"}),
])
def test_go_cargo_jest(text, runner, expected):
    got_runner, got, _ = statuses(text)
    assert (got_runner, got) == (runner, expected)


@pytest.mark.parametrize("text", [
    "total 12\ndrwxr-xr-x 2 root root 4096 a.py", "def f(x):\n    return x  # ... ok\n",
    "Successfully installed pytest-8.0.0", "grep: tests: No such file or directory", "",
    "Checking the fix:\n  ✓ separability matrix is diagonal\n  ✓ nested models work\nTests: done",
])
def test_other_output_is_not_a_test_run(text):
    assert parse_test_output(text) is None


@pytest.mark.skipif(not SHARED_CORPUS.is_dir(), reason=f"real corpus not found at {SHARED_CORPUS}")
def test_real_test_runs_become_per_test_results(tmp_path):
    from trajwh.ingest.normalize import normalize_warehouse
    from trajwh.ingest.raw_store import IngestOptions, ingest_paths
    from trajwh.lineage.catalog import Warehouse

    wh = Warehouse(tmp_path / "wh")
    ingest_paths(wh, [SHARED_CORPUS / "mini-swe-agent-2x", SHARED_CORPUS / "mini-swe-agent-traj-json"],
                 IngestOptions(source="corpus"))
    normalize_warehouse(wh, run_id="n")
    rows = wh.query("""SELECT e.instance_id, json_extract_string(s.metadata, '$.tests_parsed_from') AS runner,
                              len(s.test_results) AS n FROM steps s JOIN episodes e USING (trajectory_key)
                       WHERE json_extract_string(s.metadata, '$.tests_parsed_from') IS NOT NULL""").to_pylist()
    by = {}
    for r in rows:
        by.setdefault((r["instance_id"], r["runner"]), []).append(r["n"] or 0)
    assert ("django__django-11019", "unittest") in by and max(by[("django__django-11019", "unittest")]) >= 5
    assert ("pytest-dev__pytest-5840", "pytest") in by


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("abc:/._- \n=.✓✕PASSEDFAILok()0123456789[]->")), max_size=300))
def test_parsers_never_raise_and_return_well_formed_results(text):
    parsed = parse_test_output(text)
    if parsed is not None:
        runner, results, summary = parsed
        assert runner in ("pytest", "unittest", "go", "cargo", "jest")
        assert all(set(r) == {"name", "status"} and r["status"] in
                   ("passed", "failed", "error", "skipped", "xfail", "xpass") for r in results)
        assert summary["passed"] >= 0 and summary["failed"] >= 0
