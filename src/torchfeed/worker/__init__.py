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
    from .objects import ConnectionLimits, Registry, UnknownReference
    from .server import HANDSHAKE_TIMEOUT, WorkerServer, raise_fd_limit, run_worker

_EXPORTS = {
    "ConnectionLimits": "objects",
    "HANDSHAKE_TIMEOUT": "server",
    "Registry": "objects",
    "UnknownReference": "objects",
    "WorkerServer": "server",
    "raise_fd_limit": "server",
    "run_worker": "server",
}
__all__ = [
    "HANDSHAKE_TIMEOUT",
    "ConnectionLimits",
    "Registry",
    "UnknownReference",
    "WorkerServer",
    "raise_fd_limit",
    "run_worker",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
