"""What :func:`torchfeed.autoscale` needs of a pool of workers: the :class:`WorkerPool` protocol.

A pool starts and stops torchfeed workers on an engine that already schedules processes
(a Dask cluster, Slurm); it never schedules them itself. The autoscale controller owns
the decisions: it asks a pool for a number of workers, adds the addresses that appear to
the loader's dataset, drains the workers it wants gone (removes them from the dataset and
waits until nothing of theirs is in flight), and only then asks the pool to retire them.

Pools implementing it: ``torchfeed.dask.Pool`` (any Dask cluster with ``scale``) and
``torchfeed.cluster.SlurmPool`` (worker jobs submitted with sbatch).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


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
