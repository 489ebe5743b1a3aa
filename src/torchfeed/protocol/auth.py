"""The shared secret, and the handshake that turns it into a sealed channel.

Secret sources, in order: ``TORCHFEED_SECRET`` (the value itself), the file named by
``TORCHFEED_SECRET_FILE``, then a per-user default file (``$XDG_CONFIG_HOME/torchfeed/secret``
or ``~/.config/torchfeed/secret``), created with 32 random bytes (hex) when missing. On a
cluster with a shared home directory, trainers and workers of one user agree with no
configuration at all. Every secret must be at least 32 bytes and look random (not a few
characters, a repeated block or runs like ``abcd``: :mod:`torchfeed.protocol.strength`):
the handshake gives an eavesdropper (or an impostor worker) material for an offline
guessing attack, which only a long random secret makes hopeless. Secret files are opened without following symbolic
links and must belong to the current user, be unreadable by others and sit in a
directory others cannot write.

Workers keep the secret out of their environment: ``torchfeed worker`` adopts it
(:func:`adopt_secret`: this process's ``load_secret()`` still finds it) and removes
``TORCHFEED_SECRET`` from ``os.environ``, so subprocesses of dataset code do not inherit
it; processes that start workers (``LocalWorkers``, ``--procs N``, the Dask plugin) hand it
over on the worker's standard input (:func:`handover_line`, ``--secret-on-stdin``).

Handshake (fixed-size clear frames, nothing is unpickled)::

    worker -> client  HELLO    worker nonce (32) | worker policy (1)
    client -> worker  AUTH     client nonce (32) | mode (1) | dialled (18) | proof (32)
    worker -> client  AUTH_OK  proof (32)                   (or AUTH_FAIL, reason text)

with ``proof = HMAC-SHA256(K, role | HELLO meta | client nonce | mode | dialled)`` and
``K`` derived from the secret with HKDF-SHA256. Each side proves it holds the secret
without sending it, over a transcript that includes both fresh nonces, the negotiated
mode and the endpoint the client dialled, so a recorded handshake cannot be replayed, the
mode cannot be downgraded and a relay cannot hand a connection meant for one worker to
another worker holding the same secret: ``dialled`` is the IP address (16 bytes, IPv4 as
IPv4-mapped IPv6) and port the client's TCP connection went to, and the worker answers
AUTH_OK only if that endpoint is its own (see :mod:`torchfeed.worker.names`). Both sides
then derive one AES-256-GCM key per direction with HKDF-SHA256 (salt: both nonces; info:
the direction, the mode and the dialled endpoint) and continue in
:class:`torchfeed.protocol.channel.Channel`, where every record is authenticated and
numbered. A relay that does not hold the secret can forward the handshake but can
neither read nor alter nor inject anything after it.

The mode is ``encrypted`` unless both sides opted into integrity-only traffic with the
environment variable ``TORCHFEED_TRUSTED_NETWORK_NO_ENCRYPTION=1`` (and, for the worker,
``--trusted-network-no-encryption``): records then travel in clear with their tags, for
networks where no one else can listen.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Union

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ..errors import AuthenticationError, ProtocolError
from . import strength, wire
from .channel import Channel

ENV_SECRET = "TORCHFEED_SECRET"
ENV_SECRET_FILE = "TORCHFEED_SECRET_FILE"
ENV_NO_ENCRYPTION = "TORCHFEED_TRUSTED_NETWORK_NO_ENCRYPTION"
NONCE_BYTES = 32
MAC_BYTES = 32
MIN_SECRET_BYTES = 32
ENDPOINT_BYTES = 18  # IPv6 address (IPv4 mapped) and port
HELLO_BYTES = NONCE_BYTES + 1
AUTH_BYTES = NONCE_BYTES + 1 + ENDPOINT_BYTES + MAC_BYTES
NOT_THIS_WORKER = "not this worker: "  # an AUTH_FAIL reason: the connection reached the wrong worker
MODE_ENCRYPTED = 0
MODE_INTEGRITY_ONLY = 1
# over a same-host Unix socket whose peer has this process's uid (protocol.localpath) only:
# no seals at all (protocol.localchannel says why none are needed)
MODE_LOCAL = 2
MAKE_ONE = 'python -c "import secrets; print(secrets.token_hex(32))"'

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


def _checked(value: bytes, source: str) -> Secret:
    if len(value) < MIN_SECRET_BYTES:
        raise AuthenticationError(
            f"the secret from {source} is {len(value)} bytes; torchfeed needs at least "
            f"{MIN_SECRET_BYTES}, random: make one with `{MAKE_ONE}`"
        )
    why = strength.weakness(value)
    if why is not None:
        raise AuthenticationError(
            f"the secret from {source} is too easy to guess: {why}. Anyone who records one "
            f"handshake can try such values offline. Use a random secret: make one with `{MAKE_ONE}`"
        )
    return Secret(value, source)


def _check_private_dir(path: Path) -> None:
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode):
        raise AuthenticationError(f"{path} (the secret file's directory) is not a directory")
    if st.st_uid not in (os.geteuid(), 0) or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise AuthenticationError(
            f"the secret file's directory {path} can be written by other users (mode "
            f"{stat.S_IMODE(st.st_mode):o}, owner uid {st.st_uid}): they could replace the secret. "
            f"Keep the secret in a private directory (`chmod 700 {path}`)"
        )


def read_secret_file(path: Path) -> bytes:
    """The content of a secret file (stripped when it is text), after checking who can read
    and replace it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise AuthenticationError(
            f"secret file {path} does not exist: create it (`{MAKE_ONE} > {path}; chmod 600 {path}`) "
            f"or unset {ENV_SECRET_FILE}"
        ) from None
    except OSError as exc:
        if os.path.islink(path):
            raise AuthenticationError(
                f"secret file {path} is a symbolic link: torchfeed does not follow links to secrets; "
                "point to the file itself"
            ) from None
        raise AuthenticationError(f"cannot open secret file {path}: {exc}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise AuthenticationError(f"secret file {path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise AuthenticationError(
                f"secret file {path} belongs to uid {st.st_uid}, not to you (uid {os.geteuid()}): "
                "another user controls it. Use a secret file of your own"
            )
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise AuthenticationError(
                f"secret file {path} is readable by other users (mode {stat.S_IMODE(st.st_mode):o}); "
                f"anyone who reads it can run code on your workers. Fix it with `chmod 600 {path}`"
            )
        value = f.read(1 << 16)
    # text (hex, base64, a line written by echo): without surrounding whitespace; raw random
    # bytes as they are (stripping would cut a secret that ends in a byte like 0x0a or 0x20)
    value = value.strip() if value.isascii() else value
    _check_private_dir(path.parent)
    return value


def _create_default(path: Path) -> None:
    """Create the default secret file atomically: concurrent first uses never see it half written."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(prefix=".secret-", dir=path.parent)  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_hex(32).encode() + b"\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # fails if another process got there first: use theirs
        except FileExistsError:
            pass
    finally:
        os.unlink(tmp)


def secret_from_file(path: str | os.PathLike) -> Secret:
    """The secret in the file ``path``, checked like ``TORCHFEED_SECRET_FILE``'s."""
    path = Path(path).expanduser()
    return _checked(read_secret_file(path), f"file {path}")


_adopted: list[Secret | None] = [None]  # this process's secret, set by adopt_secret()


def adopt_secret(secret: Secret | None) -> Secret | None:
    """Make ``secret`` what ``load_secret()`` finds in this process, ahead of the environment,
    without putting it in the environment that subprocesses inherit; ``None`` stops that.
    Returns the one adopted before."""
    previous, _adopted[0] = _adopted[0], secret
    return previous


def adopted_secret() -> Secret | None:
    """The secret this process adopted (:func:`adopt_secret`), if any."""
    return _adopted[0]


def take_secret_from_environment() -> Secret:
    """Find the secret as ``load_secret()`` does, adopt it and remove ``TORCHFEED_SECRET``
    from this process's environment: what it starts (dataset code's subprocesses) does not
    inherit the value. ``TORCHFEED_SECRET_FILE``, a path, stays."""
    secret = load_secret()
    adopt_secret(secret)
    os.environ.pop(ENV_SECRET, None)
    return secret


# A worker's parent (LocalWorkers, `torchfeed worker --procs N`, the Dask plugin) hands it
# the secret on its standard input (`--secret-on-stdin`), never in its environment: one line,
# hex (a file's secret may hold any byte), written right after the start.
HANDOVER_SOURCE = "the process that started this worker (handed over on standard input)"
_HANDOVER_MAX = 2 * (1 << 16) + 2


def handover_line(value: bytes) -> bytes:
    """What a parent writes on a worker's standard input to give it the secret ``value``."""
    return value.hex().encode() + b"\n"


def read_handover(fd: int = 0) -> Secret:
    """Read the line :func:`handover_line` made from ``fd`` (no further: the rest of the pipe
    stays unread, e.g. for ``--watch-stdin``) and check the secret in it."""
    line = bytearray()
    while len(line) < _HANDOVER_MAX and not line.endswith(b"\n"):
        chunk = os.read(fd, 1)
        if not chunk:
            break
        line += chunk
    try:
        value = bytes.fromhex(line.decode("ascii"))
    except ValueError:
        value = b""
    if not line.endswith(b"\n") or not value:
        raise AuthenticationError(
            "--secret-on-stdin: standard input did not start with the secret (one line, hex); this "
            "option is for the processes that start workers (LocalWorkers, --procs). Without it the "
            f"worker finds its secret in {ENV_SECRET}, {ENV_SECRET_FILE} or the default file"
        )
    return _checked(value, HANDOVER_SOURCE)


def load_secret(secret: SecretLike = None) -> Secret:
    """Find the shared secret.

    Parameters
    ----------
    secret : str, bytes, Secret or None
        An explicit secret (at least 32 bytes); ``None``: the one this process adopted
        (:func:`adopt_secret`), else searches the environment and the default file.
    """
    if isinstance(secret, Secret):
        return _checked(secret.value, secret.source)
    if isinstance(secret, str):
        return _checked(secret.encode(), "the secret= argument")
    if isinstance(secret, (bytes, bytearray)):
        return _checked(bytes(secret), "the secret= argument")
    if secret is not None:
        raise TypeError(f"secret must be str, bytes or None, not {type(secret).__name__}")
    adopted = _adopted[0]
    if adopted is not None:
        return adopted
    key = (os.environ.get(ENV_SECRET), os.environ.get(ENV_SECRET_FILE), str(default_secret_path()))
    cached = _discovered.get(key)
    if cached is None:
        cached = _discovered[key] = _discover()
    return cached


_discovered: dict = {}  # environment -> Secret; discovery reads files, calls are frequent


def _discover() -> Secret:
    env = os.environ.get(ENV_SECRET)
    if env:
        return _checked(env.encode(), f"environment variable {ENV_SECRET}")
    file = os.environ.get(ENV_SECRET_FILE)
    if file:
        path = Path(file).expanduser()
        return _checked(read_secret_file(path), f"file {path} (from {ENV_SECRET_FILE})")
    path = default_secret_path()
    if not os.path.lexists(path):
        _create_default(path)
    return _checked(read_secret_file(path), f"default file {path}")


def integrity_only_requested() -> bool:
    """Whether this process opted out of encryption (``TORCHFEED_TRUSTED_NETWORK_NO_ENCRYPTION=1``)."""
    return os.environ.get(ENV_NO_ENCRYPTION, "") == "1"


def fix_hint(secret: Secret) -> str:
    return (
        f"this side's secret comes from {secret.source}. Trainers and workers must share one "
        f"secret: set {ENV_SECRET} (or {ENV_SECRET_FILE}) to the same value on both sides, or "
        f"give both the same home directory so they share {default_secret_path()}"
    )


# -- key schedule -------------------------------------------------------------


def _hkdf(secret: bytes, salt: bytes, info: bytes, length: int = 32) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=salt, info=info).derive(secret)


def handshake_proof(
    secret: bytes, role: bytes, hello: bytes, cnonce: bytes, mode: int, dialled: bytes
) -> bytes:
    key = _hkdf(secret, b"", b"torchfeed/4 handshake proof")
    return hmac.new(key, role + hello + cnonce + bytes([mode]) + dialled, hashlib.sha256).digest()


# -- the dialled endpoint ----------------------------------------------------------------


def pack_endpoint(sockaddr) -> bytes:
    """``(host, port, ...)`` of an IP socket -> the 18 bytes sent in AUTH; anything else
    (a Unix socket, an unparsable host) -> 18 zero bytes, "unknown"."""
    try:
        ip = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        port = int(sockaddr[1])
    except (ValueError, TypeError, IndexError):
        return bytes(ENDPOINT_BYTES)
    if isinstance(ip, ipaddress.IPv4Address):
        ip = ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + ip.packed)
    return ip.packed + port.to_bytes(2, "big")


