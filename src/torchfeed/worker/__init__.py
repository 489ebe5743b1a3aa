"""The worker daemon (``torchfeed worker``): the server (server), one authenticated
client's reader and writer (connection), the accept loop and handshakes (doorman) and the
worker's own counters (stats).

``from torchfeed.worker import run_worker, WorkerServer`` keeps working: names are read
from :mod:`torchfeed.worker.server` on first use (``torchfeed --help`` stays light).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .server import ConnectionLimits, Registry, UnknownReference, WorkerServer, raise_fd_limit, run_worker

__all__ = ["ConnectionLimits", "Registry", "UnknownReference", "WorkerServer", "raise_fd_limit", "run_worker"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(".server", __name__), name)
    globals()[name] = value
    return value
