"""Loading what workers send back: by default nothing in a reply runs code in the trainer.

A worker that holds the secret may still be hostile (a compromised CPU node, or dataset
code that returns a crafted object), and plain ``pickle.loads`` runs any function a pickle
names. So every reply is loaded by a restricted unpickler (as ``torch.load`` does with
``weights_only=True``): a pickle may name only

* the rebuild functions of rebuild.py (tensors, arrays, dtypes, numpy scalars), which
  check their arguments, and :func:`rebuild_class` (a class allowed by name);
* ``complex``, ``collections.OrderedDict``, torch dtypes, ``torch.Size`` and
  ``torch.device`` (builtin containers, strings and numbers have opcodes of their own),
  called only with plain values (rebuild.check_plain: an object could answer their
  ``__complex__``, ``__index__``, ``__iter__`` or ``keys`` with code of its own);
* ``torch._utils._rebuild_sparse_tensor`` (sparse tensors as torch reduces them), swapped
  for rebuild.rebuild_sparse_tensor, which checks their invariants;
* what the user allowed: :func:`add_safe_globals` (this process), or a loader's,
  session's or call's ``safe_globals``;
* classes of the trainer's that hold data only (namedtuples, dataclasses, plain classes,
  dict and list subclasses with no methods: plainclass.py), through a stand-in that never
  runs their ``__init__``.

Anything else raises :class:`~torchfeed.errors.UnsafeReplyError` naming every global the
reply needs that is not allowed (:func:`needs`), before any is called. Before loading, picklescan.py refuses pickles that nest deep enough to
overflow the stack, unfold too far through shared references (where it walks them), use
extension codes or cannot be read; after, rebuild.Made refuses a load whose pickle changed
(BUILD) an object a rebuild function made. A call made with ``trust_worker=True``
loads its reply with plain pickle.

Errors and statistics do not need this: an error travels as plain data (type names,
message, traceback text, plain arguments: :func:`torchfeed.protocol.errordata.describe_exception`)
and is loaded by :func:`load_data`, which allows no global but ``complex``; statistics are JSON.
"""

from __future__ import annotations

import io
import pickle
import sys
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..errors import UnsafeReplyError
from . import picklescan, plainclass, rebuild

_HERE = __name__
_REBUILD = rebuild.__name__
_REBUILD_CLASS = f"{_HERE}.rebuild_class"


def rebuild_class(name: str, payload: bytes):
    """A class the worker could only send by value (defined in the trainer's ``__main__`` or
    in a function): ``payload`` is its cloudpickle. Used as is by trusted loads only; the
    restricted unpickler swaps in :meth:`ReplyPolicy.allowed_class`, which ignores the payload."""
    import cloudpickle

    return cloudpickle.loads(payload)


def _given_plain(func: Any, what: str) -> type:
    """A stand-in for ``func`` that calls it only with plain values (rebuild.check_plain), and
    is called or made (REDUCE, NEWOBJ) as ``func`` is: its ``__new__`` returns what ``func`` does."""

    def __new__(stand_in: type, *args: Any, **kwargs: Any) -> Any:
        rebuild.check_plain(what, (args, list(kwargs.values())))
        return func(*args, **kwargs)

    return type(what.rpartition(".")[2], (), {"__new__": __new__, "__slots__": ()})


_COMPLEX = _given_plain(complex, "complex")

# what a reply may name, besides the ReplyPolicy's own entries (see _Restricted.find_class): only
# callables that build plain values, from plain values. Containers have their own opcodes in
# pickle protocol 5; builtins such as bytes(n) would allocate whatever a pickle asks for.
_ALWAYS: dict[str, Any] = {
    "builtins.complex": _COMPLEX,
    "torch.Size": _given_plain(torch.Size, "torch.Size"),
    "torch.device": _given_plain(torch.device, "torch.device"),
    f"{_REBUILD}.rebuild_np_scalar": rebuild.rebuild_np_scalar,
    "torch.serialization._get_layout": rebuild.rebuild_layout,  # torch's reduction of a sparse tensor
}


# -- what the user allows ------------------------------------------------------------------

_lock = threading.Lock()
_added: dict[str, Any] = {}


