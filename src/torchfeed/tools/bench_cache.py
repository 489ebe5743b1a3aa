"""The sample cache's benchmark: decode once with :func:`torchfeed.cached`.

600 JPEGs (800x600, made here with Pillow and numpy) are read, decoded and resized to a
3x224x224 float32 tensor (602 KB: ~360 MB for the set) by :class:`JpegFiles`, the cached
part; :func:`crop_flip` (a random 200x200 crop and a random flip) runs in ``then``. Two
worker processes, batch 32, shuffled. Measured:

* per-epoch rates of one job (epoch 1 decodes, the next find the samples cached) and the
  cache hit rate of each epoch (``loader.stats().cache_hit_rate``);
* the workers' CPU seconds of one job (2 epochs) and of two concurrent jobs (different
  seeds, 2 epochs each) on fresh workers;
* the growth of a worker's RSS over 2 epochs with ``--cache-size 16MiB``.

``benchmarks/cache.py`` runs it and writes the plot; ``torchfeed bench cache`` reports the
epoch-2/epoch-1 ratio.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import Dataset

SIDE = 224
CROP = 200


class JpegDir(Dataset):
    """The ``.jpg`` files of ``root``, in name order: sample i is made from :meth:`path` ``(i)``."""

    def __init__(self, root: str):
        self.root = root
        self.files = sorted(f for f in os.listdir(root) if f.endswith(".jpg"))

    def __len__(self) -> int:
        return len(self.files)

    def path(self, i: int) -> str:
        return os.path.join(self.root, self.files[i])


class JpegFiles(JpegDir):
    """Read + decode + resize: ``root/000123.jpg`` -> a 3x224x224 float32 tensor in [0, 1]."""

    def __getitem__(self, i: int) -> torch.Tensor:
        from PIL import Image

        with Image.open(self.path(i)) as img:
            small = img.convert("RGB").resize((SIDE, SIDE), Image.Resampling.BILINEAR)
        return (
            torch.frombuffer(bytearray(small.tobytes()), dtype=torch.uint8)
            .view(SIDE, SIDE, 3)
            .permute(2, 0, 1)
            .float()
            .div_(255)
        )


def crop_flip(x: torch.Tensor) -> torch.Tensor:
    """The random part: a random CROP x CROP crop and a horizontal flip half of the time."""
    top, left = (int(v) for v in torch.randint(0, SIDE - CROP + 1, (2,)))
    out = x[:, top : top + CROP, left : left + CROP]
    return out.flip(-1) if torch.rand(()) < 0.5 else out.clone()


def make_jpegs(root: str, count: int = 600, size: tuple[int, int] = (800, 600), seed: int = 0) -> None:
    """``count`` distinct JPEGs (smooth colour fields with noise, quality 90)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    w, h = size
    for i in range(count):
        coarse = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).resize(
            (w, h), Image.Resampling.BICUBIC
        )
        noisy = np.asarray(coarse, dtype=np.int16) + rng.integers(-12, 13, (h, w, 3), dtype=np.int16)
        Image.fromarray(noisy.clip(0, 255).astype(np.uint8)).save(
            os.path.join(root, f"{i:06d}.jpg"), quality=90
        )


def _cpu(pids) -> float:
    from .measure import process_cpu_seconds

    return sum(process_cpu_seconds(p) for p in pids)


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm", "rb") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _epochs(loader, epochs: int) -> list[tuple[float, float | None]]:
    """(samples/s, cache hit rate) of each epoch."""
    out = []
    for _ in range(epochs):
        start, n = time.perf_counter(), 0
        for batch in loader:
            n += len(batch)
        rate = n / (time.perf_counter() - start)
        out.append((rate, loader.stats().cache_hit_rate))  # the pass's, final when it ends
    return out


