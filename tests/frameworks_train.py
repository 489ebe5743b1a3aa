"""One rank of a 2-rank torchrun job for tests/test_frameworks.py.

``python -m torch.distributed.run --nproc_per_node 2 frameworks_train.py FRAMEWORKS OUT_DIR``
runs, for each of the comma-separated FRAMEWORKS (torchrun, lightning, fabric, accelerate, hf)
in turn, the same training with torch's DataLoader and with RemoteDataLoader (workers from
``TORCHFEED_TEST_WORKERS``), and writes what this rank saw (sample indices per batch, per epoch;
random draws; gradient syncs) to ``OUT_DIR/{framework}.rank{RANK}.json``. Samples name their
index, so the test compares shards, order, step counts and resumed batches with torch's.

One job runs them all (starting a rank, importing the frameworks, costs more than a run): the
process group is made once, here, and every framework finds it made, as under any launcher
that initialises it first; each framework keeps its checkpoints in its own folder.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info
from torch.utils.data import DistributedSampler as TorchDistributedSampler

import torchfeed
import torchfeed.audit

N = 45  # 2 ranks: torch pads to 46, 23 samples and 6 batches of 4 per rank
BATCH = 4
EPOCHS = 2


class Indexed(Dataset):
    """Sample i names i and draws one random number (a random augmentation)."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"index": torch.tensor(i), "noise": torch.rand(()), "x": torch.full((2,), float(i))}


class Stream(IterableDataset):
    """Iterable-style: splits the samples by worker id, as torch's documentation shows."""

    def share(self):
        info = get_worker_info()
        return (info.id, info.num_workers) if info is not None else (0, 1)

    def __iter__(self):
        k, n = self.share()
        for i in range(k, N, n):
            yield Indexed()[i]


class RankStream(Stream):
    """What a torch user writes for DDP: splits by rank too (a remote worker cannot ask for it)."""

    def share(self):
        k, n = super().share()
        return dist.get_rank() * n + k, dist.get_world_size() * n


def remote_dataset():
    return torchfeed.RemoteDataset(os.environ["TORCHFEED_TEST_WORKERS"].split(","), Indexed)


def indices(batch) -> list[int]:
    return batch["index"].tolist()


def noise(batch) -> list[float]:
    return [round(v, 6) for v in batch["noise"].tolist()]


# -- plain torchrun (DDP without a framework) ------------------------------------------------
def run_torchrun(out: dict) -> None:
    rds = remote_dataset()
    for name, make in (
        ("torch", lambda: DataLoader(Indexed(), BATCH, sampler=TorchDistributedSampler(Indexed(), seed=3))),
        (
            "remote",
            lambda: torchfeed.RemoteDataLoader(rds, BATCH, sampler=torchfeed.DistributedSampler(rds, seed=3)),
        ),
    ):
        loader = make()
        epochs = []
        for e in range(EPOCHS):
            if isinstance(loader, torchfeed.RemoteDataLoader):
                loader.set_epoch(e)
            else:
                assert isinstance(loader.sampler, TorchDistributedSampler)
                loader.sampler.set_epoch(e)
            epochs.append([indices(b) for b in loader])
        out[name] = epochs
    # no sampler: every rank loads everything, as torch, and a warning says so
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("torchfeed.loader").addHandler(handler)
    out["plain"] = [indices(b) for b in torchfeed.RemoteDataLoader(rds, BATCH)]
    out["plain_torch"] = [indices(b) for b in DataLoader(Indexed(), BATCH)]
    out["plain_warnings"] = [m for m in records if "every rank loads the whole dataset" in m]
    # a resume in epoch 1 after 3 batches, from the loader's state, in a new loader
    torch.manual_seed(0)  # base seeds come from the global generator (seed=None), as torch's
    full = torchfeed.RemoteDataLoader(rds, BATCH, sampler=torchfeed.DistributedSampler(rds, seed=3))
    seen = []
    for e in range(EPOCHS):
        full.set_epoch(e)
        seen.append([noise(b) for b in full])
    torch.manual_seed(0)
    first = torchfeed.RemoteDataLoader(rds, BATCH, sampler=torchfeed.DistributedSampler(rds, seed=3))
    list(first)
    first.set_epoch(1)
    it = iter(first)
    head = [noise(next(it)) for _ in range(3)]
    state = first.state_dict()
    resumed = torchfeed.RemoteDataLoader(rds, BATCH, sampler=torchfeed.DistributedSampler(rds, seed=3))
    torch.manual_seed(1)  # the resumed process's generator is another's
    resumed.load_state_dict(state)
    out["resume"] = {
        "expected": seen[1],
        "head": head,
        "tail": [noise(b) for b in resumed],
        "len_after_load": len(resumed),
        "len": len(full),
    }

    # two checkpoints in one epoch with an exactly-once sampler: 2 batches, save, resume in a new
    # loader, 2 more, save, resume again, to the end; every rank's indices gathered
    def elastic():
        return torchfeed.RemoteDataLoader(
            rds, BATCH, sampler=torchfeed.DistributedSampler(rds, seed=0, pad=False), seed=0, audit=True
        )

    mine: list[int] = []
    checkpoint: dict | None = None
    saved: list[dict] = []  # this rank's states, as a job keeps its checkpoints
    for stop in (2, 2, None):
        loader = elastic()
        if checkpoint is not None:
            loader.load_state_dict(checkpoint)
        it = iter(loader)
        for _ in range(stop) if stop is not None else iter(int, 1):
            batch = next(it, None)
            if batch is None:
                break
            mine += indices(batch)
        checkpoint = loader.state_dict()
        saved.append(checkpoint)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    out["two_resumes"] = sorted(i for rank in every for i in rank)
    # the audit proves it from every rank's saved states, gathered as a job would collect them
    states: list = [None] * dist.get_world_size()
    dist.all_gather_object(states, saved)
    report = torchfeed.audit.verify([s for rank in states for s in rank], N)
    out["audit"] = {"ok": report.ok, "segments": report.segments, "text": str(report)}
    # a broken chain is caught: rank 1's state at the end of the epoch left out
    partial = [s for r, rank in enumerate(states) for k, s in enumerate(rank) if (r, k) != (1, 2)]
    out["audit_partial"] = str(torchfeed.audit.verify(partial, N))