def global_name(obj: Any) -> str:
    """``module.qualname`` of a class or function, as a pickle names it."""
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not (isinstance(module, str) and isinstance(qualname, str)):
        raise TypeError(
            f"{obj!r} has no module and qualified name: pass the class or function itself, or a pair "
            "(object, 'module.name') with the name a pickle gives it"
        )
    return f"{module}.{qualname}"


def _named(objs: Iterable[Any]) -> dict[str, Any]:
    if isinstance(objs, (str, bytes)) or not isinstance(objs, Iterable):
        raise TypeError(f"safe globals must be a list of classes or functions, not {objs!r}")
    out = {}
    for obj in objs:
        if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[1], str):
            out[obj[1]] = obj[0]
        else:
            out[global_name(obj)] = obj
    return out


def add_safe_globals(objs: Iterable[Any]) -> None:
    """Allow these classes or functions in every reply this process loads.

    As :func:`torch.serialization.add_safe_globals`: ``torchfeed.add_safe_globals([MyRecord,
    PIL.Image.Image])``. An item may also be a pair ``(obj, "module.name")`` for an object a
    pickle names differently. A reply may then build instances of these classes (with their
    ``__new__``, ``__setstate__`` or constructor and arguments of its choice): allow only
    types whose construction does nothing more than hold data.
    """
    named = _named(objs)
    with _lock:
        _added.update(named)


def get_safe_globals() -> list[Any]:
    """The objects allowed by :func:`add_safe_globals`."""
    with _lock:
        return list(_added.values())


def clear_safe_globals() -> None:
    """Forget every object allowed by :func:`add_safe_globals`."""
    with _lock:
        _added.clear()


# -- policies and unpicklers ----------------------------------------------------------------


class ReplyPolicy:
    """How a reply is loaded: restricted to the allowed globals (and ``safe_globals``), or,
    with ``trusted=True``, by plain pickle."""

    __slots__ = ("extra", "trusted")

    def __init__(self, safe_globals: Iterable[Any] = (), *, trusted: bool = False):
        self.extra = _named(safe_globals)
        self.trusted = bool(trusted)

    def __repr__(self) -> str:
        return (
            "ReplyPolicy(trusted=True)" if self.trusted else f"ReplyPolicy(safe_globals={sorted(self.extra)})"
        )

    def with_globals(self, safe_globals: Iterable[Any] | None) -> ReplyPolicy:
        """This policy with more allowed objects (itself when there are none)."""
        more = _named(safe_globals or ())
        if not more or self.trusted:
            return self
        return ReplyPolicy([(obj, name) for name, obj in {**self.extra, **more}.items()])

    def allowed(self, name: str) -> Any:
        """The object allowed under ``name``, or None."""
        found = _ALWAYS.get(name)
        if found is None:
            found = self.extra.get(name)
        if found is None:
            with _lock:
                found = _added.get(name)
        return found

    def allowed_class(self, name: str, payload: bytes = b"") -> Any:
        """Restricted form of :func:`rebuild_class`: the class must be allowed by name, or be
        a plain class of the trainer's (its stand-in, plainclass.maker)."""
        named = type(name) is str
        found = self.allowed(name) if named else None
        if found is None and named:
            found = plainclass.plain_class(name)
        if found is None:
            raise refused(name if named else rebuild.shown(name, 80))
        return found

    def loads(self, meta: bytes, buffers: Sequence[memoryview] = ()) -> Any:
        if self.trusted:
            return _Trusting(meta, buffers).load()
        picklescan.check(meta)
        try:
            return _Restricted(meta, buffers, self).load()
        except UnsafeReplyError as exc:
            names = getattr(exc, "global_name", None) and self.needs(meta)
            if names and len(names) > 1:
                raise refused(*names) from None
            raise

    def needs(self, meta: bytes) -> list[str]:
        """The globals ``meta`` names that this policy does not load, in order (a refused
        load's message lists them all; nothing is loaded or called)."""
        out: list[str] = []
        for name in picklescan.global_names(meta):
            if name not in out and not self._loads(name):
                out.append(name)
        return out

    def _loads(self, name: str) -> bool:
        module, _, attr = name.rpartition(".")
        return (
            name in _MADE_BY
            or name == _REBUILD_CLASS
            or (module == "torch" and attr in rebuild.TORCH_DTYPES)
            or self.allowed(name) is not None
            or plainclass.plain_class(name) is not None
        )


