"""``torchfeed.pools.Pool``, the documented path of :class:`torchfeed.scaling.pool.WorkerPool`."""

from __future__ import annotations

from .scaling.pool import Pool, WorkerPool

__all__ = ["Pool", "WorkerPool"]
