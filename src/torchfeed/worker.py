"""The worker daemon: accepts trainers, authenticates them, runs their calls.

NOTE [worker threads, queues and shutdown]
One process serves many clients with these threads:

* the **doorman** (the thread that calls ``serve_forever``): accepts connections and
  runs every handshake without blocking (:mod:`torchfeed.doorman`); unauthenticated
  peers get no thread of their own;
* per authenticated connection, a **reader** (parses sealed frames, answers heartbeats
  at once whatever user code is doing, puts calls on the shared task queue) and a
  **writer** (sends the connection's replies from its outbox, in order). Executors never
  block on a socket: a small reply with nothing queued before it is written at once with
  a non-blocking send (what the socket does not take goes to the front of the outbox),
  anything else is appended to the outbox. So a client that stops reading stalls its own
  writer and nobody else; a writer that makes no progress for ``timeout`` seconds closes
  its connection;
* ``parallel`` **executors**, shared by all connections, run user code;
* the **keeper** drops connections silent for ``timeout`` seconds (half-open peers).

Per connection, requests waiting for a reply, reply bytes not yet sent (the reader
stops reading while over the bound: back pressure through TCP), the size of one call
and the number of live remote references are bounded (:class:`ConnectionLimits`); going
over a bound answers that request with a clear error. Objects kept for clients (remote
references) live in a registry and are freed when released or when the owning
connection closes. Nothing a client does can stop the process: bad frames, failed
handshakes and exceptions in user code end that request or that connection only.
Shutdown (``stop``): the stop event ends the doorman loop, every connection is closed
(its reader and writer leave on the closed socket), and one ``None`` per executor ends
the executors after the request they are running.
"""

from __future__ import annotations

import logging
import pickle
import queue
import resource
import secrets
import signal
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from . import auth, errors, seeding, serialize, wire
from .addrfile import announce, read_address_file  # noqa: F401  (read_address_file: old import path)
from .buffers import allocate
from .doorman import Doorman
from .errors import FrameTooLarge, LimitExceeded, ProtocolError, TorchfeedError
from .limits import check_reply

log = logging.getLogger("torchfeed.worker")

HANDSHAKE_TIMEOUT = 10.0
# replies up to this size are sealed and written by the thread that made them when nothing
# is queued before them (see ServerConnection.send); larger ones always go to the writer
_DIRECT_BYTES = 64 * 1024
_SEALED = -1  # outbox entry: already sealed bytes (the rest of a direct write)


@dataclass(frozen=True)
class ConnectionLimits:
    """What one authenticated client may hold on a worker at once."""

    max_queued_requests: int = 1024  # received, not yet answered
    max_unsent_bytes: int = 1 << 30  # replies produced, not yet sent: reading pauses above this
    max_call_bytes: int = 1 << 30  # pickled arguments plus buffers of one call
    max_queued_bytes: int = 2 << 30  # the size of the calls waiting
    max_refs: int = 4096  # live remote references

    def __post_init__(self):
        for name, value in vars(self).items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")

    def frame_limits(self) -> wire.Limits:
        return wire.Limits(
            max_meta=self.max_call_bytes,
            max_buffers=65536,
            max_buffer_bytes=self.max_call_bytes,
            knob="raise it with `torchfeed worker --max-call-bytes N` or pass less data per call "
            "(build large objects inside the dataset on the worker)",
        )


class UnknownReference(TorchfeedError, KeyError):
    pass


