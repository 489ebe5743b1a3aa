"""Workers found through DNS (``RemoteDataset("dns://NAME:PORT")``), against a real DNS server.

dnsmasq (Debian's) answers on 127.0.0.1 at a free port from a hosts file this test rewrites
and makes it read again (SIGHUP); the workers listen on 127.0.0.2, .3 and .4, one port for
all, as the pods behind a Kubernetes headless Service do. Without dnsmasq (or dnspython)
the tests that need it skip and say so.
"""

from __future__ import annotations

import logging
import time

import pytest

from helpers import SleepDataset, port_free_on, wait_for
from torchfeed import LocalWorkers, RemoteDataLoader, RemoteDataset
from torchfeed.loader.dnsnames import DNSName, WatchedName
from torchfeed.util import free_port

pytest.importorskip(
    "dns.resolver", reason="dns:// names need dnspython (pip install 'torchfeed[kubernetes]')"
)

NAME = "torchfeed-workers.test"
HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")


def test_urls_parse():
    d = DNSName.parse("dns://torchfeed-workers.ml.svc:6543")
    assert (d.name, d.port, d.server) == ("torchfeed-workers.ml.svc", 6543, None)
    d = DNSName.parse("dns://w.test:7?server=127.0.0.1:5353&every=0.5")
    assert (d.server, d.server_port, d.every) == ("127.0.0.1", 5353, 0.5)
    assert DNSName.parse(d.url()) == d
    assert DNSName.parse("dns://w.test:7?server=[::1]:53").server == "::1"
    for bad in (
        "dns://w.test",
        "dns://w.test:7?color=red",
        "dns://w.test:7?server=x:y",
        "dns://w.test:7?every=0",
    ):
        with pytest.raises(ValueError, match="dns://NAME:PORT"):
            DNSName.parse(bad)


def test_a_failing_server_changes_nothing(caplog):
    dead = DNSName(NAME, 1, server="127.0.0.1", server_port=free_port(), every=0.01, timeout=0.3)
    with pytest.raises(OSError, match="could not resolve"):
        dead.resolve()
    watched = WatchedName(dead, ["127.0.0.2:1"])
    time.sleep(0.02)
    with caplog.at_level(logging.WARNING, logger="torchfeed.dataset"):
        assert watched.changed() is None
        time.sleep(0.02)
        assert watched.changed() is None
    said = [r for r in caplog.records if "keeping its 1 worker" in r.getMessage()]
    assert len(said) == 1  # once until it resolves again


def test_a_and_aaaa_records_are_workers(dnsmasq):
    dnsmasq.set(["127.0.0.2", "::1", "127.0.0.3"])
    name = DNSName(NAME, 6543, server="127.0.0.1", server_port=dnsmasq.port)
    expected = ["127.0.0.2:6543", "127.0.0.3:6543", "[::1]:6543"]
    assert wait_for(lambda: name.resolve() == expected, timeout=30), (
        f"{NAME} resolves to {expected}"
    )  # after SIGHUP


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_records_that_change_during_an_epoch(dnsmasq):
    port = port_free_on(HOSTS)
    pools = [LocalWorkers(1, host=h, extra_args=["--port", str(port)]) for h in HOSTS]
    address = {h: f"{h}:{port}" for h in HOSTS}
    try:
        dnsmasq.set(HOSTS[:2])
        n = 240
        ds = RemoteDataset(
            f"dns://{NAME}:{port}?server=127.0.0.1:{dnsmasq.port}&every=0.2", SleepDataset, n, 0.01
        )
        assert sorted(ds.workers) == [address[h] for h in HOSTS[:2]]
        loader = RemoteDataLoader(ds, batch_size=8, shuffle=True)

        seen = []
        for i, (_, idx) in enumerate(loader):
            seen += idx.tolist()
            if i == 2:  # mid-epoch: .2 leaves, .4 joins
                dnsmasq.set(HOSTS[1:])
                assert wait_for(lambda: sorted(ds.workers) == [address[h] for h in HOSTS[1:]], timeout=60), (
                    "the records are followed"
                )
        assert sorted(seen) == list(range(n)), "epoch 1: every index exactly once"
        rows = loader.stats().workers
        assert rows[address["127.0.0.4"]].samples > 0, "the worker that appeared served in the same epoch"

        before = {a: w.samples for a, w in loader.stats().workers.items()}
        assert sorted(i for _, idx in loader for i in idx.tolist()) == list(range(n)), "epoch 2: exactly once"
        after = loader.stats().workers
        assert address["127.0.0.2"] not in ds.workers
        assert after.get(address["127.0.0.2"]) is None or after[address["127.0.0.2"]].samples == before.get(
            address["127.0.0.2"], 0
        ), "the worker that vanished got no batch in epoch 2"

        dnsmasq.set([])  # an empty answer keeps the pool (a Service between two rollouts)
        time.sleep(1.0)
        assert sorted(ds.workers) == [address[h] for h in HOSTS[1:]]
        dnsmasq.set(HOSTS)
        assert wait_for(lambda: sorted(ds.workers) == sorted(address.values()), timeout=60), (
            "all three listed again"
        )
        assert sorted(i for _, idx in loader for i in idx.tolist()) == list(range(n)), "epoch 3: exactly once"
        ds.close()
    finally:
        for w in pools:
            w.close()
