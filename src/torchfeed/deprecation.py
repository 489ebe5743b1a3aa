"""Old names: each still works, and warns once per process with its replacement and the
release that removes it.

A package lists its old names in :func:`renamed_getattr` (old name -> the new one's full
dotted path); the first use of each warns with a ``FutureWarning`` (shown by default, at the
user's line) and every use returns the new object. A module whose every name moved keeps only
a stub whose ``__getattr__`` is :func:`moved_module`, its names listed in :data:`MOVED_MODULES`.
Names deprecated in a release are removed :data:`REMOVED_IN`; CHANGELOG.md lists them.
"""

from __future__ import annotations

import importlib
import threading
import warnings
from collections.abc import Callable, Mapping
from typing import Any

REMOVED_IN = "0.4.0"  # the release that removes the names deprecated in 0.3.0

# Modules whose every name moved: module -> {old name: the new one's full name}. Their stubs
# import no engine package: the new object is imported by name on first use.
MOVED_MODULES: dict[str, dict[str, str]] = {
    "torchfeed.pools": {"Pool": "torchfeed.scaling.WorkerPool", "WorkerPool": "torchfeed.scaling.WorkerPool"},
    "torchfeed.scaling.dask_pool": {
        "DaskPool": "torchfeed.dask.DaskPool",
        "Pool": "torchfeed.dask.Pool",
        "PoolProcesses": "torchfeed.dask.pool.PoolProcesses",
        "POOL_PLUGIN": "torchfeed.dask.pool.POOL_PLUGIN",
    },
    "torchfeed.scaling.ray_pool": {
        "RayPool": "torchfeed.ray.RayPool",
        "Pool": "torchfeed.ray.Pool",
        "actor_class": "torchfeed.ray.pool.actor_class",
        "node_address": "torchfeed.ray.pool.node_address",
    },
    "torchfeed.scaling.slurm_pool": {
        "SlurmPool": "torchfeed.cluster.SlurmPool",
        "pool_script": "torchfeed.cluster.pool_script",
    },
}

_warned: set[str] = set()
_lock = threading.Lock()


def warn(old: str, new: str, removed_in: str = REMOVED_IN, stacklevel: int = 3) -> None:
    """Warn that ``old`` is deprecated for ``new`` (full names), once per process."""
    with _lock:
        if old in _warned:
            return
        _warned.add(old)
    warnings.warn(
        f"{old} is deprecated and will be removed in torchfeed {removed_in}: use {new}",
        FutureWarning,
        stacklevel=stacklevel,
    )


def resolve(dotted: str) -> Any:
    """The object at a full dotted name (``torchfeed.scaling.WorkerPool``)."""
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def renamed_getattr(
    package: str, renamed: Mapping[str, str], others: Callable[[str], Any] | None = None
) -> Callable[[str], Any]:
    """A module ``__getattr__`` for old names (``renamed``: old name -> new full name); any
    other name goes to ``others`` (a package's lazy exports), or is an AttributeError."""

    def __getattr__(name: str) -> Any:
        new = renamed.get(name)
        if new is None:
            if others is not None:
                return others(name)
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        warn(f"{package}.{name}", new)
        return resolve(new)

    return __getattr__


def moved_module(module: str) -> Callable[[str], Any]:
    """The ``__getattr__`` of ``module``, whose every name moved (:data:`MOVED_MODULES`)."""
    return renamed_getattr(module, MOVED_MODULES[module])
