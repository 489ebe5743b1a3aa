"""torchfeed: feed PyTorch training from data-loading workers on other machines.

Start workers with ``torchfeed worker`` and replace ``torch.utils.data.DataLoader`` with
:class:`RemoteDataLoader` over a :class:`RemoteDataset`.

Names are imported on first use, so that ``torchfeed --help`` and other light uses of
the package do not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .deprecation import renamed_getattr

__version__ = "0.2.0"

# public name -> module that defines it
_EXPORTS = {
    "AuthenticationError": "errors",
    "ConnectionClosed": "errors",
    "DistributedSampler": "loader.sampling",
    "FrameTooLarge": "errors",
    "LimitExceeded": "errors",
    "LoaderStats": "stats",
    "LocalWorkers": "local",
    "PoisonSampleError": "errors",
    "ProtocolError": "errors",
    "RemoteDataLoader": "loader.dataloader",
    "RemoteDataset": "loader.dataset",
    "RemoteError": "errors",
    "RemoteRef": "client",
    "SerializationError": "errors",
    "Session": "client.session",
    "Timeout": "errors",
    "TorchfeedError": "errors",
    "UnsafeAddressFile": "protocol.addrfile",
    "WorkerLost": "errors",
    "WorkerServer": "worker.server",
    "WorkerStats": "stats",
    "UnsafeReplyError": "errors",
    "add_safe_globals": "protocol.replies",
    "autoscale": "scaling.controller",
    "cached": "loader.cache",
    "clear_safe_globals": "protocol.replies",
    "get_safe_globals": "protocol.replies",
    "rpc_async": "client",
    "run_worker": "worker.server",
    "set_heartbeat": "client",
    "set_random_seeds": "loader.sampling",
    "set_reply_limits": "protocol.limits",
}
# Names of the design this project grew from: deprecated (torchfeed.deprecation).
_RENAMED = {"RPCDataset": "torchfeed.RemoteDataset", "RPCDataloader": "torchfeed.RemoteDataLoader"}

__all__ = sorted(_EXPORTS)  # the public names, listed once (in _EXPORTS)


def _export(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'torchfeed' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


__getattr__ = renamed_getattr(__name__, _RENAMED, _export)


def __dir__():
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and IDEs: _EXPORTS, imported eagerly (test_public_paths compares)
    from .client import RemoteRef, rpc_async, set_heartbeat
    from .client.session import Session
    from .errors import (
        AuthenticationError,
        ConnectionClosed,
        FrameTooLarge,
        LimitExceeded,
        PoisonSampleError,
        ProtocolError,
        RemoteError,
        SerializationError,
        Timeout,
        TorchfeedError,
        UnsafeReplyError,
        WorkerLost,
    )
    from .loader.cache import cached
    from .loader.dataloader import RemoteDataLoader
    from .loader.dataset import RemoteDataset
    from .loader.sampling import DistributedSampler, set_random_seeds
    from .local import LocalWorkers
    from .protocol.addrfile import UnsafeAddressFile
    from .protocol.limits import set_reply_limits
    from .protocol.replies import add_safe_globals, clear_safe_globals, get_safe_globals
    from .scaling.controller import autoscale
    from .stats import LoaderStats, WorkerStats
    from .worker.server import WorkerServer, run_worker

    RPCDataset = RemoteDataset
    RPCDataloader = RemoteDataLoader
