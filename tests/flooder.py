"""A handshake flood from one source: ``python flooder.py HOST PORT N SECONDS [SOURCE]``.

Holds ``N`` connections to ``HOST:PORT`` from the address ``SOURCE`` (default 127.0.0.2, so
that a client on 127.0.0.1 is another peer), none of which ever sends a byte, and opens a
new one for every connection the worker drops: a sustained flood of bounded size. Prints
``ready`` once the first ``N`` are open; stops after ``SECONDS`` or when its stdin closes,
printing how many connections it made and how many the worker dropped.
"""

from __future__ import annotations

import selectors
import socket
import sys
import time


def main() -> None:
    host, port, n, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    source = sys.argv[5] if len(sys.argv) > 5 else "127.0.0.2"
    sel = selectors.DefaultSelector()
    sel.register(sys.stdin, selectors.EVENT_READ)  # closed by whoever started it: time to report
    made = dropped = 0

    def one() -> None:
        nonlocal made
        s = socket.socket()
        try:
            s.bind((source, 0))
            s.setblocking(False)
            s.connect_ex((host, port))
            sel.register(s, selectors.EVENT_READ)
        except OSError:
            s.close()
            return
        made += 1

    for _ in range(n):
        one()
    print("ready", flush=True)
    began = time.monotonic()
    while time.monotonic() - began < seconds:
        events = sel.select(0.1)
        if any(key.fileobj is sys.stdin for key, _ in events):
            break
        for key, _ in events:
            s = key.fileobj
            assert isinstance(s, socket.socket)  # stdin ends the loop above
            try:
                data = s.recv(4096)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:  # dropped by the worker: take its place again
                sel.unregister(s)
                s.close()
                dropped += 1
                one()
    took = time.monotonic() - began
    print(f"flooder: {made} connections made in {took:.1f} s, {dropped} dropped by the worker", flush=True)


if __name__ == "__main__":
    main()
