"""Which dialled endpoints name this worker.

A trainer sends, inside its AUTH message and covered by its proof, the IP address and
port its TCP connection went to (:mod:`torchfeed.protocol.auth`). The worker answers
AUTH_OK only if that endpoint is its own, so a relay (a spoofed host name, a forged line
in a workers file, a box on the path) that hands a connection meant for worker A to
worker B, both holding the secret, gets a refusal from B naming both addresses instead of
a trainer silently served by the wrong worker. A relay cannot rewrite the endpoint: the
proofs would no longer match. An endpoint names this worker when

* its port is the worker's listening port and its address is the one the connection
  arrived on (no address translation on the way: the usual case), or any address of this
  machine for a worker bound to all interfaces, or any loopback address when the
  connection arrived on loopback (127.0.0.0/8 and ::1 reach only this machine); or
* it is one of the endpoints given with ``--reachable-at HOST:PORT`` (``reachable_at=``):
  port forwarding, NAT, containers, SSH tunnels, where the trainer dials an endpoint the
  worker cannot see. ``*:PORT`` accepts any address with that port, ``*`` any endpoint
  (the check is off). Host names are resolved once, at start.

Known gap: two workers bound to different loopback addresses with the same port are not
told apart. The check runs on the doorman thread: comparisons, and for a worker bound to
all interfaces at most one ``bind`` of a throw-away UDP socket (no I/O that can block).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence

from ..protocol import auth
from ..protocol.localpath import is_local

IP = ipaddress.IPv4Address | ipaddress.IPv6Address
WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def parse_reachable(entry: str) -> tuple[str, int | None]:
    """``"HOST:PORT"``, ``"[v6]:PORT"``, ``"*:PORT"`` or ``"*"`` -> ``(host, port)``
    (``("*", None)`` for ``"*"``)."""
    text = entry.strip()
    if text == "*":
        return "*", None
    if text.startswith("["):
        host, _, port = text[1:].partition("]:")
    else:
        host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"--reachable-at {entry!r}: expected HOST:PORT (the address trainers dial, e.g. "
            "gateway.example.org:7000 or *:7000), or * to accept any address"
        )
    return host, int(port)


def _resolve(entry: str) -> set[tuple[IP | None, int | None]]:
    host, port = parse_reachable(entry)
    if host == "*":
        return {(None, port)}
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ValueError(f"--reachable-at {entry!r}: cannot resolve {host!r}: {exc}") from None
    out: set[tuple[IP | None, int | None]] = set()
    for info in infos:
        ip, _ = auth.unpack_endpoint(auth.pack_endpoint(info[4]))
        out.add((ip, port))
    return out


class Names:
    """The endpoints one worker answers to (see the module docstring).

    ``bound_host``: the address it listens on; ``port``: its port; ``address``: how it
    announces itself (for messages); ``reachable_at``: extra ``HOST:PORT`` endpoints.
    """

    def __init__(self, bound_host: str, port: int, address: str, reachable_at: Sequence[str] = ()):
        self.port = port
        self.address = address
        self.wildcard = bound_host in WILDCARD_HOSTS
        self.extra: set[tuple[IP | None, int | None]] = set()
        for entry in reachable_at:
            self.extra |= _resolve(entry)

    def refusal(self, dialled: bytes, local) -> str | None:
        """``None`` if the endpoint ``dialled`` (packed) names this worker, reached on its
        socket's local address ``local``; else the AUTH_FAIL reason."""
        ip, port = auth.unpack_endpoint(dialled)
        if {(None, None), (None, port), (ip, port)} & self.extra:
            return None
        if dialled != bytes(auth.ENDPOINT_BYTES) and port == self.port:
            here, _ = auth.unpack_endpoint(auth.pack_endpoint(local))
            if ip == here or (ip.is_loopback and here.is_loopback) or (self.wildcard and is_local(ip)):
                return None
        shown = auth.endpoint_text(dialled)
        return (
            f"{auth.NOT_THIS_WORKER}the trainer dialled {shown}, but this is the worker at {self.address} "
            f"(port {self.port}): a relay, port forwarding or NAT sent the connection here. If that "
            f"forwarding is intended, start this worker with --reachable-at {shown}"
        )
