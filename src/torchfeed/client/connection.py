"""One persistent, multiplexed, authenticated connection to one worker.

Many requests share a connection (request ids); a reader thread per connection receives
replies straight into their final buffers and hands them to callbacks (each reply's outcome
is made by :mod:`torchfeed.client.delivery`, on that thread). Each connection
belongs to an owner (a :class:`~torchfeed.Session`, session.py) that it reports to
(``watch`` when made, ``forget`` when it fails or closes) and whose heartbeat settings it
reads; the owner's keeper thread calls :meth:`Connection.tick`.
"""

from __future__ import annotations

import itertools
import logging
import pickle
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from .. import errors
from ..errors import ConnectionClosed, FrameTooLarge, ProtocolError, Timeout, TorchfeedError, WorkerLost
from ..protocol import auth, codec, limits, localpath, shm, wire
from ..protocol.channel import Channel
from ..protocol.localchannel import FdReader, LocalChannel
from ..protocol.replies import SAFE, ReplyPolicy
from ..util import hard_close
from .addresses import Address, connect_failure, format_address, parse_address
from .delivery import JSON_REPLY, deliver, ref_id, reply_bytes, reply_wire  # noqa: F401 - re-exported

log = logging.getLogger("torchfeed.client")

Callback = Callable[[bool, Any], None]


class Owner(Protocol):
    """What a connection needs of the session that looks after it."""

    heartbeat_interval: float
    heartbeat_timeout: float
    reply_policy: ReplyPolicy  # how replies are loaded when a request names no policy

    def watch(self, connection: Connection) -> None: ...

    def forget(self, connection: Connection) -> None: ...


class _Pending:
    __slots__ = ("callback", "compression", "deadline", "pin", "policy", "session")

    def __init__(
        self,
        callback: Callback,
        pin: bool,
        deadline: float | None,
        session: Owner | None,
        policy: Any,
        compression: int = codec.NONE,
    ):
        self.callback = callback
        self.pin = pin
        self.deadline = deadline
        self.session = session  # a call in flight keeps its session (and so this connection) open
        self.policy = policy  # a replies.ReplyPolicy, or JSON_REPLY
        self.compression = compression  # what the call allowed its reply (codec.refusal)


def _open(host: str, port: int, address: str, secret: auth.Secret, timeout: float, owner: Owner):
    """Connect and authenticate: ``(socket, channel)``. A worker on this machine under this
    uid is reached over its same-host socket (protocol.localpath), any other over TCP."""
    near = localpath.dial(host, port, timeout)
    if near is not None:
        sock, ip = near
    else:
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise WorkerLost(
                f"could not connect to worker {address}: {connect_failure(exc, timeout)}. "
                "Is `torchfeed worker` running there, and is the address right?",
                {address: repr(exc)},
            ) from exc
    channel: Channel
    try:
        if near is not None:
            reader = FdReader(sock)
            auth.client_session(sock, secret, address, same_host=(ip, port), reader=reader)
            channel = LocalChannel(sock, reader=reader, mappings=shm.Mappings())
        else:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            channel = auth.client_handshake(
                sock, secret, address, integrity_only=auth.integrity_only_requested()
            )
        sock.settimeout(None)
        # sends fail when the worker reads nothing for the heartbeat timeout (a hung
        # worker must not block a sending thread forever); receives stay blocking
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 1, 0))
        channel.send_stall_timeout = owner.heartbeat_timeout or None
    except TimeoutError as exc:
        sock.close()
        raise Timeout(f"worker {address} did not complete the handshake within {timeout:g} s") from exc
    except (OSError, TorchfeedError):
        sock.close()
        raise
    return sock, channel


