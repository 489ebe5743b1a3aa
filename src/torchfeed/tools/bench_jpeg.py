"""The first-epoch benchmark: a JPEG pipeline from a cold start, torchfeed against torch.

600 JPEGs (800x600, made here) are decoded with Pillow (DCT-scaled to 400x300, ~360 KB a
decoded image), random-resized-cropped to 224x224 and flipped (:class:`JpegPipeline`), batch
32, 2 loading processes on each side, shuffled; the consumer touches every page of every batch.
Every round runs the three sides below, each from a cold start; the rounds take the six orders
of the sides in turn (so each side follows each other one as often); a ratio is the median
over rounds of the round's ratio, so that the machine's drifts between rounds cancel:

* torch: a new ``DataLoader(num_workers=2, persistent_workers=True)``; epoch 1 includes forking
  its workers, as a user's first epoch does;
* torchfeed: new worker processes (:class:`~torchfeed.LocalWorkers`, started before the clock
  starts), then the ``RemoteDataset`` is built inside the clock: epoch 1 pays every first-use
  cost of the workers (imports, buffers, connections);
* cached: ``torchfeed.cached`` over the decode (:class:`JpegDecoded`), the crop and flip in
  ``then``, on fresh workers: its epoch 1 decodes and keeps every image (its owner gets a note).

Also measured: the time to the first batch (from entering ``LocalWorkers(2)``, which forks its
workers from the process's fork server, started by the sides' earlier runs; from building a ``RemoteDataset`` on running, idle
workers; from building torch's DataLoader), the trainer's CPU per
batch, and minor page faults per batch of all the processes (memory mapped and unmapped per
batch: what slows a loader most when something else on the machine stalls page faults).
Every round also times the ceilings (:mod:`~torchfeed.tools.bench_ceiling`): the same work
in 2 bare processes that send nothing back, which no loader with 2 workers can beat.
``benchmarks/jpeg.py`` runs it; numbers in benchmarks/README.md.
"""

from __future__ import annotations

import itertools
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, default_collate

from . import measure
from .bench_cache import JpegDir, make_jpegs
from .bench_ceiling import Bare
from .measure import child_pids, own_cpu_seconds, touch

SIDE = 224
DRAFT = (400, 300)
BATCH = 32
WORKERS = 2
IDLE = 1.5  # seconds for workers to finish a closed pass's prefetched batches (4 x ~0.2 s of CPU)


def decode(path: str) -> np.ndarray:
    """A JPEG file as an HxWx3 uint8 array, DCT-scaled by the decoder to about :data:`DRAFT`."""
    from PIL import Image

    with Image.open(path) as img:
        img.draft("RGB", DRAFT)
        return np.asarray(img.convert("RGB"))


def crop_flip(image: np.ndarray) -> torch.Tensor:
    """A random resized crop (8-100% of the area, aspect 3/4-4/3) to 224x224 and a random flip.

    Draws from torch's generator, which both loaders seed per worker alike."""
    from PIL import Image

    h, w = image.shape[:2]
    area = h * w
    for _ in range(10):
        target = area * float(torch.empty(()).uniform_(0.08, 1.0))
        aspect = math.exp(float(torch.empty(()).uniform_(math.log(3 / 4), math.log(4 / 3))))
        cw, ch = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < cw <= w and 0 < ch <= h:
            top = int(torch.randint(0, h - ch + 1, ()))
            left = int(torch.randint(0, w - cw + 1, ()))
            break
    else:  # the whole image
        top, left, ch, cw = 0, 0, h, w
    crop = np.asarray(
        Image.fromarray(image[top : top + ch, left : left + cw]).resize(
            (SIDE, SIDE), Image.Resampling.BILINEAR
        )
    )
    if torch.rand(()) < 0.5:
        crop = crop[:, ::-1]
    return torch.from_numpy(np.ascontiguousarray(crop.transpose(2, 0, 1)))


class JpegDecoded(JpegDir):
    """``root/000123.jpg`` -> the decoded image (the part :func:`torchfeed.cached` keeps)."""

    def __getitem__(self, i: int) -> np.ndarray:
        return decode(self.path(i))


class JpegPipeline(JpegDecoded):
    """Decode, crop and flip every time: a 3x224x224 uint8 tensor."""

    def __getitem__(self, i: int) -> Any:
        return crop_flip(super().__getitem__(i))


