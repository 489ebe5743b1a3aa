"""Classes a reply may name without being allowed: the trainer's own, holding data only.

torch's DataLoader hands back whatever a dataset returns; a restricted load cannot (a class
named by a pickle can run code when it is built, and Python calls a class's special methods
on its instances: a dict key's ``__hash__`` and ``__eq__``, the ``__index__`` and
``__iter__`` of what torch.Size is given, a ``__call__`` a pickle stores under an instance's
``__setstate__``). Some classes build, and are handled by a load, without running any code
of theirs, and those load by default (:func:`plain_class`):

* a namedtuple (``collections.namedtuple``, ``typing.NamedTuple``), built by the ``__new__``
  that ``namedtuple`` generated (a tuple of the values);
* a class whose instances are an empty object given a ``__dict__`` (a dataclass, a plain
  class): pickle makes them with ``object.__new__`` and fills ``__dict__`` directly;
* a ``dict`` or ``list`` subclass that defines nothing of its own but the inert attributes
  below: pickle fills it through the builtin's own methods (SETITEM and SETITEMS call the
  type's ``__setitem__``, APPEND and APPENDS look up ``extend``, else ``append``).

What decides it, for every class in its method resolution order besides builtins (and
``typing.Generic``): it defines no special (``__dunder__``) attribute but the inert ones of
:data:`INERT` (metadata, and ``__init__``, ``__post_init__``, ``__repr__``, ``__str__``,
which no load calls) and those that ``dataclasses`` or ``namedtuple`` generated (they
compare, hash or refuse by the fields, fill the fields, or build the tuple: :func:`_generated`),
nor a descriptor with a setter (a property's ``fset``: pickle may set any attribute); a
``dict`` or ``list`` subclass defines no other attribute at all; no builtin type but
``object`` (``tuple`` for a namedtuple, ``dict`` or ``list`` for those) is a base; the
metaclass is ``type`` or ``abc.ABCMeta``. The class must be already imported in the trainer,
found under its name (nothing is imported), outside the standard library, torch, numpy and
torchfeed (whose classes may act on their attributes; allow one by name where a dataset
returns it), and not defined in a function (``<locals>``: a name the trainer cannot look up).

The unpickler is not given the class itself, which a pickle could call with arguments of
its choice (running ``__init__``), but :func:`maker`: a stand-in whose call makes an
instance without ``__init__`` (``cls.__new__(cls, *args)``), as pickle's NEWOBJ does.

Exceptions are rebuilt from their arguments (errordata.py calls their constructor, as
torch's DataLoader does): :func:`plain_exception` takes any exception class already
imported whose classes define no special attribute beyond the same inert ones (so its own
``__init__`` runs, but no ``__setattr__`` on the attributes the worker sends, nor an
``__init_subclass__`` when the trainer derives ``RemoteError[T]`` from it).
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import sys
import threading
import types
import typing
from collections.abc import Callable
from typing import Any

# special attributes no load reads as code: metadata, and methods only the class's own code
# (or the user) calls
INERT = frozenset(
    (
        "__module__",
        "__qualname__",
        "__doc__",
        "__dict__",
        "__weakref__",
        "__annotations__",
        "__annotate__",
        "__annotate_func__",
        "__annotations_cache__",
        "__slots__",
        "__slotnames__",  # copyreg's cache, set once an instance is pickled
        "__match_args__",
        "__dataclass_fields__",
        "__dataclass_params__",
        "__orig_bases__",
        "__parameters__",
        "__type_params__",
        "__firstlineno__",
        "__static_attributes__",
        "__abstractmethods__",
        "_abc_impl",
        "__init__",
        "__post_init__",
        "__repr__",
        "__str__",
    )
)
# what dataclasses generates from source text ("<string>"): compare, hash or refuse by the fields
_DATACLASS_MADE = frozenset(
    ("__eq__", "__lt__", "__le__", "__gt__", "__ge__", "__hash__", "__setattr__", "__delattr__")
)
# what dataclasses sets from its own module: fill or copy the fields (slots=True, 3.13's copy.replace)
_DATACLASS_SHARED = frozenset(("__getstate__", "__setstate__", "__replace__"))
_FOREIGN = frozenset(("torch", "numpy", "torchfeed", "builtins", "__future__")) | frozenset(
    getattr(sys, "stdlib_module_names", ())
)
_NEUTRAL = (object, typing.Generic)  # bases with no instance hooks
_METACLASSES = (type, abc.ABCMeta)
_FILLED = ([dict], [list])  # builtin bases whose own methods fill an instance (SETITEMS, APPENDS)


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


def _made_in(value: Any, filename: str, scope: str | None) -> bool:
    """Whether ``value`` is a plain function of ``filename``, defined directly in the function
    ``scope`` (None: at module level). Python 3.10's code has no qualified name: the file decides."""
    if not isinstance(value, types.FunctionType):
        return False
    code = value.__code__
    qualname = getattr(code, "co_qualname", None)
    expected = code.co_name if scope is None else f"{scope}.<locals>.{code.co_name}"
    return code.co_filename == filename and (qualname is None or qualname == expected)