def unpack_endpoint(packed: bytes) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """The 18 bytes of :func:`pack_endpoint` -> ``(ip, port)``; IPv4-mapped addresses as IPv4."""
    ip6 = ipaddress.IPv6Address(packed[:16])
    return ip6.ipv4_mapped or ip6, int.from_bytes(packed[16:18], "big")


def endpoint_text(packed: bytes) -> str:
    if packed == bytes(ENDPOINT_BYTES):
        return "an unknown address"
    ip, port = unpack_endpoint(packed)
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def dialled_of(auth_meta: bytes) -> bytes:
    """The dialled endpoint in an AUTH message's meta."""
    return auth_meta[NONCE_BYTES + 1 : NONCE_BYTES + 1 + ENDPOINT_BYTES]


@dataclass(frozen=True)
class SessionKeys:
    """The two directional keys of one connection, seen from one side."""

    send: bytes
    recv: bytes
    encrypt: bool
    local: bool = False  # MODE_LOCAL: the channel is a LocalChannel, made by the caller

    def channel(self, sock, reader: wire.FrameReader | None = None) -> Channel:
        """The sealed channel on ``sock``; ``reader``: the handshake's reader, holding any bytes
        received past the handshake."""
        if self.local:
            raise ProtocolError("a same-host session has no sealed channel")
        return Channel(sock, self.send, self.recv, encrypt=self.encrypt, reader=reader)


