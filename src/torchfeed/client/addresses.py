"""Worker addresses: ``host:port``, ``[v6]:port`` or ``(host, port)``, parsed and written one way,
and why connecting to one failed, in words."""

from __future__ import annotations

import socket

Address = str | tuple[str, int]


def parse_address(address: Address) -> tuple[str, int]:
    """``"host:port"``, ``"[v6]:port"`` or ``(host, port)`` -> ``(host, port)``."""
    if isinstance(address, tuple):
        given_host, given_port = address
        return str(given_host), int(given_port)
    text = str(address).strip()
    if text.startswith("["):
        host, _, port = text[1:].partition("]:")
    else:
        host, _, port = text.rpartition(":")
        if ":" in host:  # "127.0.0.1:6543:1", or an IPv6 address without its brackets
            raise ValueError(
                f"worker address {address!r} is not of the form host:port (it has more than one ':'; "
                "write an IPv6 address in brackets: [::1]:6543)"
            )
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"worker address {address!r} is not of the form host:port (a port is 1-65535)")
    return host, int(port)


def connect_failure(exc: OSError, timeout: float) -> str:
    """Why a connection failed, in words: a name that does not resolve or a refusal is said at
    once, as it is; only a timeout took the whole ``timeout``."""
    if isinstance(exc, socket.gaierror):
        return f"its host name does not resolve ({exc.strerror or exc})"
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout:g} s"
    return str(exc)


def format_address(address: Address) -> str:
    host, port = parse_address(address)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
