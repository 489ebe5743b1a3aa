"""Serialization of calls and replies.

* Calls (function + arguments) use cloudpickle, so lambdas, local functions and
  classes defined in ``__main__`` or inside functions travel by value.
* Replies use pickle protocol 5. Tensors and numpy arrays are reduced to their raw bytes
  as out-of-band buffers: the sender writes them straight from the tensor's memory
  (no copy into the pickle stream) and the receiver reads them straight into one
  preallocated block (pinned when asked), from which the tensors are views.

The meta part starts with nothing but the pickle stream; the frame's buffers are the
out-of-band buffers in the order pickle asked for them.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import threading
import warnings
from collections import ChainMap
from typing import Any, List, Optional, Sequence, Tuple

import cloudpickle
import numpy as np
import torch

from . import buffers

ALIGN = 64  # every buffer starts on a 64-byte boundary of the receive block

_state = threading.local()


# -- tensors and arrays ----------------------------------------------------

def _rebuild_tensor(buf, dtype_name: str, shape: Tuple[int, ...], requires_grad: bool):
    dtype = getattr(torch, dtype_name)
    mv = memoryview(buf)
    if mv.nbytes == 0:
        t = torch.empty(shape, dtype=dtype)
    else:
        flat = torch.from_numpy(np.frombuffer(mv, dtype=np.uint8))
        t = flat.view(dtype).view(shape)
    if requires_grad:
        t.requires_grad_(True)
    return t


def _reduce_tensor(t: torch.Tensor):
    if t.layout != torch.strided or t.is_quantized or t.device.type == "meta" or t.is_nested:
        return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)  # rare kinds: torch's own way
    requires_grad = t.requires_grad
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy()
    dtype_name = str(t.dtype).split(".", 1)[1]
    return _rebuild_tensor, (pickle.PickleBuffer(raw), dtype_name, tuple(t.shape), requires_grad)


def _rebuild_ndarray(buf, dtype, shape):
    return np.frombuffer(memoryview(buf), dtype=np.uint8).view(dtype).reshape(shape)


def _reduce_ndarray(a: np.ndarray):
    if a.dtype.hasobject:
        return a.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    if not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)
    raw = a.reshape(-1).view(np.uint8)
    return _rebuild_ndarray, (pickle.PickleBuffer(raw), a.dtype, a.shape)


_REDUCERS = {torch.Tensor: _reduce_tensor, np.ndarray: _reduce_ndarray}
_PLAIN_TABLE = ChainMap(_REDUCERS, copyreg.dispatch_table)
_CLOUD_TABLE = ChainMap(_REDUCERS, cloudpickle.Pickler.dispatch_table)


def dumps(obj: Any, *, by_value: bool = False) -> Tuple[bytes, List[memoryview]]:
    """Serialize ``obj``; return the pickle stream and the out-of-band buffers.

    ``by_value=True`` uses cloudpickle (for functions, classes, lambdas).
    """
    buffers: List[memoryview] = []

    def keep(pb: pickle.PickleBuffer) -> bool:
        buffers.append(pb.raw())
        return False  # out of band

    out = io.BytesIO()
    if by_value:
        p = cloudpickle.Pickler(out, protocol=5, buffer_callback=keep)
        p.dispatch_table = _CLOUD_TABLE
    else:
        p = pickle.Pickler(out, protocol=5, buffer_callback=keep)
        p.dispatch_table = _PLAIN_TABLE
    p.dump(obj)
    return out.getvalue(), buffers


# -- receiving ---------------------------------------------------------------

_warned_pin = False


def _cuda_pinnable() -> bool:
    global _warned_pin
    if torch.cuda.is_available():
        return True
    if not _warned_pin:
        _warned_pin = True
        warnings.warn(
            "pin_memory=True but CUDA is not available: batches are received into ordinary "
            "memory instead",
            stacklevel=4,
        )
    return False


def allocate(lengths: Sequence[int], pin: bool = False) -> List[memoryview]:
    """One block holding every buffer of a message, each 64-byte aligned.

    With ``pin=True`` and CUDA available the block is page-locked host memory, so the
    tensors rebuilt from it can be copied to the GPU asynchronously.
    """
    offsets = []
    total = 0
    for n in lengths:
        offsets.append(total)
        total += (n + ALIGN - 1) // ALIGN * ALIGN
    if pin and _cuda_pinnable():
        block = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=True)  # torch caches these
    else:
        block = buffers.empty_bytes(max(total, 1))
    arr = block.numpy()
    return [memoryview(arr[o : o + n]) for o, n in zip(offsets, lengths)]


def loads(meta: bytes, buffers: Sequence[memoryview] = ()) -> Any:
    """Inverse of :func:`dumps` with buffers already received."""
    return pickle.loads(meta, buffers=buffers)


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