def _session(
    secret: bytes, hello: bytes, cnonce: bytes, mode: int, dialled: bytes, *, worker: bool
) -> SessionKeys:
    salt = hello[:NONCE_BYTES] + cnonce
    tag = bytes([mode]) + dialled
    to_worker = _hkdf(secret, salt, b"torchfeed/4 client->worker " + tag)
    to_client = _hkdf(secret, salt, b"torchfeed/4 worker->client " + tag)
    encrypt = mode == MODE_ENCRYPTED
    local = mode == MODE_LOCAL
    return (
        SessionKeys(to_client, to_worker, encrypt, local)
        if worker
        else SessionKeys(to_worker, to_client, encrypt, local)
    )


# -- worker side (pure: the worker's doorman does the I/O without blocking) --------


def hello_meta(allow_integrity_only: bool) -> bytes:
    return secrets.token_bytes(NONCE_BYTES) + bytes([1 if allow_integrity_only else 0])


def check_auth(
    secret: Secret, hello: bytes, auth_meta: bytes, *, same_host: bool = False
) -> tuple[bool, bytes, SessionKeys]:
    """Check a client's AUTH meta against our HELLO meta (``same_host``: it came over the
    same-host socket from a peer of this uid, where MODE_LOCAL is allowed).

    Returns ``(ok, reply meta, keys)``: on success the reply is the AUTH_OK proof, else
    the AUTH_FAIL reason text (keys are then meaningless). Whether the dialled endpoint
    (:func:`dialled_of`) names this worker is the caller's to check before answering.
    """
    if len(auth_meta) != AUTH_BYTES:
        raise ProtocolError(f"expected an AUTH message of {AUTH_BYTES} bytes, got {len(auth_meta)}")
    cnonce, mode, proof = auth_meta[:NONCE_BYTES], auth_meta[NONCE_BYTES], auth_meta[-MAC_BYTES:]
    dialled = dialled_of(auth_meta)
    if not hmac.compare_digest(proof, handshake_proof(secret.value, b"client", hello, cnonce, mode, dialled)):
        return False, b"wrong secret", SessionKeys(b"", b"", True)
    if mode == MODE_LOCAL and not same_host:
        return (
            False,
            b"unsealed same-host sessions are only for the worker's same-host socket",
            SessionKeys(b"", b"", True),
        )
    if mode not in (MODE_ENCRYPTED, MODE_INTEGRITY_ONLY, MODE_LOCAL) or (
        mode == MODE_INTEGRITY_ONLY and not hello[-1]
    ):
        return (
            False,
            b"this worker requires encryption (it was not started with --trusted-network-no-encryption)",
            SessionKeys(b"", b"", True),
        )
    reply = handshake_proof(secret.value, b"worker", hello, cnonce, mode, dialled)
    return True, reply, _session(secret.value, hello, cnonce, mode, dialled, worker=True)


