"""The functions a reply names to rebuild tensors, arrays, dtypes and numpy scalars.

A worker's pickler reduces these objects to calls of the functions below with plain
arguments (serialize.py); the trainer's restricted unpickler (replies.py) calls nothing
else of torch's or numpy's. Each function checks what it is given, since a hostile worker
chooses the arguments: a dtype arrives as a description (a string, or lists and dicts of
them) from which numpy builds and checks a fresh dtype, never as a dtype object whose state
the pickle could set; a tensor's elements must lie in the bytes that arrived.

The unpickler cannot stop a pickle from applying BUILD (``__setstate__`` or attribute
updates) to an object these functions return, so :class:`Made` records what they made and
:meth:`Made.check` refuses a load in which one of them was changed after it was made.
"""

from __future__ import annotations

import collections
import math
from typing import Any

import numpy as np
import torch

from ..errors import UnsafeReplyError

# a tensor's elements may exceed the bytes that arrived (a broadcast tensor: stride 0) by at
# most this much; the worker sends larger broadcasts dense (serialize.py)
BROADCAST_SLACK = 64 << 20

# torch's dtypes by name (vars(): no lookup that runs torch's module-level __getattr__);
# not the quantized ones, which travel as torch pickles them (and are not loaded)
TORCH_DTYPES = {
    str(d).split(".", 1)[1]: d
    for d in vars(torch).values()
    if isinstance(d, torch.dtype) and not str(d).startswith(("torch.qint", "torch.quint"))
}

# torch's layouts by their str() ("torch.sparse_coo"), as torch.serialization._get_layout
# names them in a sparse tensor's reduction
TORCH_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}

_MAX_DTYPE_DEPTH = 8
_MAX_DTYPE_PARTS = 4096


def rebuild_layout(name: Any) -> torch.layout:
    """A torch layout by its name (what a reply naming torch.serialization._get_layout gets)."""
    found = TORCH_LAYOUTS.get(name) if isinstance(name, str) else None
    if found is None:
        raise UnsafeReplyError(f"the reply names an unknown torch layout {name!r:.80}")
    return found


def check_sizes(what: str, values) -> None:
    if not (isinstance(values, tuple) and all(type(v) is int and v >= 0 for v in values)):
        raise UnsafeReplyError(f"a {what} in the reply is not a tuple of sizes: {values!r:.200}")


# -- dtypes --------------------------------------------------------------------------------


def dtype_spec(d: np.dtype) -> Any:
    """A numpy dtype as plain data (the worker side of :func:`dtype_from_spec`)."""
    if d.fields is not None:
        names = list(d.names or ())
        fields = [d.fields[n] for n in names]
        spec: dict[str, Any] = {
            "names": names,
            "formats": [dtype_spec(f[0]) for f in fields],
            "offsets": [f[1] for f in fields],
            "itemsize": d.itemsize,
            "aligned": bool(d.isalignedstruct),
        }
        if any(len(f) > 2 for f in fields):
            spec["titles"] = [f[2] if len(f) > 2 else None for f in fields]
        return spec
    if d.subdtype is not None:
        base, shape = d.subdtype
        return ["sub", dtype_spec(base), list(shape)]
    return d.str


def dtype_from_spec(spec: Any, depth: int = 0, budget: list[int] | None = None) -> np.dtype:
    """A fresh numpy dtype from :func:`dtype_spec`'s description; no object dtypes."""
    if budget is None:
        budget = [_MAX_DTYPE_PARTS]  # parts in all: a shared description may not fan out
    budget[0] -= 1
    if depth > _MAX_DTYPE_DEPTH or budget[0] < 0:
        raise UnsafeReplyError(
            f"a dtype in the reply nests more than {_MAX_DTYPE_DEPTH} deep or has more than "
            f"{_MAX_DTYPE_PARTS} fields and subarrays in all"
        )
    if isinstance(spec, str):
        if len(spec) > 256:  # "u1,u1,..." parses into fields: a long string is not a plain dtype
            raise UnsafeReplyError(f"a dtype in the reply is described by a {len(spec)}-character string")
        d = np.dtype(spec)
    elif isinstance(spec, list) and len(spec) == 3 and spec[0] == "sub" and isinstance(spec[2], list):
        shape = tuple(spec[2])
        check_sizes("subarray shape", shape)
        d = np.dtype((dtype_from_spec(spec[1], depth + 1, budget), shape))
    elif isinstance(spec, dict) and _plain_fields(spec):
        described: dict[str, Any] = {
            "names": spec["names"],
            "formats": [dtype_from_spec(f, depth + 1, budget) for f in spec["formats"]],
            "offsets": spec["offsets"],
            "itemsize": spec["itemsize"],
        }
        if "titles" in spec:
            described["titles"] = spec["titles"]
        d = np.dtype(described, align=spec.get("aligned") is True)  # type: ignore[call-overload]
    else:
        raise UnsafeReplyError(f"a dtype in the reply is described by {spec!r:.200}, not a dtype description")
    if d.hasobject:
        raise UnsafeReplyError(
            f"a dtype in the reply holds Python objects ({d}): only plain numpy dtypes load"
        )
    return d


