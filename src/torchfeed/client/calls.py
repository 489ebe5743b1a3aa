"""A call as a session sends it: the function and its arguments packed (by value, with
cloudpickle) and sent as one CALL request on a connection; with ``rref`` the reply is made a
:class:`~torchfeed.client.refs.RemoteRef` to the result the worker keeps.

Threads: :func:`send` runs on the caller's thread, or on the thread that reached a starting
worker (client/reach.py); the callback it wraps runs on the connection's reader thread
(client/connection.py). Nothing here takes a lock.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import SerializationError, WorkerLost
from ..protocol import serialize, wire
from ..protocol.buffers import check_pinnable
from .addresses import Address, format_address
from .connection import Callback, Connection
from .refs import Call, RemoteRef


def pack(address: Address, func: Callable, args, kwargs, pin_memory: bool) -> tuple[bytes, list]:
    """The CALL message's meta and buffers for ``func(*args, **kwargs)``."""
    check_pinnable(pin_memory)
    try:
        return serialize.dumps((func, tuple(args or ()), dict(kwargs or {})), by_value=True)
    except WorkerLost:  # a RemoteRef argument was lost with its connection
        raise
    except Exception as exc:
        raise SerializationError(
            f"the call of {getattr(func, '__qualname__', func)!r} cannot be sent to worker "
            f"{format_address(address)}: its function or arguments cannot be pickled "
            f"({exc})"
        ) from exc


def send(
    conn: Connection,
    meta: bytes,
    buffers: list,
    args,
    kwargs,
    rref: bool,
    pin_memory: bool,
    timeout: float | None,
    callback: Callback,
    policy: Any,
    compression: int,
) -> Call:
    """Send a packed call on ``conn``; ``callback(ok, value)`` receives its outcome."""
    # The arguments stay referenced until the reply: a RemoteRef argument dropped by the
    # caller right away must not be released before the worker used it.
    keep = [args, kwargs]

    def done(ok, value):
        keep.clear()
        if ok and rref:
            value = RemoteRef(conn, value)
        callback(ok, value)

    rid = conn.request(
        wire.CALL,
        meta,
        buffers,
        callback=done,
        flags=wire.FLAG_RREF if rref else 0,
        pin=pin_memory,
        timeout=timeout,
        policy=policy,
        compression=compression,
    )
    return Call(conn, rid)
