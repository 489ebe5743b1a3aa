"""The functions a reply names to rebuild tensors, arrays, dtypes and numpy scalars.

A worker's pickler reduces these objects to calls of the functions below with plain
arguments (serialize.py); the trainer's restricted unpickler (replies.py) calls nothing
else of torch's or numpy's. Each function checks what it is given, since a hostile worker
chooses the arguments: a dtype arrives as a description (a string, or lists and dicts of
them) from which numpy builds and checks a fresh dtype, never as a dtype object whose state
the pickle could set; a tensor's elements must lie in the bytes that arrived.

Sparse tensors (COO, CSR, CSC, BSR, BSC) arrive as torch reduces them, naming
``torch._utils._rebuild_sparse_tensor``; the unpickler calls :func:`rebuild_sparse_tensor`
instead, which takes dense tensors made here and checks the sparse invariants (indices
within the size, compressed indices ordered, a coalesced flag that is true), as torch's own
loads do under ``torch.sparse.check_sparse_tensor_invariants``: a tensor that broke them
would read and write out of bounds when used.

Every other callable a reply may name that takes arguments (``complex``, ``torch.Size``,
``torch.device``, ``collections.OrderedDict``: replies.py) is given only plain values
(:func:`check_plain`): an object of a class could answer their ``__complex__``,
``__index__``, ``__iter__``, ``keys`` and ``__getitem__`` with code of its own.

The unpickler cannot stop a pickle from applying BUILD (``__setstate__`` or attribute
updates) to an object these functions return, nor from changing the bytes of a
``bytearray`` a tensor views (SETITEMS), so :class:`Made` records what they made and
:meth:`Made.check` refuses a load in which one of them was changed after it was made, and
checks each sparse tensor's invariants again once the load is done.
"""

from __future__ import annotations

import collections
import math
from typing import Any

import numpy as np
import torch

from ..errors import UnsafeReplyError
from . import limits

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

# what a worker's pickle passes to the builtins and torch types a reply may call (replies.py)
_PLAIN = (int, float, str, bytes, bool, type(None))


def shown(value: Any, limit: int = 200) -> str:
    """``value`` for an error message, without running code of the reply's: the repr of a
    plain value (or a short tuple or list of them), else what it is."""
    kind = type(value)
    if kind in (str, bytes) and len(value) > limit:
        return f"{value[:limit]!r}..."
    few = kind in (tuple, list) and len(value) <= 32 and all(_short(v, limit) for v in value)
    if kind in _PLAIN or few:
        text = repr(value)
        return text if len(text) <= limit else f"{text[:limit]}..."
    if kind in (tuple, list):
        return f"a {kind.__qualname__} of {len(value)} items"
    return f"a {kind.__qualname__:.80}"


def _short(value: Any, limit: int) -> bool:
    return type(value) in _PLAIN and not (type(value) in (str, bytes) and len(value) > limit)


def check_plain(what: str, value: Any) -> None:
    """Refuse ``value`` unless it is plain: exactly an int, float, str, bytes, bool or None,
    or a tuple or list of plain values (each container walked once: shared or cyclic ones
    cost nothing more). ``what`` names the callable it is for."""
    todo, seen = [value], set()
    while todo:
        item = todo.pop()
        kind = type(item)
        if kind in _PLAIN:
            continue
        if kind not in (tuple, list):
            raise UnsafeReplyError(
                f"the reply calls {what} with a {kind.__qualname__:.80} value: a worker's pickle passes it "
                "only numbers, strings, bytes, None and tuples and lists of them, so this reply was "
                "crafted (the worker may be compromised)"
            )
        if id(item) not in seen:
            seen.add(id(item))
            todo.extend(item)


def rebuild_layout(name: Any) -> torch.layout:
    """A torch layout by its name (what a reply naming torch.serialization._get_layout gets)."""
    found = TORCH_LAYOUTS.get(name) if type(name) is str else None
    if found is None:
        raise UnsafeReplyError(f"the reply names an unknown torch layout {shown(name, 80)}")
    return found


