"""May the secret travel through this Ray cluster's channels? (:func:`check_node`)

:class:`torchfeed.ray.Pool` hands each worker actor what it needs to start its torchfeed
worker: the secret itself, or only the path of a secret file the actor's machine has. A
method call carries its arguments over Ray's gRPC connections (driver to the actor's
process), in clear unless Ray runs with TLS (``RAY_USE_TLS=1``). So the secret itself is
sent only when Ray's connections are encrypted or when both ends are on this machine (the
driver and the actor's node on loopback addresses, or the actor on the driver's own node at an
address of this machine); otherwise the pool refuses that actor,
with what to do. The check runs for every actor, once it is placed, before anything secret
is sent to it.
"""

from __future__ import annotations

import os
import socket

from ..util import is_loopback_host as is_loopback

TLS_VARIABLE = "RAY_USE_TLS"


def ray_uses_tls() -> bool:
    """Whether this process's Ray connections are TLS (``RAY_USE_TLS`` on, as the whole cluster must be)."""
    return os.environ.get(TLS_VARIABLE, "0").strip().lower() in ("1", "true", "yes")


def is_this_machine(host: str) -> bool:
    """Whether ``host`` (an IP) is an address of this machine (it can be bound here): traffic
    between two of them never leaves it."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host.strip("[]"), 0))
        return True
    except OSError:
        return False


def clear_reason(driver_ip: str, node_ip: str) -> str | None:
    """Why the secret would cross a network in clear between the driver and an actor on
    ``node_ip`` (None: it would not)."""
    if ray_uses_tls():
        return None
    away = [ip for ip in (driver_ip, node_ip) if not is_loopback(ip)]
    if not away:
        return None
    if driver_ip == node_ip and is_this_machine(node_ip):
        return None  # the driver's own node: the call stays on this machine
    return (
        f"Ray's connections are not encrypted ({TLS_VARIABLE} is not set) and the actor's node "
        f"{node_ip} is reached from this driver ({driver_ip}) over a network"
    )


def refusal(what: str, reason: str) -> str:
    """The message of a refused start: the reason and the three ways out."""
    return (
        f"{what}: not sending the torchfeed secret: {reason}. Anyone who can read that traffic gets "
        "the secret, and with it can run code on the torchfeed workers and read your data. Fix it in "
        f"one of these ways: (1) run Ray with TLS ({TLS_VARIABLE}=1 and its certificates on every node); "
        "(2) keep the secret in a file every node already has (chmod 600, a private directory) and "
        "pass secret_file=PATH: only the path is sent; (3) if no one else can listen on this network, "
        "pass allow_insecure=True"
    )


__all__ = ["clear_reason", "is_loopback", "ray_uses_tls", "refusal"]
