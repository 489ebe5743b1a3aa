"""Workers on the trainer's own machine as a pool :func:`torchfeed.autoscale` can grow.

The cheapest workers there are: no network, batches in shared memory (the same-host path).
But they share the trainer's cores, so the pool holds at most ``cpu_budget`` of them: by
default the cores this process may run on, less ``keep_for_trainer`` left to the training
process itself. Given with remote pools (``autoscale(loader, [LocalPool(), remote])``), the
local workers are grown first and retired last (see :mod:`torchfeed.scaling.tiers`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from ..local import LocalWorkers
from ..util import cpu_count
from ..worker.options import WorkerOptions

log = logging.getLogger("torchfeed.autoscale")


class LocalPool:
    """A :class:`~torchfeed.scaling.pool.WorkerPool` of worker processes on this machine.

    Parameters
    ----------
    cpu_budget : int, optional
        Most workers at once (default: the CPUs this process may run on, :func:`torchfeed.util.cpu_count`, less ``keep_for_trainer``, at least 1).
    keep_for_trainer : int
        Cores left to the training process when ``cpu_budget`` is not given (default 1).
    options : WorkerOptions, optional
        How each worker serves (as for :class:`torchfeed.LocalWorkers`).
    start_timeout : float
        Seconds a worker may take to start before it is given up (logged).
    """

    def __init__(
        self,
        cpu_budget: int | None = None,
        *,
        keep_for_trainer: int = 1,
        options: WorkerOptions | None = None,
        start_timeout: float = 60.0,
    ):
        if keep_for_trainer < 0:
            raise ValueError(f"keep_for_trainer must be >= 0, got {keep_for_trainer}")
        if cpu_budget is None:
            cpu_budget = max(cpu_count() - keep_for_trainer, 1)
        if cpu_budget < 1:
            raise ValueError(f"cpu_budget must be >= 1 worker, got {cpu_budget}")
        self.limit = cpu_budget
        self.options = options
        self.start_timeout = start_timeout
        self._ready: dict[str, LocalWorkers] = {}
        self._starting = 0
        self._lock = threading.Lock()
        self._closed = False

    def addresses(self) -> list[str]:
        with self._lock:
            return list(self._ready)

    def requested(self) -> int:
        with self._lock:
            return len(self._ready) + self._starting

    def scale(self, n: int) -> None:
        """Start workers until ``n`` are asked for (never more than :attr:`limit`); returns at once."""
        with self._lock:
            more = min(n, self.limit) - len(self._ready) - self._starting
            if self._closed or more <= 0:
                return
            self._starting += more
        for _ in range(more):
            threading.Thread(target=self._start_one, name="torchfeed-localpool", daemon=True).start()

    def _start_one(self) -> None:
        try:
            workers = LocalWorkers(1, options=self.options, start_timeout=self.start_timeout)
        except Exception as exc:  # noqa: BLE001 - the controller sees the pool not growing
            log.warning("LocalPool: a worker did not start (%s: %s)", type(exc).__name__, exc)
            with self._lock:
                self._starting -= 1
            return
        with self._lock:
            self._starting -= 1
            if not self._closed:
                self._ready[workers.addresses[0]] = workers
                return
        workers.close()

    def retire(self, addresses: Sequence[str]) -> None:
        with self._lock:
            going = [self._ready.pop(a) for a in addresses if a in self._ready]
        for workers in going:
            workers.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            going, self._ready = list(self._ready.values()), {}
        for workers in going:
            workers.close()

    def __enter__(self) -> LocalPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
