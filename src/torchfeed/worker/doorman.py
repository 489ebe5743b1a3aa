"""The worker's front door: accepts connections and runs every handshake on one thread.

Before a peer has proven it holds the secret it gets no thread, no large buffer and no
unpickling: a single thread multiplexes the listening socket and all handshakes in
progress with a selector, each costing one socket and a few hundred bytes. Peers are
held to a small budget:

* at most ``max_pending`` handshakes at once; a new connection beyond that evicts the
  oldest handshake of the source holding the most (an IPv4 address or an IPv6 /64): a
  flood from one source sheds its own connections, never those of other sources (and
  handshakes in progress are served before the next few accepts, so a real client's AUTH
  does not wait behind the flood's new connections);
* ``handshake_timeout`` seconds to finish;
* wrong secrets are rate limited per source address (a token bucket): a source out of
  tokens gets no AUTH_FAIL answer and no log line for its failures until it earns a token
  back, and log lines are rate limited too. A right secret is never refused, so a trainer
  sharing a host (or a NAT address) with a guesser is not locked out; guessing itself is
  made hopeless by the 32-byte minimum on secrets, not by this limit.

A client with the right secret is answered AUTH_OK only if the endpoint it dialled names
this worker (:mod:`torchfeed.worker.names`); else AUTH_FAIL says which worker it reached.

The same loop accepts on the worker's same-host socket (:mod:`torchfeed.protocol.localpath`)
when it has one: a connection there whose peer (``SO_PEERCRED``) is not this process's uid
is closed before a byte is sent; the others go through the same handshake, where they may
ask for the unsealed same-host mode (refused over TCP).

``accept`` failing for lack of file descriptors, memory or buffers (EMFILE, ENFILE,
ENOMEM, ENOBUFS) is logged, a handshake is evicted as above to free a descriptor, and
accepting pauses with exponential backoff (10 ms to 1 s): the loop never ends because of
load. A successful handshake is handed to ``on_authenticated``; if that fails (no thread
can be started), the connection is closed and the doorman goes on.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import selectors
import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from ..errors import ProtocolError
from ..protocol import auth, wire
from ..util import double_delay
from .names import Names

log = logging.getLogger("torchfeed.worker")

_RESOURCE_ERRORS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
_AUTH_FRAME = wire.HEADER.size + auth.AUTH_BYTES


class RateLimitedLog:
    """At most one line per key every ``interval`` seconds to ``logger``; the rest are counted
    into the next line. Safe from several threads; memory bounded under address floods."""

    def __init__(self, interval: float = 10.0, logger: logging.Logger = log):
        self.interval = interval
        self._log = logger
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def __call__(self, level: int, key: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(key, -1e9) < self.interval:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return
            self._last[key] = now
            n = self._suppressed.pop(key, 0)
            if len(self._last) > 4096:
                self._last.clear()
        self._log.log(level, msg + (f" ({n} more like this suppressed)" if n else ""), *args)


class FailureLimiter:
    """Token bucket per source address for failed handshakes."""

    def __init__(self, burst: float = 10.0, per_second: float = 1.0, max_sources: int = 4096):
        self.burst, self.rate, self.max_sources = burst, per_second, max_sources
        self._tokens: dict[str, tuple] = {}  # host -> (tokens, last update)

    def _level(self, host: str, now: float) -> float:
        tokens, last = self._tokens.get(host, (self.burst, now))
        return min(self.burst, tokens + (now - last) * self.rate)

    def blocked(self, host: str) -> bool:
        return host in self._tokens and self._level(host, time.monotonic()) < 1.0

    def failed(self, host: str) -> None:
        now = time.monotonic()
        if len(self._tokens) >= self.max_sources and host not in self._tokens:
            self._tokens = {h: v for h, v in self._tokens.items() if self._level(h, now) < self.burst}
        self._tokens[host] = (max(0.0, self._level(host, now) - 1.0), now)


def source_of(host: str) -> str:
    """The unit a flood is counted in: an IPv4 address, or the /64 network of an IPv6 one
    (one machine usually holds a whole /64)."""
    if ":" not in host:  # IPv4: the common case, kept cheap (it runs once per connection)
        return host
    try:
        ip = ipaddress.IPv6Address(host.split("%", 1)[0])
    except ValueError:
        return host
    if ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ipaddress.IPv6Network((ip, 64), strict=False))


class _Handshake:
    __slots__ = ("sock", "peer", "host", "source", "hello", "buf", "deadline", "same_host")

    def __init__(
        self,
        sock: socket.socket,
        peer: str,
        host: str,
        hello: bytes,
        deadline: float,
        same_host: bool = False,
    ):
        self.sock, self.peer, self.host, self.hello, self.deadline = sock, peer, host, hello, deadline
        self.source = source_of(host)
        self.buf = bytearray()
        self.same_host = same_host  # came over the same-host socket from a peer of our uid


_SAME_HOST = "same-host"  # the selector's mark of the same-host listener (the TCP one: None)


def judge(
    received: bytes, hello: bytes, secret: auth.Secret, same_host: bool = False
) -> tuple[str, bytes, auth.SessionKeys | None]:
    """Judge what a connecting peer sent after our HELLO (pure: no I/O, no unpickling).

    Returns ``(verdict, reply, keys)``: ``"more"`` (wait for more bytes), ``"bye"`` (not
    the protocol: ``reply`` is the BYE text), ``"fail"`` (wrong proof: ``reply`` is the
    AUTH_FAIL reason) or ``"ok"`` (``reply`` is the AUTH_OK proof, ``keys`` the session).
    """
    try:
        if len(received) >= wire.HEADER.size:
            kind, _flags, _rid, meta_len, nbuf, _aux = wire.parse_header(received[: wire.HEADER.size])
            if kind != wire.AUTH or meta_len != auth.AUTH_BYTES or nbuf:
                raise ProtocolError(
                    f"expected an AUTH message, got {wire.KIND_NAMES[kind]} with {meta_len} bytes"
                )
        if len(received) < _AUTH_FRAME:
            return "more", b"", None
        ok, reply, keys = auth.check_auth(
            secret, hello, received[wire.HEADER.size : _AUTH_FRAME], same_host=same_host
        )
    except ProtocolError as exc:
        return "bye", str(exc).encode()[:400], None
    return ("ok", reply, keys) if ok else ("fail", reply, None)


def _listener_last(event) -> int:
    """Handshakes in progress first, then the same-host socket (only this user's processes
    reach it: a TCP flood must not take every descriptor it frees), then TCP."""
    return {_SAME_HOST: 1, None: 2}.get(event[0].data, 0)


class Doorman:
    """Accept loop and handshakes of one worker (see the module docstring)."""

    def __init__(
        self,
        listener: socket.socket,
        secret: auth.Secret,
        on_authenticated: Callable[[socket.socket, str, auth.SessionKeys, bytes], None],
        *,
        handshake_timeout: float,
        stopping: threading.Event,
        max_pending: int = 128,
        allow_integrity_only: bool = False,
        limiter: FailureLimiter | None = None,
        names: Names | None = None,
        same_host: socket.socket | None = None,
    ):
        self.listener = listener
        self.same_host = same_host  # the Unix listener beside the TCP one (protocol.localpath)
        self.secret = secret
        self.on_authenticated = on_authenticated
        self.handshake_timeout = handshake_timeout
        self.stopping = stopping
        self.max_pending = max_pending
        self.allow_integrity_only = allow_integrity_only
        self.limiter = limiter or FailureLimiter()
        if names is None:
            here = listener.getsockname()
            names = Names(str(here[0]), here[1], f"{here[0]}:{here[1]}")
        self.names = names
        self.say = RateLimitedLog()
        self._pending: OrderedDict[int, _Handshake] = OrderedDict()  # fd -> handshake, oldest first
        self._by_source: dict[str, OrderedDict[int, _Handshake]] = {}  # the same, per source
        self._sel = selectors.DefaultSelector()
        self._accept_paused_until = 0.0
        self._backoff = 0.0

    @property
    def pending(self) -> int:
        return len(self._pending)

    # -- loop ---------------------------------------------------------------------
    def run(self) -> None:
        self._listen(True)
        try:
            while not self.stopping.is_set():
                try:
                    self._maybe_resume_accepting()
                    self._expire()
                except Exception:  # never the end of the accept loop
                    log.exception("unexpected error in the accept loop")
                # handshakes in progress first: an honest AUTH never waits behind a burst of accepts
                for key, _ in sorted(self._sel.select(timeout=self._wait()), key=_listener_last):
                    try:
                        if key.data in (None, _SAME_HOST):
                            self._accept_some(key.fileobj, key.data == _SAME_HOST)
                        else:
                            self._advance(key.data)
                    except Exception:  # a bug here must cost one peer, never the accept loop
                        log.exception("unexpected error in the accept loop")
                        if key.data is not None:
                            self._close(key.data)
        finally:
            for hs in list(self._pending.values()):
                self._close(hs)
            self._sel.close()

    def _wait(self) -> float:
        wait = 0.5  # signals on other threads and stop requests are seen at least this often
        if self._pending:
            wait = min(wait, max(0.0, next(iter(self._pending.values())).deadline - time.monotonic()))
        if self._accept_paused_until:
            wait = min(wait, max(0.0, self._accept_paused_until - time.monotonic()))
        return wait

    def _listen(self, on: bool) -> None:
        for listener, mark in ((self.listener, None), (self.same_host, _SAME_HOST)):
            if listener is None:
                continue
            if on:
                listener.setblocking(False)
                self._sel.register(listener, selectors.EVENT_READ, mark)
            else:
                self._sel.unregister(listener)

    def _accept_some(self, listener, same_host: bool) -> None:
        for _ in range(16):  # then let handshakes in progress run
            try:
                sock, addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if self.stopping.is_set():
                    return
                if exc.errno in _RESOURCE_ERRORS:
                    self._pause_accepting(exc)
                else:  # e.g. ECONNABORTED: that peer is gone, others are not
                    self.say(logging.INFO, "accept", "accept failed: %s", exc)
                return
            self._backoff = 0.0
            if same_host:
                self._admit_same_host(sock)
            else:
                self._admit(sock, addr)

    def _pause_accepting(self, exc: OSError) -> None:
        if self._pending:  # free a descriptor for the next real client
            self._evict()
        self._backoff = double_delay(self._backoff, 0.01, 1.0)
        self._accept_paused_until = time.monotonic() + self._backoff
        self._listen(False)
        self.say(
            logging.WARNING,
            "accept-resources",
            "cannot accept connections (%s): %d handshakes pending; pausing %.2f s. Raise the file "
            "descriptor limit (ulimit -n) if this worker serves many clients",
            exc,
            self.pending,
            self._backoff,
        )

    def _maybe_resume_accepting(self) -> None:
        if self._accept_paused_until and time.monotonic() >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            self._listen(True)

    def _admit_same_host(self, sock: socket.socket) -> None:
        """A connection on the same-host socket: only a process of this uid gets a byte."""
        try:
            pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        except OSError:
            sock.close()
            return
        if uid != os.getuid():
            self.say(
                logging.WARNING,
                f"same-host uid {uid}",
                "refused a same-host connection from process %d of uid %d (this worker runs as uid %d)",
                pid,
                uid,
                os.getuid(),
            )
            sock.close()
            return
        self._admit(sock, ("same-host", pid), same_host=True)

    def _admit(self, sock: socket.socket, addr, same_host: bool = False) -> None:
        host = str(addr[0])
        peer = f"{addr[0]}:{addr[1]}"
        while len(self._pending) >= self.max_pending:
            self._evict()
        hello = auth.hello_meta(self.allow_integrity_only)
        try:
            sock.setblocking(False)
            if not same_host:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            frame = wire.pack_header(wire.HELLO, 0, len(hello), []) + hello
            if sock.send(frame) != len(frame):
                raise BlockingIOError("greeting did not fit the send buffer")
        except OSError:
            sock.close()
            return
        hs = _Handshake(sock, peer, host, hello, time.monotonic() + self.handshake_timeout, same_host)
        try:
            self._sel.register(sock, selectors.EVENT_READ, hs)
        except (OSError, ValueError):
            sock.close()
            return
        self._pending[sock.fileno()] = hs
        self._by_source.setdefault(hs.source, OrderedDict())[sock.fileno()] = hs

    # -- one handshake ---------------------------------------------------------------
    def _advance(self, hs: _Handshake) -> None:
        try:
            data = hs.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(hs)
            return
        hs.buf += data
        verdict, reply, keys = judge(bytes(hs.buf), hs.hello, self.secret, hs.same_host)
        if verdict == "more":
            return
        if verdict == "bye":
            self.say(
                logging.INFO,
                f"bad {hs.host}",
                "dropping %s during the handshake: %s",
                hs.peer,
                reply.decode(),
            )
            self._send_quietly(hs, wire.BYE, reply)
            self._close(hs)
            return
        if verdict == "fail":
            if not self.limiter.blocked(hs.host):  # out of tokens: no answer, no log line
                self.limiter.failed(hs.host)
                self.say(
                    logging.WARNING, f"wrong {hs.host}", "rejected client %s: %s", hs.peer, reply.decode()
                )
                self._send_quietly(hs, wire.AUTH_FAIL, reply)
            self._close(hs)
            return
        if self._misrouted(hs):
            return
        leftover = bytes(hs.buf[_AUTH_FRAME:])
        if not self._send_quietly(hs, wire.AUTH_OK, reply):
            self._close(hs)
            return
        self._forget(hs)
        assert keys is not None  # verdict "ok" comes with the session keys
        try:
            hs.sock.setblocking(True)
            self.on_authenticated(hs.sock, hs.peer, keys, leftover)
        except Exception as exc:  # e.g. "can't start new thread": this client only
            self.say(logging.WARNING, "handoff", "could not serve client %s: %s", hs.peer, exc)
            hs.sock.close()

    def _misrouted(self, hs: _Handshake) -> bool:
        """Refuse (and close) a client whose dialled endpoint is not this worker's."""
        dialled = auth.dialled_of(bytes(hs.buf[wire.HEADER.size : _AUTH_FRAME]))
        try:  # a same-host peer dialled the TCP endpoint it stands for
            here = self.listener if hs.same_host else hs.sock
            refusal = self.names.refusal(dialled, here.getsockname())
        except OSError:  # the socket is gone
            refusal = "connection lost"
        if refusal is None:
            return False
        self.say(logging.WARNING, f"misrouted {hs.host}", "refused client %s: %s", hs.peer, refusal)
        self._send_quietly(hs, wire.AUTH_FAIL, refusal.encode()[:500])
        self._close(hs)
        return True

    def _send_quietly(self, hs: _Handshake, kind: int, meta: bytes) -> bool:
        frame = wire.pack_header(kind, 0, len(meta), []) + meta
        try:
            return hs.sock.send(frame) == len(frame)
        except OSError:
            return False

    # -- bookkeeping -----------------------------------------------------------------
    def _forget(self, hs: _Handshake) -> None:
        fd = hs.sock.fileno()
        if self._pending.pop(fd, None) is not None:
            mine = self._by_source.get(hs.source)
            if mine is not None:
                mine.pop(fd, None)
                if not mine:
                    del self._by_source[hs.source]
        try:
            self._sel.unregister(hs.sock)
        except (KeyError, ValueError):
            pass

    def _close(self, hs: _Handshake) -> None:
        self._forget(hs)
        hs.sock.close()

    def _evict(self) -> None:
        """Drop the oldest handshake of the source holding the most (ties: the older one)."""

        def weight(source: str) -> tuple[int, float]:
            held = self._by_source[source]
            return len(held), -next(iter(held.values())).deadline

        source = max(self._by_source, key=weight)
        held = self._by_source[source]
        hs = next(iter(held.values()))
        self.say(
            logging.INFO,
            "evict",
            "too many handshakes in progress (%d): dropping the oldest of %s's %d",
            len(self._pending),
            source,
            len(held),
        )
        self._close(hs)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._pending:
            hs = next(iter(self._pending.values()))
            if hs.deadline > now:
                return
            self.say(
                logging.INFO,
                f"slow {hs.host}",
                "dropping %s: no handshake within %.0f s",
                hs.peer,
                self.handshake_timeout,
            )
            self._close(hs)
