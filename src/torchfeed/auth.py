"""Shared-secret discovery and the mutual HMAC challenge-response handshake.

Order of secret sources: ``TORCHFEED_SECRET`` (the value itself), then the file named by
``TORCHFEED_SECRET_FILE``, then a per-user default file
(``$XDG_CONFIG_HOME/torchfeed/secret`` or ``~/.config/torchfeed/secret``), created with
mode 0600 and 32 random bytes when missing. On a cluster with a shared home directory,
trainers and workers of one user therefore agree with no configuration at all.

Handshake (raw fixed-size frames, nothing is unpickled)::

    worker -> client  HELLO    worker nonce (32 bytes)
    client -> worker  AUTH     client nonce (32) + HMAC(secret, "client" | wnonce | cnonce)
    worker -> client  AUTH_OK  HMAC(secret, "worker" | cnonce | wnonce)   (or AUTH_FAIL)

Both sides prove knowledge of the secret without sending it; fresh nonces on both
sides prevent replay; comparisons are constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from . import wire
from .errors import AuthenticationError, ProtocolError

ENV_SECRET = "TORCHFEED_SECRET"
ENV_SECRET_FILE = "TORCHFEED_SECRET_FILE"
NONCE_BYTES = 32
MAC_BYTES = 32

SecretLike = Union[str, bytes, "Secret", None]


@dataclass(frozen=True)
class Secret:
    """A shared secret and a human description of where it came from."""

    value: bytes
    source: str

    def __repr__(self) -> str:  # never print the value
        return f"Secret(source={self.source!r})"


def default_secret_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "torchfeed" / "secret"


def _read_secret_file(path: Path, *, check_mode: bool = True) -> bytes:
    try:
        st = path.stat()
    except FileNotFoundError:
        raise AuthenticationError(
            f"secret file {path} does not exist: create it (for example "
            f"`python -c 'import secrets;print(secrets.token_hex(32))' > {path}; chmod 600 {path}`) "
            f"or unset {ENV_SECRET_FILE}"
        ) from None
    if check_mode and st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise AuthenticationError(
            f"secret file {path} is readable by other users (mode {stat.S_IMODE(st.st_mode):o}); "
            f"anyone who reads it can run code on your workers. Fix it with `chmod 600 {path}`"
        )
    value = path.read_bytes().strip()
    if len(value) < 16:
        raise AuthenticationError(f"secret file {path} holds fewer than 16 bytes: use a longer secret")
    return value


def _create_default(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = secrets.token_hex(32).encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return  # another process created it first; use theirs
    try:
        os.write(fd, token + b"\n")
    finally:
        os.close(fd)


def load_secret(secret: SecretLike = None) -> Secret:
    """Find the shared secret.

    Parameters
    ----------
    secret : str, bytes, Secret or None
        An explicit secret; ``None`` searches the environment and the default file.
    """
    if isinstance(secret, Secret):
        return secret
    if isinstance(secret, str):
        return Secret(secret.encode(), "explicit argument")
    if isinstance(secret, (bytes, bytearray)):
        return Secret(bytes(secret), "explicit argument")
    if secret is not None:
        raise TypeError(f"secret must be str, bytes or None, not {type(secret).__name__}")
    key = (os.environ.get(ENV_SECRET), os.environ.get(ENV_SECRET_FILE), str(default_secret_path()))
    cached = _discovered.get(key)
    if cached is None:
        cached = _discovered[key] = _discover()
    return cached


_discovered: dict = {}  # environment -> Secret; discovery reads files, calls are frequent


def _discover() -> Secret:
    env = os.environ.get(ENV_SECRET)
    if env:
        return Secret(env.encode(), f"environment variable {ENV_SECRET}")
    file = os.environ.get(ENV_SECRET_FILE)
    if file:
        path = Path(file).expanduser()
        return Secret(_read_secret_file(path), f"file {path} (from {ENV_SECRET_FILE})")
    path = default_secret_path()
    if not path.exists():
        _create_default(path)
    return Secret(_read_secret_file(path), f"default file {path}")


def _mac(secret: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, role + first + second, hashlib.sha256).digest()


def fix_hint(secret: Secret) -> str:
    return (
        f"this side's secret comes from {secret.source}. Trainers and workers must share one "
        f"secret: set {ENV_SECRET} (or {ENV_SECRET_FILE}) to the same value on both sides, or "
        f"give both the same home directory so they share {default_secret_path()}"
    )


def client_handshake(sock, reader: "wire.FrameReader", secret: Secret, address: str) -> None:
    """Run the client side of the handshake on a connected socket; raise on failure."""
    frame = reader.read_frame(wire.HANDSHAKE_LIMITS)
    if frame.kind == wire.BYE:
        raise ProtocolError(f"worker {address} refused the connection: {frame.meta.decode(errors='replace')}")
    if frame.kind != wire.HELLO or len(frame.meta) != NONCE_BYTES:
        raise ProtocolError(f"worker {address} sent an unexpected greeting (kind {frame.kind})")
    wnonce = frame.meta
    cnonce = secrets.token_bytes(NONCE_BYTES)
    proof = _mac(secret.value, b"client", wnonce, cnonce)
    wire.send_frame(sock, wire.AUTH, meta=cnonce + proof)
    frame = reader.read_frame(wire.HANDSHAKE_LIMITS)
    if frame.kind == wire.AUTH_FAIL:
        raise AuthenticationError(
            f"worker {address} rejected this client's secret ({frame.meta.decode(errors='replace')}); "
            + fix_hint(secret)
        )
    if frame.kind != wire.AUTH_OK or len(frame.meta) != MAC_BYTES:
        raise ProtocolError(f"worker {address} sent an unexpected handshake reply (kind {frame.kind})")
    expected = _mac(secret.value, b"worker", cnonce, wnonce)
    if not hmac.compare_digest(frame.meta, expected):
        raise AuthenticationError(
            f"worker {address} could not prove it holds our secret (it may be an impostor or use "
            "another secret); " + fix_hint(secret)
        )


def server_handshake(sock, reader: "wire.FrameReader", secret: Secret) -> bool:
    """Run the worker side; return True when the client proved the secret."""
    wnonce = secrets.token_bytes(NONCE_BYTES)
    wire.send_frame(sock, wire.HELLO, meta=wnonce)
    frame = reader.read_frame(wire.HANDSHAKE_LIMITS)
    if frame.kind != wire.AUTH or len(frame.meta) != NONCE_BYTES + MAC_BYTES:
        raise ProtocolError(f"expected an AUTH message, got kind {frame.kind} with {len(frame.meta)} bytes")
    cnonce, proof = frame.meta[:NONCE_BYTES], frame.meta[NONCE_BYTES:]
    if not hmac.compare_digest(proof, _mac(secret.value, b"client", wnonce, cnonce)):
        wire.send_frame(sock, wire.AUTH_FAIL, meta=b"wrong secret")
        return False
    wire.send_frame(sock, wire.AUTH_OK, meta=_mac(secret.value, b"worker", cnonce, wnonce))
    return True
