"""Workers found through DNS: ``RemoteDataset("dns://torchfeed-workers.ml.svc:6543", ...)``.

Every A and AAAA record of the name is a worker on the given port (a Kubernetes headless
Service lists one record per ready pod). A :class:`WatchedName` is followed like a
watched workers file (:class:`~torchfeed.loader.membership.WatchedFile`): the dataset's
membership thread asks :meth:`WatchedName.changed` every round; the name is resolved
again every ``every`` seconds, and addresses that appear join, addresses that vanish are
drained. Resolving blocks only that thread, at most ``timeout`` seconds per record type.

Invariants:

* a failed lookup (timeout, server error) changes nothing: a DNS hiccup must not drain a
  pool; it is logged once until a lookup succeeds again;
* an answer with no records changes nothing either (logged the same way): during a
  rolling update, or while every pod restarts, a Service can list no pod for a moment,
  and a loader with no worker cannot go on; workers that really are gone are lost and
  their batches requeued, as for any dead worker.

The URL form is ``dns://NAME:PORT``, optionally with ``?server=IP[:PORT]`` (a nameserver to
ask instead of the system's ``/etc/resolv.conf`` ones) and ``&every=SECONDS``. Lookups use
dnspython (``pip install 'torchfeed[kubernetes]'``).
"""

from __future__ import annotations

import logging
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

from ..client.addresses import format_address

log = logging.getLogger("torchfeed.dataset")

SCHEME = "dns://"
EVERY = 5.0  # seconds between two lookups of a watched name
TIMEOUT = 2.0  # seconds one lookup (one record type) may take


@dataclass(frozen=True)
class DNSName:
    """A name whose A/AAAA records are the workers, all listening on ``port``."""

    name: str
    port: int
    server: str | None = None  # a nameserver's IP; None: the system's resolver configuration
    server_port: int = 53
    every: float = EVERY
    timeout: float = TIMEOUT

    @classmethod
    def parse(cls, url: str) -> DNSName:
        """``dns://NAME:PORT[?server=IP[:PORT]][&every=SECONDS]``."""
        usage = "expected dns://NAME:PORT, optionally ?server=IP[:PORT]&every=SECONDS"
        if not url.startswith(SCHEME):
            raise ValueError(f"{url!r} is not a DNS name for workers: {usage}")
        parts = urllib.parse.urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            port = None
        if not parts.hostname or port is None or port < 1:
            raise ValueError(f"{url!r} names no host and port: {usage}")
        query = urllib.parse.parse_qs(parts.query, strict_parsing=False)
        unknown = set(query) - {"server", "every"}
        if unknown or parts.path not in ("", "/"):
            raise ValueError(f"{url!r}: unknown parts {sorted(unknown) or parts.path!r}; {usage}")
        server, server_port = None, 53
        if "server" in query:
            server, server_port = _host_port(query["server"][-1], url, usage)
        try:
            every = float(query["every"][-1]) if "every" in query else EVERY
        except ValueError:
            every = -1.0
        if not every > 0:
            raise ValueError(f"{url!r}: every must be a positive number of seconds; {usage}")
        return cls(parts.hostname, port, server, server_port, every)

    def url(self) -> str:
        shown = f"{SCHEME}{self.name}:{self.port}"
        if self.server is not None:
            host = f"[{self.server}]" if ":" in self.server else self.server
            shown += f"?server={host}:{self.server_port}"
        if self.every != EVERY:
            shown += ("&" if self.server is not None else "?") + f"every={self.every:g}"
        return shown

    def resolve(self) -> list[str]:
        """The workers' ``host:port`` now, sorted; raises OSError when no lookup succeeded."""
        resolver = _resolver(self.server, self.server_port)
        import dns.exception
        import dns.resolver

        found: list[str] = []
        failures = []
        for rdtype in ("A", "AAAA"):
            try:
                answer = resolver.resolve(self.name, rdtype, lifetime=self.timeout, search=True)
            except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
                continue  # the name has no record of this type: a valid, empty answer
            except dns.exception.DNSException as exc:
                failures.append(f"{rdtype}: {exc}")  # e.g. a server that refuses AAAA
                continue
            found += [format_address((r.address, self.port)) for r in answer]
        if len(failures) == 2:
            raise OSError(f"could not resolve {self.name}: " + "; ".join(failures))
        return sorted(set(found))

    def wait(self, at_least: int, timeout: float) -> list[str]:
        """Resolve until at least ``at_least`` workers are listed (Timeout after ``timeout`` s)."""
        from ..errors import Timeout

        deadline = time.monotonic() + timeout
        while True:
            try:
                found = self.resolve()
                why = f"it lists {len(found)}"
            except OSError as exc:
                found, why = [], str(exc)
            if len(found) >= at_least:
                return found
            if time.monotonic() > deadline:
                raise Timeout(
                    f"{self.url()}: expected at least {at_least} worker(s) after {timeout:g} s, but {why}: "
                    "is the workers' Service there and are its pods ready?"
                )
            time.sleep(min(self.every, 1.0))


