"""The worker daemon: accepts trainers, authenticates them, runs their calls.

NOTE [worker threads, queues and shutdown]
One process serves many clients with these threads:

* the **doorman** (the thread that calls ``serve_forever``): accepts connections and
  runs every handshake without blocking (:mod:`torchfeed.worker.doorman`); unauthenticated
  peers get no thread of their own;
* per authenticated connection, a **reader** (parses sealed frames, answers heartbeats
  at once whatever user code is doing, queues calls for the executors) and a
  **writer** (sends the connection's replies from its outbox, in order). Executors never
  block on a socket: a small reply with nothing queued before it is written at once with
  a non-blocking send (what the socket does not take goes to the front of the outbox),
  anything else is appended to the outbox. So a client that stops reading stalls its own
  writer and nobody else; a writer that makes no progress for ``timeout`` seconds closes
  its connection;
* ``parallel`` **executors**, shared by all connections, run user code;
* the **keeper** drops connections silent for ``timeout`` seconds (half-open peers).

Queues: calls wait in a :class:`~torchfeed.worker.fair.FairQueue`, one FIFO per
connection; executors take the next call from the next connection (round-robin) that
has one. One trainer with hundreds of calls queued therefore delays another trainer's
call by about one call per executor, not by its whole backlog. The calls of one
connection still start in the order they arrived (with ``parallel > 1`` they may run,
and be answered, out of order, as before: clients match replies by request id and the
loader's passes do not rely on reply order).

Per connection, requests waiting for a reply, reply bytes not yet sent (the reader
stops reading while over the bound: back pressure through TCP), the size of one call
and the number of live remote references are bounded (:class:`ConnectionLimits`); so
are the calls of all connections together and their size (the worker's
:class:`~torchfeed.worker.objects.Budget`, counted from a call's authenticated header,
while memory is only committed as its records arrive). Going over a bound answers that
request with a clear error naming the option to raise. Objects kept for clients (remote
references) live in a registry and are freed when released or when the owning
connection closes. Nothing a client does can stop the process: bad frames, failed
handshakes and exceptions in user code end that request or that connection only.
Shutdown (``stop``): the stop event ends the doorman loop, every connection is closed
(its reader and writer leave on the closed socket, its queued calls are dropped), and
the closed queue ends the executors after the request they are running. Calls queued
by a connection that closes are dropped too (never run: nobody waits for them).
"""

from __future__ import annotations

import dataclasses
import logging
import resource
import signal
import socket
import struct
import threading
import time
from typing import Any

from .. import deprecation
from ..protocol import auth, localpath, shm, wire
from ..protocol.addrfile import announce
from ..protocol.channel import Channel
from ..protocol.localchannel import FdReader, LocalChannel
from ..util import hard_close
from . import counters as workerstats
from . import samplestore as workercache
from .doorman import Doorman
from .fair import FairQueue
from .names import Names
from .objects import Budget, ConnectionLimits, Registry
from .options import WorkerOptions
from .serverconn import ServerConnection

log = logging.getLogger("torchfeed.worker")

# keywords of WorkerServer renamed to the option they set
_RENAMED = {"max_pending_handshakes": "max_handshakes", "integrity_only": "trusted_network_no_encryption"}


