"""Deprecated: ``torchfeed.pools.Pool`` is :class:`torchfeed.scaling.WorkerPool`."""

from __future__ import annotations

from .deprecation import renamed_getattr

__getattr__ = renamed_getattr(
    __name__, {"Pool": "torchfeed.scaling.WorkerPool", "WorkerPool": "torchfeed.scaling.WorkerPool"}
)
