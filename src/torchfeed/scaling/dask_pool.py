"""Deprecated: the Dask pool lives in :mod:`torchfeed.dask.pool` (``torchfeed.dask.Pool``).

Each old name still works and warns once (:mod:`torchfeed.deprecation`); this module imports
no engine package itself: the new object is looked up by name on first use.
"""

from __future__ import annotations

from ..deprecation import renamed_getattr

__getattr__ = renamed_getattr(
    __name__,
    {
        "DaskPool": "torchfeed.dask.DaskPool",
        "Pool": "torchfeed.dask.Pool",
        "PoolProcesses": "torchfeed.dask.pool.PoolProcesses",
        "POOL_PLUGIN": "torchfeed.dask.pool.POOL_PLUGIN",
    },
)
