"""Client side of the data plane: one persistent, multiplexed connection per worker.

Many requests share a connection (request ids); a reader thread per connection
receives replies straight into their final buffers and hands them to callbacks. A
single keeper thread per process sends heartbeats, flushes reference releases, expires
request deadlines and declares a worker lost when it stops answering.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import pickle
import socket
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import auth, errors, limits, serialize, wire
from .buffers import allocate, check_pinnable
from .errors import (
    ConnectionClosed,
    FrameTooLarge,
    ProtocolError,
    SerializationError,
    Timeout,
    TorchfeedError,
    WorkerLost,
)

log = logging.getLogger("torchfeed.client")

# seconds between pings on a quiet connection, and of silence from a worker we wait on
# before it counts as lost (it hangs, or the network is cut); see set_heartbeat()
HEARTBEAT_INTERVAL = float(os.environ.get("TORCHFEED_HEARTBEAT_INTERVAL", 2.0))
HEARTBEAT_TIMEOUT = float(os.environ.get("TORCHFEED_HEARTBEAT_TIMEOUT", 15.0))

Address = str | tuple[str, int]
Callback = Callable[[bool, Any], None]


def set_heartbeat(interval: float = 2.0, timeout: float = 15.0) -> None:
    """Configure failure detection for this process's connections.

    Parameters
    ----------
    interval : float
        Seconds between heartbeats on a quiet connection.
    timeout : float
        A worker that sent nothing for this long while a request waits on it is lost:
        its batches go to other workers. Workers answer heartbeats from a thread of their
        own, so a long ``__getitem__`` does not count as silence. Must exceed ``interval``.
    """
    global HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT
    if not 0 < interval < timeout:
        raise ValueError(f"need 0 < interval < timeout, got interval={interval}, timeout={timeout}")
    HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT = float(interval), float(timeout)


def parse_address(address: Address) -> tuple[str, int]:
    """``"host:port"``, ``"[v6]:port"`` or ``(host, port)`` -> ``(host, port)``."""
    if isinstance(address, tuple):
        host, port = address
        return str(host), int(port)
    text = str(address).strip()
    if text.startswith("["):
        host, _, port = text[1:].partition("]:")
    else:
        host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"worker address {address!r} is not of the form host:port")
    return host, int(port)


def format_address(address: Address) -> str:
    host, port = parse_address(address)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


_delivering = threading.local()


def reply_bytes() -> int:
    """Inside a result callback: the size of the reply being delivered (header excluded)."""
    return getattr(_delivering, "nbytes", 0)


class _Pending:
    __slots__ = ("callback", "pin", "deadline")

    def __init__(self, callback: Callback, pin: bool, deadline: float | None):
        self.callback = callback
        self.pin = pin
        self.deadline = deadline


class Connection:
    """An authenticated connection to one worker."""

    def __init__(self, address: Address, secret: auth.Secret, timeout: float = 120.0):
        self.address = format_address(address)
        host, port = parse_address(address)
        self.secret = secret
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise WorkerLost(
                f"could not connect to worker {self.address} within {timeout:g} s: {exc}. "
                "Is `torchfeed worker` running there, and is the address right?",
                {self.address: repr(exc)},
            ) from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            self.channel = auth.client_handshake(
                sock, secret, self.address, integrity_only=auth.integrity_only_requested()
            )
            sock.settimeout(None)
        except TimeoutError as exc:
            sock.close()
            raise Timeout(
                f"worker {self.address} did not complete the handshake within {timeout:g} s"
            ) from exc
        except (OSError, TorchfeedError):
            sock.close()
            raise
        self.sock = sock
        self._send_lock = threading.Lock()
        self._pending_lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self._releases: list = []
        self.last_tx = time.monotonic()
        self.closed = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._read_loop, name=f"torchfeed-rx-{self.address}", daemon=True
        )
        self._thread.start()
        _keeper.add(self)

    # -- sending ---------------------------------------------------------
    def _send(self, kind: int, request_id: int = 0, meta: bytes = b"", buffers=(), flags: int = 0) -> None:
        with self._send_lock:
            self.channel.send(kind, request_id, meta, buffers, flags)
            self.last_tx = time.monotonic()

    def request(
        self,
        kind: int,
        meta: bytes,
        buffers: Sequence = (),
        *,
        callback: Callback,
        flags: int = 0,
        pin: bool = False,
        timeout: float | None = None,
    ) -> int:
        """Send a call; ``callback(ok, value)`` runs on the reader thread with the result."""
        rid = next(self._ids)
        deadline = time.monotonic() + timeout if timeout else None
        with self._pending_lock:
            if self.closed:
                raise self._lost_error()
            self._pending[rid] = _Pending(callback, pin, deadline)
        try:
            self._send(kind, rid, meta, buffers, flags)
        except BaseException as exc:
            with self._pending_lock:
                self._pending.pop(rid, None)
            if not isinstance(exc, OSError):
                raise
            self._fail_async(exc)
            raise WorkerLost(f"worker {self.address} was lost: {exc!r}", {self.address: repr(exc)}) from exc
        return rid

    def _fail_async(self, exc: BaseException) -> None:
        # Callers may hold their own locks, and callbacks take them: fail elsewhere.
        threading.Thread(target=self._fail, args=(exc,), daemon=True).start()

    def cancel(self, request_ids) -> None:
        """Forget these requests; the worker skips those it has not started."""
        ids = []
        with self._pending_lock:
            for rid in request_ids:
                if self._pending.pop(rid, None) is not None:
                    ids.append(rid)
        if ids and not self.closed:
            try:
                self._send(wire.CANCEL, meta=pickle.dumps(ids))
            except OSError as exc:
                self._fail_async(exc)

    def release_later(self, ref_id: int) -> None:
        # Called from garbage collection, possibly in the middle of a send: only queue.
        self._releases.append(ref_id)

    def num_pending(self) -> int:
        return len(self._pending)

    # -- receiving -------------------------------------------------------
    def _read_loop(self) -> None:
        channel = self.channel
        try:
            while True:
                try:
                    frame = channel.read_header(limits.reply_limits())
                except FrameTooLarge as exc:  # authentic but too big: fail that request only
                    channel.skip(exc.frame)
                    self._fail_request(exc.frame.request_id, exc)
                    continue
                if frame.kind not in (wire.REPLY, wire.ERROR, wire.PONG, wire.BYE):
                    raise ProtocolError(f"unexpected {wire.KIND_NAMES[frame.kind]} message from worker")
                with self._pending_lock:
                    pending = (
                        self._pending.pop(frame.request_id, None)
                        if frame.kind in (wire.REPLY, wire.ERROR)
                        else None
                    )
                if pending is None:  # a heartbeat, or cancelled or expired: drain and drop
                    channel.read_meta(frame)
                    channel.skip(frame, meta=False)
                    if frame.kind == wire.BYE:
                        raise ProtocolError(
                            f"worker closed the connection: {frame.meta.decode(errors='replace')}"
                        )
                    continue
                try:
                    channel.read_meta(frame)
                    buffers = allocate(frame.buffer_lengths, pending.pin) if frame.buffer_lengths else []
                    channel.read_buffers(buffers)  # each record received counts as life
                except BaseException as exc:
                    with self._pending_lock:  # the request being received fails with the connection
                        closed = self.closed
                        if not closed:
                            self._pending[frame.request_id] = pending
                    if closed:  # already failed by another thread: fail this one here
                        pending.callback(False, self._lost_error())
                    raise exc
                self._deliver(frame, buffers, pending)
                del frame, buffers, pending  # an idle connection must not keep the last reply alive
        except BaseException as exc:  # noqa: BLE001 - the thread must fail every waiter
            self._fail(exc)

    def _fail_request(self, rid: int, exc: BaseException) -> None:
        with self._pending_lock:
            pending = self._pending.pop(rid, None)
        if pending is not None:
            try:
                pending.callback(False, exc)
            except Exception:
                log.exception("a result callback failed")

    def _deliver(self, frame: wire.Frame, buffers, pending: _Pending) -> None:
        try:
            if frame.kind == wire.ERROR:
                ok, value = False, errors.rebuild_remote_error(self.address, pickle.loads(frame.meta))
            elif frame.flags & wire.FLAG_RREF:
                ok, value = True, pickle.loads(frame.meta)
            else:
                ok, value = True, serialize.loads(frame.meta, buffers)
        except Exception as exc:  # an unpicklable reply fails that request only
            ok, value = (
                False,
                SerializationError(
                    f"the reply from worker {self.address} could not be unpickled here: {exc!r}. Classes of the "
                    "result must be importable in the trainer too (or be defined in __main__)"
                ),
            )
            value.__cause__ = exc
        _delivering.nbytes = frame.size  # [stats hook] read by the callback: reply_bytes()
        try:
            pending.callback(ok, value)
        except Exception:
            log.exception("a result callback failed")

    # -- failure ----------------------------------------------------------
    def _lost_error(self) -> WorkerLost:
        return errors.worker_lost(self.address, self.error)

    def _fail(self, exc: BaseException) -> None:
        with self._pending_lock:
            if self.closed:
                return
            self.closed = True
            self.error = exc
            pending, self._pending = self._pending, {}
        _keeper.discard(self)
        _pool.discard(self)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        if pending:
            lost = self._lost_error()
            for p in pending.values():
                try:
                    p.callback(False, lost)
                except Exception:
                    log.exception("a result callback failed")

    def close(self) -> None:
        self._fail(ConnectionClosed(f"the connection to worker {self.address} was closed by this process"))

    # -- keeper duties ------------------------------------------------------
    def tick(self, now: float) -> None:
        expired = []
        with self._pending_lock:
            waiting = bool(self._pending)
            for rid, p in list(self._pending.items()):
                if p.deadline is not None and now > p.deadline:
                    expired.append(self._pending.pop(rid))
        for p in expired:
            try:
                p.callback(
                    False, Timeout(f"no reply from worker {self.address} within the request's timeout")
                )
            except Exception:
                log.exception("a result callback failed")
        # alive: a record arrived, or a large upload to it made progress (it reads)
        heard = self.channel.last_activity
        if waiting and now - heard > HEARTBEAT_TIMEOUT:
            self._fail(
                WorkerLost(
                    f"worker {self.address} sent nothing for {now - heard:.1f} s "
                    "(no heartbeat): it hangs or the network is cut"
                )
            )
            return
        releases, self._releases = self._releases, []
        try:
            if releases:
                self._send(wire.RELEASE, meta=pickle.dumps(releases))
            elif now - self.last_tx > HEARTBEAT_INTERVAL and self._send_lock.acquire(blocking=False):
                try:
                    self.channel.send(wire.PING)
                    self.last_tx = now
                finally:
                    self._send_lock.release()
        except OSError as exc:
            self._fail(exc)


class _Keeper:
    """One background thread per process that looks after every connection."""

    def __init__(self):
        self._conns: weakref.WeakSet[Connection] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pid = None

    def add(self, conn: Connection) -> None:
        with self._lock:
            self._conns.add(conn)
            if self._thread is None or self._pid != os.getpid():
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._run, name="torchfeed-keeper", daemon=True)
                self._thread.start()

    def discard(self, conn: Connection) -> None:
        with self._lock:
            self._conns.discard(conn)

    def _run(self) -> None:
        while True:
            time.sleep(0.25)
            with self._lock:
                conns = list(self._conns)
            now = time.monotonic()
            for conn in conns:
                try:
                    conn.tick(now)
                except Exception:
                    log.exception("keeper failed on %s", conn.address)
            del conns


_keeper = _Keeper()


class _Pool:
    """Process-wide cache: one connection per (worker address, secret)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._conns: dict[tuple[str, bytes], Connection] = {}
        self._connecting: dict[tuple[str, bytes], threading.Lock] = {}
        self._pid = os.getpid()

    def get(self, address: Address, secret: auth.SecretLike = None, timeout: float = 120.0) -> Connection:
        sec = auth.load_secret(secret)
        key = (format_address(address), sec.value)
        with self._lock:
            if self._pid != os.getpid():  # forked: the parent's sockets are not ours
                self._conns.clear()
                self._connecting.clear()
                self._pid = os.getpid()
            conn = self._conns.get(key)
            if conn is not None and not conn.closed:
                return conn
            gate = self._connecting.setdefault(key, threading.Lock())
        with gate:  # one connect per address at a time
            with self._lock:
                conn = self._conns.get(key)
                if conn is not None and not conn.closed:
                    return conn
            conn = Connection(key[0], sec, timeout)
            with self._lock:
                self._conns[key] = conn
            return conn

    def discard(self, conn: Connection) -> None:
        with self._lock:
            key = (conn.address, conn.secret.value)
            if self._conns.get(key) is conn:
                del self._conns[key]

    def close_all(self, join_timeout: float = 1.0) -> None:
        with self._lock:
            conns = list(self._conns.values())
            self._conns.clear()
        for c in conns:
            c.close()
        deadline = time.monotonic() + join_timeout
        for c in conns:  # let reader threads leave torch code before the interpreter exits
            if c._thread is not threading.current_thread():
                c._thread.join(max(0.0, deadline - time.monotonic()))


