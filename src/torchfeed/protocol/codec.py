"""Compression of replies' raw buffers on the wire (lz4 or zstd), chosen per buffer.

A reply's tensor and array buffers may travel compressed, chunk by chunk: the buffer is
cut into the channel's records (:data:`torchfeed.protocol.channel.CHUNK` bytes each) and
each chunk is compressed on its own, or sent as it is when it does not shrink. The
receiver decrypts one record into a small scratch block and decompresses it straight
into the chunk's place in its final (pinned, when asked) buffer: one pass, memory bounded
by a record, and a mix of compressible and incompressible data costs nothing extra.
Sealing stays on top: compress, then seal (the records carry compressed bytes).

Who decides (see :class:`Chooser`): the trainer asks for a mode in each call's flags
(:data:`MODES`: none, lz4, zstd or auto) and, with ``auto``, says how fast replies
arrive over this connection (:class:`LinkMeter`: wire bytes over the time from a reply's
header to its last byte). The worker compresses a sample of each large buffer with each
codec, keeps per-connection estimates of their speeds, and compresses when the estimated
time per byte (compressing, then sending fewer bytes) beats sending the bytes as they
are by :data:`MIN_GAIN`. On a fast link (loopback) nothing is even sampled: a codec
slower than the link cannot pay.

Wire layout of a packed reply (``wire.FLAG_PACKED``), after the buffer-length table:
one codec byte per buffer; then, after the meta, each buffer: raw chunks when its codec
is :data:`NONE`, else a table of its chunks' wire sizes (u32 each) followed by one record
per chunk of that size (the chunk's own length: stored raw).
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

import lz4.block
import zstandard

from ..errors import ProtocolError
from . import wire

log = logging.getLogger("torchfeed.codec")

NONE, LZ4, ZSTD = 0, 1, 2
CODEC_NAMES = {NONE: "none", LZ4: "lz4", ZSTD: "zstd"}
AUTO = 3
# compression= value -> the mode a call asks for (two bits of the call's flags)
MODES: dict[Any, int] = {None: NONE, "none": NONE, "lz4": LZ4, "zstd": ZSTD, "auto": AUTO}
DEFAULT = "auto"

MIN_BYTES = 64 * 1024  # smaller buffers are never compressed (a tiny reply stays one record)
SAMPLE = 64 * 1024  # bytes of a buffer compressed to estimate its ratio and the codec's speed
MIN_GAIN = 0.85  # compress when its estimated time per byte is below this share of sending raw
RESAMPLE = 8  # a buffer position's decision is re-estimated every this many replies
ZSTD_LEVEL = 1
# speeds assumed before a connection measured its own (bytes of input per second)
_START_SPEED = {LZ4: 600e6, ZSTD: 350e6}
_SLACK = 3.0  # codecs up to this many times slower than the link are still sampled


def check_mode(compression) -> int:
    """The mode of a ``compression=`` argument; a clear error for anything else."""
    try:
        return MODES[compression]
    except (KeyError, TypeError):
        raise ValueError(
            f"compression={compression!r} is not a choice: use 'auto' (compress a buffer when the data shrinks "
            "and the link is slower than compressing it), 'lz4', 'zstd', or None"
        ) from None


# -- codecs -----------------------------------------------------------------------------

_local = threading.local()  # zstd contexts are not thread safe: one per thread


def _zstd_c() -> zstandard.ZstdCompressor:
    c = getattr(_local, "zc", None)
    if c is None:
        c = _local.zc = zstandard.ZstdCompressor(
            level=ZSTD_LEVEL, write_content_size=True, write_checksum=False
        )
    return c


def _zstd_d() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "zd", None)
    if d is None:
        d = _local.zd = zstandard.ZstdDecompressor()
    return d


def compress(codec: int, data) -> bytes:
    """``data`` compressed with ``codec`` (one chunk: no framing of ours)."""
    if codec == LZ4:
        return lz4.block.compress(data, store_size=False)
    return _zstd_c().compress(data)


def refusal(kind: int, mode: int, lengths: Sequence[int], codecs: bytes) -> str | None:
    """Trainer side: why a reply of ``kind`` (wire.REPLY or ERROR) with buffers of
    ``lengths`` compressed as ``codecs`` is not read, for a call that asked for ``mode``;
    None when it is. An error never carries buffers; a reply is compressed only as the call
    allowed (none for ``compression=None``, that codec for "lz4" or "zstd", either for auto)."""
    if kind == wire.ERROR and lengths:
        return f"an error reply carries {len(lengths)} buffer(s); errors never carry buffers"
    allowed = (NONE,) if mode == NONE else (NONE, LZ4, ZSTD) if mode == AUTO else (NONE, mode)
    bad = sorted({CODEC_NAMES.get(c, str(c)) for c in codecs if c not in allowed})
    if bad:
        asked = "no compression" if mode == NONE else f"compression={CODEC_NAMES.get(mode, 'auto')!r}"
        return f"a reply is compressed with {', '.join(bad)} where the call asked for {asked}"
    return None


def decompress_into(codec: int, src, dest: memoryview, worker: str = "") -> None:
    """Decompress ``src`` into ``dest``, which it must fill exactly; else ProtocolError."""
    n = len(dest)
    try:
        if codec == LZ4:
            out = lz4.block.decompress(src, uncompressed_size=n)
        elif codec == ZSTD:
            # zstandard allocates what the frame announces, whatever max_output_size says:
            # check the announcement first (a small frame may announce gigabytes)
            announced = zstandard.get_frame_parameters(src).content_size
            if announced != n:
                raise ValueError(f"the frame announces {announced:,} bytes")
            out = _zstd_d().decompress(src, max_output_size=n)
        else:
            raise ValueError(f"unknown codec {codec}")
    except Exception as exc:  # lz4.block.LZ4BlockError, zstandard.ZstdError, ...
        raise ProtocolError(
            f"worker {worker} sent {CODEC_NAMES.get(codec, codec)} data that does not decompress ({exc}): its "
            "torchfeed, lz4 or zstandard installation is broken or the worker is hostile; the connection is "
            "dropped and its batches go to other workers"
        ) from None
    if len(out) != n:
        raise ProtocolError(
            f"worker {worker} sent a {CODEC_NAMES[codec]} chunk that decompresses to {len(out):,} bytes instead of "
            f"{n:,}: the connection is dropped and its batches go to other workers"
        )
    dest[:] = out


# -- the worker's side: what to compress -------------------------------------------------


class Packed:
    """A reply's buffers as they go on the wire: per buffer a codec and its records."""

    __slots__ = ("lengths", "codecs", "bodies", "wire_bytes")

    def __init__(self, lengths: list[int], codecs: bytes, bodies: list, wire_bytes: int):
        self.lengths = lengths  # each buffer's own length
        self.codecs = codecs  # one byte per buffer
        self.bodies = bodies  # per buffer: the raw view (NONE), or [sizes table, chunk, chunk, ...]
        self.wire_bytes = wire_bytes  # payload bytes of all buffers on the wire (tables included)