def check_sizes(what: str, values) -> None:
    if not (type(values) in (tuple, torch.Size) and all(type(v) is int and v >= 0 for v in values)):
        raise UnsafeReplyError(f"a {what} in the reply is not a tuple of sizes: {shown(values)}")


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
    if type(spec) is str:
        if len(spec) > 256:  # "u1,u1,..." parses into fields: a long string is not a plain dtype
            raise UnsafeReplyError(f"a dtype in the reply is described by a {len(spec)}-character string")
        d = np.dtype(spec)
    elif type(spec) is list and len(spec) == 3 and spec[0] == "sub" and type(spec[2]) is list:
        shape = tuple(spec[2])
        check_sizes("subarray shape", shape)
        d = np.dtype((dtype_from_spec(spec[1], depth + 1, budget), shape))
    elif type(spec) is dict and _plain_fields(spec):
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
        raise UnsafeReplyError(f"a dtype in the reply is described by {shown(spec)}, not a dtype description")
    if d.hasobject:
        raise UnsafeReplyError(
            f"a dtype in the reply holds Python objects ({d}): only plain numpy dtypes load"
        )
    return d


def _plain_fields(spec: dict) -> bool:
    names, formats, offsets = spec.get("names"), spec.get("formats"), spec.get("offsets")
    titles = spec.get("titles", [])
    return (
        type(names) is list
        and all(type(n) is str for n in names)
        and type(formats) is list
        and type(offsets) is list
        and all(type(o) is int for o in offsets)
        and len(names) == len(formats) == len(offsets)
        and type(spec.get("itemsize")) is int
        and type(titles) is list
        and all(t is None or type(t) is str for t in titles)
    )


def rebuild_dtype(spec: Any) -> np.dtype:
    # what replies name: the description only (a pickle may not pass dtype_from_spec's budget)
    return dtype_from_spec(spec)


# -- tensors and arrays --------------------------------------------------------------------


def rebuild_tensor(
    buf, dtype_name: str, shape: tuple[int, ...], requires_grad: bool, stride: tuple[int, ...] | None = None
) -> torch.Tensor:
    dtype = TORCH_DTYPES.get(dtype_name) if type(dtype_name) is str else None
    if dtype is None:
        raise UnsafeReplyError(
            f"a tensor in the reply names {shown(dtype_name, 80)}, which is not a torch dtype"
        )
    check_sizes("tensor shape", shape)
    if stride is not None:
        check_sizes("tensor stride", stride)
    if type(requires_grad) is not bool:
        raise UnsafeReplyError(f"a tensor in the reply has requires_grad={shown(requires_grad, 80)}")
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
    if type(items) is not list:
        raise UnsafeReplyError(
            f"an object array in the reply carries {type(items).__name__} instead of a list"
        )
    out = np.empty(len(items), dtype=object)
    for i, item in enumerate(items):  # one by one: numpy would make nested sequences dimensions
        out[i] = item
    return out.reshape(shape)


def rebuild_np_scalar(spec: Any, data: bytes) -> Any:
    dtype = dtype_from_spec(spec)
    if type(data) is not bytes or len(data) != dtype.itemsize:
        size = f"{len(data)} bytes" if type(data) is bytes else f"a {type(data).__qualname__:.80}"
        raise UnsafeReplyError(f"a numpy scalar of dtype {dtype} in the reply has {size}")
    return np.frombuffer(data, dtype=dtype)[0].copy()


# -- sparse tensors ---------------------------------------------------------------------------

_COMPRESSED = frozenset((torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc))


