"""Classes a reply may name without being allowed: the trainer's own, holding data only.

torch's DataLoader hands back whatever a dataset returns; a restricted load cannot (a class
named by a pickle can run code when it is built). Some classes build without running any
code of theirs, and those load by default (:func:`plain_class`):

* a namedtuple (``collections.namedtuple``, ``typing.NamedTuple``), built by the ``__new__``
  that ``namedtuple`` generated (a tuple of the values);
* a class whose instances are an empty object given a ``__dict__`` (a dataclass, a plain
  class): pickle makes them with ``object.__new__`` and fills ``__dict__`` directly.

What decides it, for every class in its method resolution order besides ``object`` (and
``typing.Generic``): none defines ``__new__`` (a namedtuple's generated one aside),
``__reduce__``, ``__reduce_ex__``, ``__setstate__``, ``__getattr__``, ``__getattribute__``,
``__setattr__``, ``__del__`` or ``__hash__`` (a dict key's hash runs during the load; those a
dataclass generates aside: they hash the fields or refuse), nor a descriptor with a setter (a property's ``fset``: pickle
may set any attribute); no builtin type but ``object`` (or ``tuple`` for a namedtuple) is
a base (a ``list`` subclass's ``append`` would run); the metaclass is ``type`` or
``abc.ABCMeta``. The class must be already imported in the trainer, found under its name
(nothing is imported), outside the standard library, torch, numpy and torchfeed (whose
classes may act on their attributes; allow one by name where a dataset returns it), and
not defined in a function (``<locals>``: a name the trainer cannot look up).

The unpickler is not given the class itself, which a pickle could call with arguments of
its choice (running ``__init__``), but :func:`maker`: a stand-in whose call makes an
instance without ``__init__`` (``cls.__new__(cls, *args)``), as pickle's NEWOBJ does.

Exceptions are rebuilt from their arguments (errordata.py calls their constructor, as
torch's DataLoader does): :func:`plain_exception` takes any exception class already
imported whose classes define none of the hooks above but ``__init__`` may be their own.
"""

from __future__ import annotations

import abc
import sys
import threading
import typing
from typing import Any

_HOOKS = (
    "__new__",
    "__reduce__",
    "__reduce_ex__",
    "__setstate__",
    "__getattr__",
    "__getattribute__",
    "__setattr__",
    "__del__",
    "__hash__",
)
_DATACLASS_MADE = ("__hash__", "__setattr__")  # generated, compare or refuse: no code of the user's
_FOREIGN = frozenset(("torch", "numpy", "torchfeed", "builtins", "__future__")) | frozenset(
    getattr(sys, "stdlib_module_names", ())
)
_NEUTRAL = (object, typing.Generic)  # bases with no instance hooks
_METACLASSES = (type, abc.ABCMeta)


def _find(name: str) -> Any:
    """The object ``module.qualname`` names in an already imported module, or None."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):  # the longest imported module prefix
        obj: Any = sys.modules.get(".".join(parts[:cut]))
        if obj is None:
            continue
        for part in parts[cut:]:  # vars(): no module __getattr__ runs (torch's imports subsystems)
            try:
                obj = vars(obj).get(part)
            except TypeError:  # an object without __dict__
                return None
        return obj
    return None


def _namedtuple_new(fn: Any) -> bool:
    """Whether ``fn`` is a ``__new__`` that collections.namedtuple generated (a class's dict
    holds it as a staticmethod)."""
    scope = getattr(getattr(fn, "__func__", fn), "__globals__", None)
    return (
        isinstance(scope, dict)
        and scope.get("_tuple_new") is tuple.__new__
        and str(scope.get("__name__", "")).startswith("namedtuple_")
    )


def _generated(cls: type, key: str, value: Any) -> bool:
    if value is None and key == "__hash__":  # unhashable: nothing runs
        return True
    if key == "__new__" and _namedtuple_new(value):
        return True
    code = getattr(value, "__code__", None)
    return (
        key in _DATACLASS_MADE
        and "__dataclass_fields__" in vars(cls)
        and code is not None
        and (code.co_filename == "<string>")
    )


def _sets_in_python(value: Any) -> bool:
    """A descriptor whose set runs Python code (a property with a setter, a Python __set__)."""
    if isinstance(value, property):
        return value.fset is not None
    setter = getattr(type(value), "__set__", None)
    return setter is not None and hasattr(setter, "__code__")


def _hooks_of(cls: type, hooks: tuple[str, ...], descriptors: bool) -> str | None:
    """The first hook a user class in ``cls``'s MRO defines, or None."""
    for klass in cls.__mro__:
        if klass.__module__ == "builtins" or klass in _NEUTRAL:
            continue
        for key, value in vars(klass).items():
            if key in hooks and not _generated(klass, key, value):
                return f"{klass.__qualname__}.{key}"
            if descriptors and _sets_in_python(value):
                return f"{klass.__qualname__}.{key} (a descriptor with a setter)"
    return None


def why_not(cls: Any) -> str | None:
    """Why ``cls`` does not load by default as a plain class, or None when it does."""
    if not isinstance(cls, type):
        return "it is not a class"
    if type(cls) not in _METACLASSES:
        return f"its metaclass is {type(cls).__qualname__}"
    if "<locals>" in cls.__qualname__:
        return "it is defined in a function"
    if cls.__module__.partition(".")[0] in _FOREIGN and not _is_namedtuple(cls):
        return f"it is a class of {cls.__module__.partition('.')[0]}, loaded only when allowed by name"
    solid = [k for k in cls.__mro__ if k.__module__ == "builtins" and k is not object]
    if solid and not (_is_namedtuple(cls) and solid == [tuple]):
        return f"it is a {solid[0].__qualname__} subclass"
    found = _hooks_of(cls, _HOOKS, descriptors=True)
    return f"it defines {found}" if found else None


def _is_namedtuple(cls: type) -> bool:
    return issubclass(cls, tuple) and any(
        _namedtuple_new(vars(k).get("__new__")) for k in cls.__mro__ if k is not tuple
    )


_lock = threading.Lock()
_makers: dict[type, type] = {}


def maker(cls: type) -> type:
    """A stand-in for ``cls``: calling it (pickle's NEWOBJ or REDUCE) makes a ``cls``
    instance with ``cls.__new__(cls, *args)``, never running ``__init__``."""
    with _lock:
        found = _makers.get(cls)
        if found is None:
            new = cls.__new__

            def __new__(stand_in: type, *args: Any, **kwargs: Any) -> Any:
                return new(cls, *args, **kwargs)

            found = _makers[cls] = type(cls.__name__, (), {"__new__": __new__, "__slots__": ()})
        return found


def plain_class(name: str) -> type | None:
    """The stand-in (:func:`maker`) of the class ``name`` when it loads by default, else None."""
    cls = _find(name) if isinstance(name, str) else None
    if cls is None or why_not(cls) is not None:
        return None
    return maker(cls)


def plain_exception(name: str) -> type | None:
    """The exception class ``name`` when it is rebuilt by default from its arguments, else None."""
    cls = _find(name) if isinstance(name, str) else None
    if not (isinstance(cls, type) and issubclass(cls, BaseException)):
        return None
    if "<locals>" in cls.__qualname__ or type(cls) not in _METACLASSES:
        return None
    return cls if _hooks_of(cls, _HOOKS[:4] + ("__del__",), descriptors=False) is None else None