# -- client side (blocking) -----------------------------------------------------------


def _dialled(sock) -> bytes:
    try:
        return pack_endpoint(sock.getpeername())
    except OSError:
        return bytes(ENDPOINT_BYTES)


def _refused(address: str, reason: str, secret: Secret) -> AuthenticationError:
    if reason == "wrong secret":
        return AuthenticationError(f"worker {address} rejected this client's secret; " + fix_hint(secret))
    if reason.startswith(NOT_THIS_WORKER):
        return AuthenticationError(
            f"the connection to worker {address} reached a different worker, which refused it: "
            + reason[len(NOT_THIS_WORKER) :]
        )
    return AuthenticationError(f"worker {address} rejected this client: {reason}")


def client_handshake(sock, secret: Secret, address: str, *, integrity_only: bool = False) -> Channel:
    """Run the client side of the handshake on a connected TCP socket; return the sealed channel."""
    keys, reader = client_session(sock, secret, address, integrity_only=integrity_only)
    return keys.channel(sock, reader)


def client_session(
    sock,
    secret: Secret,
    address: str,
    *,
    integrity_only: bool = False,
    same_host: tuple[str, int] | None = None,
    reader: wire.FrameReader | None = None,
) -> tuple[SessionKeys, wire.FrameReader]:
    """Run the client side of the handshake on a connected socket; return the session's keys
    and the reader holding what arrived past the handshake. ``same_host``: the socket is the
    worker's same-host socket, and this is the TCP endpoint it stands for (MODE_LOCAL)."""
    reader = reader or wire.FrameReader(sock)
    frame = reader.read_frame(wire.HANDSHAKE_LIMITS)
    if frame.kind == wire.BYE:
        raise ProtocolError(f"worker {address} refused the connection: {frame.meta.decode(errors='replace')}")
    if frame.kind != wire.HELLO or len(frame.meta) != HELLO_BYTES:
        raise ProtocolError(f"worker {address} sent an unexpected greeting (kind {frame.kind})")
    hello = frame.meta
    mode = MODE_INTEGRITY_ONLY if integrity_only and hello[-1] else MODE_ENCRYPTED
    if same_host is not None:
        mode = MODE_LOCAL
    cnonce = secrets.token_bytes(NONCE_BYTES)
    dialled = _dialled(sock) if same_host is None else pack_endpoint(same_host)
    proof = handshake_proof(secret.value, b"client", hello, cnonce, mode, dialled)
    wire.send_frame(sock, wire.AUTH, meta=cnonce + bytes([mode]) + dialled + proof)
    frame = reader.read_frame(wire.HANDSHAKE_LIMITS)
    if frame.kind == wire.AUTH_FAIL:
        raise _refused(address, frame.meta.decode(errors="replace"), secret)
    if frame.kind == wire.BYE:
        raise ProtocolError(f"worker {address} refused the connection: {frame.meta.decode(errors='replace')}")
    if frame.kind != wire.AUTH_OK or len(frame.meta) != MAC_BYTES:
        raise ProtocolError(f"worker {address} sent an unexpected handshake reply (kind {frame.kind})")
    expected = handshake_proof(secret.value, b"worker", hello, cnonce, mode, dialled)
    if not hmac.compare_digest(frame.meta, expected):
        raise AuthenticationError(
            f"worker {address} could not prove it holds our secret (it may be an impostor or use "
            "another secret); " + fix_hint(secret)
        )
    return _session(secret.value, hello, cnonce, mode, dialled, worker=False), reader
