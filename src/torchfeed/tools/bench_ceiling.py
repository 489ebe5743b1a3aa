"""What no loader with the same worker count can beat: the work itself, in bare processes.

:class:`Bare` forks as many processes as the loaders have workers (from the benchmark's
process, so they are warm: imports done, files in the page cache) and has them build the
batches a loader would, keeping nothing and sending nothing back: no sampler thread, no
transfer, no trainer. The time they take for a share of the work is a ceiling on this
machine: a loader that reaches it has no overhead left to cut, and a target above it
needs more CPU, not a better loader. Three shares are timed (:meth:`Bare.run`):

* ``epoch``: every sample of a pass, in equal shares (no loader balances better), in batches;
* ``cached``: the same, keeping every decoded image and handing a copy of it to the random
  part (what a cached epoch 1 must do at least: each kept image is new memory);
* ``parts``: one batch cut into one part per process (what a split first batch must wait for).

Used by :mod:`torchfeed.tools.bench_jpeg`.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable, Sequence
from typing import Any

from torch.utils.data import default_collate

WAIT = 120.0  # seconds a share may take before the benchmark gives up


def _serve(make: Callable[[], Any], split: Callable[[Any], tuple[Any, Callable]], conn) -> None:
    """A bare process: build what each message names, answer when done."""
    import torch

    from ..loader.cache import copy_for_then

    torch.set_num_threads(1)  # as torch's and torchfeed's workers run
    dataset = make()
    decode, then = split(dataset)
    while True:
        job = conn.recv()
        if job is None:
            return
        mode, batches = job
        kept: dict[int, Any] = {}
        try:
            for keys in batches:
                if mode == "cached":
                    samples = []
                    for k in keys:
                        kept[k] = decode(k)
                        samples.append(then(copy_for_then(kept[k])))
                    default_collate(samples)
                else:
                    default_collate([dataset[k] for k in keys])
        except Exception as exc:  # noqa: BLE001 - reported to the benchmark, which stops
            conn.send(("failed", repr(exc)))
            continue
        conn.send(("built", sum(map(len, batches))))


class Bare:
    """``processes`` forked processes holding ``make()``; ``split(dataset)`` gives the
    ``(decode, then)`` pair a cached share uses (``decode(key)`` is the part a cache keeps)."""

    def __init__(self, processes: int, make: Callable[[], Any], split: Callable[[Any], tuple[Any, Callable]]):
        ctx = multiprocessing.get_context("fork")
        self._pipes = [ctx.Pipe() for _ in range(processes)]
        self._procs = [
            ctx.Process(target=_serve, args=(make, split, child), daemon=True) for _, child in self._pipes
        ]
        for p in self._procs:
            p.start()

    @property
    def processes(self) -> list:
        """The bare processes (``multiprocessing.Process``)."""
        return list(self._procs)

    def run(self, mode: str, batches: Sequence[Sequence[int]]) -> float:
        """Seconds for the processes to build ``batches``: their samples in equal shares for
        ``epoch`` and ``cached``; for ``parts``, one batch cut into one part per process."""
        n = len(self._pipes)
        keys = [k for b in batches for k in b]
        size = -(-len(keys) // n)
        cuts = [keys[i * size : (i + 1) * size] for i in range(n)]
        if mode == "parts" and len(batches) == 1:
            shares = [("epoch", [cut]) for cut in cuts]
        elif mode in ("epoch", "cached"):
            step = len(batches[0])
            shares = [(mode, [cut[i : i + step] for i in range(0, len(cut), step)]) for cut in cuts]
        else:
            raise ValueError(
                f"unknown share {mode!r} of {len(batches)} batch(es): epoch, cached or parts of one"
            )
        start = time.perf_counter()
        for (parent, _), share in zip(self._pipes, shares):
            parent.send(share)
        built = 0
        for parent, _ in self._pipes:
            if not parent.poll(WAIT):
                raise TimeoutError(f"a bare process took more than {WAIT:g} s for its share")
            outcome, value = parent.recv()
            if outcome == "failed":
                raise RuntimeError(f"a bare process failed to build its share: {value}")
            built += value
        elapsed = time.perf_counter() - start
        if built != len(keys):
            raise RuntimeError(f"the bare processes built {built} of {len(keys)} samples")
        return elapsed

    def close(self) -> None:
        for parent, _ in self._pipes:
            try:
                parent.send(None)
            except OSError:
                pass
        for p in self._procs:
            p.join(WAIT)
            if p.is_alive():
                p.kill()
                p.join()
        for parent, child in self._pipes:
            parent.close()
            child.close()

    def __enter__(self) -> Bare:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
