"""The suite's bound on one test's time (a pytest plugin, loaded by tests/conftest.py).

A test whose call takes longer than ``long_test_s`` (pyproject.toml) fails, unless it is
marked ``@pytest.mark.long("why it needs that long")``: the suite stays under its 20
minutes by each test staying short, and a test that grows says why or is made faster.
Set-up and tear-down are not counted: a fixture shared by a module starts its daemon
once, in whichever test comes first."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("long_test_s", "seconds a test's call may take without @pytest.mark.long(why)", default="90")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "long(why): the test may take longer than long_test_s; say why")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    bound = float(item.config.getini("long_test_s"))
    if report.when == "call" and report.passed and call.duration > bound:
        marked = item.get_closest_marker("long")
        if marked is None or not marked.args or not str(marked.args[0]).strip():
            report.outcome = "failed"
            report.longrepr = (
                f"{item.nodeid} took {call.duration:.1f} s, over the suite's bound of {bound:g} s a test "
                "(long_test_s in pyproject.toml): make it faster (share a daemon, wait on events, move "
                'figures to benchmarks) or mark it @pytest.mark.long("why it needs that long")'
            )
    return report
