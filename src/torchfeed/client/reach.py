"""Reaching a worker that does not listen yet: refused connections are tried again.

Workers often start after the trainer first tries them: Slurm and torchrun start both
sides at once, and a script may start ``torchfeed worker`` and call it on the next line.
A refused connection then means "not yet", so :func:`retry_refused` tries again with
backoff until the deadline. Waiting is not silent: the first refusal is logged (under
``torchfeed.workers``, WARNING) with the address and how long the wait may last, and
again every :data:`REFUSED_LOG_EVERY` seconds while the worker keeps refusing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

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