def minor_faults(pid: int) -> int:
    """Minor page faults of a process so far (Linux /proc; 0 where unavailable)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[7])
    except (OSError, IndexError, ValueError):
        return 0


class Epochs:
    """Times consecutive passes of one loader: samples/s, trainer CPU and page faults per batch."""

    def __init__(self, loader, pids: Callable[[], list[int]]):
        self.loader, self.pids = loader, pids
        self.rates: list[float] = []
        self.cpu_ms: list[float] = []
        self.faults: list[float] = []

    def run(self, start: float | None = None) -> float:
        """One pass; ``start`` is when the clock started (set-up before the pass counted)."""
        pids = [os.getpid(), *self.pids()]
        faults = sum(map(minor_faults, pids))
        cpu = own_cpu_seconds()
        start = time.perf_counter() if start is None else start
        n = batches = 0
        for batch in self.loader:
            touch(batch)
            n += len(batch)
            batches += 1
        rate = n / (time.perf_counter() - start)
        pids = [os.getpid(), *self.pids()]  # torch's workers exist only once the pass started
        self.rates.append(rate)
        self.cpu_ms.append((own_cpu_seconds() - cpu) * 1e3 / batches)
        self.faults.append((sum(map(minor_faults, pids)) - faults) / batches)
        return rate

    def passes(self, start: float, epochs: int) -> None:
        """``epochs`` passes, the first timed from ``start``."""
        self.run(start)
        for _ in range(epochs - 1):
            self.run()


def children() -> list[int]:
    """This process's child processes: torch's forked workers while a pass runs."""
    return child_pids(os.getpid())


def _in_process(root: str, keys: list[int], tries: int = 3) -> float:
    """Seconds to build the batch of ``keys`` in this process (the dataset warm; the median of
    ``tries``): what a split first batch is measured against."""
    ds = JpegPipeline(root)
    default_collate([ds[i] for i in range(len(keys))])  # warm: imports, caches
    times = []
    for _ in range(tries):
        start = time.perf_counter()
        default_collate([ds[i] for i in keys])
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class KeptOrder(torch.utils.data.RandomSampler):
    """``shuffle=True``'s sampler, keeping the order of its last pass (so the in-process time
    and the bare processes' are measured on the keys of the pass's first batch)."""

    order: list[int] = []

    def __iter__(self) -> Iterator[int]:
        self.order = list(super().__iter__())
        return iter(self.order)


def _decode_then(dataset: JpegPipeline) -> tuple[Callable[[int], np.ndarray], Callable]:
    """A pipeline's cached part (the decode) and random part (crop and flip), for a bare process."""
    return partial(JpegDecoded.__getitem__, dataset), crop_flip


def _ceilings(bare: Bare, count: int, first: list[int], ceiling: dict[str, list[float]]) -> None:
    """One round of the bare processes: an epoch, a cached epoch 1, and the batch of keys
    ``first`` split between them."""
    order = torch.randperm(count).tolist()
    batches = [order[i : i + BATCH] for i in range(0, count, BATCH)]
    ceiling["epoch"].append(count / bare.run("epoch", batches))
    ceiling["cached"].append(count / bare.run("cached", batches))
    ceiling["parts"].append(bare.run("parts", [first]))


def _first_batch(make: Callable[[], Any]) -> float:
    """Seconds from ``make()`` (a loader, or an iterator of one) to its first batch."""
    start = time.perf_counter()
    made = make()
    next(iter(made))
    return time.perf_counter() - start


