"""Fixtures: real worker processes on loopback, sharing a test secret."""

from __future__ import annotations

import collections
import os
import secrets
import signal
import sys
import threading
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
SECRET = secrets.token_hex(32)  # a random one per run, as users should make theirs

# The trainer (this process) and every worker use the same secret; workers can import
# the helper modules of tests/ (datasets defined there travel by reference).
os.environ["TORCHFEED_SECRET"] = SECRET
os.environ["PYTHONPATH"] = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
sys.path.insert(0, str(TESTS))
# Bytecode caches: the run starts a few hundred interpreters that import torch (workers, fork
# servers, clusters, scripts). Where PYTHONDONTWRITEBYTECODE is set (this project's CI machines
# set it) each one compiles torch's Python source again, about 3.5 s of CPU instead of 1.4 s
# from the caches; the run writes them, as Python does by default.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

from torchfeed import LocalWorkers, client, events


@pytest.fixture(scope="session")
def workers2():
    """Two worker processes shared by the tests that do not harm them."""
    with LocalWorkers(2) as w:
        yield w.addresses


@pytest.fixture
def dnsmasq(tmp_path):
    """A dnsmasq answering for ``torchfeed-workers.test`` (tests/dnsserver.py; skips where
    dnsmasq is missing): the DNS server of test_dns.py and test_dns_strays.py."""
    from dnsserver import NAME, Dnsmasq, Unavailable

    try:
        server = Dnsmasq(tmp_path, NAME)
    except Unavailable as exc:
        pytest.skip(str(exc))
    yield server
    server.close()


OTHER_USER = "tf-other-user"


@pytest.fixture(scope="session")
def other_user():
    """(uid, gid) of a second local user, made with useradd (skips without root, useradd or
    setpriv): what another user of a shared machine can do is tested as that user."""
    import pwd
    import shutil
    import subprocess

    if os.geteuid() != 0 or shutil.which("useradd") is None or shutil.which("setpriv") is None:
        pytest.skip("needs root, useradd and setpriv to act as a second local user")
    try:
        entry = pwd.getpwnam(OTHER_USER)
    except KeyError:
        done = subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/bin/sh", OTHER_USER],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if done.returncode != 0 and "already exists" not in done.stderr:
            pytest.skip(f"useradd failed: {done.stderr.strip()}")
        entry = pwd.getpwnam(OTHER_USER)
    return entry.pw_uid, entry.pw_gid


@pytest.fixture
def tcp_only(monkeypatch):
    """Trainers reach every worker over TCP (the sealed channel), same-host ones included: for
    tests of the wire itself (captures, compression, relays of the stream)."""
    import torchfeed
    from torchfeed.protocol import localpath

    torchfeed.client.close_all()  # connections pooled by earlier tests may be same-host ones
    monkeypatch.setenv(localpath.ENV, "tcp")
    yield
    torchfeed.client.close_all()  # and later tests get theirs by their own path


@pytest.fixture(scope="session")
def ray_cluster_shared():
    """A two-node Ray cluster on loopback (tests/raycluster.py) for test_ray.py and the Ray
    blocks of the docs (one xdist group): started once, at its first use (about 40 s with its
    shutdown). Users close their pools and actors; none stops a node."""
    pytest.importorskip("ray")
    from raycluster import RayCluster, Unavailable

    try:
        cluster = RayCluster()
    except Unavailable as exc:
        pytest.skip(str(exc))
    try:
        yield cluster
    finally:
        cluster.close()


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
    events.new_periods()  # each test's event lines count against a budget of their own
    yield
    # connections to workers killed by a test must not leak into the next test
    session = client.default_session()
    for conn in session.connections():
        if conn.closed:
            session.forget(conn)


# -- running in parallel -------------------------------------------------------------------
# pyproject.toml's addopts run the suite on pytest-xdist workers with --dist loadgroup. Each
# test file is one group, run whole by one xdist worker: its module fixtures (clusters, worker
# pools, the frameworks' torchrun job) start once, and tests that share a fixture never run at
# the same time. GROUPS joins the two files that start private Slurm clusters (one at a time is
# load enough for 2 cores), and the files that start torch.distributed jobs. The docs' code
# blocks (test_docs.py, the longest file: each block is a process of its own) are spread one
# by one, but for those that share a server: the Ray blocks run with test_ray.py on the
# session's Ray cluster, the S3 blocks together. The xdist workers take groups in collection
# order, so the longest (measured: the run's last lines name them) come first, and the docs'
# short blocks last.
GROUPS = {
    "test_ray": "ray",
    "test_slurm": "slurm",
    "test_slurm_pool": "slurm",
    # files that start torch.distributed jobs on loopback (Dask ranks, torchrun, cluster launches):
    # one at a time, as in a serial run (a Dask rank once met a gloo peer it did not expect
    # while a torchrun job of another file ran beside it)
    "test_dask": "ddp",
    "test_frameworks": "ddp",
    "test_cluster": "ddp",
}
LONGEST_FIRST = [
    "test_ray",
    "test_dask",  # with test_frameworks and test_cluster: the "ddp" group
    "test_frameworks",
    "test_cluster",
    "test_slurm",  # with test_slurm_pool: the "slurm" group
    "test_slurm_pool",
    "test_cli",
    "test_attacks",
    "test_autoscale",
    "test_same_host",
    "test_dask_secret",
]
# the docs' blocks come last: each a unit of its own (a few seconds), they fill the workers
# that finish their groups first, so the run ends with short units rather than a long group;
# among them, the pages whose blocks start clusters or training jobs (30-110 s each, measured)
# go first, so that the last units to start are short ones
LAST = ["test_docs"]
LONGEST_DOCS = ["docs/autoscale.md", "docs/clusters.md", "docs/frameworks.md", "docs/object-storage.md"]


