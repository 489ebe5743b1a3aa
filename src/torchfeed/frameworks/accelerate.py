"""Accelerate: a RemoteDataLoader prepared exactly as Accelerate prepares a DataLoader.

``accelerator.prepare(loader)`` builds a new torch ``DataLoader`` over ``loader.dataset`` with
its own batch sampler (``BatchSamplerShard``: each process's batches, padded with the first
ones when ``even_batches``). :func:`prepare` lets Accelerate make every one of those
decisions with its own code (``Accelerator.prepare_data_loader``: sharding, seedable
samplers, the synchronized generator, device placement, the end-of-loader gradient sync)
and then puts a :class:`~torchfeed.RemoteDataLoader` over Accelerate's batch sampler in the
place of the torch loader inside Accelerate's ``DataLoaderShard``. The torch loader it built
is never iterated.

The prepared loader reports its state to ``accelerator.save_state``/``load_state`` (as a
torchdata ``StatefulDataLoader`` does) and to ``register_for_checkpointing``, so a mid-epoch
resume continues with exactly the batches that had not been delivered. Accelerate's
``skip_first_batches`` would rebuild a torch loader: resume through the loader's state instead.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DistributedSampler, IterableDataset

from ..loader import resume
from ..loader.dataloader import RemoteDataLoader

# the constructor arguments a prepared loader keeps (every one is a public attribute)
_KEPT = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
    "seed",
    "audit",
    "per_sample_seeding",
    "max_retries",
    "straggler_factor",
    "straggler_min_seconds",
    "safe_globals",
    "compression",
)


def prepare(accelerator: Any, *objects: Any, device_placement: list[bool] | None = None) -> Any:
    """``accelerator.prepare(*objects)``, with every :class:`~torchfeed.RemoteDataLoader` among
    them prepared by :func:`prepare_loader`. Returns what ``accelerator.prepare`` returns: the
    objects in the same order (one object alone, else a tuple).

    Example: ``model, optimizer, loader = torchfeed.frameworks.accelerate.prepare(accelerator,
    model, optimizer, loader)``.
    """
    if device_placement is not None and len(device_placement) != len(objects):
        raise ValueError(
            f"device_placement has {len(device_placement)} entries for {len(objects)} objects: give one per object"
        )
    places: list[bool | None] = (
        list(device_placement) if device_placement is not None else [None] * len(objects)
    )
    others = [i for i, obj in enumerate(objects) if not isinstance(obj, RemoteDataLoader)]
    done: dict[int, Any] = {}
    if others:
        kwargs = {} if device_placement is None else {"device_placement": [places[i] for i in others]}
        prepared = accelerator.prepare(*(objects[i] for i in others), **kwargs)
        done.update(zip(others, prepared if len(others) > 1 else (prepared,)))
    for i, obj in enumerate(objects):
        if i not in done:
            done[i] = prepare_loader(accelerator, obj, device_placement=places[i])
    result = tuple(done[i] for i in range(len(objects)))
    return result[0] if len(result) == 1 else result


def prepare_loader(accelerator: Any, loader: RemoteDataLoader, device_placement: bool | None = None) -> Any:
    """Prepare one map-style :class:`~torchfeed.RemoteDataLoader` as
    ``accelerator.prepare_data_loader`` prepares a ``DataLoader``; returns Accelerate's
    ``DataLoaderShard`` whose batches come from a RemoteDataLoader over Accelerate's batch
    sampler (this process's share)."""
    if not isinstance(loader, RemoteDataLoader):
        raise TypeError(
            f"expected a RemoteDataLoader, got {type(loader).__name__}: use accelerator.prepare for it"
        )
    check_unsharded(loader, accelerator.num_processes)
    shard = accelerator.prepare_data_loader(loader, device_placement=device_placement)
    if shard.base_dataloader.dataset is not loader.dataset:
        raise TypeError(_WRAPPED)
    return remote_shard(shard, **{name: getattr(loader, name) for name in _KEPT})


_WRAPPED = (
    "Accelerate shards this loader by wrapping its dataset (an iterable-style dataset), which "
    "would load it in the trainer: give each process its own RemoteDataLoader (with "
    "rank_streams=True) and do not prepare it"
)


def check_unsharded(loader: Any, processes: int) -> None:
    """Refuse a loader whose sampler already shards the data among ranks when Accelerate will
    shard its batches among ``processes`` again (each process would train on a fraction of its
    share, silently). Accelerate does so whatever the sampler is, for torch's loaders too."""
    for sampler in (loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
        if isinstance(sampler, DistributedSampler) and sampler.num_replicas > 1 and processes > 1:
            raise ValueError(
                f"this loader's {type(sampler).__name__} already gives each of {sampler.num_replicas} "
                f"ranks its share, and Accelerate shards the batches among its {processes} processes "
                "again: each process would see 1/"
                f"{sampler.num_replicas * processes} of the data. Either drop the sampler (pass "
                "shuffle=True) and let prepare() shard the loader, or keep the sampler and do not "
                "prepare the loader (iterate it directly)"
            )


# what a torch DataLoader holds of its arguments (public attributes), kept by remote_shard
_TORCH_KEPT = _KEPT[: _KEPT.index("seed")]


def remote_shard(shard: Any, **options: Any) -> Any:
    """Put a :class:`~torchfeed.RemoteDataLoader` in the place of the torch ``DataLoader`` that
    Accelerate's ``DataLoaderShard`` wraps (built over a RemoteDataset, never iterated): same
    dataset and batch sampler (Accelerate's shard), the torch loader's arguments, and
    ``options`` (RemoteDataLoader's own: ``seed=``, ...) over them. Returns ``shard``."""
    local = shard.base_dataloader
    if local.batch_sampler is None or isinstance(local.dataset, IterableDataset):
        raise TypeError(_WRAPPED)
    if not isinstance(local, RemoteDataLoader):
        options = {**{name: getattr(local, name) for name in _TORCH_KEPT}, **options}
    remote: RemoteDataLoader = RemoteDataLoader(local.dataset, batch_sampler=local.batch_sampler, **options)
    shard.base_dataloader = remote
    shard.dl_state_dict = remote.state_dict()
    # save_state/load_state then keep the loader's state, as for a torchdata StatefulDataLoader
    shard.use_stateful_dataloader = True
    shard.state_dict = ShardState(shard, remote)
    return shard


class ShardState:
    """The prepared loader's ``state_dict``: Accelerate's own (``dl_state_dict``, taken before
    the batch in the user's hands was yielded, counting it as used), except when a state is
    taken while an exception unwinds with a batch in the user's hands: then that batch may not have been trained on, and the state leaves it out (a resume loads
    it again). Accelerate reads one batch ahead, so the loader has then handed out one more
    than the user has, unless the epoch ended with the batch in hand."""

    def __init__(self, shard: Any, loader: RemoteDataLoader):
        self._shard = shard
        self._loader = loader

    def __call__(self) -> dict:
        shard = self._shard
        captured: dict = shard.dl_state_dict
        # Accelerate lists a loader from the start of its iteration until the user came back
        # after its last batch
        iterating = any(ref is shard for ref in shard.gradient_state.dataloader_references)
        if not iterating or not resume.interrupted():
            return captured
        ahead = 1 if captured.get("active") else 0  # the epoch ended: nothing was read ahead
        return self._loader.state_dict(leave_out=1 + ahead)
