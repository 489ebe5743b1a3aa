"""Deprecated: the Ray pool lives in :mod:`torchfeed.ray.pool` (``torchfeed.ray.Pool``).

Each old name still works and warns once (:mod:`torchfeed.deprecation`); this module imports
no engine package itself: the new object is looked up by name on first use.
"""

from __future__ import annotations

from ..deprecation import renamed_getattr

__getattr__ = renamed_getattr(
    __name__,
    {
        "RayPool": "torchfeed.ray.RayPool",
        "Pool": "torchfeed.ray.Pool",
        "actor_class": "torchfeed.ray.pool.actor_class",
        "node_address": "torchfeed.ray.pool.node_address",
    },
)
