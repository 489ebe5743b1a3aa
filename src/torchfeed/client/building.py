"""Trainer side of building a RemoteDataset: checking what is sent, reaching workers that start late.

* :func:`check_factory` and :func:`check_picklable` turn the usual first mistakes (a
  dataset instance instead of its class, an argument that cannot be pickled such as an
  open file or a lock) into errors that say what to do, before any worker is contacted.
* :func:`connect_all` connects to every worker, retrying refused connections with
  backoff until the timeout: under Slurm or torchrun, workers often start after the
  trainer. Wrong secrets fail at once with :class:`~torchfeed.AuthenticationError`.
* :func:`connect_found` connects once to addresses that a DNS name listed: anyone able to
  add a record may point one anywhere, so an address that refuses, does not answer in
  :data:`FOUND_TIMEOUT` seconds or fails the handshake is a failure of that address only.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import AuthenticationError, SerializationError, Timeout, WorkerLost
from ..protocol import auth, serialize
from ..protocol.auth import SecretLike
from . import session as sessions

if TYPE_CHECKING:
    from .session import Session

FOUND_TIMEOUT = 10.0  # seconds an address a DNS name listed may take to connect and shake hands
FOUND_AT_ONCE = 64  # listed addresses tried at once (one thread each); the rest wait their turn


def build(factory: Callable, args: tuple, kwargs: dict):
    """Runs on the worker: construct the dataset."""
    return factory(*args, **kwargs)


def describe(dataset) -> tuple:
    """Runs on the worker: (is it an IterableDataset, its length or None)."""
    from torch.utils.data import IterableDataset

    iterable = isinstance(dataset, IterableDataset)
    try:
        length = len(dataset)
    except TypeError:  # no __len__: an iterable dataset, or a map-style one used with a sampler
        length = None
    return iterable, length


def _name(factory: Any) -> str:
    return getattr(factory, "__qualname__", None) or type(factory).__qualname__


def check_factory(dataset: Any, what: str = "RemoteDataset") -> None:
    """Refuse a dataset *instance* where a class or factory is expected, saying what to write."""
    from torch.utils.data import Dataset

    is_instance = isinstance(dataset, Dataset) or not callable(dataset)
    if isinstance(dataset, type) or not is_instance:
        return
    cls = type(dataset).__qualname__
    raise TypeError(
        f"{what} got a dataset instance ({cls} object), but it builds the dataset on every worker itself: "
        f"pass the class (or a factory) and its arguments instead, e.g. "
        f"RemoteDataset(workers, {cls}, arg1, key=value) rather than RemoteDataset(workers, {cls}(arg1, "
        "key=value)). The arguments are pickled and sent; data is then read on the workers."
    )


def _takes_keyword(factory: Callable, name: str) -> bool:
    """Whether a keyword ``name`` could reach ``factory``: it names such a parameter, or takes
    ``**kwargs``; not when a ``functools.partial`` already binds it."""
    if isinstance(factory, functools.partial) and name in factory.keywords:
        return False  # bound: RemoteDataset's own keyword cannot be meant for it
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # no signature to read (some builtins): it names nothing
        return False
    parameter = parameters.get(name)
    keyword_kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    if parameter is not None and parameter.kind in keyword_kinds:
        return True
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def check_timeout(factory: Callable, timeout: float | None) -> None:
    """``RemoteDataset(..., timeout=T)`` is the RemoteDataset's; refuse it when ``factory`` takes a
    ``timeout`` of its own (which one was meant cannot be known), saying how to pass either."""
    if timeout is None:
        return
    if not _takes_keyword(factory, "timeout"):
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"RemoteDataset's timeout must be a positive number of seconds, got {timeout!r}")
        return
    name = _name(factory)
    raise TypeError(
        f"RemoteDataset(workers, {name}, ..., timeout={timeout!r}) is ambiguous: timeout= is RemoteDataset's "
        f"own (seconds to reach the workers, build the dataset and make calls) and is never passed to the "
        f"dataset, but {name} may take one too (a 'timeout' parameter, or **kwargs). Pass {name}'s with the "
        f"factory: "
        f"RemoteDataset(workers, functools.partial({name}, timeout={timeout!r}), ...); pass RemoteDataset's "
        f"with its session: RemoteDataset(workers, {name}, ..., session=torchfeed.Session(timeout={timeout!r}))"
    )


def bind_own_keywords(factory: Callable, kwargs: dict) -> tuple[Callable, dict]:
    """``kwargs`` meant for ``factory`` alone (``RemoteDataLoader(kwargs=...)``): a ``timeout``
    among them, which RemoteDataset would take as its own, is bound to the factory instead."""
    if "timeout" not in kwargs:
        return factory, kwargs
    rest = {k: v for k, v in kwargs.items() if k != "timeout"}
    return functools.partial(factory, timeout=kwargs["timeout"]), rest


def _argument_names(factory: Callable, args: tuple, kwargs: dict) -> list[tuple]:
    """(description, value) of every argument, named after the factory's parameters when possible."""
    try:
        bound = inspect.signature(factory).bind_partial(*args, **kwargs)
        named = []
        for name, value in bound.arguments.items():
            kind = inspect.signature(factory).parameters[name].kind
            if kind is inspect.Parameter.VAR_POSITIONAL:
                named += [(f"positional argument {i} (in *{name})", v) for i, v in enumerate(value)]
            elif kind is inspect.Parameter.VAR_KEYWORD:
                named += [(f"keyword argument {k!r}", v) for k, v in value.items()]
            else:
                named.append((f"argument {name!r}", value))
        return named
    except (TypeError, ValueError):
        return [(f"positional argument {i}", v) for i, v in enumerate(args)] + [
            (f"keyword argument {k!r}", v) for k, v in kwargs.items()
        ]


