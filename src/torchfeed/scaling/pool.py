"""What :func:`torchfeed.autoscale` needs of a pool of workers: the :class:`WorkerPool` protocol.

A pool starts and stops torchfeed workers on an engine that already schedules processes
(a Dask cluster, Slurm); it never schedules them itself. The autoscale controller owns
the decisions: it asks a pool for a number of workers, adds the addresses that appear to
the loader's dataset, drains the workers it wants gone (removes them from the dataset and
waits until nothing of theirs is in flight), and only then asks the pool to retire them.

Pools implementing it: ``torchfeed.dask.Pool`` (any Dask cluster with ``scale``),
``torchfeed.ray.Pool`` (Ray actors), ``torchfeed.cluster.SlurmPool`` (worker jobs submitted
with sbatch) and :class:`~torchfeed.scaling.LocalPool` (this machine). The pools that run a
background thread share :class:`BasePool`: the requested count, ``scale``/``retire``/``wait``,
the queue of operations their thread consumes, and ``close``.

This module imports no engine: each engine's pool lives in its engine's package
(``torchfeed/dask/pool.py``, ``torchfeed/ray/pool.py``, ``torchfeed/cluster/pool.py``) and
imports this base, never the reverse.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable


@runtime_checkable
class WorkerPool(Protocol):
    """A set of torchfeed workers that can grow and shrink.

    Every method returns promptly (no method waits for a worker to start or stop);
    a pool that cannot grow (the engine refuses, or the jobs queue) says so in one log
    line and keeps what it has.
    """

    def addresses(self) -> list[str]:
        """The ``host:port`` of every worker that is ready now (started and announced)."""
        ...

    def requested(self) -> int:
        """How many workers the pool is asked to hold: ready ones plus those starting."""
        ...

    def scale(self, n: int) -> None:
        """Ask for ``n`` workers in all (grow only; shrinking goes through :meth:`retire`)."""
        ...

    def retire(self, addresses: Sequence[str]) -> None:
        """Stop these workers (already drained by the caller); the request count drops too."""
        ...

    def close(self) -> None:
        """Stop every worker this pool started and release what it holds."""
        ...


_P = TypeVar("_P", bound="BasePool")
Op = tuple[str, Any]  # ("scale", n) | ("retire", what _claim returned)


class BasePool:
    """A :class:`WorkerPool` whose engine is driven by one background thread it owns.

    What it holds: the requested count (:meth:`requested`), the queue of operations, the
    lock over both, and the thread. Its subclass (one per engine) holds the engine's state
    and implements the steps marked *hook* below: :meth:`_claim`, :meth:`_bounded`,
    :meth:`_scaled` and :meth:`_ready_addresses` run under the lock on the caller's thread,
    :meth:`_release` on the thread that calls :meth:`close`, every other hook on the pool's.

    Threads and who owns what:

    * the pool owns one daemon thread, named :attr:`thread_name`, started by
      :meth:`_start_thread` (the subclass's ``__init__`` calls it once its state is set). It
      is the only thread that calls the engine to grow, shrink or look (:meth:`_grow`,
      :meth:`_shrink`, :meth:`_step`); an exception there is logged (unless the pool is
      closed) and the next round tries again;
    * the public methods return at once: :meth:`scale` and :meth:`retire` change the
      requested count under the lock and queue an operation; :meth:`addresses` and
      :meth:`requested` only read. :meth:`wait` polls :meth:`addresses` until its timeout;
    * the thread wakes on each queued operation, or after :meth:`_poll_wait` seconds, and
      runs :meth:`_step` after every wake;
    * :meth:`close` marks the pool closed (later ``scale`` calls do nothing), queues the stop
      sentinel, joins the thread for at most ``timeout`` seconds (default
      :attr:`close_timeout`; never from the thread itself), then calls :meth:`_release` on
      the caller's thread to stop the workers and free the engine's resources. A second
      ``close`` does nothing.
    """

    label = "torchfeed pool"  # how log lines and errors name the pool (its documented name)
    thread_name = "torchfeed-pool"
    close_timeout = 60.0  # seconds close() waits for the thread to end
    unknown_holder = "no worker of this pool serves"  # retire() of addresses the pool has not
    # the text of wait()'s TimeoutError, formatted with label, ready, n, timeout and requested
    wait_failed_text = "{label}: {ready} of {n} workers ready after {timeout:g} s (asked for {requested})"

    def __init__(self, poll: float, log: logging.Logger):
        self.poll = poll
        self._log = log
        self._lock = threading.Lock()
        self._target = 0  # workers asked for: ready plus starting (guarded by _lock)
        self._closed = False
        self._ops: queue.Queue[Op | None] = queue.Queue()  # None: the thread ends
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)

    def _start_thread(self) -> None:
        self._thread.start()

    # -- the Pool protocol ---------------------------------------------------------------
    def addresses(self) -> list[str]:
        """The ``host:port`` of every worker ready now."""
        with self._lock:
            return self._ready_addresses()

    def requested(self) -> int:
        """Workers asked for: ready plus starting."""
        with self._lock:
            return self._target

    def scale(self, n: int) -> None:
        """Ask for ``n`` workers in all (grow only; shrinking goes through :meth:`retire`); returns at once."""
        with self._lock:
            n = self._bounded(n)
            if n <= self._target or self._closed:
                return
            self._target = n
            self._scaled(n)
        self._ops.put(("scale", n))

    def retire(self, addresses: Sequence[str]) -> None:
        """Stop these (drained) workers; the requested count drops by as many; returns at once.
        Addresses no worker of this pool serves are logged and left alone."""
        with self._lock:
            claimed, count, covered = self._claim(addresses)
            self._target = max(self._target - count, 0)
        unknown = sorted(set(addresses) - set(covered))
        if unknown:
            self._log.warning(
                "%s: %s %s; nothing to retire there", self.label, self.unknown_holder, ", ".join(unknown)
            )
        if count:
            self._ops.put(("retire", claimed))

    def wait(self, n: int = 1, timeout: float = 120.0) -> list[str]:
        """Wait until ``n`` workers are ready; their addresses (TimeoutError after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while len(ready := self.addresses()) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(self._wait_failed(len(ready), n, timeout))
            time.sleep(0.05)
        return ready

    def close(self, timeout: float | None = None) -> None:
        """Stop every worker of this pool and its thread (which gets ``timeout`` seconds to end)."""
        if self._closed:
            return
        self._closed = True
        self._ops.put(None)
        if threading.current_thread() is not self._thread and self._thread.is_alive():
            self._thread.join(self.close_timeout if timeout is None else timeout)
        self._release()

    def __enter__(self: _P) -> _P:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            op: Op | None | tuple[()]
            try:
                op = self._ops.get(timeout=self._poll_wait())
            except queue.Empty:
                op = ()
            if op is None:
                return
            try:
                if op and op[0] == "scale":
                    self._grow(op[1])
                elif op:
                    self._shrink(op[1])
                self._step()
            except Exception as exc:  # noqa: BLE001 - keep serving; the next round tries again
                if not self._closed:
                    self._log.warning("%s: %s: %s", self.label, type(exc).__name__, exc)

    # -- hooks -------------------------------------------------------------------------------
    def _ready_addresses(self) -> list[str]:
        """Hook (under the lock): the addresses of the workers ready now."""
        raise NotImplementedError

    def _claim(self, addresses: Sequence[str]) -> tuple[Any, int, list[str]]:
        """Hook (under the lock): mark the workers serving ``addresses`` as leaving; return
        what :meth:`_shrink` gets, how many requested workers that is, and the addresses it
        covers (the others are logged as unknown)."""
        raise NotImplementedError

    def _bounded(self, n: int) -> int:
        """Hook (under the lock): the most of ``n`` this pool will ask for (default: ``n``)."""
        return n

    def _scaled(self, n: int) -> None:
        """Hook (under the lock): the requested count just grew to ``n`` (default: nothing)."""

    def _poll_wait(self) -> float:
        """Hook: seconds the thread waits for an operation before its next :meth:`_step`."""
        return self.poll

    def _grow(self, n: int) -> None:
        """Hook (thread): ``scale(n)`` was asked (default: nothing, :meth:`_step` grows)."""

    def _shrink(self, claimed: Any) -> None:
        """Hook (thread): stop the workers :meth:`_claim` marked."""
        raise NotImplementedError

    def _step(self) -> None:
        """Hook (thread): look at the engine after every wake (default: nothing)."""

    def _release(self) -> None:
        """Hook (the caller of close, once the thread ended or ``timeout`` passed): stop what is
        left and free the engine's resources."""

    def _wait_failed(self, ready: int, n: int, timeout: float) -> str:
        """The text of :meth:`wait`'s TimeoutError (:attr:`wait_failed_text` filled in)."""
        return self.wait_failed_text.format(
            label=self.label, ready=ready, n=n, timeout=timeout, requested=self.requested()
        )