_pool = _Pool()
connect = _pool.get
close_all = _pool.close_all
atexit.register(close_all)


def close_connections(addresses: Sequence[Address]) -> None:
    """Close this process's connections to these workers (before stopping them on purpose).

    Their pending requests fail with :class:`ConnectionClosed`, which loaders do not warn about.
    """
    wanted = {format_address(a) for a in addresses}
    for conn in list(_pool._conns.values()):
        if conn.address in wanted:
            conn.close()


class RemoteRef:
    """A reference to an object kept on a worker (``rpc_async(..., rref=True)``).

    Pass it as an argument of later calls to the same worker: it arrives there as the
    object itself. The worker frees the object when this reference is garbage collected
    or when the client disconnects.
    """

    def __init__(self, conn: Connection, ref_id: int):
        self.address = conn.address
        self.ref_id = ref_id
        self._conn = conn
        self._finalizer = weakref.finalize(self, conn.release_later, ref_id)

    def __reduce__(self):
        return serialize.resolve_reference, (self.ref_id, self.address)

    def __repr__(self) -> str:
        return f"RemoteRef({self.address}, id={self.ref_id})"

    def release(self) -> None:
        """Free the remote object now."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        """Whether the connection this reference lives on has failed or was closed."""
        return self._conn.closed

    def request(self, args: tuple, *, callback: Callback, pin: bool = False) -> int:
        """Call the referenced object with ``args`` (plain pickle); ``callback(ok, value)`` gets
        the outcome on the connection's reader thread. Returns the request id (see :meth:`cancel`)."""
        meta = pickle.dumps((self.ref_id, args, None), protocol=5)
        return self._conn.request(wire.CALL_REF, meta, callback=callback, pin=pin)

    def cancel(self, request_ids) -> None:
        """Forget these requests made with :meth:`request`."""
        self._conn.cancel(request_ids)


