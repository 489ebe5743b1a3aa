"""One owner for the client state of the data plane: :class:`Session`.

A session holds the trainer side's client state: the heartbeat settings, the default timeout and secret, the cache of
connections (one per worker address and secret) and the keeper thread that sends
heartbeats, flushes reference releases and expires request deadlines for them.

``torchfeed.rpc_async``, ``torchfeed.set_heartbeat`` and the other module-level
functions of :mod:`torchfeed.client` are thin wrappers over a default session, created
on first use (the ``TORCHFEED_HEARTBEAT_*`` variables are read then, not at import). A
session of your own gives a part of a program its own settings::

    with torchfeed.Session(heartbeat_interval=0.5, heartbeat_timeout=5, secret=key) as s:
        print(s.rpc_async("host:7000", os.getpid).wait())

Forks: a child process forked while connections exist must not use its parent's
sockets (both would read the same stream). A handler registered with
``os.register_at_fork`` marks every inherited connection closed in the child (its
socket's descriptor is closed there without a shutdown, so the parent's connection
keeps working) and forgets the keeper thread; the child connects afresh when it calls.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import ConnectionClosed
from ..protocol import auth, codec, replies
from ..util import env_seconds
from . import calls
from . import connection as client
from .reach import Reaching
from .reach import retry_refused as retry_refused_until
from .refs import Call

log = logging.getLogger("torchfeed.client")

_KEEPER_PERIOD = 0.25  # seconds between the keeper's rounds
_sessions: weakref.WeakSet[Session] = weakref.WeakSet()  # every live session, for fork and exit
_default: Session | None = None
_default_lock = threading.Lock()


class Session:
    """Client-side state of the data plane: settings, connections and their keeper.

    Parameters
    ----------
    heartbeat_interval : float, optional
        Seconds between heartbeats on a quiet connection (default: the environment
        variable ``TORCHFEED_HEARTBEAT_INTERVAL``, else 2).
    heartbeat_timeout : float, optional
        A worker that sent nothing for this long while a request waits on it is lost
        (default: ``TORCHFEED_HEARTBEAT_TIMEOUT``, else 15). Must exceed the interval.
    timeout : float
        Default seconds to connect and to wait for a call's result (120), and what
        datasets built with this session allow for building.
    secret : str, bytes or path, optional
        Default shared secret; None discovers it as :func:`torchfeed.protocol.auth.load_secret` does.
    safe_globals : list, optional
        Classes and functions that replies to this session's calls may contain, beyond what
        torchfeed loads by default and :func:`torchfeed.add_safe_globals` allows (see
        :mod:`torchfeed.protocol.replies`: a worker's reply runs no code here).
    compression : {"auto", "lz4", "zstd", None}
        How replies' tensor and array buffers may travel (default "auto": compressed per
        buffer when the data shrinks and the link is slower than compressing it; see
        :mod:`torchfeed.protocol.codec`). The default of the loaders over this session
        and of its calls.
    """

    def __init__(
        self,
        *,
        heartbeat_interval: float | None = None,
        heartbeat_timeout: float | None = None,
        timeout: float = 120.0,
        secret: auth.SecretLike = None,
        safe_globals: Sequence[Any] | None = None,
        compression: str | None = codec.DEFAULT,
    ):
        self.compression = codec.check_mode(compression)  # a codec.MODES value
        interval = (
            env_seconds("TORCHFEED_HEARTBEAT_INTERVAL", 2.0)
            if heartbeat_interval is None
            else heartbeat_interval
        )
        limit = (
            env_seconds("TORCHFEED_HEARTBEAT_TIMEOUT", 15.0)
            if heartbeat_timeout is None
            else heartbeat_timeout
        )
        self.heartbeat_interval = 0.0
        self.heartbeat_timeout = 0.0
        try:
            self.set_heartbeat(interval, limit)
        except ValueError as exc:
            if heartbeat_interval is not None and heartbeat_timeout is not None:
                raise
            raise ValueError(
                f"{exc} (from TORCHFEED_HEARTBEAT_INTERVAL / TORCHFEED_HEARTBEAT_TIMEOUT in the "
                "environment, or their defaults 2 and 15: set both)"
            ) from None
        self.timeout = float(timeout)
        self.secret = secret
        self.reply_policy = replies.policy(safe_globals)
        self._fresh_state()
        _sessions.add(self)
        # dropped without close(): its connections are closed when it is collected (calls
        # in flight and remote references keep it alive until they are done)
        finalizer = weakref.finalize(self, _close_dropped, self._conns)
        finalizer.atexit = False  # at exit, _close_all_sessions closes what is left (and waits)

    def _fresh_state(self) -> None:
        self._generation = 0  # close() counts up: a connect() that straddles it is undone
        self._lock = threading.Lock()
        if not hasattr(self, "_conns"):
            self._conns: dict[tuple[str, bytes], client.Connection] = {}
        self._conns.clear()  # the same dict: the finalizer closes what it holds
        self._connecting: dict[tuple[str, bytes], threading.Lock] = {}
        self._watched: weakref.WeakSet[client.Connection] = weakref.WeakSet()
        self._keeper: threading.Thread | None = None
        # addresses connected to since the last close(): a refusal there is a loss, not "not yet"
        self._reached: set[str] = set()
        self._reaching = Reaching()  # the calls waiting while a thread reaches a starting worker

    def __repr__(self) -> str:
        return (
            f"Session(heartbeat_interval={self.heartbeat_interval:g}, heartbeat_timeout="
            f"{self.heartbeat_timeout:g}, timeout={self.timeout:g}, connections={len(self._conns)})"
        )

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- settings ---------------------------------------------------------------------
    def set_heartbeat(self, interval: float = 2.0, timeout: float = 15.0) -> None:
        """Configure failure detection for this session's connections (see the class doc)."""
        if not 0 < interval < timeout:
            raise ValueError(
                f"need 0 < interval < timeout, got interval={interval}, timeout={timeout}: "
                "heartbeats must be sent more often than silence is declared a loss"
            )
        self.heartbeat_interval, self.heartbeat_timeout = float(interval), float(timeout)

    # -- connections --------------------------------------------------------------------
    def connect(
        self,
        address: client.Address,
        secret: auth.SecretLike = None,
        timeout: float | None = None,
        *,
        retry_refused: bool = False,
    ) -> client.Connection:
        """The session's connection to ``address`` (made now if there is none or it failed).

        With ``retry_refused``, a refused connection (a worker that does not listen yet) is
        tried again with backoff until ``timeout`` (see :mod:`torchfeed.client.reach`).
        """
        if retry_refused:
            seconds = self.timeout if timeout is None else timeout
            return retry_refused_until(
                lambda left: self.connect(address, secret, left), client.format_address(address), seconds
            )
        sec = auth.load_secret(self.secret if secret is None else secret)
        key = (client.format_address(address), sec.value)
        with self._lock:
            conn = self._conns.get(key)
            if conn is not None and not conn.closed:
                return conn
            gate = self._connecting.setdefault(key, threading.Lock())
        with gate:  # one connect per address at a time
            with self._lock:
                conn = self._conns.get(key)
                if conn is not None and not conn.closed:
                    return conn
                generation = self._generation
            conn = client.Connection(key[0], sec, self.timeout if timeout is None else timeout, session=self)
            with self._lock:
                self._reached.add(key[0])
                closed_meanwhile = generation != self._generation
                if not closed_meanwhile:
                    self._conns[key] = conn
            if closed_meanwhile:
                conn.close()
                raise ConnectionClosed(
                    f"the session was closed while connecting to worker {key[0]}; call again to reconnect"
                )
            return conn

    def connections(self) -> list[client.Connection]:
        """The connections this session holds now (open or failed, not yet forgotten)."""
        with self._lock:
            return list(self._conns.values())

    def paths(self) -> dict[str, str]:
        """How each open connection reaches its worker: ``"same-host"`` (a worker of this
        machine and user: Unix socket and shared memory) or ``"tcp"`` (the sealed channel)."""
        return {c.address: c.path for c in self.connections() if not c.closed}

    def close_connections(self, addresses: Sequence[client.Address]) -> None:
        """Close the connections to these workers (before stopping them on purpose).

        Their pending requests fail with :class:`ConnectionClosed`, which loaders do not warn about.
        """
        wanted = {client.format_address(a) for a in addresses}
        for conn in self.connections():
            if conn.address in wanted:
                conn.close()

    def close(self, join_timeout: float = 1.0) -> None:
        """Close every connection; reader threads get ``join_timeout`` seconds to end."""
        with self._lock:
            conns = list(self._conns.values())
            self._conns.clear()
            self._reached.clear()  # a worker restarted meanwhile may be starting again
            self._generation += 1
        for c in conns:
            c.close()
        deadline = time.monotonic() + join_timeout
        for c in conns:  # let reader threads leave torch code before the interpreter exits
            c.join(max(0.0, deadline - time.monotonic()))

    # -- what connections report (client.Connection calls these) ---------------------------
    def watch(self, conn: client.Connection) -> None:
        """Let the keeper look after ``conn`` (heartbeats, deadlines, releases)."""
        with self._lock:
            self._watched.add(conn)
            if self._keeper is None:
                self._keeper = threading.Thread(
                    target=_keeper_loop, args=(weakref.ref(self),), name="torchfeed-keeper", daemon=True
                )
                self._keeper.start()

    def forget(self, conn: client.Connection) -> None:
        """``conn`` failed or was closed: stop looking after it, connect afresh next time."""
        with self._lock:
            self._watched.discard(conn)
            key = (conn.address, conn.secret.value)
            if self._conns.get(key) is conn:
                del self._conns[key]

    def _tick(self) -> None:
        """One round of the keeper."""
        with self._lock:
            conns = list(self._watched)
        now = time.monotonic()
        for conn in conns:
            try:
                conn.tick(now)
            except Exception:
                log.exception("keeper failed on %s", conn.address)

    def _after_fork_in_child(self) -> None:
        """In a forked child: the inherited connections are the parent's; drop them."""
        inherited = list(self._watched) + list(self._conns.values())
        self._fresh_state()  # new locks: another thread may have held the old ones at the fork
        for conn in inherited:
            conn.abandon()

    # -- calls ------------------------------------------------------------------------------
    def call(
        self,
        address: client.Address,
        func: Callable,
        args=None,
        kwargs=None,
        *,
        rref: bool = False,
        pin_memory: bool = False,
        timeout: float | None = None,
        secret: auth.SecretLike = None,
        callback: client.Callback,
        safe_globals: Sequence[Any] | None = None,
        trust_worker: bool = False,
    ) -> Call:
        """Low-level asynchronous call: ``callback(ok, value)`` receives the outcome on a
        connection's reader thread. Returns the :class:`~torchfeed.client.Call`.
        ``safe_globals`` and ``trust_worker`` are as for :meth:`rpc_async`.

        It connects in the caller's thread and fails at once where nothing listens (see
        :meth:`rpc_async` for a call that waits for a worker that is still starting).
        """
        timeout = self.timeout if timeout is None else timeout
        meta, buffers = calls.pack(address, func, args, kwargs, pin_memory)
        policy = self._policy(safe_globals, trust_worker)
        conn = self.connect(address, secret, timeout)
        return self._send(conn, meta, buffers, args, kwargs, rref, pin_memory, timeout, callback, policy)

    def _policy(self, safe_globals: Sequence[Any] | None, trust_worker: bool) -> replies.ReplyPolicy:
        return replies.TRUSTED if trust_worker else self.reply_policy.with_globals(safe_globals)

    def _send(self, conn, meta, buffers, args, kwargs, rref, pin_memory, timeout, callback, policy) -> Call:
        return calls.send(
            conn, meta, buffers, args, kwargs, rref, pin_memory, timeout, callback, policy, self.compression
        )

    def rpc_async(
        self,
        host: client.Address,
        func: Callable,
        args=None,
        kwargs=None,
        pin_memory: bool = False,
        rref: bool = False,
        timeout: float | None = None,
        *,
        secret: auth.SecretLike = None,
        wait_for_worker: bool | None = None,
        safe_globals: Sequence[Any] | None = None,
        trust_worker: bool = False,
    ) -> torch.futures.Future:
        """Execute ``func(*args, **kwargs)`` on a worker; return a future of its result.

        Uses the session's connections, secret and timeout: :func:`torchfeed.rpc_async` is this
        method of the default session (:func:`torchfeed.client.default_session`).

        Parameters
        ----------
        host : str
            Worker address ``host:port``.
        func : callable
            Any callable; lambdas and local functions work (sent with cloudpickle).
        args, kwargs : optional
            Arguments; :class:`RemoteRef` arguments arrive as the objects they refer to.
        pin_memory : bool
            Receive tensors of the result into pinned memory (when CUDA is available).
        rref : bool
            Keep the result on the worker and return a :class:`RemoteRef` to it.
        timeout : float, optional
            Seconds to connect and to wait for the result (default: the session's, 120). A
            worker this session has not reached since its last :meth:`close` may still be
            starting: its refused connections are tried again within this time (the first
            refusal is logged), on a thread that reaches that address for every call waiting
            on it; the future is returned at once.
        secret : optional
            The shared secret (default: the session's, else discovered).
        wait_for_worker : bool, optional
            Wait for a worker that refuses connections: by default only for one this session
            has not reached yet (once reached, a refusal means it was lost: the call fails at
            once); ``False`` never waits, ``True`` always does.
        safe_globals : list, optional
            Classes (or functions) this call's result may contain beyond what torchfeed loads
            by default (containers, scalars, tensors, arrays) and what
            :func:`torchfeed.add_safe_globals` and the session allow: a worker's reply runs no
            code in this process.
        trust_worker : bool
            Load the result with plain pickle, as trusted data (a reply can then run any code
            here): only for a worker you trust with this process.

        Returns
        -------
        torch.futures.Future
            Raises :class:`RemoteError` from ``wait()`` if ``func`` raised on the worker, and
            :class:`~torchfeed.errors.UnsafeReplyError` if its result names a class that is not
            allowed (nothing of it ran).
        """
        timeout = self.timeout if timeout is None else timeout
        fut: torch.futures.Future = torch.futures.Future()
        completing = threading.Lock()

        def done(ok: bool, value: Any) -> None:
            # the first outcome wins: a send that fails as the connection is failed by
            # another thread reports the same loss twice
            with completing:
                if fut.done():
                    return
                if ok:
                    fut.set_result(value)
                else:
                    fut.set_exception(value)

        try:
            policy = self._policy(safe_globals, trust_worker)
            meta, buffers = calls.pack(host, func, args, kwargs, pin_memory)
            address = client.format_address(host)
            with self._lock:
                wait = wait_for_worker if wait_for_worker is not None else address not in self._reached
            if not wait:
                conn = self.connect(address, secret, timeout)
                self._send(conn, meta, buffers, args, kwargs, rref, pin_memory, timeout, done, policy)
                return fut
        except Exception as exc:
            done(False, exc)
            return fut
        start = time.monotonic()

        def then(conn: client.Connection | None, error: BaseException | None) -> None:
            try:
                if error is not None:
                    raise error
                assert conn is not None
                left = max(0.1, timeout - (time.monotonic() - start))
                self._send(conn, meta, buffers, args, kwargs, rref, pin_memory, left, done, policy)
            except Exception as exc:
                done(False, exc)

        self._reach(address, secret, timeout, then)
        return fut

    def _reach(self, address: str, secret: auth.SecretLike, timeout: float, then: Callable) -> None:
        """Connect to ``address`` retrying refusals, on one thread per address and secret, and
        hand the outcome to ``then(connection, error)`` of every call that waited for it."""
        key = (address, auth.load_secret(self.secret if secret is None else secret).value)
        self._reaching.reach(key, lambda: self.connect(address, secret, timeout, retry_refused=True), then)


