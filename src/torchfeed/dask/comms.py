"""May a secret travel through this Dask cluster's connections? (:func:`refuse_clear_transport`)

:func:`torchfeed.dask.start_workers` hands the torchfeed secret to the Dask workers through
Dask itself: client -> scheduler -> each worker. On ``tcp://`` (or ``ws://``)
that is clear text, readable by anyone on the network path, and the secret lets its holder
run code on the torchfeed workers. It is safe only on TLS (``tls://``, ``wss://``), inside
one process (``inproc://``) or when every hop stays on this machine (a loopback host:
127.0.0.0/8, ::1, ``localhost``) and is a process of this user (or root): a Dask worker that
another local user runs on 127.0.0.1 would get the secret, so the owner of the socket that
listens on a loopback address is read from the kernel (``/proc/net/tcp``, Linux); where it
cannot be read, the address counts as in clear. Host names other than ``localhost`` are not
resolved: a name is taken to mean a network.
"""

from __future__ import annotations

import ipaddress
import os

import distributed
from distributed.comm.addressing import get_address_host_port, parse_address

from ..util import is_loopback_host

ENCRYPTED_SCHEMES = frozenset({"tls", "wss", "inproc"})


def in_clear(address: str) -> bool:
    """Whether a secret sent to ``address`` (a Dask address) could be read by anyone but this
    user: on a network, or by another local user's process listening on loopback."""
    try:
        scheme, _ = parse_address(address)
        if scheme in ENCRYPTED_SCHEMES:
            return False
        host, port = get_address_host_port(address)
        if not is_loopback_host(host):
            return True
        owners = listener_uids(host, port)
        return not owners or not owners <= {os.geteuid(), 0}
    except Exception:  # no such scheme here, or not an address (ucx: a warning): not provably safe
        return True


def _local_ip(field: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """The address of a ``/proc/net/tcp{,6}`` row's local column (``HEX:PORT``): 32-bit words
    in host byte order (little-endian here)."""
    raw = bytes.fromhex(field.rsplit(":", 1)[0])
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def _reaches(
    bound: ipaddress.IPv4Address | ipaddress.IPv6Address,
    target: ipaddress.IPv4Address | ipaddress.IPv6Address,
) -> bool:
    """Whether a socket listening on ``bound`` may take a connection to ``target``: the same
    address, the IPv4-mapped form of it, or a wildcard (an IPv6 one takes IPv4 too unless
    IPV6_V6ONLY, which the table does not show)."""
    if bound.is_unspecified:
        return bound.version == 6 or target.version == 4
    mapped = getattr(bound, "ipv4_mapped", None)
    return bound == target or (mapped is not None and mapped == target)


def listener_uids(host: str, port: int) -> set[int]:
    """The uids owning the sockets that listen on ``port`` and may take a connection to
    loopback ``host`` (``localhost``: 127.0.0.1 and ::1), from the kernel's socket tables of
    this network namespace; empty when none is found or the tables cannot be read."""
    name = host.strip("[]").split("%", 1)[0]
    targets = [
        getattr(t, "ipv4_mapped", None) or t  # ::ffff:127.0.0.1 reaches 127.0.0.1's sockets
        for t in (
            [ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")]
            if name.lower() == "localhost"
            else [ipaddress.ip_address(name)]
        )
    ]
    owners: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()  # local address, remote, state (0A: LISTEN), ..., uid (column 7)
            if len(fields) < 8 or fields[3] != "0A" or int(fields[1].rsplit(":", 1)[1], 16) != port:
                continue
            bound = _local_ip(fields[1])
            if any(_reaches(bound, t) for t in targets):
                owners.add(int(fields[7]))
    return owners


def clear_addresses(client: distributed.Client, workers: list[str] | None = None) -> list[str]:
    """The scheduler's and workers' addresses (``workers``, default: the cluster's now) a secret
    sent through ``client`` would cross in clear. Reads addresses; sends nothing secret."""
    scheduler = client.scheduler.address if client.scheduler is not None else None
    addresses = [scheduler] if scheduler else []
    addresses += current_workers(client) if workers is None else workers
    return [a for a in addresses if in_clear(a)]


def current_workers(client: distributed.Client) -> list[str]:
    """The addresses of the cluster's workers now."""
    return sorted(client.scheduler_info(n_workers=-1).get("workers", {}))


def refuse_clear_transport(client: distributed.Client, what: str) -> list[str]:
    """Raise ValueError when a secret sent through ``client`` would cross a network in clear;
    return the workers checked: send the secret to these only (one that joins later was not
    checked)."""
    workers = current_workers(client)
    exposed = clear_addresses(client, workers)
    if not exposed:
        return workers
    listed = ", ".join(exposed[:4]) + (f" and {len(exposed) - 4} more" if len(exposed) > 4 else "")
    raise ValueError(
        f"{what} would send the torchfeed secret through this Dask cluster's own connections, and "
        f"they are not encrypted and leave this machine or reach another user's process ({listed}): "
        "anyone who can read that traffic gets the secret, and with it can run code on the torchfeed "
        "workers and read your data. Fix it in one of these ways: (1) run the Dask cluster over TLS "
        "(distributed.security.Security(require_encryption=True, ...), tls:// addresses); "
        "(2) keep the secret in a file that the Dask workers' machines already share (e.g. in a "
        "shared home directory, chmod 600) and pass secret_file=PATH: only the path is sent; "
        "(3) if no one else can listen on this network, pass allow_insecure=True"
    )