def run(
    log: Callable[[str], Any] = print, rounds: int = 3, epochs: int = 3, count: int = 600
) -> dict[str, Any]:
    """Every measurement; returns JSON-friendly numbers (medians over ``rounds``)."""
    from torchfeed import LocalWorkers, RemoteDataLoader, RemoteDataset

    torch.manual_seed(0)
    out: dict[str, Any] = {"images": count, "workers": WORKERS, "batch_size": BATCH, "rounds": rounds}
    runs: dict[str, list[Epochs]] = {"torch": [], "torchfeed": [], "cached": []}
    first: dict[str, list[float]] = {
        "local_workers": [],
        "running_workers": [],
        "new_pass": [],
        "in_process": [],
        "torch": [],
    }
    ceiling: dict[str, list[float]] = {"epoch": [], "cached": [], "parts": []}
    paths = ""
    with tempfile.TemporaryDirectory(prefix="torchfeed-jpeg-bench-") as root:
        make_jpegs(root, count)
        bare = Bare(WORKERS, partial(JpegPipeline, root), _decode_then)
        orders = list(itertools.permutations(runs))  # in turn: each side follows each other as often
        for r in range(rounds):
            for kind in orders[r % len(orders)]:
                runs[kind].append(_side(kind, root, epochs))
            # time to the first batch, three ways
            start = time.perf_counter()
            with LocalWorkers(WORKERS) as w:
                ds: Any = RemoteDataset(w.addresses, JpegPipeline, root)
                passing = iter(RemoteDataLoader(ds, batch_size=BATCH, shuffle=True))
                next(passing)
                first["local_workers"].append(time.perf_counter() - start)
                del passing, ds  # the pass ends; the batches it had asked for finish within IDLE:
                time.sleep(IDLE)  # the next measurement starts on idle running workers
                first["running_workers"].append(
                    _first_batch(
                        lambda: RemoteDataLoader(
                            RemoteDataset(w.addresses, JpegPipeline, root), batch_size=BATCH, shuffle=True
                        )
                    )
                )
                # a new pass of a loader that has run one whole (an epoch's start on warm workers:
                # nothing of it was prefetched without a seed), on idle workers
                kept_order = KeptOrder(range(count))
                again: Any = RemoteDataLoader(
                    RemoteDataset(w.addresses, JpegPipeline, root), batch_size=BATCH, sampler=kept_order
                )
                for _ in again:
                    pass
                time.sleep(IDLE)
                first["new_pass"].append(_first_batch(partial(iter, again)))
                paths = measure.paths_used()
            keys = kept_order.order[:BATCH]  # the new pass's first batch
            first["in_process"].append(_in_process(root, keys))
            _ceilings(bare, count, keys, ceiling)
            first["torch"].append(
                _first_batch(
                    lambda: DataLoader(
                        JpegPipeline(root), batch_size=BATCH, shuffle=True, num_workers=WORKERS
                    )
                )
            )
            log(
                f"round {r + 1}: epoch 1 torch {runs['torch'][-1].rates[0]:.0f}/s, torchfeed "
                f"{runs['torchfeed'][-1].rates[0]:.0f}/s, cached {runs['cached'][-1].rates[0]:.0f}/s; later epochs "
                f"torch {statistics.median(runs['torch'][-1].rates[1:]):.0f}/s, torchfeed "
                f"{statistics.median(runs['torchfeed'][-1].rates[1:]):.0f}/s; first batch: LocalWorkers "
                f"{first['local_workers'][-1]:.2f} s, running workers {first['running_workers'][-1]:.3f} s, a new "
                f"pass {first['new_pass'][-1]:.3f} s (in-process {first['in_process'][-1]:.3f} s), torch "
                f"{first['torch'][-1]:.3f} s; torchfeed reached its workers by {paths}; bare processes: "
                f"epoch {ceiling['epoch'][-1]:.0f}/s, cached epoch 1 {ceiling['cached'][-1]:.0f}/s, "
                f"split batch {ceiling['parts'][-1]:.3f} s"
            )
        bare.close()
    med = statistics.median

    def paired(a: str, b: str, pick: Callable[[Epochs], float]) -> float:
        """The median over rounds of a round's ratio: drifts of the machine between rounds cancel."""
        return med(pick(x) / pick(y) for x, y in zip(runs[a], runs[b]))

    for kind, es in runs.items():
        out[kind] = {
            "epoch1": med(e.rates[0] for e in es),
            "later": med(x for e in es for x in e.rates[1:]),
            "trainer_cpu_ms_per_batch": med(x for e in es for x in e.cpu_ms[1:]),
            "minor_faults_per_batch": med(x for e in es for x in e.faults[1:]),
            "epoch1_minor_faults_per_batch": med(e.faults[0] for e in es),
            "runs": [e.rates for e in es],
        }
    out["first_batch_s"] = {k: med(v) for k, v in first.items()}
    out["new_pass_over_in_process"] = med(a / b for a, b in zip(first["new_pass"], first["in_process"]))
    out["paths"] = paths
    out["first_batch_runs"] = first
    epoch1, later = (lambda e: e.rates[0]), (lambda e: med(e.rates[1:]))
    out["epoch1_ratio"] = paired("torchfeed", "torch", epoch1)
    out["later_ratio"] = paired("torchfeed", "torch", later)
    out["cached_epoch1_over_uncached"] = paired("cached", "torchfeed", epoch1)
    later_rates = [later(e) for e in runs["torch"]], [later(e) for e in runs["torchfeed"]]
    out["ceiling"] = {
        "epoch": med(ceiling["epoch"]),
        "torch_later_over_ceiling": med(t / c for t, c in zip(later_rates[0], ceiling["epoch"])),
        "torchfeed_later_over_ceiling": med(t / c for t, c in zip(later_rates[1], ceiling["epoch"])),
        "cached_over_epoch": med(a / b for a, b in zip(ceiling["cached"], ceiling["epoch"])),
        "parts_over_in_process": med(a / b for a, b in zip(ceiling["parts"], first["in_process"])),
        "runs": ceiling,
    }
    out["ratios_of_medians"] = {
        "epoch1": out["torchfeed"]["epoch1"] / out["torch"]["epoch1"],
        "later": out["torchfeed"]["later"] / out["torch"]["later"],
        "cached_epoch1": out["cached"]["epoch1"] / out["torchfeed"]["epoch1"],
    }
    return out


