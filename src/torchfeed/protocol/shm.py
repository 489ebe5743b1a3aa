"""Shared memory of the same-host path: slots the worker fills and the trainer reads in place.

A **slot** is one anonymous memory file (``memfd_create``: not under ``/dev/shm``, so a
container's small ``/dev/shm`` does not matter, and nothing is left behind: the kernel frees
it with the last descriptor and mapping, whatever way either process ends). Its first
:data:`HEAD` bytes hold one counter, written by the trainer only: how many replies placed
in the slot it has let go of. Its size is sealed (``F_SEAL_SHRINK``) before the descriptor
leaves the worker, and the trainer checks the seal before mapping it: a slot can never
shrink under a mapping (which would make reads of it fault).

Worker side (:class:`Arena`, one per same-host connection):

* while a call runs, large allocations of the collate (``buffers.empty_array``) are leased
  from the arena, so a batch is stacked straight into a slot;
* when a reply is sent, each large buffer that lies in a slot is *placed* (slot id and
  offset travel instead of the bytes); other large buffers are copied into a slot; each
  slot a reply uses counts one more ``sent``;
* a slot is free again when no array of the worker uses it and the trainer's counter has
  caught up with ``sent``. Slots are kept for reuse (mapped once: no page faults per batch)
  up to ``budget`` bytes; past it, free slots that are too small are dropped (the trainer is
  told in the next reply), and when nothing can be had the buffer travels through the
  socket, with one warning naming the option.

Trainer side (:class:`Mappings`): each slot is mapped once, when its descriptor arrives;
a reply's tensors are views of it, and when the last of them is freed its slot's counter
is incremented (a finalizer, under a lock: several threads may free batches).
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import struct
import threading
import weakref
from collections.abc import Sequence

import numpy as np

from ..errors import ProtocolError

HEAD = 64  # the trainer's counter (u64), then padding to keep the data 64-byte aligned
GRAIN = 1 << 20  # slot sizes are rounded up to this, so similar batches share slots
MIN_PLACED = 64 * 1024  # smaller buffers travel in the message
MAX_NEW = 64  # new slots one message may announce (descriptors travel with it)
ALIGN = 64
DEFAULT_BUDGET = 1 << 30
MAX_SLOTS = 256  # slots of one connection: each holds a descriptor and a mapping on both sides
MAX_MAPPED = 1 << 40  # what a trainer maps of one worker at most (its --shm-bytes bounds it first)
NEW = struct.Struct("<IQ")  # a new slot: id, data capacity
PLACE = struct.Struct("<IQ")  # per buffer: slot id (0: in the message), offset in the slot's data
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL


def _address(buf) -> int:
    return int(np.frombuffer(buf, dtype=np.uint8).__array_interface__["data"][0])


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def map_shared(fd: int, size: int) -> np.ndarray:
    """``size`` bytes of ``fd`` mapped shared, as a uint8 array; unmapped when that array
    and every view of it are gone. (Python's own mmap keeps a duplicate of the descriptor
    for as long as the mapping lives: one more open file per slot on each side.)"""
    address = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if address is None or address == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot map {size:,} bytes of shared memory: {os.strerror(err)}")
    whole = np.frombuffer((ctypes.c_uint8 * size).from_address(address), dtype=np.uint8)  # type: ignore[call-overload]
    # not at exit: threads still running then (a collate stacking into a slot) would fault
    weakref.finalize(whole, _libc.munmap, address, size).atexit = False
    return whole


def _counter(whole: np.ndarray) -> np.ndarray:
    return whole[:8].view(np.uint64)


class _Slot:
    __slots__ = ("id", "fd", "whole", "capacity", "start", "sent", "leased", "announced")

    def __init__(self, slot_id: int, capacity: int):
        self.id, self.capacity = slot_id, capacity
        # named for /proc/PID/maps: the worker's pid and the slot
        name = f"torchfeed-slot-{os.getpid()}-{slot_id}"
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, HEAD + capacity)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)
            self.whole = map_shared(self.fd, HEAD + capacity)
        except BaseException:
            os.close(self.fd)
            raise
        self.start = _address(self.whole) + HEAD
        self.sent = 0
        # a worker array over it is alive; set under the arena's lock only on a free slot, and
        # cleared by that array's finalizer alone (no lock: finalizers run inside other locks)
        self.leased = False
        self.announced = False

    def released(self) -> int:
        return int(_counter(self.whole)[0])

    def free(self) -> bool:
        return not self.leased and self.released() == self.sent

    def close(self) -> None:
        os.close(self.fd)  # the mapping goes with the last array over it


class Placed:
    """What one message says about shared memory (see :class:`Arena.place`)."""

    __slots__ = ("new", "dropped", "where")

    def __init__(self, new: list, dropped: list[int], where: list[tuple[int, int]]):
        self.new = new  # [(slot id, capacity, fd)]
        self.dropped = dropped
        self.where = where  # per buffer: (slot id, offset); slot 0 = in the message

    def table(self) -> bytes:
        parts = [struct.pack("<II", len(self.new), len(self.dropped))]
        parts += [NEW.pack(i, cap) for i, cap, _fd in self.new]
        parts.append(struct.pack(f"<{len(self.dropped)}I", *self.dropped))
        parts += [PLACE.pack(*w) for w in self.where]
        return b"".join(parts)

    @property
    def fds(self) -> list[int]:
        return [fd for _i, _cap, fd in self.new]

    def inline(self, views: Sequence[memoryview]) -> list[memoryview]:
        """The buffers that travel in the message itself."""
        return [v for v, (slot, _) in zip(views, self.where) if slot == 0 and v.nbytes]


class Arena:
    """The worker's slots for one same-host connection (see the module docstring).

    Invariant: a slot is in at most one reply the trainer has not let go of (a slot is
    leased, or copied into, only when free), so the trainer's counter is written by one
    finalizer at a time and needs no lock."""

    def __init__(self, budget: int = DEFAULT_BUDGET, on_over_budget=None):
        self.budget = budget
        self._slots: dict[int, _Slot] = {}
        self._ids = iter(range(1, 1 << 32))
        self._lock = threading.Lock()  # never taken by a finalizer
        self._dropped: list[int] = []
        self.total = 0  # bytes of all slots
        self._on_over_budget = on_over_budget
        self._said: set[str] = set()
        self.closed = False

    # -- leasing ----------------------------------------------------------------------
    def _take(self, nbytes: int) -> _Slot | None:
        """A free slot of at least ``nbytes`` (under the lock), made if the budget allows."""
        best = None
        for slot in self._slots.values():
            if slot.capacity >= nbytes and slot.capacity <= 2 * nbytes + GRAIN and slot.free():
                if best is None or slot.capacity < best.capacity:
                    best = slot
        if best is not None:
            return best
        size = -(-max(nbytes, 1) // GRAIN) * GRAIN
        for slot in sorted(self._slots.values(), key=lambda s: s.capacity):
            if self.total + size <= self.budget and len(self._slots) < MAX_SLOTS:
                break
            if slot.free():  # too small or too big for this and in the way: let it go
                del self._slots[slot.id]
                self.total -= slot.capacity
                self._dropped.append(slot.id)
                slot.close()
        if self.total + size > self.budget or len(self._slots) >= MAX_SLOTS or self.closed:
            return None
        try:
            slot = _Slot(next(self._ids), size)
        except OSError as exc:  # out of descriptors, memory or mappings: this buffer goes inline
            self._say(
                f"cannot make a shared slot of {size:,} bytes ({exc}): batches travel through the socket"
            )
            return None
        self._slots[slot.id] = slot
        self.total += size
        return slot

    def _say(self, text: str) -> None:
        if text not in self._said and self._on_over_budget is not None:
            self._said.add(text)
            self._on_over_budget(text)

    def lease(self, nbytes: int, fresh: list | None = None) -> np.ndarray | None:
        """A uint8 array of ``nbytes`` in a slot (None when the budget is spent); the slot is
        the worker's until the array and everything cut from it are gone. ``fresh`` (the
        lender's list for the running call) records the slot: it may travel without a copy."""
        got = self._lease(nbytes)
        if got is None:
            return None
        if fresh is not None:
            fresh.append(got[0].id)
        return got[1]

    def _lease(self, nbytes: int) -> tuple[_Slot, np.ndarray] | None:
        with self._lock:
            slot = self._take(nbytes)
            if slot is None:
                return None
            slot.leased = True
        lease = slot.whole[HEAD : HEAD + nbytes]
        weakref.finalize(lease, _unlease, slot)
        # as buffers.BlockPool: an array over a memoryview keeps `lease` alive in every slice
        return slot, np.frombuffer(memoryview(lease), dtype=np.uint8)  # type: ignore[arg-type,unused-ignore]

    # -- placing a reply --------------------------------------------------------------
    def place(self, views: Sequence[memoryview], fresh: Sequence[int] = ()) -> Placed | None:
        """Where each buffer of a reply travels: in a slot or in the message; the new slots'
        descriptors go with it (None: no buffer is large enough to be placed). A buffer lying
        in a slot leased during the call that made the
        reply (``fresh``: the batch it collated) travels without a copy; any other large
        buffer is copied into a slot (an array the worker keeps, a cached or registered
        object, must not be shared with the trainer: a reply is a snapshot)."""
        if self.closed or not any(v.nbytes >= MIN_PLACED for v in views):
            return None  # a small reply (it all travels in the message), or a closed connection
        where = [(0, 0)] * len(views)
        got = None  # the slot copied into stays the worker's until its `sent` counts this reply
        copies = []
        used: dict[int, _Slot] = {}
        with self._lock:
            mine = [self._slots[i] for i in set(fresh) if i in self._slots]
            for i, v in enumerate(views):
                if v.nbytes < MIN_PLACED:
                    continue
                at = _address(v)
                slot = next(
                    (s for s in mine if s.start <= at and at + v.nbytes <= s.start + s.capacity), None
                )
                if slot is None:
                    copies.append(i)
                else:
                    where[i] = (slot.id, at - slot.start)
                    used[slot.id] = slot
        if copies:
            offsets, total = [], 0
            for i in copies:
                offsets.append(total)
                total += -(-views[i].nbytes // ALIGN) * ALIGN
            got = self._lease(total)
            if got is None and not self.closed:
                self._say(
                    f"a reply needs {total:,} bytes of shared memory beyond the budget of {self.budget:,}"
                )
            else:
                slot, block = got
                for i, off in zip(copies, offsets):
                    block[off : off + views[i].nbytes] = np.frombuffer(views[i], dtype=np.uint8)
                    where[i] = (slot.id, off)
                used[slot.id] = slot
        with self._lock:
            new: list[tuple[int, int, int]] = []
            for slot in used.values():
                if not slot.announced and len(new) == MAX_NEW:  # more than one message announces
                    where = [(0, 0) if w[0] == slot.id else w for w in where]
                    continue
                slot.sent += 1
                if not slot.announced:
                    slot.announced = True
                    new.append((slot.id, slot.capacity, slot.fd))
            dropped, self._dropped = self._dropped, []
        del got
        return Placed(new, dropped, where)

    def close(self) -> None:
        """Let every slot go (the connection closed): the trainer's mappings keep what it holds."""
        with self._lock:
            self.closed = True
            slots, self._slots = list(self._slots.values()), {}
            self.total = 0
        for slot in slots:
            slot.close()


def _unlease(slot: _Slot) -> None:
    slot.leased = False


def seals_ok(fd: int, size: int) -> bool:
    """Whether ``fd`` is a sealed memory file of at least ``size`` bytes that cannot shrink."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        return bool(seals & fcntl.F_SEAL_SHRINK) and os.fstat(fd).st_size >= size
    except OSError:
        return False


class Mappings:
    """The trainer's mappings of one connection's slots (see the module docstring)."""

    def __init__(self, max_bytes: int = MAX_MAPPED):
        self.max_bytes = max_bytes
        self._maps: dict[int, np.ndarray] = {}  # slot id -> the whole slot, mapped
        self.total = 0
        self._pid = os.getpid()

    def add(self, slot_id: int, capacity: int, fd: int) -> None:
        """Map a new slot (its descriptor is closed here, whatever happens)."""
        try:
            if slot_id in self._maps or slot_id == 0:
                raise ProtocolError(f"the worker announced slot {slot_id} twice")
            if capacity <= 0 or self.total + capacity > self.max_bytes:
                raise ProtocolError(
                    f"the worker announced a shared slot of {capacity:,} bytes, more than this trainer maps "
                    f"({self.max_bytes:,} bytes in all)"
                )
            if not seals_ok(fd, HEAD + capacity):
                raise ProtocolError(
                    "the worker sent shared memory that is not a sealed memory file of its size"
                )
            self._maps[slot_id] = map_shared(fd, HEAD + capacity)
            self.total += capacity
        finally:
            os.close(fd)

    def drop(self, slot_ids: Sequence[int]) -> None:
        for slot_id in slot_ids:
            whole = self._maps.pop(slot_id, None)
            if whole is not None:  # unmapped when the last view of it goes
                self.total -= len(whole) - HEAD

    def views(self, where: Sequence[tuple[int, int]], lengths: Sequence[int]) -> list[memoryview | None]:
        """The placed buffers of one reply as views of their slots (None: in the message).
        Each slot the reply uses is let go of once all views of it are freed."""
        leases: dict[int, np.ndarray] = {}
        out: list[memoryview | None] = []
        for (slot_id, offset), n in zip(where, lengths):
            if slot_id == 0:
                out.append(None)
                continue
            lease = leases.get(slot_id)
            if lease is None:
                whole = self._maps.get(slot_id)
                if whole is None:  # the connection fails: the worker lets its slots go
                    raise ProtocolError(
                        f"the worker placed a buffer in slot {slot_id}, which it never announced"
                    )
                data = whole[HEAD:]
                weakref.finalize(data, self._let_go, whole)
                # as buffers.BlockPool: an array over a memoryview keeps `data` alive in every slice
                lease = leases[slot_id] = np.frombuffer(memoryview(data), dtype=np.uint8)  # type: ignore[arg-type,unused-ignore]
            if offset + n > len(lease):
                raise ProtocolError(
                    f"a buffer placed at {offset:,} + {n:,} lies outside its slot of {len(lease):,} bytes"
                )
            out.append(memoryview(lease[offset : offset + n]))  # type: ignore[arg-type,unused-ignore]
        return out

    def release(self, slot_ids) -> None:
        """Let go of one reply's use of each of ``slot_ids`` now (a reply dropped unread)."""
        for slot_id in set(slot_ids):
            whole = self._maps.get(slot_id)
            if whole is not None:
                self._let_go(whole)

    def _let_go(self, whole: np.ndarray) -> None:
        """One reply in this slot is let go of (a finalizer: no lock; one reply per slot at a
        time, see :class:`Arena`). A forked child freeing its copy of a batch does nothing:
        the parent still holds it."""
        if os.getpid() == self._pid:
            _counter(whole)[0] += 1

    def close(self) -> None:
        self.drop(list(self._maps))


def parse_table(read, nbuf: int) -> tuple[list[tuple[int, int]], list[int], list[tuple[int, int]]]:
    """Read a message's shared-memory table with ``read(n) -> bytes``: (new slots as
    (id, capacity), dropped ids, per-buffer placement)."""
    n_new, n_dropped = struct.unpack("<II", read(8))
    if n_new > MAX_NEW or n_dropped > 1 << 16:
        raise ProtocolError(f"a message announces {n_new} new and {n_dropped} dropped shared slots: too many")
    new = [NEW.unpack(read(NEW.size)) for _ in range(n_new)]
    dropped = list(struct.unpack(f"<{n_dropped}I", read(4 * n_dropped))) if n_dropped else []
    where = [PLACE.unpack(read(PLACE.size)) for _ in range(nbuf)]
    return new, dropped, where