class Connection:
    """An authenticated connection to one worker, looked after by ``session`` (its owner:
    a :class:`~torchfeed.Session`, e.g. ``torchfeed.client.default_session()``)."""

    def __init__(self, address: Address, secret: auth.Secret, timeout: float = 120.0, *, session: Owner):
        owner = session
        # weak: a session dropped without close() is collected, and its finalizer closes
        # this connection (the reader thread refers to the connection, not to the session)
        self._session = weakref.ref(owner)
        self.address = format_address(address)
        host, port = parse_address(address)
        self.secret = secret
        sock, self.channel = _open(host, port, self.address, secret, timeout, owner)
        self.sock = sock
        self._send_lock = threading.Lock()
        self._pending_lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        # [request id, cancelled] of the reply whose body the reader thread is receiving: it
        # left _pending with its header, yet it still waits (keeper) and can be cancelled
        self._receiving: list | None = None
        self._ids = itertools.count(1)
        self.link = codec.LinkMeter()  # how fast replies arrive (told to the worker for compression="auto")
        self._releases: list = []
        self.last_tx = time.monotonic()
        self.closed = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._read_loop, name=f"torchfeed-rx-{self.address}", daemon=True
        )
        self._thread.start()
        owner.watch(self)

    @property
    def path(self) -> str:
        """``"same-host"`` (Unix socket, shared memory) or ``"tcp"`` (the sealed channel)."""
        return "same-host" if self.channel.local else "tcp"

    @property
    def session(self) -> Owner | None:
        """The session looking after this connection; None once that session was collected
        (its connections are then closed)."""
        return self._session()

    # -- sending ---------------------------------------------------------
    def _send(
        self, kind: int, request_id: int = 0, meta: bytes = b"", buffers=(), flags: int = 0, aux: int = 0
    ) -> None:
        with self._send_lock:
            self.channel.send(kind, request_id, meta, buffers, flags, aux=aux)
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
        policy: ReplyPolicy | str | None = None,
        compression: int = codec.NONE,
    ) -> int:
        """Send a call; ``callback(ok, value)`` runs on the reader thread with the result.

        ``policy`` says how its reply is loaded (a :class:`~torchfeed.protocol.replies.ReplyPolicy`;
        default: the session's ``reply_policy``), or ``JSON_REPLY``. ``compression`` (a
        :data:`torchfeed.protocol.codec.MODES` value) says how its buffers may travel.
        """
        aux = 0
        if compression:
            flags |= compression << wire.FLAG_CODEC_SHIFT
            if compression == codec.AUTO:
                aux = self.link.hint()
        rid = next(self._ids)
        deadline = time.monotonic() + timeout if timeout else None
        owner = self._session()
        if policy is None:
            policy = owner.reply_policy if owner is not None else SAFE
        with self._pending_lock:
            if self.closed:
                raise self._lost_error()
            self._pending[rid] = _Pending(callback, pin, deadline, owner, policy, compression)
        del owner
        try:
            self._send(kind, rid, meta, buffers, flags, aux)
        except BaseException as exc:
            with self._pending_lock:
                entry = self._pending.pop(rid, None)
            if entry is None and isinstance(exc, OSError):
                # the connection failed during the send (the keeper or the reader): the
                # call's callback already has its WorkerLost, it must not get a second outcome
                return rid
            del entry  # outside the lock: it may hold the last session reference
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
        ids, dropped = [], []
        with self._pending_lock:
            for rid in request_ids:
                entry = self._pending.pop(rid, None)
                if entry is not None:
                    ids.append(rid)
                    dropped.append(entry)  # released after the lock: it may hold the last session reference
                elif self._receiving is not None and self._receiving[0] == rid:
                    self._receiving[1] = True  # its reply is arriving: dropped once received
        del dropped
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
                before = channel.bytes_consumed
                try:
                    frame = channel.read_header(limits.reply_limits())
                except FrameTooLarge as exc:  # authentic but too big: fail that request only
                    if exc.frame is None:  # not read far enough to be skipped
                        raise
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
                    receiving = [frame.request_id, False]  # [id, cancelled]
                    self._receiving = receiving if pending is not None else None
                if pending is None:  # a heartbeat, or cancelled or expired: drain and drop
                    self._drop(frame)
                    continue
                why = codec.refusal(frame.kind, pending.compression, frame.buffer_lengths, frame.codecs)
                if why is not None:  # read past it (nothing allocated for it or inflated): that call fails
                    self._refuse(frame, pending, receiving, why)
                    del frame, pending
                    continue
                try:
                    started, headed = time.perf_counter(), channel.bytes_consumed
                    channel.read_meta(frame)
                    buffers = (  # each record received counts as life
                        channel.receive_buffers(frame, pending.pin, self.address)
                        if frame.buffer_lengths
                        else []
                    )
                    arriving = time.perf_counter() - started
                    if frame.buffer_lengths:  # how fast this reply arrived (header to last byte)
                        self.link.timed(channel.bytes_consumed - headed, arriving)
                except BaseException as exc:
                    with self._pending_lock:  # the request being received fails with the connection
                        self._receiving = None
                        closed = self.closed
                        if not closed and not receiving[1]:
                            self._pending[frame.request_id] = pending
                    if closed and not receiving[1]:  # already failed by another thread: fail it here
                        pending.callback(False, self._lost_error())
                    raise exc
                with self._pending_lock:
                    self._receiving = None
                if receiving[1]:  # cancelled while its body arrived
                    if frame.kind == wire.REPLY and frame.flags & wire.FLAG_RREF:
                        self.release_later(ref_id(frame.meta))
                else:
                    wire_bytes = (channel.bytes_consumed - before, arriving)
                    deliver(self.address, frame, buffers, pending.policy, pending.callback, wire_bytes)
                del frame, buffers, pending  # an idle connection must not keep the last reply alive
        except BaseException as exc:  # noqa: BLE001 - the thread must fail every waiter
            self._fail(exc)
        finally:  # again, from this thread: descriptors that arrived while another one closed it
            self.channel.close()

    def _refuse(self, frame: wire.Frame, pending: _Pending, receiving: list, why: str) -> None:
        """Fail the call of a refused reply, then read past the reply.

        The call left the pending table with the reply's header: neither its deadline nor a
        failure of the connection reaches it any more. So it is completed before the rest of
        the reply is read, whatever that read then meets: a bad size table or a worker that
        closes mid-reply fails the connection; one that stalls holds only the connection
        (whose heartbeat judges it once another call waits)."""
        with self._pending_lock:
            self._receiving = None
        if not receiving[1]:  # not cancelled while its header arrived
            try:
                pending.callback(False, ProtocolError(f"worker {self.address}: {why}; the reply is dropped"))
            except Exception:
                log.exception("a result callback failed")
        self.channel.skip(frame)

    def _drop(self, frame: wire.Frame) -> None:
        """Read past a message nobody waits for (a heartbeat, a cancelled or expired call)."""
        self.channel.read_meta(frame)
        self.channel.skip(frame, meta=False)
        if frame.kind == wire.REPLY and frame.flags & wire.FLAG_RREF:
            # an object kept for a call nobody waits for any more: free it
            self.release_later(ref_id(frame.meta))
        if frame.kind == wire.BYE:
            raise ProtocolError(f"worker closed the connection: {frame.meta.decode(errors='replace')}")

    def _fail_request(self, rid: int, exc: BaseException) -> None:
        with self._pending_lock:
            pending = self._pending.pop(rid, None)
        if pending is not None:
            try:
                pending.callback(False, exc)
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
        owner = self._session()
        if owner is not None:
            owner.forget(self)
        hard_close(self.sock)
        self.channel.close()  # a same-host connection's mappings (replies held keep theirs)
        if pending:
            lost = self._lost_error()
            for p in pending.values():
                try:
                    p.callback(False, lost)
                except Exception:
                    log.exception("a result callback failed")

    def close(self) -> None:
        self._fail(ConnectionClosed(f"the connection to worker {self.address} was closed by this process"))

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the reader thread to end (after :meth:`close`)."""
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def abandon(self) -> None:
        """In a forked child: this connection is the parent's. Mark it closed here and close
        this process's copy of the socket, without a shutdown (the parent keeps using it)."""
        self._pending_lock = threading.Lock()  # the parent's threads may have held them at the fork
        self._send_lock = threading.Lock()
        self._pending = {}
        self._releases = []
        self.closed = True
        self.error = ConnectionClosed(
            f"the connection to worker {self.address} belongs to the parent process (inherited by fork)"
        )
        try:
            self.sock.close()
        except OSError:
            pass

    # -- keeper duties ------------------------------------------------------
    def tick(self, now: float) -> None:
        expired = []
        with self._pending_lock:
            waiting = bool(self._pending) or self._receiving is not None  # a body may stall too
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
        owner = self._session()
        if owner is None:  # collected: its finalizer closes this connection
            return
        # alive: a record arrived, or a large upload to it made progress (it reads)
        heard = self.channel.last_activity
        if waiting and now - heard > owner.heartbeat_timeout:
            self._fail(
                WorkerLost(
                    f"worker {self.address} sent nothing for {now - heard:.1f} s "
                    "(no heartbeat): it hangs or the network is cut"
                )
            )
            return
        # the keeper never waits for the send lock: a send stuck on a worker that reads
        # nothing must not stop the heartbeats of every other connection of the session
        if not (self._releases or now - self.last_tx > owner.heartbeat_interval):
            return
        if not self._send_lock.acquire(blocking=False):
            return  # a send is under way: releases wait for the next round
        try:
            releases, self._releases = self._releases, []
            if releases:
                self.channel.send(wire.RELEASE, 0, pickle.dumps(releases))
            else:
                self.channel.send(wire.PING)
            self.last_tx = now
        except OSError as exc:
            self._send_lock.release()
            self._fail(exc)
            return
        self._send_lock.release()