def _generated(cls: type, key: str, value: Any) -> bool:
    """Whether ``cls``'s attribute ``key`` is one that namedtuple or dataclasses generated
    (never a function written in the class: its qualified name says where it was made)."""
    if value is None and key == "__hash__":  # unhashable: nothing runs
        return True
    if key == "__new__":
        return _namedtuple_new(value)
    if _made_in(value, collections.__file__, "namedtuple"):
        return _is_namedtuple(cls)
    if "__dataclass_fields__" not in vars(cls):
        return False
    if key in _DATACLASS_MADE:
        return _made_in(value, "<string>", "__create_fn__")
    return key in _DATACLASS_SHARED and _made_in(value, dataclasses.__file__, None)


def _special(key: str) -> bool:
    return len(key) > 4 and key[:2] == "__" == key[-2:] and key not in INERT


def _own(key: str) -> bool:
    return key not in INERT


def _sets_in_python(value: Any) -> bool:
    """A descriptor whose set runs Python code (a property with a setter, a Python __set__)."""
    if isinstance(value, property):
        return value.fset is not None
    setter = getattr(type(value), "__set__", None)
    return setter is not None and hasattr(setter, "__code__")


def _defines(cls: type, refused: Callable[[str], bool], descriptors: bool) -> str | None:
    """The first attribute ``refused`` names (not generated) that a class in ``cls``'s MRO
    defines, builtins aside, or None."""
    for klass in cls.__mro__:
        if klass.__module__ == "builtins" or klass in _NEUTRAL:
            continue
        for key, value in vars(klass).items():
            if refused(key) and not _generated(klass, key, value):
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
    if solid in _FILLED:
        found = _defines(cls, _own, descriptors=True)
        if found:
            kind = solid[0].__qualname__
            return (
                f"it is a {kind} subclass that defines {found} (only those with no methods of their own load)"
            )
        return None
    if solid and not (_is_namedtuple(cls) and solid == [tuple]):
        return f"it is a {solid[0].__qualname__} subclass"
    found = _defines(cls, _special, descriptors=True)
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
    cls = _find(name) if type(name) is str else None
    if cls is None or why_not(cls) is not None:
        return None
    return maker(cls)


def plain_exception(name: str) -> type | None:
    """The exception class ``name`` when it is rebuilt by default from its arguments, else None."""
    cls = _find(name) if type(name) is str else None
    if not (isinstance(cls, type) and issubclass(cls, BaseException)):
        return None
    if "<locals>" in cls.__qualname__ or type(cls) not in _METACLASSES:
        return None
    return cls if _defines(cls, _special, descriptors=False) is None else None
