"""An on-path attacker for tests: a TCP relay between a trainer and a worker.

It does not hold the secret. It forwards every byte, records what crosses it (a capture
of the wire), and lets a test rewrite the stream: ``hook(conn, direction, offset, data)``
returns the bytes to forward instead of ``data`` (``direction`` is ``"c2w"`` or
``"w2c"``; ``offset`` counts the bytes that direction of connection ``conn`` had before).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

from torchfeed.protocol import auth, wire

# where the sealed stream starts in each direction: after the clear handshake frames
C2W_SEALED = wire.HEADER.size + auth.AUTH_BYTES  # AUTH
W2C_SEALED = 2 * wire.HEADER.size + auth.HELLO_BYTES + auth.MAC_BYTES  # HELLO + AUTH_OK

Hook = Callable[[int, str, int, bytes], bytes]


def _listen_transparently(port: int) -> socket.socket:
    """A listener on the worker's port at another loopback address (127.0.0.2, ...): the
    trainer dials an endpoint the worker owns, as when an attacker on the path intercepts
    traffic to the worker's real address."""
    for last in range(2, 255):
        sock = socket.socket()
        try:
            sock.bind((f"127.0.0.{last}", port))
            return sock
        except OSError:
            sock.close()
    raise RuntimeError(f"no loopback address has port {port} free for a relay")


class Relay:
    """``transparent``: listen on the port of ``posing_as`` (default: the target) at another
    loopback address, an endpoint that worker counts as its own (an interception of its
    traffic); else on a port of its own, like a port forward (a worker refuses that unless
    started with ``--reachable-at`` the relay's address)."""

    def __init__(
        self,
        target: str,
        hook: Hook | None = None,
        capture_limit: int = 64 << 20,
        *,
        transparent: bool = True,
        posing_as: str | None = None,
    ):
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.hook = hook
        self.capture: dict[str, bytearray] = {"c2w": bytearray(), "w2c": bytearray()}
        self.capture_limit = capture_limit
        self.connections = 0
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        if transparent:
            self.listener = _listen_transparently(int((posing_as or target).rsplit(":", 1)[1]))
        else:
            self.listener = socket.socket()
            self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        host, port = self.listener.getsockname()
        self.address = f"{host}:{port}"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(self.target, timeout=10)
                up.settimeout(None)
            except OSError:
                down.close()
                continue
            with self._lock:
                index = self.connections
                self.connections += 1
                self._socks += [down, up]
            for src, dst, direction in ((down, up, "c2w"), (up, down, "w2c")):
                threading.Thread(target=self._pump, args=(index, src, dst, direction), daemon=True).start()

    def _pump(self, index: int, src: socket.socket, dst: socket.socket, direction: str) -> None:
        offset = 0
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                out = self.hook(index, direction, offset, data) if self.hook else data
                offset += len(data)
                with self._lock:
                    cap = self.capture[direction]
                    if len(cap) < self.capture_limit:
                        cap += out
                dst.sendall(out)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def captured(self) -> bytes:
        with self._lock:
            return bytes(self.capture["c2w"]) + bytes(self.capture["w2c"])

    def close(self) -> None:
        self._closed = True
        self.listener.close()
        with self._lock:
            for s in self._socks:
                try:
                    s.close()
                except OSError:
                    pass


def flip_byte_at(target_offset: int, direction: str = "w2c", conn: int = 0) -> Hook:
    """Flip one bit of the byte at ``target_offset`` of one direction of one connection."""

    def hook(index, d, offset, data):
        if index == conn and d == direction and offset <= target_offset < offset + len(data):
            b = bytearray(data)
            b[target_offset - offset] ^= 0x01
            return bytes(b)
        return data

    return hook


def _sealed_pieces(direction: str, conn: int, after: int, act):
    """A hook calling ``act(data, cut)`` on the piece of the sealed stream received after
    ``after`` earlier sealed pieces (``cut``: where the sealed stream starts in ``data``)."""
    start = C2W_SEALED if direction == "c2w" else W2C_SEALED
    seen: list[bool] = []

    def hook(index, d, offset, data):
        if index != conn or d != direction or offset + len(data) <= start or len(seen) > after:
            return data
        seen.append(True)
        return act(data, max(0, start - offset)) if len(seen) == after + 1 else data

    return hook


def replay_first_sealed(direction: str = "c2w", conn: int = 0, after: int = 0) -> Hook:
    """Send a piece of the sealed stream twice (a replayed request)."""
    return _sealed_pieces(direction, conn, after, lambda data, cut: data + data[cut:])


def inject_before_sealed(frame: bytes, direction: str = "c2w", conn: int = 0, after: int = 0) -> Hook:
    """Insert ``frame`` (bytes made without the keys) into the sealed stream."""
    return _sealed_pieces(direction, conn, after, lambda data, cut: data[:cut] + frame + data[cut:])
