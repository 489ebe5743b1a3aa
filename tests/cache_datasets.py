"""Datasets for tests/test_cache.py: a deterministic "decode" and a random "augment" (importable by workers)."""

from __future__ import annotations

import os
import threading

import torch
from torch.utils.data import Dataset

_lock = threading.Lock()
_decoded: dict[int, int] = {}  # sample -> times decoded in this worker process


class Decoded(Dataset):
    """Sample i: a deterministic 3x16x16 tensor (the "read + decode + resize")."""

    def __init__(self, n: int = 64, side: int = 16):
        self.n = n
        self.side = side

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        with _lock:
            _decoded[i] = _decoded.get(i, 0) + 1
        g = torch.Generator().manual_seed(1000 + i)
        return torch.rand(3, self.side, self.side, generator=g)


def augment(x: torch.Tensor) -> torch.Tensor:
    """The random part: a random 12x12 crop and a random flip (global generators)."""
    top, left = (int(v) for v in torch.randint(0, x.shape[-1] - 12 + 1, (2,)))
    out = x[:, top : top + 12, left : left + 12]
    if torch.rand(()) < 0.5:
        out = out.flip(-1)
    return out + 0.0  # a new tensor


class Uncached(Dataset):
    """What a cached Decoded with then=augment must give: augment(decode(i))."""

    def __init__(self, n: int = 64, side: int = 16):
        self.n = n
        self.side = side

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 + i)  # Decoded's sample, not counted as a decode
        return augment(torch.rand(3, self.side, self.side, generator=g))


def decodes() -> dict[int, int]:
    """Runs on a worker: how often each sample was decoded there."""
    with _lock:
        return dict(_decoded)


def pid() -> int:
    return os.getpid()


def shard_lines(url: str):
    """open_shard for text shards: each line as a deterministic tensor."""
    with open(url) as f:
        for line in f:
            k = int(line)
            with _lock:
                _decoded[k] = _decoded.get(k, 0) + 1
            yield torch.full((4,), float(k))


def jitter(x: torch.Tensor) -> torch.Tensor:
    return x + torch.rand(4)


def jittered_lines(url: str):
    for x in shard_lines(url):
        yield jitter(x)