def _side(kind: str, root: str, epochs: int) -> Epochs:
    """One round of one side, from a cold start: ``torch``, ``torchfeed`` or ``cached``."""
    import torchfeed
    from torchfeed import LocalWorkers, RemoteDataLoader, RemoteDataset

    if kind == "torch":  # workers forked inside epoch 1
        start = time.perf_counter()
        loader: Any = DataLoader(
            JpegPipeline(root), batch_size=BATCH, shuffle=True, num_workers=WORKERS, persistent_workers=True
        )
        e = Epochs(loader, children)
        e.passes(start, epochs)
        del loader, e.loader  # its persistent workers end with its iterator
        return e
    # fresh workers, the dataset built inside the clock
    with LocalWorkers(WORKERS, cache_size="1GiB") as w:
        pids = [p.pid for p in w.processes]
        start = time.perf_counter()
        factory: Any = JpegPipeline if kind == "torchfeed" else torchfeed.cached(JpegDecoded, then=crop_flip)
        ours: Any = RemoteDataLoader(
            RemoteDataset(w.addresses, factory, root), batch_size=BATCH, shuffle=True
        )
        e = Epochs(ours, pids.copy)
        e.passes(start, epochs)
        return e


def iter_summary(result: dict[str, Any]) -> Iterator[str]:
    """Lines for a person: the ratios and what they are measured against."""
    fb = result["first_batch_s"]
    rm = result["ratios_of_medians"]
    yield "ratios: the median of the rounds' ratios (in brackets: the ratio of the median rates)"
    ceil = result["ceiling"]
    yield f"epoch 1: torchfeed {result['epoch1_ratio']:.2f}x ({rm['epoch1']:.2f}x) torch's DataLoader (target >= 1.1)"
    yield f"later epochs: {result['later_ratio']:.2f}x ({rm['later']:.2f}x) torch (target >= 1.2)"
    yield (
        f"ceiling: 2 bare processes build {ceil['epoch']:.0f} samples/s; later epochs reach "
        f"{ceil['torch_later_over_ceiling']:.2f} of it with torch, {ceil['torchfeed_later_over_ceiling']:.2f} "
        "with torchfeed"
    )
    yield (
        f"cached epoch 1: {result['cached_epoch1_over_uncached']:.2f}x ({rm['cached_epoch1']:.2f}x) "
        f"the uncached epoch 1 (target >= 0.9; bare processes keeping the images: {ceil['cached_over_epoch']:.2f}x)"
    )
    yield f"first batch: {fb['local_workers']:.2f} s from entering LocalWorkers(2) (target <= 1)"
    yield f"first batch: {fb['running_workers']:.3f} s on running workers (target <= 0.25); torch {fb['torch']:.3f} s"
    yield (
        f"first batch of a new pass on warm workers: {fb['new_pass']:.3f} s, {result['new_pass_over_in_process']:.2f}x "
        f"building it in-process ({fb['in_process']:.3f} s; target <= 0.6x; 2 bare processes: "
        f"{ceil['parts_over_in_process']:.2f}x)"
    )
    yield f"torchfeed reached its workers by: {result['paths']}"
    for side in ("torch", "torchfeed"):
        s = result[side]
        yield (
            f"{side}: trainer CPU {s['trainer_cpu_ms_per_batch']:.2f} ms/batch, minor faults "
            f"{s['minor_faults_per_batch']:.0f}/batch (epoch 1: {s['epoch1_minor_faults_per_batch']:.0f})"
        )
