"""Finding a worker on this machine: the Unix socket beside its TCP port, and who is there.

A worker that listens on TCP ``IP:PORT`` also listens on the abstract Unix socket named
``torchfeed/IP:PORT`` (``IP`` as it was bound, ``0.0.0.0`` or ``::`` for every address).
Abstract names live in the kernel, one set per network namespace like TCP ports: nothing
is created in the filesystem and the name goes with the process, ``kill -9`` included.
Since binding ``IP:PORT`` over TCP is exclusive, so is the name.

A trainer given ``HOST:PORT`` resolves ``HOST``; when an address it resolves to is one of
this machine's (it can be bound here), it tries the names of that address and of the
wildcard, and keeps a connection only if the kernel says the process listening there runs
under the trainer's own uid (``SO_PEERCRED``). Abstract names carry no permissions, so this
check is the boundary: a name squatted by another user is refused (with a warning) and the
trainer uses TCP. The worker checks the same of every connection it accepts there, before
it sends a byte. Everything else (is this the worker holding our secret) is the
handshake's, as over TCP.

``TORCHFEED_SAME_HOST=tcp`` (or ``0``/``off``) makes trainers use TCP for every worker:
for benchmarks of the network path, or to see a same-host worker as a remote one.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import struct

log = logging.getLogger("torchfeed.client")

ENV = "TORCHFEED_SAME_HOST"
_OFF = {"0", "off", "no", "false", "tcp"}
_PREFIX = b"\0torchfeed/"
_warned: set = set()


def enabled() -> bool:
    """Whether trainers look for same-host workers (``TORCHFEED_SAME_HOST``, default on)."""
    return os.environ.get(ENV, "1").strip().lower() not in _OFF


def name_of(ip: str, port: int) -> bytes:
    """The abstract Unix socket name beside TCP ``ip:port``."""
    return _PREFIX + f"{ipaddress.ip_address(ip.split('%', 1)[0])}:{port}".encode()


def is_local(ip) -> bool:
    """Whether ``ip`` is an address of this machine: a loopback address, or one the kernel
    routes to itself (connecting a UDP socket there, which sends nothing, picks that very
    address as the source). Being able to bind it is not enough: with ``ip_nonlocal_bind``
    any address can be bound."""
    ip = ipaddress.ip_address(str(ip).split("%", 1)[0])
    if ip.is_loopback:
        return True
    family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((str(ip), 9))
            source = ipaddress.ip_address(str(s.getsockname()[0]).split("%", 1)[0])
        except (OSError, ValueError):
            return False
    return source == ip


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket, as the kernel recorded it."""
    _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return uid


def listen_beside(tcp_listener: socket.socket) -> socket.socket | None:
    """A listening Unix socket named after ``tcp_listener``'s bound address; None when the
    name is taken (a process of another user squatting it: it would be refused by trainers
    anyway) or the platform has no abstract names."""
    ip, port = tcp_listener.getsockname()[:2]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(name_of(ip, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        log.warning(
            "worker %s:%s offers no same-host path (%s): trainers on this machine reach it over TCP",
            ip,
            port,
            exc,
        )
        return None
    return sock


def _names(host: str, port: int) -> list[tuple[bytes, str]]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []  # the TCP path reports what is wrong with the address
    names: list[tuple[bytes, str]] = []  # (name, the address of this machine it stands for)
    for family, *_rest, sockaddr in infos:
        ip = str(sockaddr[0])
        if not is_local(ip):
            continue
        wildcards = ["0.0.0.0", "::"] if family == socket.AF_INET else ["::"]
        for candidate in [ip, *wildcards]:
            name = name_of(candidate, port)
            if all(name != known for known, _ in names):
                names.append((name, ip))
    return names


def dial(host: str, port: int, timeout: float) -> tuple[socket.socket, str] | None:
    """``(a connected Unix socket, the local IP it stands for)`` when the worker at
    ``host:port`` runs on this machine under this uid; None when it does not (or
    :func:`enabled` says no): use TCP."""
    if not enabled():
        return None
    me = os.getuid()
    for name, ip in _names(host, port):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(name)
            uid = peer_uid(sock)
        except OSError:
            sock.close()
            continue
        if uid == me:
            return sock, ip
        sock.close()
        shown = name[1:].decode(errors="replace")
        if shown not in _warned:
            _warned.add(shown)
            log.warning(
                "the same-host socket %s is held by a process of uid %d, not this trainer's (%d): it is not "
                "used; worker %s:%s is reached over TCP",
                shown,
                uid,
                me,
                host,
                port,
            )
    return None
