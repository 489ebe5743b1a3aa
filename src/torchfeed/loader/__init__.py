"""The trainer's loader: RemoteDataLoader (dataloader), RemoteDataset and its membership
(dataset, membership), one map-style pass (passes, plan, ledger, scheduler, workerindex,
prefetch), one iterable-style pass (iterable, streamslots), the fault policy of both (faults),
what a loader loads from (views), resume state (resume), samplers (sampling), torch's argument
checks (checks). What it sends the workers to run is in :mod:`torchfeed.worker` (fetch,
streams, context).

``torchfeed.loader.RemoteDataLoader`` and ``torchfeed.loader.RemoteDataset`` keep working
(read on first use).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..util import lazy_exports

if TYPE_CHECKING:
    from .dataloader import RemoteDataLoader
    from .dataset import RemoteDataset

_EXPORTS = {"RemoteDataLoader": "dataloader", "RemoteDataset": "dataset"}
__all__ = ["RemoteDataLoader", "RemoteDataset"]

__getattr__ = lazy_exports(__name__, _EXPORTS)
