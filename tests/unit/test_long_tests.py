"""The suite's bound on one test's time (tests/support/timing.py), in a pytest run of its
own (pytester) with a bound of a tenth of a second."""

from __future__ import annotations

import re

import pytest

SLOW_TESTS = """
import time
import pytest

def test_quick():
    pass

def test_slow_unmarked():
    time.sleep(0.3)

@pytest.mark.long("waits on purpose")
def test_slow_marked():
    time.sleep(0.3)

@pytest.mark.long("")
def test_slow_marked_without_a_reason():
    time.sleep(0.3)

def test_slow_and_failing():
    time.sleep(0.3)
    assert False, "its own failure"
"""


@pytest.fixture
def run(pytester: pytest.Pytester):
    pytester.makeini("[pytest]\nlong_test_s = 0.1\nasyncio_default_fixture_loop_scope = function\n")
    pytester.makepyfile(test_slow=SLOW_TESTS)
    return pytester.runpytest("-p", "tests.support.timing", "-p", "no:cacheprovider")


def test_a_test_over_the_bound_fails_unless_marked_with_a_reason(run):
    run.assert_outcomes(passed=2, failed=3)
    out = run.stdout.str()
    assert re.search(r"test_slow_unmarked took \d+\.\d s, over the suite's bound of 0.1 s", out)
    assert 'mark it @pytest.mark.long("why it needs that long")' in out
    assert "test_slow_marked_without_a_reason took" in out
    assert "its own failure" in out and "test_slow_and_failing took" not in out  # its own failure is kept
