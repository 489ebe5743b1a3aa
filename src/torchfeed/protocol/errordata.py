"""Exceptions as data: what a worker sends for an exception, and what the trainer raises.

The worker describes an exception with plain data only (:func:`describe_exception`): its
type's name and the names of its bases, its message, its traceback (as text and taken
apart, see :mod:`torchfeed.protocol.tracebacks`), and its arguments and attributes when they are
plain (strings, numbers, bytes and containers of them). The trainer loads that with no
global allowed (:func:`torchfeed.protocol.replies.load_data`) and raises
:class:`~torchfeed.errors.RemoteError`, also an instance of the first class of the remote
exception's bases that it allows (:func:`rebuild_remote_error`): Python's built-in
exceptions, those allowed by ``add_safe_globals`` or ``safe_globals``, and exception
classes already imported in the trainer that define no special method of their own but
``__init__``, ``__repr__`` and ``__str__`` (plainclass.plain_exception: built by their
constructor from the plain arguments, as torch's DataLoader does; no ``__setattr__`` runs on
the attributes the worker sends, no ``__init_subclass__`` when ``RemoteError[T]`` is derived
from the class), never torchfeed's own errors (the trainer acts on those) but a worker's
reports of a request over a limit (``FrameTooLarge``, ``LimitExceeded``). Attributes that would shadow a method, a
descriptor or a RemoteError field are not set (:func:`torchfeed.errors.instantiate`).
So ``except KeyError:`` catches a worker's ``KeyError``, and a ``MyError(ValueError)``
is caught by ``except MyError:`` when the trainer has imported ``MyError`` (else by
``except ValueError:``).
"""

from __future__ import annotations

import builtins
import pickle
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from .. import errors
from ..errors import RemoteError, TorchfeedError
from . import tracebacks
from .plainclass import plain_exception
from .replies import SAFE, ReplyPolicy, loaded

# arguments and attributes of an exception travel when plain and at most this large
_MAX_PLAIN = 1 << 20
_MAX_DEPTH = 16