def _host_port(text: str, url: str, usage: str) -> tuple[str, int]:
    """``IP``, ``IP:PORT``, ``[IPv6]`` or ``[IPv6]:PORT`` (port 53 when not given)."""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":") or "53"
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
    else:
        host, port = text, "53"  # a bare IPv4, or a bare IPv6 address
    if not host or not port.isdigit():
        raise ValueError(f"{url!r}: server={text!r} is not IP[:PORT]; {usage}")
    return host, int(port)


def _resolver(server: str | None, port: int) -> Any:
    try:
        import dns.resolver
    except ImportError:
        raise ImportError(
            "dns:// worker names need dnspython: pip install 'torchfeed[kubernetes]' (or pip install dnspython)"
        ) from None
    if server is None:
        return dns.resolver.Resolver()  # /etc/resolv.conf: search domains too (svc.cluster.local)
    resolver = dns.resolver.Resolver(configure=False)
    resolver.nameservers = [server]
    resolver.port = port
    return resolver


class WatchedName:
    """A :class:`DNSName` followed like a workers file: :meth:`changed` is asked every round."""

    def __init__(self, name: DNSName, listed: list[str]):
        self.name = name
        self.path = name.url()  # what the dataset's messages show
        self._listed = sorted(listed)
        self._next = time.monotonic() + name.every
        self._failing = False

    def changed(self) -> list[str] | None:
        """The workers if the records changed since the last lookup, else None (also between
        lookups, after a failed one, and for an empty answer: see the module docstring)."""
        now = time.monotonic()
        if now < self._next:
            return None
        self._next = now + self.name.every
        try:
            found = self.name.resolve()
        except OSError as exc:
            self._say(f"{exc}; keeping its {len(self._listed)} worker(s)")
            return None
        if not found:
            self._say(f"{self.path} lists no worker now; keeping its {len(self._listed)} worker(s)")
            return None
        if self._failing:
            log.info("%s resolves again: %d worker(s)", self.path, len(found))
            self._failing = False
        if found == self._listed:
            return None
        self._listed = found
        return found

    def _say(self, text: str) -> None:
        if not self._failing:
            log.warning(text)
            self._failing = True


def watch(workers: Any, timeout: float) -> tuple[list[str], WatchedName | None]:
    """``workers`` as addresses: a ``dns://`` URL (alone) or a :class:`DNSName` is resolved
    (waiting up to ``timeout`` for one record) and returned with its watcher; anything else
    is returned as it is, with None."""
    if isinstance(workers, str) and workers.startswith(SCHEME):
        workers = DNSName.parse(workers)
    elif isinstance(workers, (list, tuple)) and len(workers) == 1 and str(workers[0]).startswith(SCHEME):
        workers = DNSName.parse(workers[0])
    if not isinstance(workers, DNSName):
        return workers, None
    listed = workers.wait(1, timeout)
    return listed, WatchedName(workers, listed)


__all__ = ["DNSName", "WatchedName", "watch"]
