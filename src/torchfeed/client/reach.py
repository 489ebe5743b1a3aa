"""Reaching a worker that does not listen yet: refused connections are tried again.

Workers often start after the trainer first tries them: Slurm and torchrun start both
sides at once, and a script may start ``torchfeed worker`` and call it on the next line.
A refused connection then means "not yet", so :func:`retry_refused` tries again with
backoff until the deadline. Waiting is not silent: the first refusal is logged (under
``torchfeed.workers``, WARNING) with the address and how long the wait may last, and
again every :data:`REFUSED_LOG_EVERY` seconds while the worker keeps refusing.

:class:`Reaching` is a session's table of the calls waiting for such a worker: one thread per
address and secret (``torchfeed-reach-ADDRESS``) connects, and hands the outcome to every
call that waited. Its lock guards only that table; the calls' continuations run on that
thread with no lock held.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import WorkerLost
from ..util import double_delay

log = logging.getLogger("torchfeed.workers")

RETRY_FIRST = 0.1  # seconds before the second attempt; doubled up to RETRY_MAX
RETRY_MAX = 2.0
REFUSED_LOG_EVERY = 10.0  # seconds between the lines saying that a worker still refuses

T = TypeVar("T")


def refused(exc: BaseException) -> bool:
    """Whether a failed connect means that nothing listens there (yet)."""
    cause = exc.__cause__ if isinstance(exc, WorkerLost) else exc
    return isinstance(cause, (ConnectionRefusedError, ConnectionResetError, ConnectionAbortedError))


def retry_refused(connect: Callable[[float], T], address: str, timeout: float) -> T:
    """``connect(seconds left)`` until it succeeds, fails otherwise, or ``timeout`` seconds of
    refusals pass (then :class:`~torchfeed.WorkerLost` says for how long and what to check)."""
    start = time.monotonic()
    deadline = start + timeout
    delay = RETRY_FIRST
    attempts = 0
    next_line: float | None = None
    while True:
        attempts += 1
        try:
            return connect(max(0.1, deadline - time.monotonic()))
        except Exception as exc:
            if not refused(exc):
                raise
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                raise WorkerLost(
                    f"could not connect to worker {address}: the connection was refused for {now - start:.1f} s "
                    f"({attempts} attempts, retried until timeout={timeout:g} s). Is `torchfeed worker` "
                    "running there, on that port? (timeout= of the call, or of the RemoteDataset or its "
                    "Session, sets how long to wait)",
                    {address: repr(exc)},
                ) from exc
            if next_line is None:
                log.warning(
                    "worker %s refuses connections (not started yet?); trying again for up to %.3g s",
                    address,
                    left,
                )
                next_line = now + REFUSED_LOG_EVERY
            elif now >= next_line:
                log.warning(
                    "worker %s still refuses connections after %.3g s (%d attempts); trying again for %.3g s more",
                    address,
                    now - start,
                    attempts,
                    left,
                )
                next_line = now + REFUSED_LOG_EVERY
            time.sleep(min(delay, left))
            delay = double_delay(delay, RETRY_FIRST, RETRY_MAX)


class Reaching:
    """The calls waiting while a thread reaches a starting worker, by (address, secret)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[tuple[str, bytes], list[Callable]] = {}

    def reach(self, key: tuple[str, bytes], connect: Callable[[], Any], then: Callable) -> None:
        """``then(connection, error)`` with the outcome of ``connect()``, run on the thread of
        the first call waiting for ``key`` (later ones wait for the same outcome)."""
        with self._lock:
            waiting = self._waiting.get(key)
            if waiting is not None:
                waiting.append(then)
                return
            self._waiting[key] = [then]

        def run() -> None:
            conn, error = None, None
            try:
                conn = connect()
            except BaseException as exc:  # noqa: BLE001 - handed to every waiting call
                error = exc
            with self._lock:
                waiting = self._waiting.pop(key, [])
            for each in waiting:
                each(conn, error)

        threading.Thread(target=run, name=f"torchfeed-reach-{key[0]}", daemon=True).start()
