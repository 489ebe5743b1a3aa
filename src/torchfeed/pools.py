"""``torchfeed.pools.Pool``, the documented path of :class:`torchfeed.scaling.pool.Pool`."""

from __future__ import annotations

from .scaling.pool import Pool

__all__ = ["Pool"]
