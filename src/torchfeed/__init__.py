"""torchfeed: feed PyTorch training from data-loading workers on other machines.

Start workers with ``torchfeed worker`` and replace ``torch.utils.data.DataLoader`` with
:class:`RemoteDataLoader` over a :class:`RemoteDataset`.

Names are imported on first use, so that ``torchfeed --help`` and other light uses of
the package do not import torch.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from typing import TYPE_CHECKING, Any

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
    "UnsafeAddressFile": "addrfile",
    "WorkerLost": "errors",
    "WorkerServer": "worker.server",
    "WorkerStats": "stats",
    "UnsafeReplyError": "errors",
    "add_safe_globals": "protocol.replies",
    "autoscale": "autoscaler",
    "cached": "loader.cache",
    "clear_safe_globals": "protocol.replies",
    "get_safe_globals": "protocol.replies",
    "rpc_async": "client",
    "run_worker": "worker.server",
    "set_heartbeat": "client",
    "set_random_seeds": "loader.sampling",
    "set_reply_limits": "protocol.limits",
}
# Names of the design this project grew from, kept importable forever.
_ALIASES = {"RPCDataset": "RemoteDataset", "RPCDataloader": "RemoteDataLoader"}

__all__ = [
    "AuthenticationError",
    "ConnectionClosed",
    "DistributedSampler",
    "FrameTooLarge",
    "LimitExceeded",
    "LoaderStats",
    "LocalWorkers",
    "PoisonSampleError",
    "ProtocolError",
    "RPCDataloader",
    "RPCDataset",
    "RemoteDataLoader",
    "RemoteDataset",
    "RemoteError",
    "RemoteRef",
    "SerializationError",
    "Session",
    "Timeout",
    "TorchfeedError",
    "UnsafeAddressFile",
    "UnsafeReplyError",
    "WorkerLost",
    "WorkerServer",
    "WorkerStats",
    "add_safe_globals",
    "autoscale",
    "cached",
    "clear_safe_globals",
    "get_safe_globals",
    "rpc_async",
    "run_worker",
    "set_heartbeat",
    "set_random_seeds",
    "set_reply_limits",
]
assert sorted(__all__) == sorted([*_EXPORTS, *_ALIASES])


# Modules that moved into subpackages (wire version 3). Objects pickled by an older torchfeed
# name the old paths (a DistributedSampler kept in a checkpoint, say): importing an old name
# gives the module at its new place, with a DeprecationWarning that says where it lives now.
_MOVED = {
    "auth": "protocol.auth",
    "buffers": "protocol.buffers",
    "building": "client.building",
    "channel": "protocol.channel",
    "context": "loader.context",
    "doorman": "worker.doorman",
    "fetch": "loader.fetch",
    "iterable": "loader.iterable",
    "ledger": "loader.ledger",
    "limits": "protocol.limits",
    "loader_checks": "loader.checks",
    "passes": "loader.passes",
    "passplan": "loader.plan",
    "prefetch": "loader.prefetch",
    "refs": "client.refs",
    "remote_dataset": "loader.dataset",
    "resume": "loader.resume",
    "sampling": "loader.sampling",
    "scheduler": "loader.scheduler",
    "serialize": "protocol.serialize",
    "serverconn": "worker.connection",
    "session": "client.session",
    "streams": "loader.streams",
    "top": "cli.top",
    "views": "loader.views",
    "wire": "protocol.wire",
    "workerindex": "loader.workerindex",
    "workerstats": "worker.stats",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``torchfeed.<old name>`` as the module's new place (see _MOVED)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        prefix, _, old = fullname.partition(".")
        if prefix != __name__ or old not in _MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> Any:
        new = f"{__name__}.{_MOVED[spec.name.partition('.')[2]]}"
        warnings.warn(f"{spec.name} moved to {new}", DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)  # the same module object under both names

    def exec_module(self, module: Any) -> None:
        pass  # already executed under its new name


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())


def __getattr__(name: str) -> Any:
    target = _ALIASES.get(name, name)
    module = _EXPORTS.get(target)
    if module is None:
        raise AttributeError(f"module 'torchfeed' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), target)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from .addrfile import UnsafeAddressFile
    from .autoscaler import autoscale
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
    from .protocol.limits import set_reply_limits
    from .protocol.replies import add_safe_globals, clear_safe_globals, get_safe_globals
    from .stats import LoaderStats, WorkerStats
    from .worker.server import WorkerServer, run_worker

    RPCDataset = RemoteDataset
    RPCDataloader = RemoteDataLoader
