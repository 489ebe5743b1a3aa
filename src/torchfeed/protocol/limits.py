"""How large a reply (worker -> trainer) may be: one setting, enforced on both ends.

The trainer's connections refuse replies above :func:`reply_limits`; the loader hands the
same limits to its worker-side fetchers, which check a reply before sending it and send
a clear error instead (:class:`~torchfeed.FrameTooLarge`, naming the size, the limit and
this knob) rather than a frame the trainer would have to drop with its connection.

Replies carry tensors, numpy arrays and large ``bytes`` as raw buffers; the rest of the
result is one pickle (the "meta" part), which the wire format limits to 4 GiB.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from ..errors import FrameTooLarge
from ..util import env_int
from .wire import Limits

WIRE_MAX_META = (1 << 32) - 1  # the header's meta length is 32 bits
WIRE_MAX_BUFFERS = (1 << 32) - 1

# each limit: (environment variable, default, least allowed, most allowed)
ENVIRONMENT = {
    "max_meta": ("TORCHFEED_MAX_REPLY_META", WIRE_MAX_META, 1, WIRE_MAX_META),
    "max_buffers": ("TORCHFEED_MAX_REPLY_BUFFERS", 1 << 20, 0, WIRE_MAX_BUFFERS),
    "max_buffer_bytes": ("TORCHFEED_MAX_REPLY_BYTES", 64 << 30, 0, None),
}
_lock = threading.Lock()
_current: Limits | None = None  # read from the environment on first use, not at import


def _from_environment() -> Limits:
    return Limits(
        max_meta=env_int(*ENVIRONMENT["max_meta"]),
        max_buffers=env_int(*ENVIRONMENT["max_buffers"]),
        max_buffer_bytes=env_int(*ENVIRONMENT["max_buffer_bytes"]),
    )


def _limits() -> Limits:
    """The current limits (under ``_lock``): the environment's until set_reply_limits changes them."""
    global _current
    if _current is None:
        _current = _from_environment()
    return _current


KNOB = "torchfeed.set_reply_limits"


def reply_limits() -> Limits:
    """The limits this process accepts for replies (read from ``TORCHFEED_MAX_REPLY_*`` first)."""
    with _lock:
        return _limits()


def lowered() -> bool:
    """Whether any reply limit is below its default (the user bounds batches)."""
    current = reply_limits()
    return any(getattr(current, name) < ENVIRONMENT[name][1] for name in ENVIRONMENT)


def set_reply_limits(
    max_meta_bytes: int | None = None, max_buffers: int | None = None, max_buffer_bytes: int | None = None
) -> Limits:
    """Set how large a reply from a worker may be; return the previous limits.

    Call it before creating loaders (their workers learn the limits when a loader first
    uses them).

    Parameters
    ----------
    max_meta_bytes : int, optional
        The pickled part of a reply: everything except tensors, numpy arrays and large
        ``bytes``/``bytearray`` objects. At most 4 GiB - 1 (the wire format's bound, the
        default); environment: ``TORCHFEED_MAX_REPLY_META``.
    max_buffers : int, optional
        Number of raw buffers in one reply (default 1,048,576; ``TORCHFEED_MAX_REPLY_BUFFERS``).
    max_buffer_bytes : int, optional
        Total bytes of the raw buffers of one reply (default 64 GiB; ``TORCHFEED_MAX_REPLY_BYTES``).
    """
    global _current
    with _lock:
        previous = _limits()
        meta = previous.max_meta if max_meta_bytes is None else int(max_meta_bytes)
        count = previous.max_buffers if max_buffers is None else int(max_buffers)
        total = previous.max_buffer_bytes if max_buffer_bytes is None else int(max_buffer_bytes)
        if not 0 < meta <= WIRE_MAX_META:
            raise ValueError(
                f"max_meta_bytes must be in [1, {WIRE_MAX_META}] (the wire format's bound), got {meta}"
            )
        if not 0 <= count <= WIRE_MAX_BUFFERS or total < 0:
            raise ValueError(f"max_buffers and max_buffer_bytes must be >= 0, got {count} and {total}")
        _current = Limits(max_meta=meta, max_buffers=count, max_buffer_bytes=total)
        return previous


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit} ({n:,} bytes)"
    return f"{n:,} bytes"


def check_reply(meta: bytes, buffers: Sequence, limits: Limits | None = None) -> None:
    """Raise :class:`FrameTooLarge` (a clear message) if a reply exceeds ``limits``."""
    limits = limits or reply_limits()
    meta_cap = min(limits.max_meta, WIRE_MAX_META)
    if len(meta) > meta_cap:
        raise FrameTooLarge(
            f"the result is too large to send: its pickled part (everything except tensors, numpy arrays "
            f"and large bytes) is {_size(len(meta))}, over the reply limit of {_size(meta_cap)}. Raise the "
            f"limit in the trainer with {KNOB}(max_meta_bytes=...) (at most 4 GiB, the wire format's bound), "
            "or return such data as tensors, numpy arrays or bytes, which travel as raw buffers"
        )
    if len(buffers) > limits.max_buffers:
        raise FrameTooLarge(
            f"the result is too large to send: it has {len(buffers):,} raw buffers (tensors, arrays, large "
            f"bytes), over the reply limit of {limits.max_buffers:,}. Raise it in the trainer with "
            f"{KNOB}(max_buffers=...), or collate the samples into fewer, larger tensors"
        )
    total = sum(memoryview(b).nbytes for b in buffers)
    if total > limits.max_buffer_bytes:
        raise FrameTooLarge(
            f"the result is too large to send: its raw buffers (tensors, arrays, large bytes) hold "
            f"{_size(total)}, over the reply limit of {_size(limits.max_buffer_bytes)}. Raise it in the "
            f"trainer with {KNOB}(max_buffer_bytes=...), or use smaller batches"
        )
