"""The fork server's channel (:mod:`torchfeed.worker.forkserver`): length-prefixed JSON
messages over one end of a Unix socket pair, descriptors alongside as ``SCM_RIGHTS``.

Both ends use these functions: the trainer's :class:`~torchfeed.worker.forkserver.ForkServer`
and the server process (:mod:`torchfeed.worker.forkloop`). They hold no state and take
no lock: an end that sends from several threads serializes its sends itself.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from collections.abc import Sequence
from typing import Any

HEADER = struct.Struct("!I")
MAX_MESSAGE = 64 << 20  # bytes: a request is a worker's arguments and environment


def send(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    data = json.dumps(message).encode()
    payload = HEADER.pack(len(data)) + data
    sent = socket.send_fds(sock, [payload], list(fds)) if fds else 0
    sock.sendall(payload[sent:])


def receive(sock: socket.socket, max_fds: int = 0) -> tuple[dict[str, Any] | None, list[int]]:
    """The next message and the descriptors that came with it; (None, []) at the channel's end."""
    header, fds = b"", []
    while len(header) < HEADER.size:
        if max_fds and not header:
            chunk, got, _, _ = socket.recv_fds(sock, HEADER.size, max_fds)
            fds += got
        else:
            chunk = sock.recv(HEADER.size - len(header))
        if not chunk:
            close_all(fds)
            return None, []
        header += chunk
    (size,) = HEADER.unpack(header)
    if size > MAX_MESSAGE:
        close_all(fds)
        raise OSError(f"fork server channel: a message of {size} bytes (at most {MAX_MESSAGE})")
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            close_all(fds)
            return None, []
        data += chunk
    return json.loads(data), fds


def close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
