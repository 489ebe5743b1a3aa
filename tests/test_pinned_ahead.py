"""pin_memory=True reserves page-locked memory for a reply only as far as its bytes justify.

This machine has no CUDA, so the page-locked allocator (buffers._pinned, torch's
cudaHostAlloc-backed pin_memory=True) is replaced by a recorder that hands out ordinary
memory; the worker, the connection, the reading of the reply and the order of events are
real. A reply over buffers.PIN_AHEAD is received into ordinary memory (pages taken as its
records arrive) and copied into page-locked memory once all of it is here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torchfeed
from torchfeed.protocol import buffers
from torchfeed.protocol.channel import Channel

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.usefixtures("tcp_only"),
]  # the sealed channel's receive path


def _ones(n: int) -> torch.Tensor:
    return torch.ones(n, dtype=torch.uint8)


@pytest.fixture
def events(monkeypatch):
    seen: list[tuple[str, int]] = []
    monkeypatch.setattr(buffers, "cuda_pinnable", lambda: True)
    monkeypatch.setattr(buffers, "PIN_AHEAD", 1 << 20)

    def pinned(n: int) -> np.ndarray:
        seen.append(("pinned", n))
        return np.empty(n, dtype=np.uint8)

    monkeypatch.setattr(buffers, "_pinned", pinned)
    read = Channel.read_buffers

    def read_buffers(self, dests, frame=None, peer=""):
        read(self, dests, frame, peer)
        seen.append(("received", sum(len(d) for d in dests)))

    monkeypatch.setattr(Channel, "read_buffers", read_buffers)
    return seen


def test_a_large_reply_is_pinned_only_after_its_bytes_arrived(workers2, events):
    big = 8 << 20
    out = torchfeed.rpc_async(workers2[0], _ones, args=(big,), pin_memory=True).wait()
    assert out.numel() == big and bool(out.all())
    assert events == [("received", big), ("pinned", big)], events  # never reserved ahead
    events.clear()
    small = 64 << 10  # within PIN_AHEAD: received straight into page-locked memory, no copy
    out = torchfeed.rpc_async(workers2[0], _ones, args=(small,), pin_memory=True).wait()
    assert out.numel() == small and events == [("pinned", small), ("received", small)], events
    events.clear()
    torchfeed.rpc_async(workers2[0], _ones, args=(big,)).wait()  # not asked: never page-locked
    assert events == [("received", big)]