class Registry:
    """Objects kept on this worker on behalf of clients (remote references)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._objects: dict[int, tuple] = {}  # id -> (object, owner connection id)

    def put(self, obj: Any, owner: int, limit: int | None = None) -> int:
        with self._lock:
            if limit is not None and sum(1 for v in self._objects.values() if v[1] == owner) >= limit:
                raise LimitExceeded(
                    f"this client already holds {limit} remote references on the worker (the limit): "
                    "release references you no longer need (RemoteRef.release()), or start the worker "
                    "with a larger --max-refs"
                )
            while True:
                ref_id = secrets.randbits(63) or 1
                if ref_id not in self._objects:
                    self._objects[ref_id] = (obj, owner)
                    return ref_id

    def get(self, ref_id: int, address: str = "?") -> Any:
        try:
            return self._objects[ref_id][0]
        except KeyError:
            raise UnknownReference(
                f"remote reference {ref_id} (made on {address}) is not held by this worker: it was "
                "released, its client disconnected, or it belongs to another worker"
            ) from None

    def release(self, ids, owner: int) -> None:
        with self._lock:
            for ref_id in ids:
                entry = self._objects.get(ref_id)
                if entry is not None and entry[1] == owner:
                    del self._objects[ref_id]

    def drop_owner(self, owner: int) -> None:
        with self._lock:
            for ref_id in [k for k, v in self._objects.items() if v[1] == owner]:
                del self._objects[ref_id]

    def __len__(self) -> int:
        return len(self._objects)


def _describe_exception(exc: BaseException) -> bytes:
    return pickle.dumps(errors.describe_exception(exc), protocol=5)


class ServerConnection:
    """One authenticated client connection on the worker (see the NOTE above)."""

    _ids = iter(range(1, 1 << 62))

    def __init__(self, server: WorkerServer, sock: socket.socket, peer: str, channel):
        self.server = server
        self.sock = sock
        self.peer = peer
        self.id = next(self._ids)
        self.channel = channel
        self.channel.send_stall_timeout = server.timeout
        self.limits: ConnectionLimits = server.limits
        self.cancelled: set = set()
        self.closed = False
        self._cond = threading.Condition()
        self._outbox: deque = deque()
        self.unsent_bytes = 0
        self.queued = 0  # calls received and not yet answered
        self.queued_bytes = 0  # their size
        self.waiting_ids: set = set()  # their request ids (what CANCEL may name)
        self.sending = False  # the writer is inside a send
        self.waiting_for_room = False  # the reader is paused by back pressure

    def start(self) -> None:
        """Start the writer, then the reader; if either cannot start (no threads left), close."""
        try:
            threading.Thread(target=self._write_loop, name=f"torchfeed-tx-{self.id}", daemon=True).start()
            threading.Thread(target=self.serve, name=f"torchfeed-rx-{self.id}", daemon=True).start()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        with self._cond:
            if self.closed:
                return
            self.closed = True
            self._outbox.clear()
            self.unsent_bytes = 0
            self._cond.notify_all()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.server.registry.drop_owner(self.id)
        self.server.forget(self)

    # -- writer thread -------------------------------------------------------
    def send(self, kind: int, request_id: int = 0, meta: bytes = b"", buffers=(), flags: int = 0) -> None:
        """Send a message, or queue it for the writer; never blocks.

        A small message with nothing queued before it is sealed and written here, without
        blocking (no hop to the writer thread: the usual case for small replies); what the
        socket does not take at once goes to the front of the outbox for the writer.
        """
        size = len(meta) + sum(memoryview(b).nbytes for b in buffers)
        with self._cond:
            if self.closed:
                return
            if self._outbox or self.sending or size > _DIRECT_BYTES:
                self._outbox.append((kind, request_id, meta, buffers, flags, size))
                self.unsent_bytes += size
                self._cond.notify_all()
                return
            self.sending = True  # the writer keeps out until the rest, if any, is queued
        rest: memoryview | None = None
        try:
            rest = self.channel.write_nowait(self.channel.seal(kind, request_id, meta, buffers, flags))
        except OSError as exc:
            if not self.closed:
                log.info("could not write to client %s: %s", self.peer, exc)
            self.close()
        finally:
            with self._cond:
                self.sending = False
                if rest is not None and len(rest) and not self.closed:
                    self._outbox.appendleft((_SEALED, 0, rest, (), 0, len(rest)))
                    self.unsent_bytes += len(rest)
                if self._outbox:  # queued meanwhile: the writer waited for us
                    self._cond.notify_all()

    def _write_loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while (not self._outbox or self.sending) and not self.closed:
                        self._cond.wait()
                    if self.closed:
                        return
                    kind, rid, meta, buffers, flags, size = self._outbox.popleft()
                    self.sending = True
                if kind == _SEALED:  # the rest of a message send() began to write
                    self.channel.write(meta)
                else:
                    self.channel.send(kind, rid, meta, buffers, flags)
                del meta, buffers
                with self._cond:
                    self.sending = False
                    self.unsent_bytes -= size
                    self._cond.notify_all()
        except (OSError, TimeoutError) as exc:
            if not self.closed:
                log.info("could not write to client %s: %s", self.peer, exc)
        except Exception:  # a bug here must cost one connection, never the worker
            log.exception("unexpected error writing to %s", self.peer)
        finally:
            self.close()

    def busy(self) -> bool:
        """Replies waiting or being sent, or reading paused for them: judged by the writer."""
        return bool(self._outbox) or self.sending or self.waiting_for_room

    def silent_for(self, now: float) -> float:
        return now - self.channel.last_activity

    # -- reader thread -----------------------------------------------------
    def serve(self) -> None:
        try:
            self._read_loop()
        except (ConnectionError, OSError) as exc:
            if not self.closed:
                log.info("client %s disconnected: %s", self.peer, exc)
        except ProtocolError as exc:
            log.warning("dropping client %s: %s", self.peer, exc)
        except Exception:  # a bug here must cost one connection, never the worker
            log.exception("unexpected error serving %s", self.peer)
        finally:
            self.close()

    def _read_loop(self) -> None:
        channel = self.channel
        frame_limits = self.limits.frame_limits()
        while not self.closed:
            self._wait_for_room()
            try:
                frame = channel.read_header(frame_limits)
            except FrameTooLarge as exc:  # authentic but too big: answer it, keep the connection
                channel.skip(exc.frame)
                self._refuse(exc.frame.request_id, exc)
                continue
            kind = frame.kind
            if kind in (wire.CALL, wire.CALL_REF):
                refusal = self._over_limits(frame)
                if refusal is not None:
                    channel.skip(frame)
                    self._refuse(frame.request_id, refusal)
                    continue
                channel.read_meta(frame)
                buffers = allocate(frame.buffer_lengths) if frame.buffer_lengths else []
                channel.read_buffers(buffers)
                with self._cond:
                    self.queued += 1
                    self.queued_bytes += frame.size
                    self.waiting_ids.add(frame.request_id)
                self.server.tasks.put((self, frame, buffers))
                del buffers  # the task owns them now
                continue
            channel.read_meta(frame)
            channel.skip(frame, meta=False)
            if kind == wire.PING:
                self.send(wire.PONG, frame.request_id)
            elif kind == wire.RELEASE:
                self.server.registry.release(pickle.loads(frame.meta), self.id)
            elif kind == wire.CANCEL:
                with self._cond:  # only requests still waiting can be skipped
                    self.cancelled.update(rid for rid in pickle.loads(frame.meta) if rid in self.waiting_ids)
            else:
                raise ProtocolError(f"a client may not send {wire.KIND_NAMES[kind]} messages")

    def _over_limits(self, frame: wire.Frame) -> LimitExceeded | None:
        lim = self.limits
        if frame.size > lim.max_call_bytes:
            return LimitExceeded(
                f"a call of {frame.size:,} bytes (pickled arguments plus buffers) exceeds the worker's limit of "
                f"{lim.max_call_bytes:,}: pass less data per call (build large objects inside the dataset on "
                "the worker) or start the worker with a larger --max-call-bytes"
            )
        if self.queued >= lim.max_queued_requests or self.queued_bytes + frame.size > lim.max_queued_bytes:
            return LimitExceeded(
                f"this client has {self.queued} requests ({self.queued_bytes:,} bytes) waiting on the worker (the "
                f"limits are {lim.max_queued_requests} requests and {lim.max_queued_bytes:,} bytes): wait for "
                "replies before sending more, or start the worker with a larger --max-queued-requests"
            )
        return None

    def _wait_for_room(self) -> None:
        """Back pressure: stop reading while too many reply bytes wait to be sent."""
        with self._cond:
            self.waiting_for_room = True
            while self.unsent_bytes > self.limits.max_unsent_bytes and not self.closed:
                self._cond.wait(1.0)
            self.waiting_for_room = False

    def _refuse(self, rid: int, exc: BaseException) -> None:
        log.info("refused a request from %s: %s", self.peer, exc)
        self.send(wire.ERROR, rid, _describe_exception(exc))

    # -- executor threads ----------------------------------------------------
    def execute(self, frame: wire.Frame, buffers) -> None:
        try:
            self._execute(frame, buffers)
        finally:
            self._answered(frame)

    def _execute(self, frame: wire.Frame, buffers) -> None:
        rid = frame.request_id
        if rid in self.cancelled:
            self.cancelled.discard(rid)
            return
        try:
            payload = serialize.loads_call(frame.meta, buffers, self.server.registry)
            if frame.kind == wire.CALL:
                func, args, kwargs = payload
            else:
                ref_id, args, kwargs = payload
                func = self.server.registry.get(ref_id, self.server.address)
            if not getattr(func, "manages_rng", False):
                seeding.restore_outside()  # seeded loading may have left its seeds behind
            result = func(*(args or ()), **(kwargs or {}))
            flags = frame.flags & wire.FLAG_RREF
            if flags:
                ref = self.server.registry.put(result, self.id, self.limits.max_refs)
                meta, out = pickle.dumps(ref), []
            else:
                meta, out = serialize.dumps_reply(result)
                check_reply(meta, out, getattr(func, "reply_limits", None))
            del result
        except BaseException as exc:  # user code may raise anything, SystemExit and Ctrl-C included
            self._reply(wire.ERROR, rid, _describe_exception(exc), [])
            return
        self._reply(wire.REPLY, rid, meta, out, flags)

    def _reply(self, kind: int, rid: int, meta: bytes, buffers, flags: int = 0) -> None:
        self.cancelled.discard(rid)
        self.send(kind, rid, meta, buffers, flags)

    def _answered(self, frame: wire.Frame) -> None:
        with self._cond:
            self.queued -= 1
            self.queued_bytes -= frame.size
            self.waiting_ids.discard(frame.request_id)
            self.cancelled.discard(frame.request_id)


class WorkerServer:
    """A listening worker. ``serve_forever`` blocks; ``start`` serves from a thread."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout: float = 120.0,
        parallel: int = 1,
        *,
        secret: auth.SecretLike = None,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        limits: ConnectionLimits | None = None,
        max_pending_handshakes: int = 128,
        integrity_only: bool | None = None,
    ):
        if parallel < 1:
            raise ValueError(f"parallel must be >= 1, got {parallel}")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        if max_pending_handshakes < 1:
            raise ValueError(f"max_pending_handshakes must be >= 1, got {max_pending_handshakes}")
        self.secret = auth.load_secret(secret)
        self.timeout = float(timeout)
        self.handshake_timeout = float(handshake_timeout)
        self.parallel = parallel
        self.limits = limits or ConnectionLimits()
        self.registry = Registry()
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._conns: set = set()
        self._conns_lock = threading.Lock()
        self._stopping = threading.Event()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((host, port))
        self.listener.listen(128)
        self.host = host
        self.port = self.listener.getsockname()[1]
        shown = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
        self.address = f"[{shown}]:{self.port}" if ":" in shown else f"{shown}:{self.port}"
        if integrity_only is None:
            integrity_only = auth.integrity_only_requested()
        self.doorman = Doorman(
            self.listener,
            self.secret,
            self._authenticated,
            handshake_timeout=self.handshake_timeout,
            stopping=self._stopping,
            max_pending=max_pending_handshakes,
            allow_integrity_only=integrity_only,
        )
        self._threads = [
            threading.Thread(target=self._executor, name=f"torchfeed-exec-{i}", daemon=True)
            for i in range(parallel)
        ]
        self._threads.append(threading.Thread(target=self._keeper, name="torchfeed-keeper", daemon=True))
        for t in self._threads:
            t.start()

    # -- connections ------------------------------------------------------
    def _authenticated(self, sock: socket.socket, peer: str, keys: auth.SessionKeys, leftover: bytes) -> None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        # a blocked send returns every second, so the writer can tell a stalled peer
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(1.0))
        conn = ServerConnection(self, sock, peer, keys.channel(sock, wire.FrameReader(sock, leftover)))
        with self._conns_lock:
            self._conns.add(conn)
        conn.start()

    def forget(self, conn: ServerConnection) -> None:
        with self._conns_lock:
            self._conns.discard(conn)

    def connections(self):
        with self._conns_lock:
            return list(self._conns)

    def serve_forever(self) -> None:
        try:
            self.doorman.run()
        finally:
            self.stop()

    def start(self) -> WorkerServer:
        threading.Thread(target=self.serve_forever, name="torchfeed-accept", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()
        for conn in self.connections():
            conn.close()
        for _ in range(self.parallel):
            self.tasks.put(None)

    def join(self, timeout: float = 5.0) -> None:
        """Wait (bounded) for the executors to finish the requests they are running."""
        deadline = time.monotonic() + timeout
        for t in self._threads:
            if t.name.startswith("torchfeed-exec"):
                t.join(max(0.0, deadline - time.monotonic()))

    # -- threads ----------------------------------------------------------
    def _executor(self) -> None:
        while True:
            item = self.tasks.get()
            if item is None:
                return
            conn, frame, buffers = item
            try:
                conn.execute(frame, buffers)
            except Exception:
                log.exception("unexpected error executing a request from %s", conn.peer)
            del item, conn, frame, buffers

    def _keeper(self) -> None:
        """Drop authenticated peers that fall silent (half-open); the doorman times out handshakes."""
        while not self._stopping.wait(min(1.0, self.timeout / 4)):
            now = time.monotonic()
            for conn in self.connections():
                # a connection with replies to send is judged by its writer's progress instead
                if conn.silent_for(now) > self.timeout and not conn.busy():
                    log.warning(
                        "closing silent connection from %s (nothing received for %.0f s)",
                        conn.peer,
                        conn.silent_for(now),
                    )
                    conn.close()


def _timeval(seconds: float) -> bytes:
    return struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))


