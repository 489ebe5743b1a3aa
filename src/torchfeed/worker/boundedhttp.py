"""An HTTP server a flood of connections cannot starve: the metrics ports' (``torchfeed worker
--metrics-port``, :func:`torchfeed.metrics.serve`).

One thread accepts; each admitted connection gets a handler thread for one request. Held
to a budget, whatever the peers do:

* at most ``max_handlers`` connections are served at once, so the server holds at most
  ``1 + max_handlers`` threads;
* at most ``per_source`` of them come from one source (an IPv4 address or an IPv6 /64, as
  the doorman counts them: :func:`~torchfeed.worker.doorman.source_of`), so one source
  cannot take every handler;
* a connection beyond either cap is answered 503 (one non-blocking send, best effort) and
  closed by the accepting thread: it never gets a thread;
* a request's head (request line and headers, at most :data:`MAX_HEAD` bytes) must arrive
  within ``read_timeout`` seconds in all, not per read: a peer that sends nothing, or
  drips bytes, is dropped; each send of the answer gets ``read_timeout`` seconds too;
* ``accept`` failing for lack of descriptors, memory or buffers (EMFILE, ENFILE, ENOMEM,
  ENOBUFS) pauses accepting with exponential backoff (10 ms to 1 s), and a handler thread
  that cannot be started (the process's thread limit) closes its connection: the accept
  loop never ends because of load.

Refusals are logged under ``torchfeed.metrics`` at most once every 10 seconds, with a
count of the rest.
"""

from __future__ import annotations

import errno
import io
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from ..util import double_delay
from .doorman import RateLimitedLog, source_of

log = logging.getLogger("torchfeed.metrics")

MAX_HANDLERS = 8  # connections served at once
PER_SOURCE = 4  # of which from one source
READ_TIMEOUT = 5.0  # seconds for a request's whole head
MAX_HEAD = 16384  # bytes of request line and headers
BACKLOG = 64  # connections the kernel queues before accept

_RESOURCE_ERRORS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
_BUSY = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 21\r\n"
    b"Retry-After: 1\r\nConnection: close\r\n\r\ntoo many connections\n"
)


class Slots:
    """Handlers in use, in all and per source; ``take`` fails rather than exceed a cap.

    Invariant: ``in_use == sum(per source)`` and no source holds more than ``per_source``;
    sources holding none are forgotten (memory bounded by ``max_handlers``).
    """

    def __init__(self, max_handlers: int, per_source: int):
        if max_handlers < 1 or per_source < 1:
            raise ValueError(
                f"max_handlers and per_source must be at least 1, got {max_handlers} and {per_source}"
            )
        self.max_handlers, self.per_source = max_handlers, per_source
        self.in_use = 0
        self._by_source: dict[str, int] = {}
        self._lock = threading.Lock()

    def take(self, source: str) -> bool:
        with self._lock:
            held = self._by_source.get(source, 0)
            if self.in_use >= self.max_handlers or held >= self.per_source:
                return False
            self._by_source[source] = held + 1
            self.in_use += 1
            return True

    def held(self, source: str) -> int:
        with self._lock:
            return self._by_source.get(source, 0)

    def give(self, source: str) -> None:
        with self._lock:
            held = self._by_source.pop(source) - 1
            if held:
                self._by_source[source] = held
            self.in_use -= 1


def read_head(sock: socket.socket, seconds: float, limit: int = MAX_HEAD) -> bytes | None:
    """The request line and headers through the blank line (and whatever came with them), or
    None: not all there within ``seconds`` in all, more than ``limit`` bytes, or the peer left."""
    deadline = time.monotonic() + seconds
    head = b""
    while b"\r\n\r\n" not in head and b"\n\n" not in head:
        left = deadline - time.monotonic()
        if left <= 0 or len(head) > limit:
            return None
        sock.settimeout(left)
        try:
            chunk = sock.recv(4096)
        except OSError:  # TimeoutError included
            return None
        if not chunk:
            return None
        head += chunk
    return head


