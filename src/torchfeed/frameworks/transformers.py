"""The HF Trainer with remote loaders: :class:`RemoteTrainer`.

``RemoteTrainer`` is ``transformers.Trainer`` for datasets that are
:class:`~torchfeed.RemoteDataset`\\ s: the Trainer builds and prepares its loaders exactly as it
does for any dataset (its sampler, batch size, collator with unused columns removed,
``worker_init_fn``, Accelerate's shards), then a :class:`~torchfeed.RemoteDataLoader` with
those arguments takes the place of the torch loader inside Accelerate's ``DataLoaderShard``
(:func:`torchfeed.frameworks.accelerate.remote_shard`). Other datasets get the Trainer's
own loaders.

Resume: the Trainer skips a resumed epoch's first batches by rebuilding a torch loader
(``skip_first_batches``). ``RemoteTrainer`` saves the training loader's state at every
checkpoint instead (``OUTPUT_DIR/torchfeed-loader/step-<global step>-rank<process>.pt``) and
loads it when training resumes, so the resumed epoch continues with exactly the batches not
yet delivered (and the Trainer's ``ignore_data_skip`` is set, so it does not skip them again).
With ``ignore_data_skip=True`` given by the user, the resumed epoch starts again, as with the
plain Trainer.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from ..loader.views import Source
from .accelerate import remote_shard


def _remote(dataset: Any) -> bool:
    try:
        Source(dataset)
    except TypeError:
        return False
    return True


class RemoteTrainer(Trainer):
    """``transformers.Trainer`` whose loaders over RemoteDatasets load remotely.

    Takes the Trainer's arguments, plus ``loader_options``: RemoteDataLoader's own arguments
    (``seed=``, ``per_sample_seeding=``, ``straggler_factor=``, ...) for every remote loader.
    """

    def __init__(self, *args: Any, loader_options: dict[str, Any] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.loader_options = dict(loader_options or {})
        self.resume_loader_state = not self.args.ignore_data_skip
        self.args.ignore_data_skip = True  # the loader's state resumes the epoch, no rebuilt loader skips
        self.add_callback(LoaderState(self))

    def _get_dataloader(self, dataset: Any, *args: Any, **kwargs: Any) -> Any:
        prepared = super()._get_dataloader(dataset, *args, **kwargs)
        if not _remote(dataset):
            return prepared
        return remote_shard(prepared, **self.loader_options)


class LoaderState(TrainerCallback):
    """Saves the training loader's state at each checkpoint and loads it when training resumes."""

    def __init__(self, trainer: RemoteTrainer):
        self.trainer = trainer

    def _path(self, args: Any, step: int) -> str:
        return os.path.join(args.output_dir, "torchfeed-loader", f"step-{step}-rank{args.process_index}.pt")

    def on_save(
        self, args: Any, state: Any, control: Any, train_dataloader: Any = None, **kwargs: Any
    ) -> None:
        if not self.trainer.resume_loader_state or not callable(
            getattr(train_dataloader, "state_dict", None)
        ):
            return
        path = self._path(args, state.global_step)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(train_dataloader.state_dict(), path + ".tmp")
        os.replace(path + ".tmp", path)

    def on_train_begin(
        self, args: Any, state: Any, control: Any, train_dataloader: Any = None, **kwargs: Any
    ) -> None:
        if not self.trainer.resume_loader_state or state.global_step == 0:
            return
        path = self._path(args, state.global_step)
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"resuming at step {state.global_step} needs the loader state {path} (saved with each "
                "checkpoint by RemoteTrainer); without it the epoch's first batches would be repeated. "
                "Pass ignore_data_skip=True in TrainingArguments to restart the epoch instead"
            )
        train_dataloader.load_state_dict(torch.load(path, weights_only=True))
