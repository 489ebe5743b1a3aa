"""A reply made into its call's outcome: the ``(ok, value)`` a result callback receives.

A reply's frame becomes a value here: a pickle loaded under the call's policy, a JSON object
(``JSON_REPLY``), a remote reference id, or the worker's exception rebuilt; a reply that cannot
be loaded fails its call only. :func:`deliver` then hands the outcome to the callback.

Threads: it runs on a connection's reader thread (:mod:`torchfeed.client.connection`), one
reply at a time, and takes no lock. Before a callback runs, that thread records the reply's
sizes in a thread-local, which :func:`reply_bytes` and :func:`reply_wire` read: a callback
sees the reply it is given, whatever other connections deliver meanwhile.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from ..errors import ProtocolError, SerializationError, UnsafeReplyError
from ..protocol import wire
from ..protocol.errordata import rebuild_remote_error
from ..protocol.replies import SAFE, ReplyPolicy, load_data

log = logging.getLogger("torchfeed.client")

JSON_REPLY = "json"  # request(policy=JSON_REPLY): the reply is JSON (STATS), not a pickle

_delivering = threading.local()


def reply_bytes() -> int:
    """Inside a result callback: the size of the reply being delivered (header excluded)."""
    return getattr(_delivering, "nbytes", 0)


def reply_wire() -> tuple[int, float]:
    """Inside a result callback: the bytes the reply took on the wire (compressed and
    sealed) and the seconds from its header to its last byte."""
    return getattr(_delivering, "wire", (0, 0.0))


def json_object(address: str, meta: bytes) -> dict:
    try:
        value = json.loads(meta)
    except ValueError as exc:
        raise SerializationError(f"worker {address} answered with bytes that are not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise SerializationError(f"worker {address} answered with JSON that is not an object: {value!r:.80}")
    return value


def ref_id(meta: bytes) -> int:
    """The remote reference id of an ``rref`` reply."""
    ref = load_data(meta)
    if type(ref) is not int:
        raise ProtocolError(f"a remote reference reply carries {ref!r:.80} instead of an id")
    return ref


def outcome(address: str, frame: wire.Frame, buffers, policy: Any) -> tuple[bool, Any]:
    """``(ok, value)`` of the reply ``frame`` (its meta and ``buffers`` received) from the
    worker at ``address``, loaded as ``policy`` says (a :class:`~torchfeed.protocol.replies.ReplyPolicy`,
    or ``JSON_REPLY``)."""
    value: Any
    try:
        if frame.kind == wire.ERROR:
            rules = policy if isinstance(policy, ReplyPolicy) else SAFE
            ok, value = False, rebuild_remote_error(address, load_data(frame.meta), policy=rules)
        elif policy == JSON_REPLY:
            ok, value = True, json_object(address, frame.meta)
        elif frame.flags & wire.FLAG_RREF:
            ok, value = True, ref_id(frame.meta)
        else:
            ok, value = True, policy.loads(frame.meta, buffers)
    except UnsafeReplyError as exc:  # nothing was called: say which worker sent it
        ok, value = False, UnsafeReplyError(f"worker {address}: {exc}")
        value.global_name = exc.global_name
        value.global_names = exc.global_names or [exc.global_name]
    except SerializationError as exc:
        ok, value = False, exc
    except Exception as exc:  # an unpicklable reply fails that request only
        ok, value = (
            False,
            SerializationError(
                f"the reply from worker {address} could not be unpickled here: {exc!r}. Classes of the "
                "result must be importable in the trainer too (or be defined in __main__)"
            ),
        )
        value.__cause__ = exc
    return ok, value


def deliver(
    address: str,
    frame: wire.Frame,
    buffers,
    policy: Any,
    callback: Callable[[bool, Any], None],
    wire_bytes: tuple[int, float] = (0, 0.0),
) -> None:
    """Hand the reply's outcome to ``callback``; ``wire_bytes`` is what :func:`reply_wire`
    then says (the reply's bytes on the wire, and seconds from its header to its last byte)."""
    ok, value = outcome(address, frame, buffers, policy)
    _delivering.nbytes = frame.size  # [stats hook] read by the callback: reply_bytes()
    _delivering.wire = wire_bytes  # and reply_wire()
    try:
        callback(ok, value)
    except Exception:
        log.exception("a result callback failed")
