"""torch's DataLoader argument checks, with torch's messages, for RemoteDataLoader.

Conflicting arguments raise what torch's DataLoader raises, in torch's order, so code
written against torch behaves the same (tests/test_loader_args.py compares them).
"""

from __future__ import annotations


def workers_args(num_workers, timeout, prefetch_factor, persistent_workers) -> None:
    """torch's checks, in torch's order; an omitted num_workers means: the remote workers."""
    if num_workers is not None and num_workers < 0:
        raise ValueError(
            "num_workers option should be non-negative; use num_workers=0 to disable multiprocessing."
        )
    if timeout < 0:
        raise ValueError("timeout option should be non-negative")
    if num_workers == 0 and prefetch_factor is not None:
        raise ValueError(
            "prefetch_factor option could only be specified in multiprocessing."
            "let num_workers > 0 to enable multiprocessing, otherwise set prefetch_factor to None."
        )
    if prefetch_factor is not None and prefetch_factor < 0:
        raise ValueError("prefetch_factor option should be non-negative")
    if persistent_workers and num_workers == 0:
        raise ValueError("persistent_workers option needs num_workers > 0")


def iterable_args(shuffle, sampler, batch_sampler) -> None:
    if shuffle not in {False, None}:
        raise ValueError(
            f"DataLoader with IterableDataset: expected unspecified shuffle option, but got shuffle={shuffle}"
        )
    if sampler is not None:
        raise ValueError(
            f"DataLoader with IterableDataset: expected unspecified sampler option, but got sampler={sampler}"
        )
    if batch_sampler is not None:
        raise ValueError(
            "DataLoader with IterableDataset: expected unspecified batch_sampler option, but got "
            f"batch_sampler={batch_sampler}"
        )