def _name(cls: type) -> str:
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def plain(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is plain data: None, bool, int, float, complex, str, bytes, and
    tuples, lists and dicts (with str or int keys) of plain data."""
    kind = type(value)
    if value is None or kind in (bool, int, float, complex, str, bytes):
        return True
    if depth >= _MAX_DEPTH:
        return False
    if kind in (tuple, list):
        return all(plain(v, depth + 1) for v in value)
    if kind is dict:
        return all(type(k) in (str, int) and plain(v, depth + 1) for k, v in value.items())
    return False


def describe_exception(exc: BaseException) -> dict[str, Any]:
    """Worker side: ``exc`` as a dict of plain data (see the module's docstring).

    ``type``, ``message``, ``traceback`` and ``bases`` (``module.qualname`` of the type
    and of each base class, in method resolution order) are always there; ``args`` and
    ``state`` (its ``__dict__``) when plain and small; ``template``, ``frames`` and
    ``marker`` let the trainer show its own source for frames of code it sent.
    """
    etype = type(exc)
    name = _name(etype)
    try:
        message = str(exc)
    except Exception:  # a broken __str__ (or __repr__) must not break error reporting
        try:
            message = repr(exc)
        except Exception:
            message = object.__repr__(exc)
    info: dict[str, Any] = {"type": name, "message": message}
    try:
        info.update(tracebacks.describe(exc))
    except Exception:
        try:
            info["traceback"] = "".join(traceback.format_exception(etype, exc, exc.__traceback__))
        except Exception:
            info["traceback"] = f"{name}: {message}\n(the traceback could not be formatted)"
    info["bases"] = [f"{c.__module__}.{c.__qualname__}" for c in etype.__mro__ if c is not object]
    try:  # the constructor's arguments as pickle takes them (OSError: errno, message, filename)
        reduced = exc.__reduce__()
        args = tuple(reduced[1]) if len(reduced) > 1 and reduced[0] is etype else tuple(exc.args)
        found = reduced[2] if len(reduced) > 2 and isinstance(reduced[2], dict) else vars(exc)
        state = {k: v for k, v in found.items() if isinstance(k, str) and not k.startswith("__")}
    except Exception:
        return info
    for key, value in (("args", args), ("state", state)):
        if plain(value) and len(pickle.dumps(value, protocol=5)) <= _MAX_PLAIN:
            info[key] = value
    return info


_TOO_BROAD = ("builtins.Exception", "builtins.BaseException")


# torchfeed errors that a worker's torchfeed reports about one request, raised to the user and
# never acted on by the trainer: rebuilt as themselves (``except torchfeed.FrameTooLarge:``)
_REPORTS = (errors.FrameTooLarge, errors.LimitExceeded)


def exception_class(name: Any, policy: ReplyPolicy = SAFE) -> type | None:
    """The class to rebuild a remote exception as, for one of its ``bases`` names: a
    built-in exception or an allowed one (trusted policy: any exception class already
    imported here). None where not allowed, and for torchfeed's own errors and their
    subclasses: the trainer acts on those (a lost worker, a timeout, a refused reply...),
    so a worker's are never rebuilt as such (see :func:`rebuild_remote_error`); only the
    worker's own reports of a request over a limit (``FrameTooLarge``, ``LimitExceeded``)
    are, exactly."""
    if not isinstance(name, str):
        return None
    module, _, qualname = name.rpartition(".")
    found: Any = None
    if module == "builtins":
        found = getattr(builtins, qualname, None)
    elif module == errors.__name__:
        found = getattr(errors, qualname, None)
    else:
        found = policy.allowed(name)
        if found is None and policy.trusted:
            found = _imported(name)
        if found is None:  # already imported here, rebuilt from its arguments by its constructor
            found = plain_exception(name)
    if not (isinstance(found, type) and issubclass(found, BaseException)):
        return None
    if issubclass(found, TorchfeedError) and found not in _REPORTS:
        return None
    return found


def _imported(name: str) -> Any:
    """The object named ``module.qualname`` in a module already imported (nothing is imported)."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):  # the longest imported module prefix
        module = ".".join(parts[:cut])
        if module in sys.modules:
            return loaded(module, ".".join(parts[cut:]))
    return None


def rebuild_remote_error(
    address: str, info: Any, indices: Sequence[Any] | None = None, policy: ReplyPolicy = SAFE
) -> RemoteError:
    """Trainer side: the exception to raise for a worker's :func:`describe_exception` dict.

    A :class:`~torchfeed.errors.RemoteError`, also an instance of the nearest of the remote
    exception's bases that :func:`exception_class` allows. A torchfeed error raised on the
    worker (say a ``WorkerLost`` of a call the dataset made itself) is never rebuilt as
    that error, which would steer the trainer (a worker lost here, retried elsewhere): a
    remote ``Timeout`` is a RemoteError that is a ``TimeoutError``, a remote ``WorkerLost``
    a plain RemoteError; ``remote_type`` names the remote type. (A worker's ``FrameTooLarge``
    and ``LimitExceeded``, its reports of a request over a limit, are rebuilt as such.)

    Its ``remote_traceback`` shows frames of code this process sent by value with this
    process's source (see :func:`torchfeed.protocol.tracebacks.render`).
    """
    if not (
        isinstance(info, dict) and isinstance(info.get("type"), str) and isinstance(info.get("message"), str)
    ):
        return RemoteError(address, "?", f"a malformed error description: {info!r:.200}", "", indices)
    if not isinstance(info.get("traceback"), str):
        info["traceback"] = ""
    fields = (address, info["type"], info["message"], tracebacks.render(info), indices)
    bases = info.get("bases")
    etype = None
    for i, base in enumerate(bases if isinstance(bases, list) else []):
        if i and base in _TOO_BROAD:
            break  # a type not allowed here, whose nearest allowed base says nothing more
        etype = exception_class(base, policy)
        if etype is not None:
            break
    made = errors.remote_type_for(etype) if etype is not None else None
    if made is None or made is etype:
        return RemoteError(*fields)
    exact = etype is not None and _name(etype) == info["type"]
    args = info.get("args") if exact and type(info.get("args")) is tuple else (info["message"],)
    state = info.get("state") if exact and type(info.get("state")) is dict else None
    exc = errors.instantiate(made, etype, args, state)  # type: ignore[arg-type]
    if exc is None and args != (info["message"],):
        exc = errors.instantiate(made, etype, (info["message"],), None)  # type: ignore[arg-type]
    if exc is None:
        return RemoteError(*fields)
    errors.set_remote_fields(exc, *fields)
    exc.remote_class = etype  # type: ignore[assignment]
    return exc
