"""A client that sends small requests and never reads the replies: the worker's back pressure
counts every queued reply, empty ones included (a PONG has no payload)."""

from __future__ import annotations

import socket
import threading

import pytest

from helpers import wait_for
from torchfeed import client
from torchfeed.protocol import auth, wire
from torchfeed.worker import server as worker

pytestmark = pytest.mark.timeout(60)


def test_ping_flood_from_a_client_that_never_reads_pauses_its_reader():
    limit = 1 << 18  # 256 KiB of replies waiting: with 64 bytes charged per reply, ~4k PONGs
    srv = worker.WorkerServer(port=0, timeout=30, limits=worker.ConnectionLimits(max_unsent_bytes=limit))
    srv.listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # accepted sockets inherit it
    srv.start()
    sock = socket.socket()
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", srv.port))
        chan = auth.client_handshake(sock, auth.load_secret(), srv.address)

        ended: list = []

        def flood():
            try:
                for i in range(50_000):
                    chan.send(wire.PING, i + 1)
            except OSError as exc:  # closed at the end of the test while blocked
                ended.append(repr(exc))

        threading.Thread(target=flood, name="test-ping-flood", daemon=True).start()
        assert wait_for(lambda: srv.connections(), timeout=5)
        conn = srv.connections()[0]
        # generous: under load the flooding thread shares this process's GIL with the worker's reader
        assert wait_for(lambda: conn.waiting_for_room, timeout=30), (conn.unsent_bytes, ended)
        assert conn.unsent_bytes <= limit + 4096, conn.unsent_bytes  # bounded: no entry grows it further
        assert client.worker_stats(srv.address, timeout=5)["clients"] == 2  # others are still served
    finally:
        sock.close()
        srv.stop()