def _module(item) -> str:
    return Path(str(item.fspath)).stem


def _group(item) -> str | None:
    name = _module(item)
    if name != "test_docs":
        return GROUPS.get(name, name)
    if item.get_closest_marker("ray") is not None:
        return "ray"
    block = item.callspec.params.get("block") if hasattr(item, "callspec") else None
    return "docs-s3" if getattr(block, "kind", None) == "s3" else None


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        group = _group(item)
        if group is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    rank.update({name: len(LONGEST_FIRST) + 1 + i for i, name in enumerate(LAST)})
    items.sort(
        key=lambda item: (rank.get(_module(item), len(LONGEST_FIRST)), _docs_rank(item))
    )  # stable otherwise


def _docs_rank(item) -> int:
    """0 for a docs block of LONGEST_DOCS, else 1 (and 1 for every other test)."""
    block = item.callspec.params.get("block") if hasattr(item, "callspec") else None
    return 0 if getattr(block, "name", "").split(":")[0] in LONGEST_DOCS else 1


def pytest_configure(config):
    """pytest-xdist up to 3.8 names a test's group by rewriting its node id where pytest 9 no
    longer reads it: under ``--dist loadgroup`` every group would be scattered (module fixtures
    started again on each xdist worker, tests sharing a cluster overlapping). Refuse that pair.

    Also gives SIGINT its Python handler where the run inherited it ignored (a run started in
    the background of a shell): tests send Ctrl-C to the programs they start, which inherit
    the action, and Python raises KeyboardInterrupt only where SIGINT was not ignored at start
    (a caught signal is reset to the default action at exec)."""
    if (
        signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        and threading.current_thread() is threading.main_thread()
    ):
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if config.getoption("dist", "no") != "loadgroup" or int(pytest.version_tuple[0]) < 9:
        return
    import xdist

    if tuple(int(part) for part in xdist.__version__.split(".")[:2]) <= (3, 8):
        raise pytest.UsageError(
            f"pytest {pytest.__version__} with pytest-xdist {xdist.__version__} ignores --dist loadgroup's "
            "groups: install the versions pyproject.toml's test extra asks for (pip install -e '.[test]')"
        )


# -- what was skipped, in one line at the end of the run --------------------------------------
# the system programs some tests start (README: the Debian packages that bring them)
PROGRAMS = ("slurm", "munge", "dnsmasq", "tcpdump", "prometheus", "useradd")


def skip_kind(reason: str) -> str:
    """What a skip reason comes down to: a missing program, no GPU, a docs fragment, or itself."""
    low = reason.lower()
    if low.startswith("docs/"):
        return "docs blocks that need a real cluster or the reader's own data (run elsewhere in the suite)"
    if "cuda" in low or "gpu" in low:
        return "need a GPU"
    missing = [p for p in PROGRAMS if p in low and ("install" in low or "missing" in low)]
    if missing:
        return f"need {'/'.join(missing)}, not installed"
    return reason


_FILE_SECONDS: collections.Counter[str] = collections.Counter()  # test file -> seconds its tests took


def pytest_runtest_logreport(report):
    _FILE_SECONDS[report.nodeid.split("::", 1)[0]] += report.duration  # setup, call and teardown


@pytest.hookimpl(wrapper=True, tryfirst=True)  # outermost: after pytest's own summary of each skip
def pytest_terminal_summary(terminalreporter):
    yield
    longest = ", ".join(f"{Path(f).stem} {s:.0f} s" for f, s in _FILE_SECONDS.most_common(8))
    total = sum(_FILE_SECONDS.values())
    terminalreporter.write_line(
        f"tests took {total:.0f} s in all; the longest files (what LONGEST_FIRST orders): {longest}"
    )
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    kinds: collections.Counter[str] = collections.Counter()
    for report in skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        kinds[skip_kind(reason.removeprefix("Skipped: "))] += 1
    parts = [f"{count} {kind}" for kind, count in kinds.most_common()]
    terminalreporter.write_line(f"skipped {len(skipped)}: " + "; ".join(parts))
