"""Several pools as one, the cheapest first: :class:`Tiers`.

``autoscale(loader, [LocalPool(), torchfeed.dask.Pool(cluster)])`` asks for workers in the
order the pools are given: the first pool grows up to its ``limit`` (a :class:`LocalPool`'s
CPU budget) before the next one gets any request, so remote workers are only asked for while
the trainer still waits with every core of its own machine in use (Pecan's placement: the
cheapest workers first). Shrinking goes the other way: the controller drains the workers of
the last pool first (:meth:`Tiers.expense`).
"""

from __future__ import annotations

from collections.abc import Sequence

from .pool import WorkerPool


class Tiers:
    """A :class:`~torchfeed.scaling.pool.WorkerPool` over ``pools``, cheapest first (see the module doc).

    A pool's ``limit`` attribute, when it has one, is the most workers it is asked for; the
    last pool takes whatever the others cannot."""

    def __init__(self, pools: Sequence[WorkerPool]):
        if not pools:
            raise ValueError("Tiers needs at least one pool")
        for pool in pools:
            if not isinstance(pool, WorkerPool):
                raise TypeError(f"{type(pool).__name__} is not a pool (torchfeed.scaling.pool.WorkerPool)")
        self.pools = list(pools)

    def addresses(self) -> list[str]:
        return [a for pool in self.pools for a in pool.addresses()]

    def requested(self) -> int:
        return sum(pool.requested() for pool in self.pools)

    def scale(self, n: int) -> None:
        """Fill the pools in order: each up to its ``limit``, the last with the rest."""
        left = n
        for i, pool in enumerate(self.pools):
            limit = getattr(pool, "limit", None)
            has = pool.requested()
            share = left if limit is None or i == len(self.pools) - 1 else min(left, limit)
            if share > has:
                pool.scale(share)
            left -= max(share, has)
            if left <= 0:
                return

    def expense(self, address: str) -> int:
        """The position of the pool ``address`` belongs to (higher: retired sooner)."""
        for i, pool in enumerate(self.pools):
            if address in pool.addresses():
                return i
        return len(self.pools)

    def retire(self, addresses: Sequence[str]) -> None:
        for pool in self.pools:
            mine = set(pool.addresses())
            going = [a for a in addresses if a in mine]
            if going:
                pool.retire(going)

    def close(self) -> None:
        for pool in reversed(self.pools):
            pool.close()
