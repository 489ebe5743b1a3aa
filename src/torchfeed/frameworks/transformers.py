"""The HF Trainer with remote loaders: :class:`RemoteTrainer`.

``RemoteTrainer`` is ``transformers.Trainer`` for datasets that are
:class:`~torchfeed.RemoteDataset`\\ s: the Trainer builds and prepares its loaders exactly as it
does for any dataset (its sampler, batch size, collator with unused columns removed,
``worker_init_fn``, Accelerate's shards), then a :class:`~torchfeed.RemoteDataLoader` with
those arguments takes the place of the torch loader inside Accelerate's ``DataLoaderShard``
(:func:`torchfeed.frameworks.accelerate.remote_shard`). Other datasets get the Trainer's
own loaders.

Resume: to skip a resumed epoch's first batches the Trainer rebuilds a torch loader
(``skip_first_batches``), which would load the remote dataset in the trainer. ``RemoteTrainer``
saves the training loader's state into every checkpoint folder
(``torchfeed_loader_rank<process>.pt``, rotated with it) and, where the Trainer skips, loads
that state instead: the Trainer keeps its own step counting, gradient accumulation and RNG
restoring, and the epoch continues with exactly the batches not yet trained on.
``ignore_data_skip=True`` restarts the epoch, as with the plain Trainer.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import transformers.trainer as hf_trainer
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..loader.dataloader import RemoteDataLoader
from ..loader.views import Source
from .accelerate import remote_shard

STATE_FILE = "torchfeed_loader_rank{}.pt"


def _remote(dataset: Any) -> bool:
    try:
        Source(dataset)
    except TypeError:
        return False
    return True


def _is_remote_loader(loader: Any) -> bool:
    return isinstance(getattr(loader, "base_dataloader", None), RemoteDataLoader)


class RemoteTrainer(Trainer):
    """``transformers.Trainer`` whose loaders over RemoteDatasets load remotely.

    Takes the Trainer's arguments, plus ``loader_options``: RemoteDataLoader's own arguments
    (``seed=``, ``per_sample_seeding=``, ``straggler_factor=``, ...) for every remote loader.
    """

    def __init__(self, *args: Any, loader_options: dict[str, Any] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.loader_options = dict(loader_options or {})
        self.add_callback(LoaderState())

    def _get_dataloader(self, dataset: Any, *args: Any, **kwargs: Any) -> Any:
        prepared = super()._get_dataloader(dataset, *args, **kwargs)
        if not _remote(dataset):
            return prepared
        return remote_shard(prepared, **self.loader_options)

    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        # The Trainer skips a resumed epoch's first batches with the module's
        # skip_first_batches (Accelerate's, which rebuilds a torch loader): for a remote
        # loader, that skip loads the loader's state instead, for this call only.
        checkpoint = kwargs.get("resume_from_checkpoint")
        rank = self.args.process_index
        original = hf_trainer.skip_first_batches

        def skip(dataloader: Any, num_batches: int = 0) -> Any:
            if not _is_remote_loader(dataloader):
                return original(dataloader, num_batches)
            return _resume(dataloader, checkpoint, rank, num_batches)

        hf_trainer.skip_first_batches = skip
        try:
            return super()._run_epoch(*args, **kwargs)
        finally:
            hf_trainer.skip_first_batches = original


def _resume(loader: Any, checkpoint: str | None, rank: int, num_batches: int) -> Any:
    """``loader`` continued after its first ``num_batches`` batches, from the checkpoint's state."""
    path = os.path.join(checkpoint or "", STATE_FILE.format(rank))
    if checkpoint is None or not os.path.exists(path):
        raise FileNotFoundError(
            f"resuming {num_batches} batches into an epoch needs the loader state {path} (RemoteTrainer "
            "saves it into every checkpoint); without it the epoch's first batches would be loaded again. "
            "Pass ignore_data_skip=True in TrainingArguments to restart the epoch instead"
        )
    state = torch.load(path, weights_only=True)
    if state.get("batches") != num_batches:
        raise ValueError(
            f"the loader state in {path} is {state.get('batches')} batches into its epoch, the Trainer resumes "
            f"{num_batches} batches in: was the checkpoint taken with another batch size or number of processes?"
        )
    loader.load_state_dict(state)
    return loader


class LoaderState(TrainerCallback):
    """Saves the training loader's state into each checkpoint folder (every process its own)."""

    def on_save(
        self, args: Any, state: Any, control: Any, train_dataloader: Any = None, **kwargs: Any
    ) -> None:
        if not _is_remote_loader(train_dataloader):
            return
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, STATE_FILE.format(args.process_index))
        torch.save(train_dataloader.state_dict(), path + ".tmp")
        os.replace(path + ".tmp", path)
