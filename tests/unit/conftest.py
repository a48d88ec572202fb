"""Unit tests: no real model, no database, no HTTP server, no ``tokrag`` subprocess.

Every test here runs its setup and call (fixtures included) under :func:`_unit_guard.guarded`, which fails the
test if it loads a real model, starts the embedded Postgres, serves HTTP or runs the CLI in a
subprocess. The session's real model (``lm``) is refused outright."""

from __future__ import annotations

from pathlib import Path

import pytest
from _unit_guard import guarded

_SEEN = pytest.StashKey[list]()
_HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def lm():
    """Refused here: a unit test that needs the packaged model belongs in tests/integration."""
    pytest.fail("a unit test asked for the real model (fixture 'lm'): move it to tests/integration")


def _guarded_phase(item: pytest.Item):
    if _HERE not in Path(item.path).resolve().parents:  # a test of another folder (see below)
        yield
        return
    seen = item.stash.setdefault(_SEEN, [])
    with guarded(seen):
        yield


# Setup and call are guarded, not teardown: the last unit test of a run also tears down the
# session's fixtures, the integration tests' embedded Postgres among them. The path check keeps
# the guard to this folder's tests whichever hook proxy pytest calls these through.
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _guarded_phase(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _guarded_phase(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    seen = item.stash.get(_SEEN, [])
    if seen and report.passed and call.when in ("setup", "call", "teardown"):
        report.outcome = "failed"
        report.longrepr = "unit guard: the test " + "; ".join(seen) + " (caught by the test itself)"