SAFE = ReplyPolicy()
TRUSTED = ReplyPolicy(trusted=True)


def policy(safe_globals: Iterable[Any] | None = None, trust_worker: bool = False) -> ReplyPolicy:
    """The policy for these arguments (of a session, loader or call)."""
    if trust_worker:
        return TRUSTED
    return SAFE.with_globals(safe_globals)


def refused(*names: str) -> UnsafeReplyError:
    """The error for a reply that needs ``names`` (the first is ``global_name``, all are
    ``global_names``)."""
    listed = ", ".join(names)
    short = ", ".join(name.rpartition(".")[2] for name in names)
    which = "which torchfeed does not load" if len(names) == 1 else "none of which torchfeed loads"
    exc = UnsafeReplyError(
        f"the reply needs {listed}, {which} from a worker by default: a reply may not run "
        "code in the trainer (namedtuples, dataclasses, plain classes and dict or list subclasses "
        "of yours load by default when they define no special method but __init__, __repr__ and "
        "__str__, and the subclasses no method at all). If "
        f"it is what your dataset returns, allow it with torchfeed.add_safe_globals([{short}]) "
        "(or the loader's or session's safe_globals=[...]; rpc_async(..., trust_worker=True) "
        "trusts one call's result entirely). If your dataset returns nothing of this kind, the "
        "worker may be compromised."
    )
    exc.global_name = names[0]
    exc.global_names = list(names)
    return exc


class _Buffers:
    """persistent_load of the large ``bytes`` a worker sent apart (serialize._BytesApart)."""

    _buffers: Any

    def persistent_load(self, pid):
        if not (
            type(pid) is tuple and len(pid) == 2 and pid[0] == "torchfeed-bytes" and type(pid[1]) is bool
        ):
            raise pickle.UnpicklingError(f"unknown persistent id {rebuild.shown(pid)}")
        view = next(self._buffers)
        return bytearray(view) if pid[1] else bytes(view)


class _Trusting(_Buffers, pickle.Unpickler):
    def __init__(self, meta: bytes, buffers: Sequence[memoryview]):
        self._buffers = iter(buffers)  # shared with persistent_load: one sequence, in order
        super().__init__(io.BytesIO(meta), buffers=self._buffers)


# the rebuild functions, called through the load's rebuild.Made (checked after the load)
_MADE_BY = {
    f"{_REBUILD}.rebuild_tensor": "tensor",
    f"{_REBUILD}.rebuild_ndarray": "ndarray",
    f"{_REBUILD}.rebuild_dtype": "dtype",
    f"{_REBUILD}.rebuild_object_array": "object_array",
    "collections.OrderedDict": "ordered_dict",
    "torch._utils._rebuild_sparse_tensor": "sparse",
}


class _Restricted(_Trusting):
    def __init__(self, meta: bytes, buffers: Sequence[memoryview], rules: ReplyPolicy):
        super().__init__(meta, buffers)
        self._rules = rules
        self._made = rebuild.Made()

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        made_by = _MADE_BY.get(full)
        if made_by is not None:
            return getattr(self._made, made_by)
        if full == _REBUILD_CLASS:
            return self._rules.allowed_class
        found: Any = rebuild.TORCH_DTYPES.get(name) if module == "torch" else None
        if found is None:
            found = self._rules.allowed(full)
        if found is None:
            found = plainclass.plain_class(full)
        if found is None:
            raise refused(full)
        return found

    def load(self) -> Any:
        value = super().load()
        self._made.check()
        return value


class _DataOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name == "complex":  # containers have opcodes of their own
            return _COMPLEX
        raise refused(f"{module}.{name}")


def load_data(meta: bytes) -> Any:
    """Load a pickle of plain data (containers, strings, numbers): no global at all."""
    picklescan.check(meta)
    return _DataOnly(io.BytesIO(meta)).load()


def loaded(module: str, qualname: str) -> Any:
    """The object ``qualname`` names in ``module`` if that module is imported (nothing is
    imported), else None."""
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


def known_class(cls: type) -> bool:
    """Whether ``cls`` can be pickled by reference (found under its name where it lives)."""
    return loaded(cls.__module__, cls.__qualname__) is cls
