"""Datasets for tests/test_cache.py: a deterministic "decode" and a random "augment" (importable by workers)."""

from __future__ import annotations

import os
import threading

import torch
from torch.utils.data import Dataset

_lock = threading.Lock()
_decoded: dict[tuple, int] = {}  # (dataset size, sample) -> times decoded in this worker process


class _Images(Dataset):
    """``n`` samples of 3 x ``side`` x ``side``."""

    def __init__(self, n: int = 64, side: int = 16):
        self.n = n
        self.side = side

    def __len__(self) -> int:
        return self.n


class Decoded(_Images):
    """Sample i: a deterministic 3x16x16 tensor (the "read + decode + resize")."""

    def __getitem__(self, i: int) -> torch.Tensor:
        with _lock:
            _decoded[(self.n, i)] = _decoded.get((self.n, i), 0) + 1
        g = torch.Generator().manual_seed(1000 + i)
        return torch.rand(3, self.side, self.side, generator=g)


def augment(x: torch.Tensor) -> torch.Tensor:
    """The random part: a random 12x12 crop and a random flip (global generators)."""
    top, left = (int(v) for v in torch.randint(0, x.shape[-1] - 12 + 1, (2,)))
    out = x[:, top : top + 12, left : left + 12]
    if torch.rand(()) < 0.5:
        out = out.flip(-1)
    return out + 0.0  # a new tensor


class Uncached(_Images):
    """What a cached Decoded with then=augment must give: augment(decode(i))."""

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 + i)  # Decoded's sample, not counted as a decode
        return augment(torch.rand(3, self.side, self.side, generator=g))


def decodes(n: int) -> dict[int, int]:
    """Runs on a worker: how often each sample of Decoded(n) (or shard line, n = -1) was decoded there."""
    with _lock:
        return {i: c for (m, i), c in _decoded.items() if m == n}


def pid() -> int:
    return os.getpid()


def _lines(url: str):
    with open(url) as f:
        for line in f:
            yield int(line), torch.full((4,), float(int(line)))


def shard_lines(url: str):
    """open_shard for text shards: each line as a deterministic tensor (decodes counted)."""
    for k, x in _lines(url):
        with _lock:
            _decoded[(-1, k)] = _decoded.get((-1, k), 0) + 1
        yield x


def jitter(x: torch.Tensor) -> torch.Tensor:
    return x + torch.rand(4)


def jittered_lines(url: str):
    """The uncached equivalent of cached(Shards, then=jitter) over shard_lines."""
    for _, x in _lines(url):
        yield jitter(x)
