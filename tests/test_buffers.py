"""The block pool and receive blocks of torchfeed.protocol.buffers (no timing involved: blocks come back
when the last user is garbage collected, which ``gc.collect()`` settles)."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from torchfeed.protocol import buffers

MB = 1 << 20


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_lease_has_the_size_asked_for_and_sizes_round_up_to_the_grain():
    pool = buffers.BlockPool()
    a = pool.lease(MB + 1)
    assert a.dtype == np.uint8 and a.nbytes == MB + 1
    del a
    gc.collect()
    # a slightly different size rounds to the same block: reused
    b = pool.lease(MB + 100)
    assert b.nbytes == MB + 100
    assert (pool.hits, pool.misses) == (1, 1)


def test_block_is_reused_only_after_its_last_user_is_gone():
    pool = buffers.BlockPool()
    first = pool.lease(4 * MB)
    where = _addr(first)
    view = torch.from_numpy(first)[MB:]  # a tensor cut from the lease keeps the block leased
    del first
    gc.collect()
    other = pool.lease(4 * MB)
    assert _addr(other) != where and pool.misses == 2
    del view
    gc.collect()
    again = pool.lease(4 * MB)
    assert _addr(again) == where and pool.hits == 1
    del other, again


def test_numpy_slices_of_a_lease_keep_it_alive():
    pool = buffers.BlockPool()
    lease = pool.lease(2 * MB)
    part = lease[10:20]
    del lease
    gc.collect()
    assert pool.cached_bytes == 0  # still leased through the slice
    del part
    gc.collect()
    assert pool.cached_bytes == 2 * MB


def test_cache_limit_drops_blocks_beyond_it_and_clear_empties_it():
    pool = buffers.BlockPool(max_cached_bytes=3 * MB)
    leases = [pool.lease(2 * MB) for _ in range(2)]
    del leases
    gc.collect()
    assert pool.cached_bytes == 2 * MB  # the second block would exceed 3 MB: released
    pool.clear()
    assert pool.cached_bytes == 0


def test_small_allocations_bypass_the_pool():
    before = (buffers.pool.hits, buffers.pool.misses)
    a = buffers.empty_array(1000)
    t = buffers.empty_tensor((10, 10), torch.float32)
    assert a.nbytes == 1000 and t.shape == (10, 10) and t.dtype == torch.float32
    assert (buffers.pool.hits, buffers.pool.misses) == before


def test_empty_tensor_large_is_pooled_with_its_shape_and_dtype():
    t = buffers.empty_tensor((256, 1024), torch.float64)
    assert t.shape == (256, 1024) and t.dtype == torch.float64 and t.is_contiguous()
    t.fill_(1.5)
    assert float(t.sum()) == 1.5 * 256 * 1024


def test_allocate_aligns_every_buffer_in_one_block():
    lengths = [3, 0, 100, 65, 2 * MB]
    views = buffers.allocate(lengths)
    assert [v.nbytes for v in views] == lengths
    starts = [_addr(np.frombuffer(v, dtype=np.uint8)) if v.nbytes else None for v in views]
    base = starts[0]
    for s in starts:
        if s is not None:
            assert (s - base) % buffers.ALIGN == 0
    # consecutive, non-overlapping, in order
    assert starts[2] - base == 64 and starts[3] - base == 64 + 128 and starts[4] - base == 64 + 128 + 128


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback without CUDA")
def test_pinned_allocation_without_cuda_falls_back_and_warns_once(monkeypatch):
    monkeypatch.setattr(buffers, "_warned_pin", False)
    with pytest.warns(UserWarning, match="CUDA is not available"):
        views = buffers.allocate([10, 20], pin=True)
    assert [v.nbytes for v in views] == [10, 20]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        buffers.allocate([10], pin=True)  # no second warning
        buffers.check_pinnable(True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned host memory); CI has no GPU")
def test_pinned_allocation_with_cuda_is_page_locked():
    views = buffers.allocate([100, 3 * MB], pin=True)
    assert all(torch.frombuffer(v, dtype=torch.uint8).is_pinned() for v in views)


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address`` (Linux)."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    return []


@pytest.mark.skipif(not hasattr(__import__("mmap"), "MADV_HUGEPAGE"), reason="no transparent huge pages here")
def test_large_blocks_start_on_a_huge_page_in_memory_advised_to_use_them():
    block = buffers.mapped(5 * MB + 3)
    assert block.nbytes == 5 * MB + 3 and block.flags.writeable
    assert _addr(block) % buffers.HUGE_PAGE == 0 and "hg" in _vm_flags(_addr(block))
    block[:] = 7
    small = buffers.mapped(MB)  # below a huge page: malloc's memory
    assert "hg" not in _vm_flags(_addr(small))
    pooled = buffers.BlockPool().lease(4 * MB)
    assert "hg" in _vm_flags(_addr(pooled))


def test_the_arena_hands_out_separate_parts_and_unmaps_a_chunk_with_its_last_part():
    from torchfeed.worker.arena import Arena

    arena = Arena(chunk=4 * MB)
    parts = [arena.take(n) for n in (100, 1, 3 * MB // 4, 64)]
    spans = sorted((_addr(p), _addr(p) + p.nbytes) for p in parts)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no overlap
    assert all(_addr(p) % buffers.ALIGN == 0 for p in parts)
    for k, p in enumerate(parts):
        p[:] = k
    assert [int(p.max()) for p in parts] == [0, 1, 2, 3]  # nobody wrote into another's part
    big = arena.take(2 * MB)  # over a quarter of a chunk: a mapping of its own
    assert not any(_addr(p) <= _addr(big) < _addr(p) + 4 * MB for p in parts)
    where = _addr(parts[0])
    for _ in range(4):  # past what the first chunk has left: a second chunk
        arena.take(MB)
    assert _vm_flags(where)  # still mapped: its parts are alive
    del parts, p
    gc.collect()
    assert not _vm_flags(where)  # its last part gone (and the arena moved on): unmapped