def _keeper_loop(ref: weakref.ref[Session]) -> None:
    """The keeper thread of a session (holds it only during a round)."""
    while True:
        time.sleep(_KEEPER_PERIOD)
        session = ref()
        if session is None:
            return
        session._tick()
        del session


def default_session() -> Session:
    """The session behind the module-level functions (created on first use)."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = Session()
    return _default


def _close_dropped(conns: dict) -> None:
    """Finalizer of a session collected without close(): close its connections, on a thread
    of its own. The last reference may go anywhere, inside a connection's lock too (a
    cancel() dropping the last call in flight, a reader thread when the collector runs):
    closing takes those locks, so it never runs here."""
    if not conns or sys.is_finalizing():
        return
    threading.Thread(
        target=_close_quietly, args=(list(conns.values()),), name="torchfeed-close", daemon=True
    ).start()


def _close_quietly(conns: list[client.Connection]) -> None:
    for conn in conns:
        try:
            conn.close()
        except Exception:  # noqa: BLE001 - nobody to report to: the session is gone
            log.debug("closing a dropped session's connection", exc_info=True)


def close_connections_everywhere(addresses: Sequence[client.Address]) -> None:
    """Close every session's connections to these workers (they are being stopped on purpose)."""
    for s in list(_sessions):
        s.close_connections(addresses)


def _after_fork_in_child() -> None:
    global _default_lock
    _default_lock = threading.Lock()
    for s in list(_sessions):
        s._after_fork_in_child()


def _close_all_sessions() -> None:
    for s in list(_sessions):
        try:
            s.close()
        except Exception:  # noqa: BLE001 - exiting: a connection that will not close is gone anyway
            log.debug("closing a session at exit", exc_info=True)


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_close_all_sessions)