class _Handler(WSGIRequestHandler):
    """One request per connection, its head read under the server's deadline first."""

    server: BoundedWSGIServer

    def handle(self) -> None:
        head = read_head(self.connection, self.server.read_timeout)
        if head is None:
            return
        self.connection.settimeout(self.server.read_timeout)  # each send of the answer
        self.rfile.close()  # else the socket stays open after close() (its makefile holds it)
        self.rfile = io.BytesIO(head)
        super().handle()

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per scrape would drown the worker's log


class BoundedWSGIServer(WSGIServer):
    """A WSGI application served on ``(host, port)`` under the caps of this module's docstring.

    ``serve_forever()`` runs the accept loop (in the caller's thread); ``shutdown()`` ends it
    from another thread, ``server_close()`` frees the port.
    """

    request_queue_size = BACKLOG
    allow_reuse_address = True

    def __init__(
        self,
        address: tuple[str, int],
        app: Callable,
        *,
        max_handlers: int = MAX_HANDLERS,
        per_source: int = PER_SOURCE,
        read_timeout: float = READ_TIMEOUT,
    ):
        if read_timeout <= 0:
            raise ValueError(f"read_timeout must be positive seconds, got {read_timeout}")
        host, port = address
        family, _, _, _, sockaddr = socket.getaddrinfo(  # the family of host: IPv4 or IPv6
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        self.address_family = family
        bind_to: Any = sockaddr  # (host, port) or IPv6's (host, port, flow, scope)
        self.slots = Slots(max_handlers, per_source)
        self.read_timeout = read_timeout
        self.refused = 0  # connections closed at once: over a cap, or no thread for them
        self._say = RateLimitedLog(logger=log)
        self._stopping = threading.Event()
        self._backoff = 0.0
        super().__init__(bind_to, _Handler)
        self.set_app(app)

    def get_request(self) -> tuple[socket.socket, Any]:
        try:
            request = super().get_request()
        except OSError as exc:
            if exc.errno in _RESOURCE_ERRORS:
                self._pause(exc)
            raise  # serve_forever drops it and selects again
        self._backoff = 0.0
        return request

    def _pause(self, exc: OSError) -> None:
        self._backoff = double_delay(self._backoff, 0.01, 1.0)
        self._say(
            logging.WARNING,
            "accept",
            "metrics server cannot accept connections (%s); pausing %.2f s. Raise the file descriptor "
            "limit (ulimit -n) or keep the metrics port away from untrusted networks",
            exc,
            self._backoff,
        )
        self._stopping.wait(self._backoff)

    def process_request(self, request: Any, client_address: Any) -> None:
        source = source_of(str(client_address[0]))
        if not self.slots.take(source):
            self._refuse(
                request,
                "busy",
                "metrics connection from %s refused: %d connections served at once, %d of them its own "
                "(at most %d, %d per source); peers that send no request are dropped after %g s",
                source,
                self.slots.in_use,
                self.slots.held(source),
                self.slots.max_handlers,
                self.slots.per_source,
                self.read_timeout,
            )
            return
        try:
            threading.Thread(
                target=self._serve,
                args=(request, client_address, source),
                name="torchfeed-metrics-conn",
                daemon=True,
            ).start()
        except RuntimeError as exc:  # "can't start new thread": the process's thread limit
            self.slots.give(source)
            self._refuse(
                request,
                "threads",
                "metrics connection from %s refused: no thread could be started for it (%s); the process "
                "is at its thread limit",
                source,
                exc,
            )

    def _serve(self, request: Any, client_address: Any, source: str) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001 - a peer's fault ends its connection, never the server
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self.slots.give(source)

    def _refuse(self, request: socket.socket, key: str, why: str, *args: object) -> None:
        self.refused += 1
        try:
            request.setblocking(False)
            request.send(_BUSY)
        except OSError:
            pass  # best effort: the peer is closed on either way
        self.shutdown_request(request)
        self._say(logging.WARNING, key, why, *args)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("metrics request from %s failed", client_address, exc_info=True)

    def shutdown(self) -> None:
        self._stopping.set()
        super().shutdown()


__all__ = ["BoundedWSGIServer", "Slots", "read_head"]
