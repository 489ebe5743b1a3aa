"""Client side of the data plane: one persistent, multiplexed connection per worker.

Many requests share a connection (request ids); a reader thread per connection
receives replies straight into their final buffers and hands them to callbacks. Each
connection belongs to a :class:`~torchfeed.Session` (session.py), whose keeper thread
sends heartbeats, flushes reference releases, expires request deadlines and declares a
worker lost when it stops answering. The module-level functions here (``rpc_async``,
``connect``, ``set_heartbeat``, ...) are thin wrappers over the default session.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import time
import types
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import torch

from .. import deprecation
from ..errors import Timeout
from ..protocol import auth, wire
from . import session as sessions
from .addresses import Address, format_address, parse_address
from .connection import Callback, Connection
from .delivery import JSON_REPLY, reply_bytes, reply_wire
from .refs import Call, RemoteRef
from .session import Session

__all__ = [
    "Address",
    "Call",
    "Callback",
    "Connection",
    "RemoteRef",
    "Session",
    "call",
    "close_all",
    "close_connections",
    "connect",
    "default_session",
    "format_address",
    "parse_address",
    "paths",
    "reply_bytes",
    "reply_wire",
    "rpc_async",
    "set_heartbeat",
    "wait_all",
    "worker_stats",
]


_P = ParamSpec("_P")
_R = TypeVar("_R")

if TYPE_CHECKING:  # for type checkers: the module's class below defines them at run time
    HEARTBEAT_INTERVAL: float
    HEARTBEAT_TIMEOUT: float


def _heartbeat_setting(which: str) -> property:
    """A deprecated module attribute that reads and sets the default session's heartbeat
    ``which`` ("interval" or "timeout"), checked as :func:`set_heartbeat` checks it."""
    old, attribute = f"torchfeed.client.HEARTBEAT_{which.upper()}", f"heartbeat_{which}"
    new = (
        f"torchfeed.set_heartbeat(interval, timeout), read as torchfeed.client.default_session().{attribute}"
    )

    def read(_module: types.ModuleType) -> float:
        deprecation.warn(old, new)
        return getattr(sessions.default_session(), attribute)

    def write(_module: types.ModuleType, value: float) -> None:
        deprecation.warn(old, new)
        s = sessions.default_session()
        both = {"interval": s.heartbeat_interval, "timeout": s.heartbeat_timeout, which: value}
        s.set_heartbeat(both["interval"], both["timeout"])

    return property(read, write)


class _Module(types.ModuleType):
    """This module's type, for its two deprecated settings (the default session holds them)."""

    HEARTBEAT_INTERVAL = _heartbeat_setting("interval")
    HEARTBEAT_TIMEOUT = _heartbeat_setting("timeout")


sys.modules[__name__].__class__ = _Module


def _on_default_session(method: Callable[Concatenate[Session, _P], _R]) -> Callable[_P, _R]:
    """``method`` called on the default session, as a module function with the method's
    docstring and its signature less ``self`` (for ``help()`` and type checkers)."""
    name = method.__name__

    @functools.wraps(method)
    def on_default(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        return getattr(sessions.default_session(), name)(*args, **kwargs)

    signature = inspect.signature(method)
    on_default.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=list(signature.parameters.values())[1:]
    )
    on_default.__module__, on_default.__qualname__ = __name__, name
    return on_default


def set_heartbeat(interval: float = 2.0, timeout: float = 15.0) -> None:
    """Configure failure detection for the default session's connections.

    Parameters
    ----------
    interval : float
        Seconds between heartbeats on a quiet connection.
    timeout : float
        A worker that sent nothing for this long while a request waits on it is lost:
        its batches go to other workers. Workers answer heartbeats from a thread of their
        own, so a long ``__getitem__`` does not count as silence. Must exceed ``interval``.
    """
    sessions.default_session().set_heartbeat(interval, timeout)


def default_session() -> Session:
    """The :class:`~torchfeed.Session` behind this module's functions."""
    return sessions.default_session()


def connect(address: Address, secret: auth.SecretLike = None, timeout: float = 120.0) -> Connection:
    """The default session's connection to ``address`` (see :meth:`Session.connect`)."""
    return sessions.default_session().connect(address, secret, timeout)


def close_all(join_timeout: float = 1.0) -> None:
    """Close every connection of the default session."""
    sessions.default_session().close(join_timeout)


def paths() -> dict[str, str]:
    """How the default session reaches each worker it is connected to (:meth:`Session.paths`)."""
    return sessions.default_session().paths()


def close_connections(addresses: Sequence[Address]) -> None:
    """Close the default session's connections to these workers (before stopping them on purpose).

    Their pending requests fail with :class:`ConnectionClosed`, which loaders do not warn about.
    """
    sessions.default_session().close_connections(addresses)


# Session's methods are the one source of these signatures and docs; the API reference shows
# these names as those functions too (docs/griffe_roles.py: DefaultSessionFunctions)
call = _on_default_session(Session.call)
rpc_async = _on_default_session(Session.rpc_async)


def wait_all(futures: dict[str, torch.futures.Future], timeout: float) -> dict[str, Any]:
    """Wait for futures with one overall deadline; return address -> result or exception."""
    deadline = time.monotonic() + timeout
    out: dict[str, Any] = {}
    for addr, fut in futures.items():
        while not fut.done() and time.monotonic() < deadline:
            time.sleep(0.002)
        if not fut.done():
            out[addr] = Timeout(f"worker {addr} did not answer within {timeout:g} s")
            continue
        try:
            out[addr] = fut.value()
        except Exception as exc:  # noqa: BLE001 - sorted by the caller
            out[addr] = exc
    return out


def worker_stats(address: Address, secret: auth.SecretLike = None, timeout: float = 10.0) -> dict[str, Any]:
    """One worker's statistics (what ``torchfeed top`` shows), over the default session's
    authenticated connection to it."""
    conn = connect(address, secret, timeout)
    done = threading.Event()
    box: list = []

    def got(ok, value):
        box.append((ok, value))
        done.set()

    conn.request(wire.STATS, b"", callback=got, timeout=timeout, policy=JSON_REPLY)
    if not done.wait(timeout + 1.0):
        raise Timeout(f"worker {format_address(address)} did not answer a stats request within {timeout:g} s")
    ok, value = box[0]
    if not ok:
        raise value
    return value
