"""Unit tests: no real model, no database, no HTTP server, no ``tokrag`` subprocess.

Every test here runs (fixtures included) under :func:`_unit_guard.guarded`, which fails the
test if it loads a real model, starts the embedded Postgres, serves HTTP or runs the CLI in a
subprocess. The session's real model (``lm``) is refused outright."""

from __future__ import annotations

import pytest
from _unit_guard import guarded

_SEEN = pytest.StashKey[list]()


@pytest.fixture(scope="session")
def lm():
    """Refused here: a unit test that needs the packaged model belongs in tests/integration."""
    pytest.fail("a unit test asked for the real model (fixture 'lm'): move it to tests/integration")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    seen: list[str] = []
    item.stash[_SEEN] = seen
    with guarded(seen):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    seen = item.stash.get(_SEEN, [])
    if seen and report.passed and call.when in ("setup", "call", "teardown"):
        report.outcome = "failed"
        report.longrepr = "unit guard: the test " + "; ".join(seen) + " (caught by the test itself)"
