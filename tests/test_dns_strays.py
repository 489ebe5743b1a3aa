"""Stray records beside the workers of a ``dns://`` name, against a real DNS server.

Anyone who can add a record to the name (or a Service's selector that matches one pod too
many) can list an address that is not a torchfeed worker. Such an address is skipped with a
warning and tried again later, never used: it must not stop the dataset from being built on
the real workers, keep a new worker out, or drain the workers when the name lists nothing
else. The workers listen on 127.0.0.2-4 and the strays on 127.0.0.5 (a plain TCP server)
and 127.0.0.6 (nothing listens), all on one port, as pods behind a headless Service do.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
from typing import Any

import pytest

from helpers import SleepDataset, wait_for
from torchfeed import AuthenticationError, LocalWorkers, RemoteDataLoader, RemoteDataset, WorkerLost
from torchfeed.protocol import auth, wire
from torchfeed.util import free_port

pytest.importorskip(
    "dns.resolver", reason="dns:// names need dnspython (pip install 'torchfeed[kubernetes]')"
)

NAME = "torchfeed-workers.test"
HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
STRAY = "127.0.0.5"  # a Stray listens there
SILENT = "127.0.0.6"  # nothing listens there: connections are refused


class Stray:
    """A TCP server that is no torchfeed worker, on ``host:port``; what it does with a connection:

    * ``garbage``: sends an HTTP error page and closes;
    * ``closes``: closes at once;
    * ``impostor``: sends a well-formed HELLO, reads the client's AUTH and answers AUTH_OK with
      a proof it cannot have made (the client then raises AuthenticationError).
    """

    def __init__(self, host: str, port: int, kind: str):
        self.kind = kind
        self.server = socket.create_server((host, port))
        self.thread = threading.Thread(target=self._serve, name="stray", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    self._answer(conn)
                except OSError:
                    pass  # the client gave up first

    def _answer(self, conn: socket.socket) -> None:
        if self.kind == "garbage":
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n" + b"x" * 64)
        elif self.kind == "impostor":
            conn.settimeout(10)
            wire.send_frame(conn, wire.HELLO, meta=auth.hello_meta(False))
            conn.recv(4096)  # the client's AUTH: all a stray ever learns
            wire.send_frame(conn, wire.AUTH_OK, meta=secrets.token_bytes(auth.MAC_BYTES))

    def close(self) -> None:
        self.server.shutdown(socket.SHUT_RDWR)  # wakes the accept (Linux); close alone would not
        self.server.close()
        self.thread.join(10)


@pytest.fixture
def port() -> int:
    """A port free on every worker's and stray's address."""
    while True:
        candidate = free_port()
        try:
            for host in (*HOSTS, STRAY, SILENT):
                with socket.socket() as s:
                    s.bind((host, candidate))
            return candidate
        except OSError:
            continue


@pytest.fixture
def pods(port):
    started = [LocalWorkers(1, host=h, extra_args=["--port", str(port)]) for h in HOSTS]
    yield {h: f"{h}:{port}" for h in HOSTS}
    for w in started:
        w.close()


def _url(port: int, dnsmasq) -> str:
    return f"dns://{NAME}:{port}?server=127.0.0.1:{dnsmasq.port}&every=0.2"


def _resolves_to(dnsmasq, ips) -> None:
    """Wait until dnsmasq serves ``ips`` (it reads its hosts file again after SIGHUP)."""
    expected = sorted(f"{ip}:1" for ip in ips)
    assert wait_for(lambda: dnsmasq.name.resolve() == expected, timeout=30), f"{NAME} -> {ips}"


def _said(caplog, *words: str) -> list[str]:
    lines = [r.getMessage() for r in caplog.records if r.name == "torchfeed.workers"]
    return [line for line in lines if all(w in line for w in words)]


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["impostor", "garbage", "closes", "refuses"])
def test_a_stray_beside_two_workers_is_skipped_at_build(dnsmasq, port, pods, kind, caplog):
    stray = Stray(STRAY, port, kind) if kind != "refuses" else None
    host = STRAY if stray is not None else SILENT
    try:
        dnsmasq.set([*HOSTS[:2], host])
        _resolves_to(dnsmasq, [*HOSTS[:2], host])
        with caplog.at_level(logging.WARNING, logger="torchfeed.workers"):
            ds = RemoteDataset(_url(port, dnsmasq), SleepDataset, 40, 0.0)
            assert sorted(ds.workers) == [pods[h] for h in HOSTS[:2]]
            (_, idx), *_ = RemoteDataLoader(ds, batch_size=8)
            assert idx.tolist() == list(range(8))
        said = _said(caplog, f"{host}:{port}", "skip")
        assert len(said) == 1, f"one warning names the stray and why: {said}"
        ds.close()
    finally:
        if stray is not None:
            stray.close()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_stray_listed_with_a_new_worker_does_not_keep_it_out(dnsmasq, port, pods):
    stray = Stray(STRAY, port, "impostor")
    try:
        dnsmasq.set(HOSTS[:2])
        n = 240
        ds = RemoteDataset(_url(port, dnsmasq), SleepDataset, n, 0.01)
        loader: RemoteDataLoader[Any] = RemoteDataLoader(ds, batch_size=8, shuffle=True)
        seen = []
        for i, (_, idx) in enumerate(loader):
            seen += idx.tolist()
            if i == 2:  # mid-epoch: a new worker and a stray in the same answer
                dnsmasq.set([*HOSTS, STRAY])
                assert wait_for(lambda: pods[HOSTS[2]] in ds.alive_workers(), timeout=60), (
                    "the new worker joins"
                )
        assert sorted(seen) == list(range(n)), "every index exactly once"
        assert loader.stats().workers[pods[HOSTS[2]]].samples > 0, "the new worker served in the same epoch"
        assert f"{STRAY}:{port}" not in ds.workers
        ds.close()
    finally:
        stray.close()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_answer_of_only_strays_keeps_the_workers(dnsmasq, port, pods, caplog):
    stray = Stray(STRAY, port, "garbage")
    try:
        dnsmasq.set(HOSTS[:2])
        n = 160
        ds = RemoteDataset(_url(port, dnsmasq), SleepDataset, n, 0.01)
        loader: RemoteDataLoader[Any] = RemoteDataLoader(ds, batch_size=8, shuffle=True)
        seen = []
        with caplog.at_level(logging.WARNING, logger="torchfeed.workers"):
            for i, (_, idx) in enumerate(loader):
                seen += idx.tolist()
                if i == 2:  # mid-epoch: the name lists only what is no worker
                    dnsmasq.set([STRAY, SILENT])
                    assert wait_for(lambda: _said(caplog, "no reachable worker"), timeout=60)
        assert sorted(seen) == list(range(n)), "every index exactly once, no error"
        assert sorted(ds.workers) == [pods[h] for h in HOSTS[:2]], "the workers in use are kept"
        assert len(_said(caplog, "no reachable worker")) == 1

        dnsmasq.set(HOSTS[1:])  # reachable workers again: the unlisted one is drained now
        assert wait_for(lambda: sorted(ds.workers) == [pods[h] for h in HOSTS[1:]], timeout=60)
        assert sorted(i for _, idx in loader for i in idx.tolist()) == list(range(n))
        ds.close()
    finally:
        stray.close()


@pytest.mark.timeout(120)
def test_a_name_of_only_strays_fails_the_build_naming_them(dnsmasq, port):
    stray = Stray(STRAY, port, "garbage")
    try:
        dnsmasq.set([STRAY, SILENT])
        _resolves_to(dnsmasq, [STRAY, SILENT])
        with pytest.raises(WorkerLost) as info:
            RemoteDataset(_url(port, dnsmasq), SleepDataset, 40, 0.0, timeout=2)
        for host in (STRAY, SILENT):
            assert f"{host}:{port}" in str(info.value)
        assert "not a torchfeed endpoint" in str(info.value) and "refused" in str(info.value)
    finally:
        stray.close()


@pytest.mark.timeout(120)
def test_a_name_whose_every_address_fails_the_handshake_raises_authentication_error(dnsmasq, port):
    stray = Stray(STRAY, port, "impostor")
    try:
        dnsmasq.set([STRAY])
        _resolves_to(dnsmasq, [STRAY])
        with pytest.raises(AuthenticationError, match=f"{STRAY}:{port}"):
            RemoteDataset(_url(port, dnsmasq), SleepDataset, 40, 0.0, timeout=60)
    finally:
        stray.close()