class Chooser:
    """A worker connection's compression decisions and its estimates of codec speeds.

    Used by the executor threads that make replies (under a lock: a few microseconds).
    """

    def __init__(self, chunk: int):
        self.chunk = chunk
        self._lock = threading.Lock()
        self._speed = dict(_START_SPEED)  # bytes of input per second, per codec
        self._decisions: dict[int, tuple[int, int]] = {}  # buffer position -> (codec, replies left)

    def pack(self, buffers: Sequence[memoryview], mode: int, link_rate: float) -> Packed | None:
        """The buffers compressed as ``mode`` (and ``link_rate``, bytes/s, for auto) say;
        None when no buffer is compressed (the reply then travels as before)."""
        if mode == NONE or not buffers:
            return None
        raws = [b.cast("B") if b.format != "B" or b.ndim != 1 else b for b in buffers]
        codecs = bytearray(len(raws))
        any_packed = False
        for i, raw in enumerate(raws):
            if raw.nbytes >= MIN_BYTES:
                codecs[i] = mode if mode != AUTO else self._auto(i, raw, link_rate)
                any_packed = any_packed or codecs[i] != NONE
        if not any_packed:
            return None
        bodies: list = []
        total = 0
        for codec, raw in zip(codecs, raws):
            if codec == NONE:
                bodies.append(raw)
                total += raw.nbytes
                continue
            chunks, sizes = self._compress(codec, raw)
            table = struct.pack(f"<{len(sizes)}I", *sizes)
            bodies.append([table, *chunks])
            total += len(table) + sum(sizes)
        return Packed([raw.nbytes for raw in raws], bytes(codecs), bodies, total)

    def _compress(self, codec: int, raw: memoryview) -> tuple[list, list[int]]:
        chunks: list = []
        sizes: list[int] = []
        started = time.perf_counter()
        for start in range(0, raw.nbytes, self.chunk):
            piece = raw[start : start + self.chunk]
            out = compress(codec, piece)
            if len(out) >= len(piece):  # did not shrink: stored as it is (a copy: a view would
                chunks.append(bytes(piece))  # keep the whole buffer alive, uncounted, until sent)
                sizes.append(len(piece))
            else:
                chunks.append(out)
                sizes.append(len(out))
        seconds = time.perf_counter() - started
        with self._lock:
            if seconds > 0:
                self._speed[codec] = 0.7 * self._speed[codec] + 0.3 * raw.nbytes / seconds
        return chunks, sizes

    def _auto(self, position: int, raw: memoryview, link_rate: float) -> int:
        """The codec for buffer ``position`` (``raw``: its bytes, a flat byte view)."""
        if link_rate <= 0:  # not measured yet: nothing says the link is slow
            return NONE
        with self._lock:
            codec, left = self._decisions.get(position, (NONE, 0))
            if left > 0:
                self._decisions[position] = (codec, left - 1)
                return codec
            # a codec much slower than the link cannot pay: not even sampled (loopback); the
            # margin lets a speed measured low once (a busy moment) be measured again
            candidates = [c for c in (LZ4, ZSTD) if self._speed[c] * _SLACK > link_rate]
        if not candidates:
            choice = NONE
        else:
            middle = max(0, (raw.nbytes - SAMPLE) // 2)
            sample = raw[middle : middle + SAMPLE]
            best, best_time = NONE, MIN_GAIN / link_rate
            for c in candidates:
                started = time.perf_counter()
                ratio = len(compress(c, sample)) / len(sample)
                seconds = time.perf_counter() - started
                with self._lock:
                    if seconds > 0:
                        self._speed[c] = 0.7 * self._speed[c] + 0.3 * len(sample) / seconds
                    per_byte = 1 / self._speed[c] + min(ratio, 1.0) / link_rate
                if per_byte < best_time:
                    best, best_time = c, per_byte
            choice = best
        with self._lock:
            self._decisions[position] = (choice, RESAMPLE - 1)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "buffer %d: link %.0f MB/s, speeds %s: %s", position, link_rate / 1e6, self.speeds(), choice
            )
        return choice

    def speeds(self) -> dict[str, float]:
        """Measured compression speeds (bytes of input per second), per codec name."""
        with self._lock:
            return {CODEC_NAMES[c]: s for c, s in self._speed.items()}