# -- Lightning --------------------------------------------------------------------------
def run_lightning(out: dict) -> None:
    import lightning as L

    class Model(L.LightningModule):
        def __init__(self, make_loader, make_val, seen):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)
            self.make_loader, self.make_val, self.seen = make_loader, make_val, seen

        def training_step(self, batch, batch_idx):
            self.seen["train"].append([self.current_epoch, batch_idx, indices(batch), noise(batch)])
            return self.layer(batch["x"]).sum()

        def validation_step(self, batch, batch_idx):
            self.seen["val"].append([self.current_epoch, indices(batch)])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            return self.make_loader()

        def val_dataloader(self):
            return self.make_val()

    def trainer(**kw):
        base = dict(
            accelerator="cpu",
            devices=2,
            strategy="ddp",
            max_epochs=EPOCHS,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        return L.Trainer(**{**base, **kw})

    rds = remote_dataset()
    makers = {
        "torch": (lambda: DataLoader(Indexed(), BATCH, shuffle=True), lambda: DataLoader(Indexed(), 5)),
        "remote": (
            lambda: torchfeed.RemoteDataLoader(rds, BATCH, shuffle=True),
            lambda: torchfeed.RemoteDataLoader(rds, 5),
        ),
    }
    for name, (make, make_val) in makers.items():
        L.seed_everything(7, workers=True)
        seen: dict = {"train": [], "val": []}
        trainer().fit(Model(make, make_val, seen))
        out[name] = seen
        seen = {"train": [], "val": []}
        trainer(max_epochs=1, overfit_batches=2).fit(Model(make, make_val, seen))
        out[name + "_overfit"] = seen
    # iterable-style: no sampler injected; each rank reads its own streams (rank_streams)
    for name, make in (
        ("torch_iterable", lambda: DataLoader(RankStream(), BATCH)),
        (
            "remote_iterable",
            lambda: torchfeed.RemoteDataLoader(
                torchfeed.RemoteDataset(os.environ["TORCHFEED_TEST_WORKERS"].split(","), Stream),
                BATCH,
                num_workers=1,
                rank_streams=True,
            ),
        ),
    ):
        seen = {"train": [], "val": []}
        trainer(max_epochs=1, limit_val_batches=0).fit(Model(make, makers["torch"][1], seen))
        out[name] = seen
    # torchfeed's DistributedSampler is kept by Lightning (a torch DistributedSampler to it)
    for name, make in (
        (
            "torch_sampler",
            lambda: DataLoader(Indexed(), BATCH, sampler=TorchDistributedSampler(Indexed(), seed=0)),
        ),
        (
            "remote_sampler",
            lambda: torchfeed.RemoteDataLoader(
                rds, BATCH, sampler=torchfeed.DistributedSampler(rds, seed=0), seed=0
            ),
        ),
    ):
        seen = {"train": [], "val": []}
        trainer(limit_val_batches=0).fit(Model(make, makers["torch"][1], seen))
        out[name] = seen
    run_lightning_interrupt(out, L, Model, trainer, rds, makers["remote"][1])
    # resume from a checkpoint taken inside epoch 1 (after its 2nd batch), in a new Trainer
    ckpt = os.path.join(os.environ["FRAMEWORKS_TMP"], "lightning.ckpt")

    class SaveAt(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.current_epoch == 1 and batch_idx == 1:
                trainer.save_checkpoint(ckpt)

    # with seed= every later epoch is exact too (without it, later base seeds come from the global
    # generator, which Lightning does not restore: as with torch's DataLoader)
    make = lambda: torchfeed.RemoteDataLoader(rds, BATCH, shuffle=True, seed=11)  # noqa: E731
    make_val = makers["remote"][1]
    L.seed_everything(7, workers=True)
    full: dict = {"train": [], "val": []}
    trainer(max_epochs=3, callbacks=[SaveAt()]).fit(Model(make, make_val, full))
    L.seed_everything(7, workers=True)  # as the job was started (Lightning seeds its sampler from it)
    tail: dict = {"train": [], "val": []}
    t = trainer(max_epochs=3)
    t.fit(Model(make, make_val, tail), ckpt_path=ckpt)
    out["resume"] = {"full": full["train"], "tail": tail["train"]}


def run_lightning_interrupt(out: dict, L, Model, trainer, rds, make_val) -> None:
    """Ctrl-C (SIGINT) inside training_step of epoch 1's third batch on every rank, a checkpoint
    by OnExceptionCheckpoint, then a new Trainer resumes from it: the run trains exactly the
    batches of an uninterrupted one, the interrupted batch included."""
    import signal

    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    folder = os.path.join(os.environ["FRAMEWORKS_TMP"], "lightning-interrupt")

    class Interrupted(Model):
        stop_at: tuple | None = (1, 2)

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            if (self.current_epoch, batch_idx) == self.stop_at:
                os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the step runs
            return loss

    def make() -> torchfeed.RemoteDataLoader[Any]:
        return torchfeed.RemoteDataLoader(rds, BATCH, shuffle=True, seed=21)

    L.seed_everything(7, workers=True)
    full: dict = {"train": [], "val": []}
    trainer(limit_val_batches=0).fit(Model(make, make_val, full))
    L.seed_everything(7, workers=True)
    first: dict = {"train": [], "val": []}
    handler = signal.getsignal(signal.SIGINT)
    try:
        trainer(
            limit_val_batches=0,
            enable_checkpointing=True,
            default_root_dir=folder,
            callbacks=[OnExceptionCheckpoint(folder)],
        ).fit(Interrupted(make, make_val, first))
    except SystemExit:  # Lightning's answer to Ctrl-C, after its on_exception hooks
        pass
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores SIGINT from there on
    L.seed_everything(7, workers=True)
    tail: dict = {"train": [], "val": []}
    trainer(limit_val_batches=0).fit(
        Model(make, make_val, tail), ckpt_path=os.path.join(folder, "on_exception.ckpt")
    )
    out["interrupt"] = {"full": full["train"], "first": first["train"], "tail": tail["train"]}


# -- Lightning Fabric ---------------------------------------------------------------------
def run_fabric(out: dict) -> None:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    rds = remote_dataset()
    for name, make in (
        ("torch", lambda: DataLoader(Indexed(), BATCH, shuffle=True)),
        ("remote", lambda: torchfeed.RemoteDataLoader(rds, BATCH, shuffle=True)),
    ):
        fabric.seed_everything(5)
        loader = fabric.setup_dataloaders(make())
        out[name] = [[indices(b) for b in loader] for _ in range(EPOCHS)]


# -- Accelerate ---------------------------------------------------------------------------
def run_accelerate(out: dict) -> None:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from torchfeed.frameworks import accelerate as tf_accelerate

    rds = remote_dataset()
    state_dir = os.path.join(os.environ["FRAMEWORKS_TMP"], "accelerate-state")

    def train(name, make, prepare, stop_at=None, resume=False, interrupt_at=None):
        set_seed(11)
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        model, opt, loader = prepare(accelerator, model, opt, make())
        if resume:
            accelerator.load_state(state_dir)
        seen: list = []
        for e in range(1 if resume else 0, EPOCHS):
            loader.set_epoch(e)
            for step, batch in enumerate(loader):
                try:
                    if interrupt_at == (e, step):
                        raise KeyboardInterrupt  # Ctrl-C inside the step, before it trained
                    with accelerator.accumulate(model):
                        model(batch["x"]).sum().backward()
                        opt.step()
                        opt.zero_grad()
                except KeyboardInterrupt:
                    accelerator.save_state(state_dir)  # the checkpoint a script takes on Ctrl-C
                    return seen
                seen.append([e, indices(batch), noise(batch), accelerator.sync_gradients])
                if stop_at == (e, step):
                    accelerator.save_state(state_dir)
                    return seen
        return seen

    def torch_prepare(accelerator, *objs):
        return accelerator.prepare(*objs)

    # a loader its sampler already shards is refused, naming the fix (Accelerate shards it again)
    try:
        sharded = torchfeed.RemoteDataLoader(rds, BATCH, sampler=torchfeed.DistributedSampler(rds))
        tf_accelerate.prepare(Accelerator(cpu=True), sharded)
        out["sharded_refusal"] = None
    except ValueError as e:
        out["sharded_refusal"] = str(e)
    out["torch"] = train("torch", lambda: DataLoader(Indexed(), BATCH, shuffle=True), torch_prepare)

    def make() -> torchfeed.RemoteDataLoader[Any]:
        return torchfeed.RemoteDataLoader(rds, BATCH, shuffle=True)

    out["remote"] = train("remote", make, tf_accelerate.prepare)
    train("remote", make, tf_accelerate.prepare, stop_at=(1, 2))
    out["resume"] = train("remote", make, tf_accelerate.prepare, resume=True)
    out["interrupted"] = train("remote", make, tf_accelerate.prepare, interrupt_at=(1, 2))
    out["after_interrupt"] = train("remote", make, tf_accelerate.prepare, resume=True)


# -- the HF Trainer ---------------------------------------------------------------------------
def run_hf(out: dict) -> None:
    from transformers import Trainer, TrainingArguments

    from torchfeed.frameworks.transformers import RemoteTrainer

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)
            self.seen: list = []

        def forward(self, x, index, noise):
            self.seen.append([index.tolist(), [round(v, 6) for v in noise.tolist()]])
            return {"loss": self.layer(x).sum()}

    def train(trainer_class, dataset, epochs, resume=False, extra=None, **kw):
        args = TrainingArguments(
            output_dir=os.path.join(os.environ["FRAMEWORKS_TMP"], "hf"),
            per_device_train_batch_size=BATCH,
            num_train_epochs=epochs,
            use_cpu=True,
            ddp_backend="gloo",
            report_to="none",
            logging_strategy="no",
            remove_unused_columns=False,
            seed=13,
            **kw,
        )
        model = Model()
        trainer = trainer_class(model=model, args=args, train_dataset=dataset, **(extra or {}))
        trainer.train(resume_from_checkpoint=resume or None)
        out.setdefault("params", []).append([round(v, 6) for v in model.layer.weight.flatten().tolist()])
        return model.seen

    rds = remote_dataset()
    out["torch"] = train(Trainer, Indexed(), EPOCHS, save_strategy="no")
    out["remote"] = train(RemoteTrainer, rds, EPOCHS, save_strategy="no")
    # gradient accumulation of 2 (3 optimizer steps per epoch of 6 batches): a checkpoint at
    # global step 4 (2 batches into epoch 1), then a new trainer resumes from it; with seed=
    # the draws of every later epoch are exact too (not only the resumed one's)
    seeded = {"loader_options": {"seed": 17}}
    kw = dict(save_strategy="steps", save_steps=4, gradient_accumulation_steps=2)
    out["full"] = train(RemoteTrainer, rds, 3, extra=seeded, **kw)
    checkpoint = os.path.join(os.environ["FRAMEWORKS_TMP"], "hf", "checkpoint-4")
    out["tail"] = train(RemoteTrainer, rds, 3, checkpoint, seeded, **kw)


RUNS = {
    "torchrun": run_torchrun,
    "lightning": run_lightning,
    "fabric": run_fabric,
    "accelerate": run_accelerate,
    "hf": run_hf,
}


def main() -> None:
    frameworks, out_dir = sys.argv[1].split(","), sys.argv[2]
    os.environ.setdefault("FRAMEWORKS_TMP", tempfile.mkdtemp())
    dist.init_process_group("gloo")
    for framework in frameworks:
        out: dict = {}
        RUNS[framework](out)
        with open(os.path.join(out_dir, f"{framework}.rank{os.environ['RANK']}.json"), "w") as f:
            json.dump(out, f)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