class WorkerServer:
    """A listening worker. ``serve_forever`` blocks; ``start`` serves from a thread."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout: float | None = None,
        parallel: int | None = None,
        *,
        secret: auth.SecretLike = None,
        options: WorkerOptions | None = None,
        limits: ConnectionLimits | None = None,
        **given: Any,
    ):
        """``options``: how it serves (:class:`WorkerOptions`, checked there); ``timeout``,
        ``parallel``, ``limits`` (a :class:`ConnectionLimits`) and any other field of the options
        given by name replace theirs. A worker accepts clients that opted out of encryption when
        ``trusted_network_no_encryption`` is set or its own environment has
        ``TORCHFEED_TRUSTED_NETWORK_NO_ENCRYPTION=1``."""
        for old, new in _RENAMED.items():
            if old in given:
                deprecation.warn(f"WorkerServer({old}=...)", f"WorkerServer({new}=...)")
                given[new] = given.pop(old)
        if given.get("trusted_network_no_encryption") is None:
            given.pop("trusted_network_no_encryption", None)  # the old integrity_only=None: the environment's
        if limits is not None:
            given.update(dataclasses.asdict(limits))
        self.options = (options or WorkerOptions()).merged(timeout=timeout, parallel=parallel, **given)
        self.shm_bytes = self.options.shm_bytes  # shared slots per same-host connection (protocol.shm)
        self.secret = auth.load_secret(secret)
        self.timeout = float(self.options.timeout)
        self.handshake_timeout = float(self.options.handshake_timeout)
        self.parallel = self.options.parallel
        self.limits = self.options.limits()
        self.registry = Registry()
        self.counters = workerstats.Counters()  # [stats hook] for `torchfeed top`
        self.budget = Budget(self.limits)  # what all connections together hold
        self.tasks = FairQueue()  # ready calls, one FIFO per connection, served round-robin
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
        integrity_only = self.options.trusted_network_no_encryption or auth.integrity_only_requested()
        try:
            names = Names(host, self.port, self.address, self.options.reachable_at)
        except ValueError:
            self.listener.close()
            raise
        self.same_host_listener = localpath.listen_beside(self.listener)
        self.doorman = Doorman(
            self.listener,
            self.secret,
            self._authenticated,
            handshake_timeout=self.handshake_timeout,
            stopping=self._stopping,
            max_pending=self.options.max_handshakes,
            allow_integrity_only=integrity_only,
            names=names,
            same_host=self.same_host_listener,
        )
        self._threads = [
            threading.Thread(target=self._executor, name=f"torchfeed-exec-{i}", daemon=True)
            for i in range(self.parallel)
        ]
        self._threads.append(threading.Thread(target=self._keeper, name="torchfeed-keeper", daemon=True))
        for t in self._threads:
            t.start()

    # -- connections ------------------------------------------------------
    def _authenticated(self, sock: socket.socket, peer: str, keys: auth.SessionKeys, leftover: bytes) -> None:
        # a blocked send returns every second, so the writer can tell a stalled peer
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(1.0))
        channel: Channel
        if keys.local:
            arena = shm.Arena(self.shm_bytes, _over_budget)
            channel = LocalChannel(sock, reader=FdReader(sock, leftover), arena=arena)
        else:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            channel = keys.channel(sock, wire.FrameReader(sock, leftover))
        conn = ServerConnection(self, sock, peer, channel)
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
        hard_close(self.listener)
        if self.same_host_listener is not None:
            self.same_host_listener.close()
        for conn in self.connections():
            conn.close()  # drops the calls it had queued
        self.tasks.close()  # executors leave after the call they are running

    def join(self, timeout: float = 5.0) -> None:
        """Wait (bounded) for the executors to finish the requests they are running."""
        deadline = time.monotonic() + timeout
        for t in self._threads:
            if t.name.startswith("torchfeed-exec"):
                t.join(max(0.0, deadline - time.monotonic()))

    # -- threads ----------------------------------------------------------
    def _executor(self) -> None:
        while True:
            item = self.tasks.get()  # round-robin across connections
            if item is None:
                return
            conn, frame, buffers = item
            started = time.monotonic()
            try:
                conn.execute(frame, buffers)
            except Exception:
                log.exception("unexpected error executing a request from %s", conn.peer)
            self.counters.ran(time.monotonic() - started)  # [stats hook] busy share of the metrics
            del item, conn, frame, buffers

    def _keeper(self) -> None:
        """Drop authenticated peers that fall silent (half-open); the doorman times out handshakes."""
        while not self._stopping.wait(min(1.0, self.timeout / 4)):
            self.counters.tick()  # [stats hook] rates of `torchfeed top`
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


def _over_budget(what: str) -> None:
    """An arena could not give a reply shared memory (said once per connection and reason)."""
    log.warning(
        "%s: it travels through the socket instead, with a copy. A trainer holding many batches, or large "
        "ones, needs more: start the worker with a larger --shm-bytes (per same-host trainer)",
        what,
    )


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
    timeout: float | None = None,
    parallel: int | None = None,
    *,
    secret: auth.SecretLike = None,
    address_file: str | None = None,
    options: WorkerOptions | None = None,
) -> None:
    """Start listening and serving remote calls until SIGTERM/SIGINT.

    Parameters
    ----------
    host : str
        Interface to bind (``"0.0.0.0"`` for all).
    port : int
        Port to bind; 0 picks a free one. The address is printed as one
        ``host:port`` line on stdout when the worker is ready.
    timeout : float, optional
        Seconds of silence after which a client connection is considered dead (default:
        ``options.timeout``, 120).
    parallel : int, optional
        Number of requests executing concurrently (threads; default: ``options.parallel``, 1).
    secret : str or bytes, optional
        Shared secret; by default discovered as described in :mod:`torchfeed.protocol.auth`.
    address_file : str, optional
        Also append the address line to this file, under an exclusive lock.
    options : WorkerOptions, optional
        Everything else ``torchfeed worker`` takes: torch threads, the handshake timeout,
        per-client and per-worker bounds, ``--reachable-at``, the sample cache's size, the
        metrics port (see :class:`torchfeed.worker.options.WorkerOptions`).
    """
    options = (options or WorkerOptions()).merged(timeout=timeout, parallel=parallel)
    raise_fd_limit()
    import torch

    torch.set_num_threads(options.threads)
    server = WorkerServer(host, port, secret=secret, options=options)
    # peers reach this worker's cache through its lane, which serves under the same options
    cache_size = workercache.DEFAULT_SIZE if options.cache_size is None else options.cache_size
    workercache.configure(cache_size, lane=workercache.Lane(host, server.secret, options))
    metrics = None
    if options.metrics_port is not None:
        from .prometheus import serve_worker

        metrics_host = host if options.metrics_host is None else options.metrics_host
        try:
            metrics = serve_worker(server, options.metrics_port, metrics_host)
        except OSError as exc:
            server.stop()
            raise OSError(exc.errno, f"--metrics-port {options.metrics_port}: {exc.strerror or exc}") from exc
        except BaseException:
            server.stop()
            raise
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
        if metrics is not None:
            metrics.close()