# -- the trainer's side: how fast replies arrive ------------------------------------------


class LinkMeter:
    """How fast a connection's replies arrive: wire bytes over the time from a reply's
    header to its last byte (replies too small to time are not counted), smoothed."""

    MIN_TIMED = 256 * 1024

    def __init__(self):
        self.rate = 0.0  # bytes/s; 0: not measured yet

    def timed(self, wire_bytes: int, seconds: float) -> None:
        if wire_bytes < self.MIN_TIMED or seconds <= 0:
            return
        rate = wire_bytes / seconds
        self.rate = rate if self.rate == 0 else 0.75 * self.rate + 0.25 * rate

    def hint(self) -> int:
        """The rate in KiB/s for a call's header (0: unknown), within 32 bits."""
        return min(int(self.rate / 1024), (1 << 32) - 1)


def rate_of_hint(hint: int) -> float:
    return hint * 1024.0


def read_sizes(raw: bytes | bytearray | memoryview, pieces: Sequence[int], worker: str) -> list[int]:
    """A compressed buffer's chunk sizes, checked: each at least 1 and at most its chunk."""
    sizes = list(struct.unpack(f"<{len(pieces)}I", raw))
    for size, piece in zip(sizes, pieces):
        if not 0 < size <= piece:
            raise ProtocolError(
                f"worker {worker} announced a compressed chunk of {size:,} bytes for {piece:,} bytes of data: the "
                "connection is dropped and its batches go to other workers"
            )
    return sizes


__all__ = [
    "AUTO",
    "LZ4",
    "MODES",
    "NONE",
    "ZSTD",
    "Chooser",
    "LinkMeter",
    "Packed",
    "check_mode",
    "compress",
    "decompress_into",
    "rate_of_hint",
    "read_sizes",
]
