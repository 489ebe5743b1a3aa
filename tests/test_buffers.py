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
    assert base is not None and starts[2] is not None and starts[3] is not None and starts[4] is not None
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