def run(log: Callable[[str], Any] = print, epochs: int = 4, count: int = 600) -> dict[str, Any]:
    """Every measurement of the benchmark; returns the numbers (JSON-friendly)."""
    import torchfeed
    from torchfeed import LocalWorkers, RemoteDataLoader, RemoteDataset

    factory = torchfeed.cached(JpegFiles, then=crop_flip)
    result: dict[str, Any] = {"images": count, "workers": 2, "batch_size": 32}
    with tempfile.TemporaryDirectory(prefix="torchfeed-cache-bench-") as root:
        t = time.perf_counter()
        make_jpegs(root, count)
        log(f"made {count} JPEGs in {time.perf_counter() - t:.1f} s")

        # 1. one job, per-epoch rates and hit rates
        with LocalWorkers(2, cache_size="1GiB") as w:
            ds: Any = RemoteDataset(w.addresses, factory, root)
            loader: Any = RemoteDataLoader(ds, batch_size=32, shuffle=True, seed=0)
            per_epoch = _epochs(loader, epochs)
            result["epoch_rates"] = [r for r, _ in per_epoch]
            result["hit_rates"] = [h for _, h in per_epoch]
            for i, (r, h) in enumerate(per_epoch, 1):
                log(f"epoch {i}: {r:.0f} samples/s, cache hit rate {h}")
            result["epoch2_over_epoch1"] = per_epoch[1][0] / per_epoch[0][0]
            plain: Any = RemoteDataset(w.addresses, _Uncached, root)
            result["uncached_rate"] = _epochs(
                RemoteDataLoader(plain, batch_size=32, shuffle=True, seed=0), 1
            )[0][0]
            log(f"uncached (then(decode(i)) every time): {result['uncached_rate']:.0f} samples/s")

        # 2. worker CPU: one job against two concurrent jobs (2 epochs each, fresh workers each time)
        def jobs(n_jobs: int) -> float:
            with LocalWorkers(2, cache_size="1GiB") as w:
                pids = [p.pid for p in w.processes]
                sets: list[Any] = [RemoteDataset(w.addresses, factory, root) for _ in range(n_jobs)]
                before = _cpu(pids)
                threads = [
                    threading.Thread(
                        target=_epochs, args=(RemoteDataLoader(d, batch_size=32, shuffle=True, seed=7 * j), 2)
                    )
                    for j, d in enumerate(sets)
                ]
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
                return _cpu(pids) - before

        one, two = jobs(1), jobs(2)
        result.update(worker_cpu_one_job_s=one, worker_cpu_two_jobs_s=two, two_jobs_over_one=two / one)
        log(f"worker CPU: one job {one:.1f} s, two concurrent jobs {two:.1f} s ({two / one:.2f}x)")

        # 3. a small budget: RSS growth with --cache-size 16MiB
        with LocalWorkers(2, cache_size="16MiB") as w:
            small: Any = RemoteDataset(w.addresses, factory, root)
            bounded: Any = RemoteDataLoader(small, batch_size=32, shuffle=True, seed=0)
            _epochs(bounded, 1)  # the process's own allocations settle (buffers, pools)
            rss0 = [_rss(p.pid) for p in w.processes]
            budget_epochs = _epochs(bounded, 2)
            growth = [_rss(p.pid) - r for p, r in zip(w.processes, rss0)]
            stats = [torchfeed.client.worker_stats(a, timeout=10) for a in w.addresses]
        result["budget_rss_growth_mb"] = [g / 1e6 for g in growth]
        result["budget_cache_mb"] = [s["cache_bytes"] / 1e6 for s in stats]
        result["budget_hit_rates"] = [h for _, h in budget_epochs]
        log(
            f"--cache-size 16MiB: RSS growth {[round(g / 1e6, 1) for g in growth]} MB over 2 epochs, cache "
            f"{[round(s['cache_bytes'] / 1e6, 1) for s in stats]} MB, hit rates {result['budget_hit_rates']}"
        )
        # the same, measured from a fresh worker (the first epoch's growth included)
    return result


class _Uncached(Dataset):
    """``crop_flip(JpegFiles(root)[i])`` every time: the run without a cache."""

    def __init__(self, root: str):
        self.inner = JpegFiles(root)

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> torch.Tensor:
        return crop_flip(self.inner[i])


def plot(result: dict[str, Any], path: str) -> bool:
    """Per-epoch rates as bars (matplotlib, optional); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rates = result["epoch_rates"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = [f"epoch {i}" for i in range(1, len(rates) + 1)] + ["uncached"]
    values = [*rates, result["uncached_rate"]]
    bars = ax.bar(labels, values, color=["tab:blue"] * len(rates) + ["tab:gray"])
    for b, h in zip(bars, [*result["hit_rates"], None]):
        if h is not None:
            ax.annotate(
                f"hits {h:.0%}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom"
            )
    ax.set_ylabel("samples/s")
    ax.set_title("torchfeed.cached: 600 JPEGs, 2 workers, decode+resize cached, crop+flip in then")
    ax.title.set_fontsize(9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def case_cache(ctx) -> Any:
    """``torchfeed bench cache``: epoch 2's rate against epoch 1's (target 5x)."""
    from .measure import Result

    r = run(ctx.log, epochs=2)
    first, second = r["epoch_rates"][:2]
    return Result(
        "cache",
        "samples/s, epoch 1 (torch column) vs epoch 2 (torchfeed column), torchfeed.cached",
        first,
        second,
        5.0,
        ">= 5x",
        second >= 5 * first,
        notes=[
            f"cache hit rates {r['hit_rates']}",
            f"two concurrent jobs use {r['two_jobs_over_one']:.2f}x the worker CPU of one",
            f"RSS growth with --cache-size 16MiB: {[round(g) for g in r['budget_rss_growth_mb']]} MB",
        ],
        runs={"torch": [first], "torchfeed": [second]},
    )