def sparse_parts(layout: Any, data: Any) -> tuple:
    """``data``, the parts torch reduces a sparse tensor of ``layout`` to (COO: ``(indices,
    values, size, is_coalesced)``; CSR, CSC, BSR, BSC: ``(compressed_indices, plain_indices,
    values, size)``), checked, its tensors replaced by views of the same bytes that the pickle
    cannot reach (a BUILD could point its own at other bytes: set_())."""
    sparse = type(layout) is torch.layout and (layout is torch.sparse_coo or layout in _COMPRESSED)
    if not (sparse and type(data) is tuple and len(data) == 4):
        raise UnsafeReplyError(
            f"a sparse tensor in the reply is described by {shown(layout, 80)} and {shown(data)}, "
            "not a sparse layout and the four parts torch sends"
        )
    coo = layout is torch.sparse_coo
    if coo and type(data[3]) is not bool:
        raise UnsafeReplyError(f"a sparse tensor in the reply has is_coalesced={shown(data[3], 80)}")
    tensors = data[:2] if coo else data[:3]
    for part in tensors:
        if not (type(part) is torch.Tensor and part.layout is torch.strided and part.device.type == "cpu"):
            raise UnsafeReplyError(
                f"a sparse tensor in the reply is made of {shown(part, 80)}, not dense tensors"
            )
    size = data[2] if coo else data[3]
    check_sizes("sparse tensor size", size)
    dense = math.prod(size) * tensors[-1].element_size()  # what to_dense() would allocate
    bound = limits.reply_limits().max_buffer_bytes
    if dense > bound:
        raise UnsafeReplyError(
            f"a sparse tensor in the reply is {dense} bytes once dense, over the reply limit of "
            f"{bound} bytes: raise it (torchfeed.set_reply_limits(max_buffer_bytes=...) or "
            "TORCHFEED_MAX_REPLY_BYTES) if your dataset returns such tensors"
        )
    return tuple(t.detach() for t in tensors) + data[len(tensors) :]


def sparse_from_parts(layout: torch.layout, parts: tuple) -> torch.Tensor:
    """The sparse tensor of :func:`sparse_parts`'s ``parts``, refused unless they are
    consistent with each other and the size (torch's check_invariants)."""
    try:
        if layout is torch.sparse_coo:
            indices, values, size, coalesced = parts
            return torch.sparse_coo_tensor(
                indices, values, size, check_invariants=True, is_coalesced=coalesced
            )
        compressed, plain, values, size = parts
        return torch.sparse_compressed_tensor(
            compressed, plain, values, size, layout=layout, check_invariants=True
        )
    except (RuntimeError, ValueError, TypeError, OverflowError) as exc:
        first = str(exc).strip().partition("\n")[0]  # (torch may append its C++ stack)
        raise UnsafeReplyError(f"a sparse tensor in the reply is inconsistent: {first}") from None


def rebuild_sparse_tensor(layout: Any, data: Any) -> torch.Tensor:
    """What a reply naming ``torch._utils._rebuild_sparse_tensor`` gets (see :func:`sparse_parts`);
    a load checks it again once done (:meth:`Made.check`)."""
    return sparse_from_parts(layout, sparse_parts(layout, data))


# -- what was made, checked after the load ------------------------------------------------------


class Made:
    """The objects one load made with the functions above, to check once it is done."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.arrays: list[tuple[np.ndarray, np.dtype, tuple]] = []
        self.dtypes: list[np.dtype] = []
        self.dicts: list[collections.OrderedDict] = []
        self.sparse_tensors: list[tuple[torch.Tensor, torch.layout, tuple]] = []

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
        if len(args) > 1 or (args and not _pairs(args[0])):
            raise UnsafeReplyError(
                "the reply calls collections.OrderedDict with arguments other than a list of (key, value) "
                "pairs: a worker's pickle calls it with none, so this reply was crafted (the worker may be "
                "compromised)"
            )
        check_plain("collections.OrderedDict", args)
        od: collections.OrderedDict = collections.OrderedDict(*args)
        self.dicts.append(od)
        return od

    def sparse(self, layout: Any, data: Any) -> torch.Tensor:
        parts = sparse_parts(layout, data)
        t = sparse_from_parts(layout, parts)
        self.sparse_tensors.append((t, layout, parts))
        return t

    def check(self) -> None:
        """Refuse the load if a pickle changed (BUILD) an object after it was made here."""
        made = self.tensors + [sparse[0] for sparse in self.sparse_tensors]
        for t in made:  # (their storages cannot be resized: BUILD's set_() cannot grow them)
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
        # checked again: the bytes their parts view may have changed since (a bytearray's SETITEMS)
        for _, layout, parts in self.sparse_tensors:
            sparse_from_parts(layout, parts)


def _pairs(items: Any) -> bool:
    return type(items) in (tuple, list) and all(type(p) is tuple and len(p) == 2 for p in items)
