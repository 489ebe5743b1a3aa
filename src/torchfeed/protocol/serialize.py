"""Serialization of calls and replies.

* Calls (function + arguments) use cloudpickle, so lambdas, local functions and
  classes defined in ``__main__`` or inside functions travel by value.
* Replies use pickle protocol 5. Tensors and numpy arrays are reduced to their raw bytes
  as out-of-band buffers: the sender writes them straight from the tensor's memory
  (no copy into the pickle stream) and the receiver reads them straight into one
  preallocated block (pinned when asked), from which the tensors are views.

The meta part starts with nothing but the pickle stream; the frame's buffers are the
out-of-band buffers in the order pickle asked for them. The trainer loads replies with
a restricted unpickler (replies.py): what a pickle here may name for it to load by
default is listed there.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import sys
import threading
import types
from collections import ChainMap
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle
import numpy as np
import torch

from . import tracebacks
from .rebuild import (
    BROADCAST_SLACK,
    dtype_spec,
    rebuild_dtype,
    rebuild_ndarray,
    rebuild_np_scalar,
    rebuild_object_array,
    rebuild_tensor,
)
from .replies import known_class, rebuild_class

_state = threading.local()


# -- tensors and arrays ----------------------------------------------------


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BIT_DTYPES = {
    getattr(torch, n) for n in [f"{p}int{b}" for p in ("", "u") for b in range(1, 8)] if hasattr(torch, n)
}


def _span(t: torch.Tensor) -> int:
    """Elements of storage from ``t``'s first element to its last (strides are never negative)."""
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def _dense(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` without gaps, its dimensions laid out in the same order as in ``t``."""
    strides = t.stride()
    order = sorted(range(t.dim()), key=lambda d: -strides[d])
    back = sorted(range(t.dim()), key=order.__getitem__)
    return t.permute(order).contiguous().permute(back)


def _reduce_tensor(t: torch.Tensor):
    """A tensor's bytes as one out-of-band buffer, and how to view them again.

    Strides travel with the bytes, as they do through torch's DataLoader: a tensor laid out
    densely in another dimension order (channels_last, transposed) or broadcast (stride 0)
    arrives with the same strides, its memory sent as it is. So does a tensor with gaps (a
    strided slice of a larger one) while the memory from its first element to its last is
    at most twice its elements; beyond that (a few columns of a wide tensor) it is sent
    compact, in the same dimension order: only its elements travel, not the storage around
    them (torch's worker processes share the whole storage; a network should not carry it).
    """
    if t.layout != torch.strided or t.is_quantized or t.device.type == "meta" or t.is_nested:
        return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)  # rare kinds: torch's own way
    requires_grad = t.requires_grad
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg()
    dtype_name = str(t.dtype).split(".", 1)[1]
    if t.is_contiguous() or t.numel() == 0:
        pass
    elif t.dtype in _BIT_DTYPES:
        # sub-byte integer dtypes (int1..uint7) have no contiguous(): copy as same-size ints
        t = t.view(_INT_OF_SIZE[t.element_size()]).contiguous().view(t.dtype)
    else:
        span = _span(t)
        # gaps (more memory than elements), or a broadcast the trainer would refuse (far more
        # elements than memory: rebuild.BROADCAST_SLACK): only the elements travel
        if span > 2 * t.numel() or (t.numel() - 2 * span) * t.element_size() > BROADCAST_SLACK:
            t = _dense(t)
        memory = t.as_strided((_span(t),), (1,)).view(torch.uint8).numpy()
        return rebuild_tensor, (_buffer(memory), dtype_name, tuple(t.shape), requires_grad, t.stride())
    raw = t.reshape(-1).view(torch.uint8).numpy()
    return rebuild_tensor, (_buffer(raw), dtype_name, tuple(t.shape), requires_grad)


def _reduce_ndarray(a: np.ndarray):
    if type(a) is not np.ndarray:  # np.memmap (a memory-mapped file's slice): its values
        a = np.asarray(a)
    if a.dtype == object:  # its items as a list: each pickled (and loaded) on its own terms
        return rebuild_object_array, (list(a.reshape(-1)), a.shape)
    if a.dtype.hasobject:  # structured with object fields: numpy's own way
        return a.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    if not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)
    raw = a.reshape(-1).view(np.uint8)
    return rebuild_ndarray, (_buffer(raw), dtype_spec(a.dtype), a.shape)


# numpy dtypes and scalars travel as descriptions (rebuild.py): the trainer builds fresh ones
def _reduce_dtype(d: np.dtype):
    return rebuild_dtype, (dtype_spec(d),)


def _reduce_np_scalar(x: np.generic):
    return rebuild_np_scalar, (dtype_spec(x.dtype), x.tobytes())


def _subclasses(cls: type) -> set[type]:
    out: set[type] = set()
    todo: list[type] = [cls]
    while todo:
        subs: list[type] = todo.pop().__subclasses__()
        for sub in subs:
            if sub not in out:
                out.add(sub)
                todo.append(sub)
    return out


def _buffer(raw: np.ndarray) -> pickle.PickleBuffer:
    """An out-of-band buffer over a contiguous array, without a copy."""
    # numpy declares the buffer protocol to type checkers only for Python >= 3.12
    return pickle.PickleBuffer(raw)  # type: ignore[arg-type,unused-ignore]


class OpenFileError(pickle.PicklingError):
    """An open file object was to be pickled: it cannot travel, its path can."""


def _reduce_file(f: io.IOBase):
    """Open files are refused (cloudpickle would send a copy of a text file's content read
    here); standard output and error stay references to the receiving process's own."""
    for name in ("stdout", "stderr"):
        if f is getattr(sys, name) or f is getattr(sys, f"__{name}__"):
            return getattr, (sys, name)
    raise OpenFileError(
        f"an open file ({getattr(f, 'name', '?')}, mode {getattr(f, 'mode', '?')!r}), and a file object "
        "cannot be sent to another process: pass its path and open it in the dataset (on the worker: in "
        "__init__, or on first use in __getitem__)"
    )


_REDUCERS: dict[type, Callable[[Any], Any]] = {
    torch.Tensor: _reduce_tensor,
    np.ndarray: _reduce_ndarray,
    np.memmap: _reduce_ndarray,
    **dict.fromkeys({np.dtype, *_subclasses(np.dtype)}, _reduce_dtype),
    **dict.fromkeys(_subclasses(np.generic) - {np.object_}, _reduce_np_scalar),
    **dict.fromkeys(
        (io.TextIOWrapper, io.BufferedReader, io.BufferedWriter, io.BufferedRandom, io.FileIO), _reduce_file
    ),
}


# The C pickler reads ``dispatch_table`` once, in __init__: it must be a class attribute.
class _Pickler(pickle.Pickler):
    # copyreg's table is typed with narrower reducers than Callable[[Any], Any]; same at run time
    dispatch_table = ChainMap(_REDUCERS, copyreg.dispatch_table)  # type: ignore[arg-type]
    buffers: list[memoryview]  # set by dumps() (the bytes-apart picklers append to it)


# cloudpickle's own reducer of code objects (by value): cloudpickle 3 names their file
# "<dynamic-code>"; wrapped, they keep their real file name and the worker knows them as
# the trainer's code (tracebacks.py renders their frames from the trainer's source).
_CODE_REDUCE = cloudpickle.Pickler.dispatch_table.get(types.CodeType)


def _reduce_code(code: types.CodeType):
    assert _CODE_REDUCE is not None  # only installed when cloudpickle has one
    reduced = _CODE_REDUCE(code)
    if not (isinstance(reduced, tuple) and len(reduced) == 2):
        return reduced  # a form this wrapper does not know: cloudpickle's own
    make, args = reduced
    tracebacks.sending(code.co_filename)
    return tracebacks.rebuild_code, (make, args, code.co_filename)


_BY_VALUE: dict[type, Callable[[Any], Any]] = {types.CodeType: _reduce_code} if _CODE_REDUCE else {}


class _CloudPickler(cloudpickle.Pickler):
    dispatch_table = ChainMap(_REDUCERS, _BY_VALUE, cloudpickle.Pickler.dispatch_table)

    def reducer_override(self, obj):
        reduced = super().reducer_override(obj)
        # cloudpickle 3 rebuilds a class sent by value with its __name__ as its __qualname__:
        # keep the real one (a class of a function, "f.<locals>.Point"), the name its
        # instances come back under and are allowed by (replies.py)
        if isinstance(obj, type) and isinstance(reduced, tuple) and len(reduced) == 6:
            state = reduced[2]
            if isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], dict):
                state = ({**state[0], "__qualname__": obj.__qualname__}, state[1])
                reduced = (*reduced[:2], state, *reduced[3:])
        return reduced


class _ReplyCloudPickler(_CloudPickler):
    """A reply's classes that cannot be named (they reached this worker by value) travel
    under their name and by value apart: a trainer that restricts what it loads looks the
    name up in what it allows and never loads the value (replies.py)."""

    def reducer_override(self, obj):
        if isinstance(obj, type) and not known_class(obj):
            name = f"{obj.__module__}.{obj.__qualname__}"
            return rebuild_class, (name, cloudpickle.dumps(obj, protocol=5))
        return super().reducer_override(obj)


# ``bytes`` never reach a pickler's dispatch table (the C pickler writes them inline), but
# every object passes persistent_id first: large ones go out of band that way.
_BYTES_APART = 64 * 1024  # bytes/bytearray at least this long travel as raw buffers...
_RETRY_APART = 1 << 20  # ...when the pickle of a reply would otherwise exceed this


class _BytesApart:
    """persistent_id that sends large bytes/bytearray objects as out-of-band buffers."""

    buffers: list[memoryview]

    def persistent_id(self, obj):
        kind = type(obj)
        if (kind is bytes or kind is bytearray) and len(obj) >= _BYTES_APART:
            self.buffers.append(memoryview(obj))
            return ("torchfeed-bytes", kind is bytearray)
        return None


class _PicklerApart(_BytesApart, _Pickler):
    pass


class _CloudPicklerApart(_BytesApart, _CloudPickler):
    pass


class _ReplyCloudPicklerApart(_BytesApart, _ReplyCloudPickler):
    pass


_PICKLERS = {  # (by_value, bytes_apart, reply)
    (False, False, False): _Pickler,
    (True, False, False): _CloudPickler,
    (False, True, False): _PicklerApart,
    (True, True, False): _CloudPicklerApart,
    (True, False, True): _ReplyCloudPickler,
    (True, True, True): _ReplyCloudPicklerApart,
}


def dumps(
    obj: Any, *, by_value: bool = False, bytes_apart: bool = False, reply: bool = False
) -> tuple[bytes, list[memoryview]]:
    """Serialize ``obj``; return the pickle stream and the out-of-band buffers.

    ``by_value=True`` uses cloudpickle (for functions, classes, lambdas); ``bytes_apart``
    sends large ``bytes`` and ``bytearray`` objects as buffers too (read with
    :meth:`torchfeed.protocol.replies.ReplyPolicy.loads`); ``reply`` (with ``by_value``) sends
    classes that cannot be named apart (see ``_ReplyCloudPickler``).
    """
    buffers: list[memoryview] = []

    def keep(pb: pickle.PickleBuffer) -> bool:
        buffers.append(pb.raw())
        return False  # out of band

    out = io.BytesIO()
    pickler = _PICKLERS[by_value, bytes_apart, reply and by_value](out, protocol=5, buffer_callback=keep)
    pickler.buffers = buffers  # one list: buffers stay in the order the unpickler asks for them
    pickler.dump(obj)
    return out.getvalue(), buffers


def dumps_reply(obj: Any) -> tuple[bytes, list[memoryview]]:
    """Serialize a result: plain pickle (fast), by value when it needs to be.

    A result may be an instance of a class that reached the worker by value (defined in
    the trainer's ``__main__`` or in a function): the class travels back under its name
    (what a trainer that restricts its loads allows it by) and by value (for a trainer
    that trusts the worker). A result whose pickle is large is pickled again with
    its large ``bytes`` as raw buffers (encoded images or audio: no copy, no 4 GiB bound).
    """
    by_value = False
    try:
        meta, buffers = dumps(obj)
    except (pickle.PicklingError, AttributeError, TypeError):
        by_value = True
        meta, buffers = dumps(obj, by_value=True, reply=True)
    if len(meta) > _RETRY_APART:
        del meta, buffers
        meta, buffers = dumps(obj, by_value=by_value, bytes_apart=True, reply=True)
    return meta, buffers


# -- receiving (the receive block itself comes from buffers.allocate; replies: replies.py) ----


def loads_call(meta: bytes, buffers: Sequence[memoryview], registry) -> Any:
    """Unpickle a call on a worker; remote references resolve against ``registry``."""
    _state.registry = registry
    try:
        return pickle.loads(meta, buffers=buffers)
    finally:
        _state.registry = None


def resolve_reference(ref_id: int, address: str):
    """Rebuild hook of :class:`torchfeed.client.RemoteRef` on the worker side."""
    registry = getattr(_state, "registry", None)
    if registry is None:
        raise pickle.UnpicklingError(
            f"a remote reference to an object on worker {address} can only be used as an "
            "argument of calls to that same worker"
        )
    return registry.get(ref_id, address)