def call(
    address: Address,
    func: Callable,
    args=None,
    kwargs=None,
    *,
    rref: bool = False,
    pin_memory: bool = False,
    timeout: float = 120.0,
    secret: auth.SecretLike = None,
    callback: Callback,
) -> None:
    """Low-level asynchronous call: ``callback(ok, value)`` receives the outcome."""
    check_pinnable(pin_memory)
    try:
        meta, buffers = serialize.dumps((func, tuple(args or ()), dict(kwargs or {})), by_value=True)
    except Exception as exc:
        raise SerializationError(
            f"the call of {getattr(func, '__qualname__', func)!r} cannot be sent to worker "
            f"{format_address(address)}: its function or arguments cannot be pickled "
            f"({exc})"
        ) from exc
    conn = connect(address, secret, timeout)
    # The arguments stay referenced until the reply: a RemoteRef argument dropped by the
    # caller right away must not be released before the worker used it.
    keep = [args, kwargs]

    def done(ok, value):
        keep.clear()
        if ok and rref:
            value = RemoteRef(conn, value)
        callback(ok, value)

    conn.request(
        wire.CALL,
        meta,
        buffers,
        callback=done,
        flags=wire.FLAG_RREF if rref else 0,
        pin=pin_memory,
        timeout=timeout,
    )


def rpc_async(
    host: Address,
    func: Callable,
    args=None,
    kwargs=None,
    pin_memory: bool = False,
    rref: bool = False,
    timeout: float = 120.0,
    *,
    secret: auth.SecretLike = None,
) -> torch.futures.Future:
    """Execute ``func(*args, **kwargs)`` on a worker; return a future of its result.

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
    timeout : float
        Seconds to connect and to wait for the result.

    Returns
    -------
    torch.futures.Future
        Raises :class:`RemoteError` from ``wait()`` if ``func`` raised on the worker.
    """
    fut: torch.futures.Future = torch.futures.Future()

    def done(ok, value):
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    try:
        call(
            host,
            func,
            args,
            kwargs,
            rref=rref,
            pin_memory=pin_memory,
            timeout=timeout,
            secret=secret,
            callback=done,
        )
    except Exception as exc:
        fut.set_exception(exc)
    return fut