def raise_fd_limit() -> int:
    """Raise this process's soft limit on open files to the hard limit; return the new limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def run_worker(
    host: str,
    port: int,
    timeout: float = 120,
    parallel: int = 1,
    *,
    secret: auth.SecretLike = None,
    address_file: str | None = None,
    torch_threads: int | None = 1,
    handshake_timeout: float = HANDSHAKE_TIMEOUT,
    limits: ConnectionLimits | None = None,
    max_handshakes: int = 128,
    integrity_only: bool | None = None,
) -> None:
    """Start listening and serving remote calls until SIGTERM/SIGINT.

    Parameters
    ----------
    host : str
        Interface to bind (``"0.0.0.0"`` for all).
    port : int
        Port to bind; 0 picks a free one. The address is printed as one
        ``host:port`` line on stdout when the worker is ready.
    timeout : float
        Seconds of silence after which a client connection is considered dead.
    parallel : int
        Number of requests executing concurrently (threads).
    secret : str or bytes, optional
        Shared secret; by default discovered as described in :mod:`torchfeed.auth`.
    address_file : str, optional
        Also append the address line to this file, under an exclusive lock.
    torch_threads : int or None
        ``torch.set_num_threads`` for this process (1, like DataLoader workers; None keeps torch's default).
    handshake_timeout : float
        Seconds a new connection has to authenticate before it is dropped.
    limits : ConnectionLimits, optional
        Per-client bounds (queued requests, unsent bytes, call size, remote references).
    max_handshakes : int
        Unauthenticated connections held at once (the oldest is dropped beyond it).
    integrity_only : bool, optional
        Also accept clients that opted out of encryption (trusted networks only); by
        default read from ``TORCHFEED_TRUSTED_NETWORK_NO_ENCRYPTION``.
    """
    raise_fd_limit()
    if torch_threads is not None:
        import torch

        torch.set_num_threads(torch_threads)
    server = WorkerServer(
        host,
        port,
        timeout,
        parallel,
        secret=secret,
        handshake_timeout=handshake_timeout,
        limits=limits,
        max_pending_handshakes=max_handshakes,
        integrity_only=integrity_only,
    )
    in_main = threading.current_thread() is threading.main_thread()
    if in_main:

        def _stop(signum, _frame):
            raise SystemExit(0)

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
    log.info("torchfeed worker listening on %s (secret from %s)", server.address, server.secret.source)
    announce(server.address, address_file)
    try:
        server.serve_forever()
    except SystemExit:
        pass
    finally:
        server.stop()
        server.join(timeout=5.0)
