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
  their batches requeued, as for any dead worker;
* a record is a claim, not a worker: anyone able to add one may point it anywhere. A
  listed address that refuses, does not answer or fails the handshake is skipped (one
  WARNING under ``torchfeed.workers``) and tried again with backoff, never used; it holds
  back neither the build nor a worker listed with it, and an answer in which no address
  is a reachable worker drains nothing (:class:`~torchfeed.loader.membership.Membership`).
  Building fails only when no listed address became a worker within the timeout.

The URL form is ``dns://NAME:PORT``, optionally with ``?server=IP[:PORT]`` (a nameserver to
ask instead of the system's ``/etc/resolv.conf`` ones) and ``&every=SECONDS``. Lookups use
dnspython (``pip install 'torchfeed[kubernetes]'``).
"""

from __future__ import annotations

import logging
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from ..client.addresses import format_address

log = logging.getLogger("torchfeed.dataset")
workers_log = logging.getLogger("torchfeed.workers")

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


def name_of(workers: Any) -> DNSName | None:
    """The DNS name ``workers`` gives (a ``dns://`` URL, alone or in a list, or a :class:`DNSName`), else None."""
    if isinstance(workers, str) and workers.startswith(SCHEME):
        return DNSName.parse(workers)
    if isinstance(workers, (list, tuple)) and len(workers) == 1 and str(workers[0]).startswith(SCHEME):
        return DNSName.parse(workers[0])
    return workers if isinstance(workers, DNSName) else None


Build = Callable[[list[str]], dict[str, BaseException]]  # listed addresses -> those that failed, with why


def first_workers(
    name: DNSName, build: Build, timeout: float
) -> tuple[list[str], dict[str, BaseException], WatchedName]:
    """Resolve ``name`` and ``build`` on what it lists until at least one address builds.

    Returns the workers built on, the listed addresses that failed (with why: the membership
    skips them and tries them again) and the name's watcher. Raises AuthenticationError at
    once when every listed address failed the check of the secret (most likely this side's
    secret is wrong), else keeps resolving and building for ``timeout`` seconds, then raises
    :class:`~torchfeed.WorkerLost` naming every address tried and why it failed (Timeout
    when the name never listed one).
    """
    deadline = time.monotonic() + timeout
    tried: dict[str, BaseException] = {}
    why = "it lists none"
    said = False
    while True:
        try:
            listed = name.resolve()
        except OSError as exc:
            listed, why = [], str(exc)
        if listed:
            failed = build(listed)
            built = [w for w in listed if w not in failed]
            if built:
                return built, failed, WatchedName(name, listed)
            _refuse_secret(name, failed)
            tried.update(failed)
            why = "none of them is a reachable torchfeed worker"
            if not said:
                workers_log.warning(
                    "%s lists no reachable worker yet (%s); trying again for up to %.3g s",
                    name.url(),
                    _described(failed),
                    deadline - time.monotonic(),
                )
                said = True
        if time.monotonic() > deadline:
            _give_up(name, timeout, tried, why)
        time.sleep(min(name.every, 1.0))


def _described(failed: dict[str, BaseException]) -> str:
    return ", ".join(f"{w} ({e})" for w, e in failed.items())


def _refuse_secret(name: DNSName, failed: dict[str, BaseException]) -> None:
    """Raise AuthenticationError when every address failed the check of the secret: retrying cannot help."""
    from ..errors import AuthenticationError

    if failed and all(isinstance(e, AuthenticationError) for e in failed.values()):
        raise AuthenticationError(
            f"{name.url()}: every address it lists failed the check of the secret: {_described(failed)}"
        ) from next(iter(failed.values()))


def _give_up(name: DNSName, timeout: float, tried: dict[str, BaseException], why: str) -> NoReturn:
    from ..errors import Timeout, WorkerLost

    if not tried:
        raise Timeout(
            f"{name.url()}: expected at least 1 worker after {timeout:g} s, but {why}: "
            "is the workers' Service there and are its pods ready?"
        )
    raise WorkerLost(
        f"{name.url()}: no address it listed became a worker within {timeout:g} s: {_described(tried)}. "
        "Are the workers' pods ready, do they share this trainer's secret, and does the name list only them?",
        {w: repr(e) for w, e in tried.items()},
    ) from next(iter(tried.values()))


__all__ = ["DNSName", "WatchedName", "first_workers", "name_of"]
