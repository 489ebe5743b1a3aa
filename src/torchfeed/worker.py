"""The worker daemon: accepts trainers, authenticates them, runs their calls.

One process serves many clients. Each connection has a reader thread that parses frames
(and answers heartbeats at once, whatever user code is doing); calls run on a pool of
``parallel`` executor threads shared by all connections; replies are written by the
executor that produced them. Objects kept for clients (remote references: datasets,
batch fetchers) live in a registry and are freed when released or when the owning
connection closes. Nothing a client does can stop the process: bad frames, failed
handshakes and exceptions in user code end that request or that connection only.
"""

from __future__ import annotations

import fcntl
import logging
import os
import pickle
import queue
import secrets
import signal
import socket
import sys
import threading
import time
from typing import Any, Dict, Optional

from . import auth, errors, limits, sampling, serialize, wire
from .errors import ProtocolError, TorchfeedError

log = logging.getLogger("torchfeed.worker")

HANDSHAKE_TIMEOUT = 10.0
WORKER_LIMITS = wire.Limits()


class UnknownReference(TorchfeedError, KeyError):
    pass


class Registry:
    """Objects kept on this worker on behalf of clients (remote references)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._objects: Dict[int, tuple] = {}  # id -> (object, owner connection id)

    def put(self, obj: Any, owner: int) -> int:
        with self._lock:
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
    """One authenticated client connection on the worker."""

    _ids = iter(range(1, 1 << 62))

    def __init__(self, server: "WorkerServer", sock: socket.socket, peer: str):
        self.server = server
        self.sock = sock
        self.peer = peer
        self.id = next(self._ids)
        self.reader = wire.FrameReader(sock)
        self.send_lock = threading.Lock()
        self.last_rx = time.monotonic()
        self.authenticated = False
        self.cancelled: set = set()
        self.closed = False

    def send(self, kind: int, request_id: int = 0, meta: bytes = b"", buffers=(), flags: int = 0) -> None:
        with self.send_lock:
            wire.send_frame(self.sock, kind, request_id, meta, buffers, flags)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.server.registry.drop_owner(self.id)
        self.server.forget(self)

    # -- reader thread -----------------------------------------------------
    def serve(self) -> None:
        try:
            self.sock.settimeout(self.server.handshake_timeout)
            if not auth.server_handshake(self.sock, self.reader, self.server.secret):
                log.warning("rejected client %s: wrong secret (it got AUTH_FAIL)", self.peer)
                return
            self.sock.settimeout(None)  # idle peers are reaped by the server's keeper
            self.authenticated = True
            self.last_rx = time.monotonic()
            self._read_loop()
        except (ConnectionError, socket.timeout, OSError) as exc:
            if not self.closed:
                log.info("client %s disconnected: %s", self.peer, exc)
        except ProtocolError as exc:
            log.warning("dropping client %s: %s", self.peer, exc)
            try:
                self.send(wire.BYE, meta=str(exc).encode()[:400])
            except OSError:
                pass
        except Exception:  # a bug here must cost one connection, never the worker
            log.exception("unexpected error serving %s", self.peer)
        finally:
            self.close()

    def _read_loop(self) -> None:
        reader = self.reader
        while True:
            frame = reader.read_frame(WORKER_LIMITS)
            self.last_rx = time.monotonic()
            kind = frame.kind
            if kind == wire.PING:
                self.send(wire.PONG, frame.request_id)
            elif kind in (wire.CALL, wire.CALL_REF):
                buffers = serialize.allocate(frame.buffer_lengths) if frame.buffer_lengths else []
                reader.read_buffers(buffers)
                self.last_rx = time.monotonic()
                self.server.tasks.put((self, frame, buffers))
                del buffers  # the task owns them now
            elif kind == wire.RELEASE:
                self.server.registry.release(pickle.loads(frame.meta), self.id)
            elif kind == wire.CANCEL:
                self.cancelled.update(pickle.loads(frame.meta))
            else:
                raise ProtocolError(f"a client may not send {wire.KIND_NAMES[kind]} messages")

    # -- executor threads ----------------------------------------------------
    def execute(self, frame: wire.Frame, buffers) -> None:
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
                sampling.restore_outside()  # seeded loading may have left its seeds behind
            result = func(*(args or ()), **(kwargs or {}))
            flags = frame.flags & wire.FLAG_RREF
            if flags:
                meta, out = pickle.dumps(self.server.registry.put(result, self.id)), []
            else:
                meta, out = serialize.dumps_reply(result)
                limits.check_reply(meta, out, getattr(func, "reply_limits", None))
            del result
        except BaseException as exc:  # user code may raise anything, SystemExit and Ctrl-C included
            self._reply(wire.ERROR, rid, _describe_exception(exc), [])
            return
        self._reply(wire.REPLY, rid, meta, out, flags)

    def _reply(self, kind: int, rid: int, meta: bytes, buffers, flags: int = 0) -> None:
        self.cancelled.discard(rid)
        if self.closed:
            return
        try:
            self.send(kind, rid, meta, buffers, flags)
        except OSError as exc:
            log.info("could not reply to %s: %s", self.peer, exc)
            self.close()


class WorkerServer:
    """A listening worker. ``serve_forever`` blocks; ``start`` serves from a thread."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, timeout: float = 120.0, parallel: int = 1,
                 *, secret: auth.SecretLike = None, handshake_timeout: float = HANDSHAKE_TIMEOUT):
        if parallel < 1:
            raise ValueError(f"parallel must be >= 1, got {parallel}")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.secret = auth.load_secret(secret)
        self.timeout = float(timeout)
        self.handshake_timeout = float(handshake_timeout)
        self.parallel = parallel
        self.registry = Registry()
        self.tasks: "queue.SimpleQueue" = queue.SimpleQueue()
        self._conns: set = set()
        self._conns_lock = threading.Lock()
        self._stopping = threading.Event()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((host, port))
        self.listener.listen(128)
        # accept() wakes up regularly: a signal delivered to another thread only runs its
        # Python handler once the main thread executes bytecode again
        self.listener.settimeout(0.5)
        self.host = host
        self.port = self.listener.getsockname()[1]
        shown = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
        self.address = f"[{shown}]:{self.port}" if ":" in shown else f"{shown}:{self.port}"
        self._threads = [threading.Thread(target=self._executor, name=f"torchfeed-exec-{i}", daemon=True)
                         for i in range(parallel)]
        self._threads.append(threading.Thread(target=self._keeper, name="torchfeed-keeper", daemon=True))
        for t in self._threads:
            t.start()

    # -- connections ------------------------------------------------------
    def forget(self, conn: ServerConnection) -> None:
        with self._conns_lock:
            self._conns.discard(conn)

    def connections(self):
        with self._conns_lock:
            return list(self._conns)

    def serve_forever(self) -> None:
        try:
            while not self._stopping.is_set():
                try:
                    sock, peer = self.listener.accept()
                except socket.timeout:
                    continue
                except OSError:
                    if self._stopping.is_set():
                        break
                    raise
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                conn = ServerConnection(self, sock, f"{peer[0]}:{peer[1]}")
                with self._conns_lock:
                    self._conns.add(conn)
                threading.Thread(target=conn.serve, name=f"torchfeed-conn-{conn.id}", daemon=True).start()
        finally:
            self.stop()

    def start(self) -> "WorkerServer":
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
        """Drop peers that never finish the handshake or fall silent (half-open)."""
        while not self._stopping.wait(min(1.0, self.timeout / 4, self.handshake_timeout / 4)):
            now = time.monotonic()
            for conn in self.connections():
                limit = self.timeout if conn.authenticated else self.handshake_timeout
                if now - conn.last_rx > limit:
                    log.warning("closing silent connection from %s (nothing received for %.0f s)",
                                conn.peer, now - conn.last_rx)
                    conn.close()


def read_address_file(path: str) -> list:
    """The address lines of a file written by :func:`announce`: in order, no blanks or repeats."""
    try:
        with open(path) as f:
            lines = [line.strip() for line in f]
    except FileNotFoundError:
        return []
    return list(dict.fromkeys(line for line in lines if line and not line.startswith("#")))


def announce(address: str, address_file: Optional[str] = None) -> None:
    """Print ``host:port`` (one line, flushed) and append it to ``address_file`` under a lock."""
    if address_file:
        with open(address_file, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                f.write(address + "\n")
                f.flush()
                os.fsync(f.fileno())
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
    sys.stdout.write(address + "\n")
    sys.stdout.flush()


def run_worker(host: str, port: int, timeout: float = 120, parallel: int = 1, *,
               secret: auth.SecretLike = None, address_file: Optional[str] = None,
               torch_threads: Optional[int] = 1, handshake_timeout: float = HANDSHAKE_TIMEOUT) -> None:
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
    """
    if torch_threads is not None:
        import torch

        torch.set_num_threads(torch_threads)
    server = WorkerServer(host, port, timeout, parallel, secret=secret, handshake_timeout=handshake_timeout)
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
