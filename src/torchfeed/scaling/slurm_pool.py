"""Deprecated: the Slurm pool lives in :mod:`torchfeed.cluster.pool` (``torchfeed.cluster.SlurmPool``).

Each old name still works and warns once (:mod:`torchfeed.deprecation`); this module imports
no engine package itself: the new object is looked up by name on first use.
"""

from __future__ import annotations

from ..deprecation import renamed_getattr

__getattr__ = renamed_getattr(
    __name__,
    {"SlurmPool": "torchfeed.cluster.SlurmPool", "pool_script": "torchfeed.cluster.pool_script"},
)
