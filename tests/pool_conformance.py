"""What every pool must do, written once and checked on each engine.

A pool (:class:`torchfeed.scaling.WorkerPool`; the ones with a background thread subclass
:class:`torchfeed.scaling.BasePool`) grows when asked and says so at once, gives the addresses
of workers that serve a :class:`~torchfeed.RemoteDataset`, retires the workers it is told to
(and ignores addresses it does not hold), replaces a worker that dies or reports it as its
documentation says, keeps the secret off the workers' command lines and environments, and
closes for good. The engine test files call these functions with their own pools and cluster
fixtures, so each runs in that file's xdist group:

==========================  ==========================================  ====================
test file                   pool                                        a killed worker
==========================  ==========================================  ====================
tests/test_autoscale.py     ``torchfeed.scaling.LocalPool``             replaced
tests/test_dask.py          ``torchfeed.dask.Pool`` on a LocalCluster   replaced (the nanny)
tests/test_ray.py           ``torchfeed.ray.Pool`` (shared Ray cluster) replaced
tests/test_slurm_pool.py    ``torchfeed.cluster.SlurmPool``             reported, not counted
==========================  ==========================================  ====================

A new engine's test file calls them too (docs/development.md, "Adding a pool backend"). The
checks assert behaviour, never durations: ``timeout`` only bounds how long they wait.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest

import torchfeed
from helpers import RangeDataset
from torchfeed.scaling import WorkerPool

UNKNOWN = "127.0.0.1:9"  # an address no pool holds (the discard port)


def _until(what: str, condition: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        time.sleep(0.1)


def grow_and_wait(pool: Any, n: int, timeout: float = 120.0) -> list[str]:
    """``scale(n)`` returns at once with ``requested() == n``; ``wait(n)`` gives ``n`` ready
    addresses, which ``addresses()`` lists; a smaller ``scale`` then never stops a ready worker."""
    implements = isinstance(pool, WorkerPool)  # not an assert: it would narrow pool to the protocol
    assert implements
    pool.scale(n)
    assert pool.requested() == n
    ready = pool.wait(n, timeout)
    assert len(ready) == n == len(set(ready)), ready
    assert set(ready) <= set(pool.addresses())
    pool.scale(max(n - 1, 0))  # grow only: the ready workers stay
    assert pool.requested() == n and set(ready) <= set(pool.addresses())
    return sorted(ready)


def check_serves(addresses: Sequence[str], session: Any = None, n: int = 48) -> None:
    """The addresses serve a RemoteDataset: a loader over them gives every sample once."""
    ds = torchfeed.RemoteDataset(list(addresses), RangeDataset, n, session=session)
    try:
        assert sorted(ds.workers) == sorted(addresses)
        loader = torchfeed.RemoteDataLoader(ds, batch_size=4, shuffle=True)
        assert sorted(i for _, idx in loader for i in idx.tolist()) == list(range(n))
    finally:
        ds.close()


def retire_and_check(pool: Any, going: Sequence[str], timeout: float = 60.0) -> list[str]:
    """``retire`` drops the request count at once, takes the workers out of ``addresses()``,
    and leaves the others; the remaining addresses."""
    before, kept = pool.requested(), sorted(set(pool.addresses()) - set(going))
    pool.retire(list(going))
    check_retired(pool, going, before - len(going), kept, timeout)
    return kept


def check_retired(
    pool: Any, going: Sequence[str], requested: int, kept: Sequence[str], timeout: float = 60.0
) -> None:
    """After ``retire(going)``: ``requested`` asked for, ``going`` gone from ``addresses()``,
    ``kept`` still there; retiring them again, or an address the pool never held, changes
    nothing (the pool logs it)."""
    assert pool.requested() == requested
    _until(
        "the retired workers to leave addresses()", lambda: not set(going) & set(pool.addresses()), timeout
    )
    assert sorted(pool.addresses()) == sorted(kept) and pool.requested() == requested
    pool.retire([*going, UNKNOWN])
    assert pool.requested() == requested and sorted(pool.addresses()) == sorted(kept)


def kill_and_check(
    pool: Any,
    kill: Callable[[str], None],
    *,
    replaced: bool,
    timeout: float = 120.0,
    caplog: pytest.LogCaptureFixture | None = None,
    said: str = "",
) -> list[str]:
    """``kill(address)`` ends one worker as the engine would lose it (a crash, a lost node);
    then :func:`check_killed`. The addresses afterwards."""
    requested, victim = pool.requested(), sorted(pool.addresses())[0]
    kill(victim)
    return check_killed(pool, victim, requested, replaced=replaced, timeout=timeout, caplog=caplog, said=said)


def check_killed(
    pool: Any,
    victim: str,
    requested: int,
    *,
    replaced: bool,
    timeout: float = 120.0,
    caplog: pytest.LogCaptureFixture | None = None,
    said: str = "",
) -> list[str]:
    """After ``victim`` was lost (``requested`` asked for then): the pool takes it out of
    ``addresses()`` and either replaces it (``replaced``: the request holds and a new worker
    becomes ready) or reports it and stops counting it. ``said``: text the pool logs then
    (checked in ``caplog``). The addresses afterwards."""
    _until(f"{victim} to leave addresses()", lambda: victim not in pool.addresses(), timeout)
    if replaced:
        after = pool.wait(requested, timeout)
        assert pool.requested() == requested and victim not in after
    else:
        _until(
            "the pool to stop counting the lost worker", lambda: pool.requested() == requested - 1, timeout
        )
        after = pool.addresses()
        assert victim not in after and len(after) == requested - 1
    if caplog is not None and said:
        assert said in caplog.text, caplog.text
    return sorted(after)


def kill_the_process(address: str, session: Any = None) -> None:
    """SIGKILL the process serving ``address`` (on this machine): a crash, an OOM kill."""
    import os
    import signal

    call = session.rpc_async if session is not None else torchfeed.rpc_async
    os.kill(call(address, os.getpid, timeout=60).wait(), signal.SIGKILL)


def seen_on_the_worker(secret: str) -> dict[str, Any]:
    """Runs on a worker: where its process shows ``secret`` (its command line, its environment,
    what a subprocess it starts inherits)."""
    import os
    import subprocess
    import sys

    with open("/proc/self/cmdline", "rb") as f:
        cmdline = f.read()
    with open("/proc/self/environ", "rb") as f:
        environ = f.read()
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.environ.get('TORCHFEED_SECRET', ''))"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return {
        "command line": secret.encode() in cmdline,
        "os.environ": any(secret in value for value in os.environ.values()),
        "TORCHFEED_SECRET": os.environ.get("TORCHFEED_SECRET"),
        "a subprocess": child.stdout.strip(),
        # a forked worker's /proc/self/environ is its parent's initial block, not its own start
        "started with it": secret.encode() in environ and not _forked(environ),
    }


def _forked(environ: bytes) -> bool:
    import os

    try:
        with open(f"/proc/{os.getppid()}/environ", "rb") as f:
            return f.read() == environ
    except OSError:
        return False


def check_secret_off_the_workers(addresses: Sequence[str], secret: bytes, session: Any = None) -> None:
    """No worker of the pool finds the secret on its command line or in its environment, nor
    passes it to what it starts (the pools hand it over stdin, a file or their engine's call)."""
    call = session.rpc_async if session is not None else torchfeed.rpc_async
    text = secret.decode()
    for address in addresses:
        seen = call(address, seen_on_the_worker, (text,), timeout=60).wait()
        assert seen == {
            "command line": False,
            "os.environ": False,
            "TORCHFEED_SECRET": None,
            "a subprocess": "",
            "started with it": False,
        }, (address, seen)


def close_and_check(pool: Any) -> None:
    """``close`` leaves no worker listed, and a second ``close`` does nothing."""
    pool.close()
    assert pool.addresses() == []
    pool.close()
    assert pool.addresses() == []


def check_pool(
    pool: Any,
    kill: Callable[[str], None],
    *,
    replaced: bool,
    secret: bytes,
    n: int = 2,
    session: Any = None,
    timeout: float = 120.0,
    caplog: pytest.LogCaptureFixture | None = None,
    said: str = "",
) -> None:
    """Every check in order on one pool (grown to ``n`` >= 2, one killed, one retired, closed)."""
    if caplog is not None:
        caplog.set_level(logging.WARNING)
    ready = grow_and_wait(pool, n, timeout)
    check_serves(ready, session)
    check_secret_off_the_workers(ready, secret, session)
    after = kill_and_check(pool, kill, replaced=replaced, timeout=timeout, caplog=caplog, said=said)
    check_serves(after, session)
    retire_and_check(pool, after[:1])
    close_and_check(pool)
