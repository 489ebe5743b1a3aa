"""Stray records beside the workers of a ``dns://`` name, against a real DNS server.

Anyone who can add a record to the name (or a Service's selector that matches one pod too
many) can list an address that is not a torchfeed worker. Such an address is skipped with a
warning and tried again later, never used: it must not stop the dataset from being built on
the real workers, keep a new worker out, or drain the workers when the name lists nothing
else. The workers listen on 127.0.0.2-4 and the strays on 127.0.0.5 (a plain TCP server)
and 127.0.0.6 (nothing listens), all on one port, as pods behind a headless Service do.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import threading

import pytest

from helpers import SleepDataset, port_free_on, wait_for
from torchfeed import AuthenticationError, LocalWorkers, RemoteDataLoader, RemoteDataset, WorkerLost
from torchfeed.protocol import auth, wire

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

    def __enter__(self) -> Stray:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@pytest.fixture
def port() -> int:
    """A port free on every worker's and stray's address."""
    return port_free_on((*HOSTS, STRAY, SILENT))


@pytest.fixture
def pods(port):
    started = [LocalWorkers(1, host=h, extra_args=["--port", str(port)]) for h in HOSTS]
    yield {h: f"{h}:{port}" for h in HOSTS}
    for w in started:
        w.close()


def _url(port: int, dnsmasq) -> str:
    return f"dns://{NAME}:{port}?server=127.0.0.1:{dnsmasq.port}&every=0.2"


def _list(dnsmasq, ips) -> None:
    """Make the name list ``ips``, and wait until dnsmasq serves them (it reads its hosts file
    again after SIGHUP)."""
    dnsmasq.set(ips)
    expected = sorted(f"{ip}:1" for ip in ips)
    assert wait_for(lambda: dnsmasq.name.resolve() == expected, timeout=30), f"{NAME} -> {ips}"


def _said(caplog, *words: str) -> list[str]:
    lines = [r.getMessage() for r in caplog.records if r.name == "torchfeed.workers"]
    return [line for line in lines if all(w in line for w in words)]


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["impostor", "garbage", "closes", "refuses"])
def test_a_stray_beside_two_workers_is_skipped_at_build(dnsmasq, port, pods, kind, caplog):
    host = STRAY if kind != "refuses" else SILENT
    with Stray(STRAY, port, kind) if kind != "refuses" else contextlib.nullcontext():
        _list(dnsmasq, [*HOSTS[:2], host])
        with caplog.at_level(logging.WARNING, logger="torchfeed.workers"):
            ds = RemoteDataset(_url(port, dnsmasq), SleepDataset, 40, 0.0)
            assert sorted(ds.workers) == [pods[h] for h in HOSTS[:2]]
            (_, idx), *_ = RemoteDataLoader(ds, batch_size=8)
            assert idx.tolist() == list(range(8))
        said = _said(caplog, f"{host}:{port}", "skip")
        assert len(said) == 1, f"one warning names the stray and why: {said}"
        ds.close()


def _epoch_changing_the_name(
    dnsmasq, port: int, n: int, change
) -> tuple[RemoteDataset, RemoteDataLoader, list]:
    """The name lists two workers; an epoch of ``n`` samples over it (shuffled, batches of 8)
    runs ``change(the dataset)`` mid-epoch, after its third batch. Returns the dataset, its
    loader and every index the epoch delivered."""
    dnsmasq.set(HOSTS[:2])
    ds = RemoteDataset(_url(port, dnsmasq), SleepDataset, n, 0.01)
    loader = RemoteDataLoader(ds, batch_size=8, shuffle=True)
    seen = []
    for i, (_, idx) in enumerate(loader):
        seen += idx.tolist()
        if i == 2:
            change(ds)
    return ds, loader, seen


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_stray_listed_with_a_new_worker_does_not_keep_it_out(dnsmasq, port, pods):
    def change(ds) -> None:  # a new worker and a stray in the same answer
        dnsmasq.set([*HOSTS, STRAY])
        assert wait_for(lambda: pods[HOSTS[2]] in ds.alive_workers(), timeout=60), "the new worker joins"

    with Stray(STRAY, port, "impostor"):
        ds, loader, seen = _epoch_changing_the_name(dnsmasq, port, 240, change)
        assert sorted(seen) == list(range(240)), "every index exactly once"
        assert loader.stats().workers[pods[HOSTS[2]]].samples > 0, "the new worker served in the same epoch"
        assert f"{STRAY}:{port}" not in ds.workers
        ds.close()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_answer_of_only_strays_keeps_the_workers(dnsmasq, port, pods, caplog):
    def change(ds) -> None:  # the name lists only what is no worker
        dnsmasq.set([STRAY, SILENT])
        assert wait_for(lambda: _said(caplog, "no reachable worker"), timeout=60)

    with Stray(STRAY, port, "garbage"), caplog.at_level(logging.WARNING, logger="torchfeed.workers"):
        ds, loader, seen = _epoch_changing_the_name(dnsmasq, port, 160, change)
        assert sorted(seen) == list(range(160)), "every index exactly once, no error"
        assert sorted(ds.workers) == [pods[h] for h in HOSTS[:2]], "the workers in use are kept"
        assert len(_said(caplog, "no reachable worker")) == 1

        dnsmasq.set(HOSTS[1:])  # reachable workers again: the unlisted one is drained now
        assert wait_for(lambda: sorted(ds.workers) == [pods[h] for h in HOSTS[1:]], timeout=60)
        assert sorted(i for _, idx in loader for i in idx.tolist()) == list(range(160))
        ds.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "kind, listed, error, timeout, why",
    [
        # a name of only strays fails the build, naming each and why
        ("garbage", [STRAY, SILENT], WorkerLost, 2, ["not a torchfeed endpoint", "refused"]),
        # a name whose every address fails the handshake raises AuthenticationError
        ("impostor", [STRAY], AuthenticationError, 60, []),
    ],
)
def test_a_name_of_only_strays_fails_the_build_naming_them(dnsmasq, port, kind, listed, error, timeout, why):
    with Stray(STRAY, port, kind):
        _list(dnsmasq, listed)
        with pytest.raises(error) as info:
            RemoteDataset(_url(port, dnsmasq), SleepDataset, 40, 0.0, timeout=timeout)
    for said in [f"{host}:{port}" for host in listed] + why:
        assert said in str(info.value)
