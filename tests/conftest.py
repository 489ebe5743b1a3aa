"""Fixtures: real worker processes on loopback, sharing a test secret."""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
SECRET = secrets.token_hex(32)  # a random one per run, as users should make theirs

# The trainer (this process) and every worker use the same secret; workers can import
# the helper modules of tests/ (datasets defined there travel by reference).
os.environ["TORCHFEED_SECRET"] = SECRET
os.environ["PYTHONPATH"] = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
sys.path.insert(0, str(TESTS))

from torchfeed import LocalWorkers, client


@pytest.fixture(scope="session")
def workers2():
    """Two worker processes shared by the tests that do not harm them."""
    with LocalWorkers(2) as w:
        yield w.addresses


@pytest.fixture
def fresh_workers():
    """Factory for private worker processes (for tests that kill or stop them)."""
    made = []

    def make(n=2, **kw):
        w = LocalWorkers(n, **kw)
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()


@pytest.fixture(autouse=True)
def _no_stale_connections():
    yield
    # connections to workers killed by a test must not leak into the next test
    session = client.default_session()
    for conn in session.connections():
        if conn.closed:
            session.forget(conn)