def _plain_fields(spec: dict) -> bool:
    names, formats, offsets = spec.get("names"), spec.get("formats"), spec.get("offsets")
    titles = spec.get("titles", [])
    return (
        isinstance(names, list)
        and all(type(n) is str for n in names)
        and isinstance(formats, list)
        and isinstance(offsets, list)
        and all(type(o) is int for o in offsets)
        and len(names) == len(formats) == len(offsets)
        and type(spec.get("itemsize")) is int
        and isinstance(titles, list)
        and all(t is None or type(t) is str for t in titles)
    )


def rebuild_dtype(spec: Any) -> np.dtype:
    # what replies name: the description only (a pickle may not pass dtype_from_spec's budget)
    return dtype_from_spec(spec)


# -- tensors and arrays --------------------------------------------------------------------


def rebuild_tensor(
    buf, dtype_name: str, shape: tuple[int, ...], requires_grad: bool, stride: tuple[int, ...] | None = None
) -> torch.Tensor:
    dtype = TORCH_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise UnsafeReplyError(f"a tensor in the reply names {dtype_name!r:.80}, which is not a torch dtype")
    check_sizes("tensor shape", shape)
    if stride is not None:
        check_sizes("tensor stride", stride)
    if type(requires_grad) is not bool:
        raise UnsafeReplyError(f"a tensor in the reply has requires_grad={requires_grad!r:.80}")
    mv = memoryview(buf)
    numel = math.prod(shape)
    if mv.nbytes == 0:
        if numel:
            raise UnsafeReplyError(f"a tensor of {numel} elements in the reply arrived without its bytes")
        # on numpy's memory, as every other one: a storage that cannot be resized (a pickle's
        # BUILD -> Tensor.__setstate__ -> set_() could make torch.empty's grow at will)
        flat = torch.from_numpy(np.empty(dtype.itemsize, dtype=np.uint8)).view(dtype)[:0]
    elif numel * dtype.itemsize > 2 * mv.nbytes + BROADCAST_SLACK:
        raise UnsafeReplyError(
            f"a tensor in the reply has {numel} elements of {dtype} over {mv.nbytes} bytes that arrived"
        )
    else:
        flat = torch.from_numpy(np.frombuffer(mv, dtype=np.uint8)).view(dtype)
    t = flat.view(shape) if stride is None else flat.as_strided(shape, stride)
    if requires_grad:
        t.requires_grad_(True)
    return t


def rebuild_ndarray(buf, spec: Any, shape: tuple[int, ...]) -> np.ndarray:
    dtype = dtype_from_spec(spec)
    check_sizes("array shape", shape)
    return np.frombuffer(memoryview(buf), dtype=np.uint8).view(dtype).reshape(shape)


def rebuild_object_array(items: list, shape: tuple[int, ...]) -> np.ndarray:
    check_sizes("array shape", shape)
    if not isinstance(items, list):
        raise UnsafeReplyError(
            f"an object array in the reply carries {type(items).__name__} instead of a list"
        )
    out = np.empty(len(items), dtype=object)
    for i, item in enumerate(items):  # one by one: numpy would make nested sequences dimensions
        out[i] = item
    return out.reshape(shape)


def rebuild_np_scalar(spec: Any, data: bytes) -> Any:
    dtype = dtype_from_spec(spec)
    if not isinstance(data, bytes) or len(data) != dtype.itemsize:
        raise UnsafeReplyError(f"a numpy scalar of dtype {dtype} in the reply has {len(data)!r} bytes")
    return np.frombuffer(data, dtype=dtype)[0].copy()


# -- what was made, checked after the load ------------------------------------------------------


class Made:
    """The objects one load made with the functions above, to check once it is done."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.arrays: list[tuple[np.ndarray, np.dtype, tuple]] = []
        self.dtypes: list[np.dtype] = []
        self.dicts: list[collections.OrderedDict] = []

    def tensor(self, *args) -> torch.Tensor:
        t = rebuild_tensor(*args)
        self.tensors.append(t)
        return t

    def object_array(self, *args) -> np.ndarray:
        a = rebuild_object_array(*args)
        self.arrays.append((a, a.dtype, a.shape))
        return a

    def ndarray(self, *args) -> np.ndarray:
        a = rebuild_ndarray(*args)
        self.arrays.append((a, a.dtype, a.shape))
        return a

    def dtype(self, spec: Any) -> np.dtype:
        d = rebuild_dtype(spec)
        self.dtypes.append(d)
        return d

    def ordered_dict(self, *args) -> collections.OrderedDict:
        od: collections.OrderedDict = collections.OrderedDict(*args)
        self.dicts.append(od)
        return od

    def check(self) -> None:
        """Refuse the load if a pickle changed (BUILD) an object after it was made here."""
        for t in self.tensors:  # (their storages cannot be resized: BUILD's set_() cannot grow them)
            if t._backward_hooks:
                raise UnsafeReplyError("a tensor in the reply was given gradient hooks after it was made")
        for a, dtype, shape in self.arrays:
            if a.dtype is not dtype or a.shape != shape:
                raise UnsafeReplyError(
                    "an array in the reply was given another dtype or shape after it was made"
                )
        for d in self.dtypes:
            if d.hasobject or d.__reduce__() != dtype_from_spec(dtype_spec(d)).__reduce__():
                raise UnsafeReplyError("a dtype in the reply was changed after it was made")
        for od in self.dicts:
            if vars(od):
                raise UnsafeReplyError("an OrderedDict in the reply was given attributes after it was made")
