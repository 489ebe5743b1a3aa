"""The trainer's loader and the worker-side code it sends: RemoteDataLoader (dataloader),
RemoteDataset and its membership (dataset, membership), one map-style pass (passes, plan,
ledger, scheduler, workerindex, prefetch), one iterable-style pass (iterable), what a
loader loads from (views), resume state (resume), samplers (sampling), torch's argument
checks (checks); run on the workers: fetch, streams, context.

``torchfeed.loader.RemoteDataLoader`` and ``torchfeed.loader.RemoteDataset`` keep working
(read on first use).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .dataloader import RemoteDataLoader
    from .dataset import RemoteDataset

_EXPORTS = {"RemoteDataLoader": "dataloader", "RemoteDataset": "dataset"}
__all__ = ["RemoteDataLoader", "RemoteDataset"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
