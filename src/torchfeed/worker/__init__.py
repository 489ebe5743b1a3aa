"""The worker daemon (``torchfeed worker``) and what runs in it: the server (server), one
authenticated client's reader and writer (serverconn), the accept loop and handshakes
(doorman), the worker's own counters (counters), its options (options), its processes (process,
group, forked, forkserver), and the code loaders send it to run (fetch, streams, context).

``from torchfeed.worker import run_worker, WorkerServer`` keeps working: names are read
from :mod:`torchfeed.worker.server` on first use (``torchfeed --help`` stays light).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..util import lazy_exports

if TYPE_CHECKING:
    from .objects import ConnectionLimits, Registry, UnknownReference
    from .options import HANDSHAKE_TIMEOUT
    from .server import WorkerServer, raise_fd_limit, run_worker

_EXPORTS = {
    "ConnectionLimits": "objects",
    "HANDSHAKE_TIMEOUT": "options",
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

__getattr__ = lazy_exports(__name__, _EXPORTS)