def check_picklable(factory: Callable, args: tuple, kwargs: dict) -> None:
    """Raise :class:`SerializationError` naming the first argument that cannot be sent to workers."""
    try:
        serialize.dumps((factory, args, kwargs), by_value=True)
        return
    except Exception as whole:
        failure = whole
    name = _name(factory)
    try:
        serialize.dumps(factory, by_value=True)
    except Exception as exc:
        raise SerializationError(
            f"the dataset factory {name} cannot be pickled to be sent to the workers ({exc}). Define the "
            "class at module level, in __main__, or in a function, and keep unpicklable objects (open files, "
            "locks, connections, CUDA tensors) out of it"
        ) from exc
    for described, value in _argument_names(factory, args, kwargs):
        try:
            serialize.dumps(value, by_value=True)
        except serialize.OpenFileError as exc:
            raise SerializationError(
                f"{described} of {name} ({type(value).__qualname__} object) is or holds {exc}. {name} is "
                "built on the workers, where this process's files are not open"
            ) from exc
        except Exception as exc:
            raise SerializationError(
                f"{described} of {name} ({type(value).__qualname__} object) cannot be pickled to be sent to "
                f"the workers: {exc}. Construct it inside the dataset on the worker instead (in {name}.__init__, "
                "or lazily on first use in __getitem__), and pass what it is made from: a path, a URL, "
                "options"
            ) from exc
    raise SerializationError(f"the arguments of {name} cannot be pickled: {failure}") from failure


def connect(
    address: str, secret: SecretLike, timeout: float, session: Session | None = None
) -> BaseException | None:
    """Connect (``session``'s cache; the default session's if None), retrying refused connections
    until ``timeout``; return the failure or None."""
    session = session if session is not None else sessions.default_session()
    try:
        session.connect(address, secret, timeout, retry_refused=True)
        return None
    except Exception as exc:  # noqa: BLE001 - returned: the caller sorts the failures of all workers
        return exc


def connect_all(
    workers: Sequence[str], secret: SecretLike, timeout: float, session: Session | None = None
) -> dict[str, BaseException]:
    """Connect to every worker concurrently; return the failures. A wrong secret raises at once."""
    failures: dict[str, BaseException] = {}
    lock = threading.Lock()

    def one(address: str) -> None:
        failure = connect(address, secret, timeout, session)
        if failure is not None:
            with lock:
                failures[address] = failure

    threads = [
        threading.Thread(target=one, args=(w,), name=f"torchfeed-connect-{w}", daemon=True) for w in workers
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for failure in failures.values():
        if isinstance(failure, AuthenticationError):
            raise failure
    return failures


def connect_found(
    workers: Sequence[str], secret: SecretLike, timeout: float, session: Session | None = None
) -> dict[str, BaseException]:
    """Connect once to every address concurrently (no refusal is retried); return the failures.

    Each address gets at most ``min(timeout, FOUND_TIMEOUT)`` seconds, however it stalls: the
    others are not held back by it (a connection still being made is left to finish in the
    background). Only a secret that cannot be loaded raises (the setup is wrong, not an
    address); a handshake that fails is that address's failure, as a refusal is. At most
    :data:`FOUND_AT_ONCE` addresses are tried (threads bounded however many records a name
    has); the others are returned as not tried yet.
    """
    session = session if session is not None else sessions.default_session()
    sec = auth.load_secret(session.secret if secret is None else secret)
    seconds = min(timeout, FOUND_TIMEOUT)
    workers, later = list(workers)[:FOUND_AT_ONCE], list(workers)[FOUND_AT_ONCE:]
    failures: dict[str, BaseException] = {
        w: WorkerLost(f"{w} was not tried yet: more than {FOUND_AT_ONCE} addresses were listed at once")
        for w in later
    }
    lock = threading.Lock()

    def one(address: str) -> None:
        try:
            session.connect(address, sec, seconds)
        except Exception as exc:  # noqa: BLE001 - returned: this address is no worker (now)
            with lock:
                failures[address] = exc

    threads = {
        w: threading.Thread(target=one, args=(w,), name=f"torchfeed-connect-{w}", daemon=True)
        for w in workers
    }
    for t in threads.values():
        t.start()
    deadline = time.monotonic() + seconds
    for w, t in threads.items():
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            with lock:
                failures[w] = Timeout(f"{w} did not complete the handshake within {seconds:g} s")
    with lock:
        return dict(failures)
