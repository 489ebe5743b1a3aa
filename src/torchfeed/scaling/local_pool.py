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
from .pool import BasePool

log = logging.getLogger("torchfeed.autoscale")


class LocalPool(BasePool):
    """A :class:`~torchfeed.scaling.pool.WorkerPool` of worker processes on this machine.

    Its thread (``torchfeed-localpool``, see :class:`~torchfeed.scaling.pool.BasePool`) starts
    each missing worker on a short-lived thread of its own (so that several start at once),
    which hands it to the pool, or closes it when the pool closed meanwhile; :meth:`close`
    stops the pool's thread, then every worker.

    Parameters
    ----------
    cpu_budget : int, optional
        Most workers at once (default: the CPUs this process may run on, :func:`torchfeed.util.cpu_count`, less ``keep_for_trainer``, at least 1).
    keep_for_trainer : int
        Cores left to the training process when ``cpu_budget`` is not given (default 1).
    options : WorkerOptions, optional
        How each worker serves (as for :class:`torchfeed.LocalWorkers`).
    start_timeout : float
        Seconds a worker may take to start before it is given up (logged; the request
        count drops by one).
    poll : float
        Seconds between two looks at the workers: one that ended (killed, crashed) leaves
        :meth:`addresses`, is logged, and another starts in its place (the request holds).
    """

    label = "LocalPool"
    thread_name = "torchfeed-localpool"
    close_timeout = 10.0
    unknown_holder = "no local worker serves"

    def __init__(
        self,
        cpu_budget: int | None = None,
        *,
        keep_for_trainer: int = 1,
        options: WorkerOptions | None = None,
        start_timeout: float = 60.0,
        poll: float = 0.5,
    ):
        if keep_for_trainer < 0:
            raise ValueError(f"keep_for_trainer must be >= 0, got {keep_for_trainer}")
        if cpu_budget is None:
            cpu_budget = max(cpu_count() - keep_for_trainer, 1)
        if cpu_budget < 1:
            raise ValueError(f"cpu_budget must be >= 1 worker, got {cpu_budget}")
        super().__init__(poll, log)
        self.limit = cpu_budget
        self.options = options
        self.start_timeout = start_timeout
        self._ready: dict[str, LocalWorkers] = {}
        self._starting = 0
        self._start_thread()

    # -- the engine's steps (BasePool's hooks) ----------------------------------------------
    def _ready_addresses(self) -> list[str]:
        return list(self._ready)

    def _bounded(self, n: int) -> int:
        return min(n, self.limit)

    def _claim(self, addresses: Sequence[str]) -> tuple[list[LocalWorkers], int, list[str]]:
        covered = [a for a in dict.fromkeys(addresses) if a in self._ready]
        return [self._ready.pop(a) for a in covered], len(covered), covered

    def _shrink(self, going: list[LocalWorkers]) -> None:
        for workers in going:
            workers.close()

    def _step(self) -> None:
        with self._lock:
            ended = {a: w for a, w in self._ready.items() if w.workers[0].poll() is not None}
            for address in ended:
                del self._ready[address]
            more = 0 if self._closed else max(self._target - len(self._ready) - self._starting, 0)
            self._starting += more
        for address, workers in ended.items():
            log.warning("LocalPool: worker %s ended; starting another", address)
            workers.close()
        for _ in range(more):
            threading.Thread(target=self._start_one, name="torchfeed-localpool-start", daemon=True).start()

    def _start_one(self) -> None:
        try:
            workers = LocalWorkers(1, options=self.options, start_timeout=self.start_timeout)
        except Exception as exc:  # noqa: BLE001 - the controller sees the pool not growing
            if not self._closed:
                log.warning("LocalPool: a worker did not start (%s: %s)", type(exc).__name__, exc)
            with self._lock:
                self._starting -= 1
                self._target = max(self._target - 1, 0)
            return
        with self._lock:
            self._starting -= 1
            if not self._closed:
                self._ready[workers.addresses[0]] = workers
                return
        workers.close()

    def _release(self) -> None:
        with self._lock:
            going, self._ready = list(self._ready.values()), {}
        self._shrink(going)
