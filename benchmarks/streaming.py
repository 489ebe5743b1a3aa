"""Streaming (IterableDataset) benchmarks: torchfeed against torch's DataLoader in the same run.

Two cases, both on worker processes of this machine (loopback):

* ``jpeg``: an IterableDataset that reads JPEG records from local tar shards (each
  stream takes every K-th shard, torch's usual pattern), decodes them with Pillow and
  crops 224x224; 2 torchfeed workers against ``DataLoader(num_workers=2)``; samples/s
  over whole epochs, alternating the two loaders.
* ``straggler``: :class:`torchfeed.datasets.Shards` of small text shards, sleep-bound
  samples, 4 streams on 4 workers, one worker 4x slower; samples/s over whole epochs as
  a fraction of the ideal rate: 3 fast workers + 1/4 of one, at the rate the same
  loader reaches with 4 fast workers (so what is measured is the straggler's cost
  alone, not the sleep's overhead on a busy machine). torch's DataLoader with
  the same dataset (static split of the shards, worker 0 slow) is shown for reference.

Usage: ``python benchmarks/streaming.py [--case jpeg|straggler|all] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

import torchfeed
from torchfeed.datasets import Shards, lines


# --------------------------------------------------------------------------- jpeg
def make_jpeg_shards(root: str, shards: int, per_shard: int, size: int = 256) -> list[str]:
    from PIL import Image

    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:size, 0:size]
    urls = []
    for s in range(shards):
        url = os.path.join(root, f"images-{s:04d}.tar")
        with tarfile.open(url, "w") as tar:
            for k in range(per_shard):
                base = (np.stack([xx, yy, (xx + yy) // 2], -1) * (1 + k % 3)) % 256
                pixels = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
                out = io.BytesIO()
                Image.fromarray(pixels).save(out, format="JPEG", quality=90)
                for name, data in (
                    (f"{s:04d}{k:05d}.jpg", out.getvalue()),
                    (f"{s:04d}{k:05d}.cls", b"%d" % (k % 10)),
                ):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        urls.append(url)
    return urls


class JpegTarStream(IterableDataset):
    """JPEG records from tar shards; stream i of K reads every K-th shard."""

    def __init__(self, urls: list[str], crop: int = 224):
        self.urls = list(urls)
        self.crop = crop

    def __iter__(self):
        from PIL import Image

        info = get_worker_info()
        wid, count = (info.id, info.num_workers) if info is not None else (0, 1)
        for url in self.urls[wid::count]:
            with tarfile.open(url, "r") as tar:
                image = None
                for member in tar:
                    member_file = tar.extractfile(member)
                    assert member_file is not None, member.name  # the shards hold regular files
                    data = member_file.read()
                    if member.name.endswith(".jpg"):
                        image = Image.open(io.BytesIO(data)).convert("RGB")
                        continue
                    label = int(data)
                    assert image is not None, f"{url}: a label before its image"
                    left = (image.width - self.crop) // 2
                    top = (image.height - self.crop) // 2
                    pixels = np.asarray(image.crop((left, top, left + self.crop, top + self.crop)))
                    yield torch.from_numpy(pixels.copy()).permute(2, 0, 1), label


def _epoch_rate(loader) -> float:
    start, n = time.perf_counter(), 0
    for batch in loader:
        n += len(batch[0]) if isinstance(batch, (list, tuple)) else len(batch)
    return n / (time.perf_counter() - start)


def _take_turns(loaders: dict[str, Any], repeats: int) -> dict[str, list[float]]:
    """Samples/s of whole epochs, by loader name: a warm-up epoch of each loader (start-up,
    caches), then ``repeats`` rounds in which the loaders take turns in the order given."""
    for loader in loaders.values():
        _epoch_rate(loader)
    rates: dict[str, list[float]] = {name: [] for name in sorted(loaders)}
    for _ in range(repeats):
        for name, loader in loaders.items():
            rates[name].append(_epoch_rate(loader))
    return rates


def _compare(case: str, samples: int, loaders: dict[str, Any], repeats: int) -> dict:
    """A case's result: every run of each loader (:func:`_take_turns`) and each one's best."""
    rates = _take_turns(loaders, repeats)
    return {"case": case, "samples": samples, "rates": rates, "best": {k: max(v) for k, v in rates.items()}}


def case_jpeg(repeats: int, shards: int = 16, per_shard: int = 96, batch: int = 32) -> dict:
    with tempfile.TemporaryDirectory() as root, torchfeed.LocalWorkers(2) as workers:
        urls = make_jpeg_shards(root, shards, per_shard)
        theirs = DataLoader(JpegTarStream(urls), batch_size=batch, num_workers=2, persistent_workers=True)
        ours = torchfeed.RemoteDataLoader(
            torchfeed.RemoteDataset(workers.addresses, JpegTarStream, urls), batch_size=batch
        )
        result = _compare("jpeg", shards * per_shard, {"torch": theirs, "torchfeed": ours}, repeats)
        del theirs
    best = result["best"]
    return {**result, "ratio": best["torchfeed"] / best["torch"]}


# --------------------------------------------------------------------------- straggler
class SleepyLines:
    """Lines of a text shard; every line sleeps ``seconds`` (times ``factor`` on the slow process)."""

    def __init__(self, seconds: float, slow_pid: int = -1, slow_worker_id: int = -1, factor: float = 1.0):
        self.seconds = seconds
        self.slow_pid = slow_pid
        self.slow_worker_id = slow_worker_id
        self.factor = factor

    def _delay(self) -> float:
        info = get_worker_info()
        slow = os.getpid() == self.slow_pid or (
            info is not None and info.id == self.slow_worker_id and self.slow_pid == -1
        )
        return self.seconds * (self.factor if slow else 1.0)

    def __call__(self, url):
        delay = self._delay()
        for line in lines(url):
            time.sleep(delay)
            yield int(line)


def _single_rate(url: str, seconds: float) -> float:
    reader = SleepyLines(seconds)
    start, n = time.perf_counter(), 0
    for _ in range(3):
        for _ in reader(url):
            n += 1
    return n / (time.perf_counter() - start)


# The straggler case's setting, read by the case and by the line that reports it: SHARDS text
# shards of PER_SHARD lines; reading a line sleeps SECONDS, SLOWDOWN times longer on worker 0
# (of WORKERS); batches of BATCH lines.
SHARDS, PER_SHARD, SECONDS, SLOWDOWN, WORKERS, BATCH = 320, 10, 0.002, 4.0, 4, 10


def case_straggler(repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as root, torchfeed.LocalWorkers(WORKERS) as workers:
        urls = []
        for s in range(SHARDS):
            url = os.path.join(root, f"part-{s:04d}.txt")
            with open(url, "w") as f:
                f.write("".join(f"{s * PER_SHARD + k}\n" for k in range(PER_SHARD)))
            urls.append(url)
        single = _single_rate(urls[0], SECONDS)
        slow_pid = workers.processes[0].pid
        even = torchfeed.RemoteDataLoader(
            torchfeed.RemoteDataset(workers.addresses, Shards, urls, SleepyLines(SECONDS)),
            batch_size=BATCH,
            num_workers=WORKERS,
        )
        # the ideal: the fast workers and 1 / SLOWDOWN of the slow one, at the rate all reach when fast
        all_fast = max(_take_turns({"even": even}, repeats)["even"])
        ideal = all_fast / WORKERS * (WORKERS - 1 + 1 / SLOWDOWN)
        ours = torchfeed.RemoteDataLoader(
            torchfeed.RemoteDataset(
                workers.addresses, Shards, urls, SleepyLines(SECONDS, slow_pid, factor=SLOWDOWN)
            ),
            batch_size=BATCH,
            num_workers=WORKERS,
        )
        theirs = DataLoader(
            Shards(urls, SleepyLines(SECONDS, slow_worker_id=0, factor=SLOWDOWN)),
            batch_size=BATCH,
            num_workers=WORKERS,
            persistent_workers=True,
        )
        result = _compare("straggler", SHARDS * PER_SHARD, {"torchfeed": ours, "torch": theirs}, repeats)
        del theirs
    return {
        **result,
        "single": single,
        "all_fast": all_fast,
        "nominal": (WORKERS - 1 + 1 / SLOWDOWN) / SECONDS,
        "ideal": ideal,
        "fraction": {k: v / ideal for k, v in result["best"].items()},
    }


def _runs(r: dict) -> str:
    return f"runs { ({k: [round(x) for x in v] for k, v in r['rates'].items()}) }"


def describe_jpeg(r: dict) -> str:
    return (
        f"jpeg: {r['samples']} samples/epoch, batch 32, 2 workers: torch {r['best']['torch']:.0f} samples/s, "
        f"torchfeed {r['best']['torchfeed']:.0f} samples/s, ratio {r['ratio']:.2f}x (target >= 1.0x); "
        + _runs(r)
    )


def describe_straggler(r: dict) -> str:
    f = r["fraction"]
    return (
        f"straggler: Shards, {WORKERS} streams on {WORKERS} workers, one {SLOWDOWN:g}x slower, "
        f"ideal {r['ideal']:.0f} samples/s "
        f"(4 fast workers reach {r['all_fast']:.0f}; nominal ideal from the sleep alone {r['nominal']:.0f}; "
        f"one fast reader in-process {r['single']:.0f}): torchfeed {r['best']['torchfeed']:.0f} samples/s = {f['torchfeed']:.0%} "
        f"of ideal (target >= 90%); torch {r['best']['torch']:.0f} = {f['torch']:.0%}; " + _runs(r)
    )


# case name -> (its function of the number of repeats, the line that reports its result)
CASES: dict[str, tuple[Callable[[int], dict], Callable[[dict], str]]] = {
    "jpeg": (case_jpeg, describe_jpeg),
    "straggler": (case_straggler, describe_straggler),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=[*CASES, "all"], default="all")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for name, (run, describe) in CASES.items():
        if args.case in (name, "all"):
            print(describe(run(args.repeats)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
