"""RemoteDataLoader under the training frameworks, against torch's DataLoader under the same one.

One real 2-rank torchrun job (gloo, CPU) runs tests/frameworks_train.py under each framework
installed here in turn (lightning, accelerate, transformers: the test extra), once with
torch's DataLoader and once with RemoteDataLoader in the same processes; each test compares what
every rank saw: sample indices per batch and epoch (the shard, the order, the step count),
validation batches, gradient-sync steps, and the batches after a mid-epoch resume through the
framework's own checkpointing (with the random draws of the samples).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchfeed import LocalWorkers
from torchfeed.util import free_port

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
N = 45


# in the order the job runs them; a framework not installed here is left out (its test skips)
FRAMEWORKS = {
    "torchrun": None,
    "fabric": "lightning",
    "lightning": "lightning",
    "accelerate": "accelerate",
    "hf": "transformers",
}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """One torchrun job that runs every framework in turn (a rank's start-up, importing
    torch and the frameworks, costs more than a run): the completed process, its folder and
    the frameworks it ran. This process never imports a framework (a minute on a busy machine)."""
    tmp = tmp_path_factory.mktemp("frameworks")
    out = tmp / "out"
    out.mkdir()
    names = [
        name for name, module in FRAMEWORKS.items() if module is None or importlib.util.find_spec(module)
    ]
    with LocalWorkers(2) as workers:
        env = {
            **os.environ,
            "TORCHFEED_TEST_WORKERS": ",".join(workers.addresses),
            "FRAMEWORKS_TMP": str(tmp),
            "OMP_NUM_THREADS": "1",
        }
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            str(HERE / "frameworks_train.py"),
            ",".join(names),
            str(out),
        ]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    return done, out, names


def run(framework: str, job) -> list[dict]:
    """Both ranks' records of one framework's run (the job stops at the first that fails)."""
    done, out, names = job
    if framework not in names:
        pytest.skip(f"{FRAMEWORKS[framework]} is not installed (the test extra brings it)")
    files = [out / f"{framework}.rank{r}.json" for r in range(2)]
    assert all(f.exists() for f in files), (
        f"the job ended with {done.returncode} before {framework} was done:\n"
        + done.stdout[-4000:]
        + done.stderr[-8000:]
    )
    return [json.loads(f.read_text()) for f in files]


def batches(rows, column):
    return [row[column] for row in rows]


def assert_sharded(per_rank_epochs, per_rank=23):
    """Each epoch: ranks disjoint but for the padding, together the whole dataset."""
    for epoch in zip(*per_rank_epochs):
        ranks = [[i for b in rank for i in b] for rank in epoch]
        assert len(ranks[0]) == len(ranks[1]) == per_rank
        assert set(ranks[0]) | set(ranks[1]) == set(range(N))
        assert len(ranks[0]) + len(ranks[1]) - len(set(ranks[0]) | set(ranks[1])) == 2 * per_rank - N


@pytest.mark.timeout(900)
def test_torchrun_ddp(job):
    ranks = run("torchrun", job)
    for r in ranks:
        # torchfeed.DistributedSampler gives torch's DistributedSampler indices, and
        # loader.set_epoch(e) reaches the sampler (the second epoch is reshuffled)
        assert r["remote"] == r["torch"]
        assert r["remote"][0] != r["remote"][1]
        # without a sampler every rank loads everything (as torch) and is told so, once
        assert r["plain"] == r["plain_torch"] and len(r["plain"]) == 12
        assert len(r["plain_warnings"]) == 1
        # resumed from the loader's state in epoch 1: the remaining batches, same draws;
        # len() stays the epoch's length
        resume = r["resume"]
        assert resume["head"] == resume["expected"][:3]
        assert resume["tail"] == resume["expected"][3:]
        assert resume["len_after_load"] == resume["len"] == 6
        # two checkpoints in one epoch (2 + 2 batches, then the rest), pad=False: the job's
        # ranks together see every sample exactly once
        assert r["two_resumes"] == list(range(N))
        # ... and torchfeed.audit.verify proves it from the ranks' saved states (2 + 2 + 2
        # segments), and names the record missing when a rank's final state is left out
        assert r["audit"]["ok"] and r["audit"]["segments"] == 6, r["audit"]["text"]
        assert "no state of rank(s) [1]" in r["audit_partial"], r["audit_partial"]
    assert_sharded([ranks[0]["remote"], ranks[1]["remote"]])


@pytest.mark.timeout(900)
def test_lightning_trainer(job):
    ranks = run("lightning", job)
    for r in ranks:
        # Lightning injects its DistributedSampler into RemoteDataLoader as into DataLoader
        assert [row[:3] for row in r["remote"]["train"]] == [row[:3] for row in r["torch"]["train"]]
        assert r["remote"]["val"] == r["torch"]["val"]  # validation sharded too
        assert len(r["remote"]["train"]) == 12  # 6 steps per epoch per rank, not 12
        assert [row[:3] for row in r["remote_overfit"]["train"]] == [
            row[:3] for row in r["torch_overfit"]["train"]
        ]
        # iterable-style: streams numbered across the ranks give each rank the batches a
        # rank-aware dataset gives it under torch's DataLoader
        iterable = r["remote_iterable"]["train"]
        assert [row[:3] for row in iterable] == [row[:3] for row in r["torch_iterable"]["train"]]
        # resumed from a checkpoint inside epoch 1: exactly the rest of the run (indices and
        # random draws), 6 batches in every later epoch
        full = {(e, b): (idx, draws) for e, b, idx, draws in r["resume"]["full"]}
        tail = r["resume"]["tail"]
        assert [(e, b) for e, b, _, _ in tail] == [k for k in full if k > (1, 1)]
        assert all(full[(e, b)] == (idx, draws) for e, b, idx, draws in tail)
    epochs = [[[row[2] for row in r["remote"]["train"] if row[0] == e] for e in range(2)] for r in ranks]
    assert_sharded(epochs)
    # torchfeed's DistributedSampler is kept (not replaced by Lightning's): the shards and order of
    # torch's DistributedSampler, every epoch the whole dataset across the ranks
    for r in ranks:
        assert [row[:3] for row in r["remote_sampler"]["train"]] == [
            row[:3] for row in r["torch_sampler"]["train"]
        ]
    epochs = [
        [[row[2] for row in r["remote_sampler"]["train"] if row[0] == e] for e in range(2)] for r in ranks
    ]
    assert_sharded(epochs)
    # Ctrl-C inside a step, OnExceptionCheckpoint, fit(ckpt_path=...): the interrupted batch is
    # trained after the resume, and the whole run is the uninterrupted one's
    for r in ranks:
        cut = r["interrupt"]
        stop = next(i for i, row in enumerate(cut["first"]) if row[:2] == [1, 2])
        assert cut["tail"][0][:4] == cut["first"][stop][:4]
        assert [row[:4] for row in cut["first"][:stop] + cut["tail"]] == [row[:4] for row in cut["full"]]
    streams = [[row[2] for row in r["remote_iterable"]["train"]] for r in ranks]
    assert sorted(i for rank in streams for b in rank for i in b) == list(range(N))  # no duplicates


@pytest.mark.timeout(900)
def test_lightning_fabric(job):
    ranks = run("fabric", job)
    for r in ranks:
        assert r["remote"] == r["torch"]  # setup_dataloaders accepts it and shards it as torch's
        assert r["remote"][0] != r["remote"][1]
    assert_sharded([ranks[0]["remote"], ranks[1]["remote"]])


@pytest.mark.timeout(900)
def test_accelerate(job):
    ranks = run("accelerate", job)
    for r in ranks:
        assert "drop the sampler" in r["sharded_refusal"]

        # Accelerate's own shards, order and end-of-loader gradient syncs (gradient
        # accumulation of 4 over 6 batches: syncs after the 4th and the last)
        def seen(rows):
            return [(e, idx, sync) for e, idx, _, sync in rows]

        assert seen(r["remote"]) == seen(r["torch"])
        assert [sync for e, _, _, sync in r["remote"] if e == 0] == [False] * 3 + [True, False, True]
        # save_state inside epoch 1 after 3 batches, load_state in a new Accelerator: the rest
        epoch1 = [row for row in r["remote"] if row[0] == 1]
        assert r["resume"] == epoch1[3:]
        # Ctrl-C inside epoch 1's third step, save_state in `except`, load_state: the
        # interrupted batch comes first (Accelerate had read one batch ahead)
        assert [row[:3] for row in r["interrupted"]] == [row[:3] for row in r["remote"][: 6 + 2]]
        assert [row[:3] for row in r["after_interrupt"]] == [row[:3] for row in epoch1[2:]]
    epochs = [[[row[1] for row in r["remote"] if row[0] == e] for e in range(2)] for r in ranks]
    assert_sharded(
        epochs, per_rank=24
    )  # even_batches: 12 batches of 4, the last padded from the first samples


@pytest.mark.timeout(900)
def test_hf_trainer(job):
    ranks = run("hf", job)
    for r in ranks:
        # RemoteTrainer's loaders: the Trainer's sampler and Accelerate's shards, as Trainer's
        assert [idx for idx, _ in r["remote"]] == [idx for idx, _ in r["torch"]]
        assert len(r["remote"]) == 12
        # resume_from_checkpoint at step 4 (epoch 1, third batch; accumulation of 2): the
        # remaining 10 batches, draws included, without a torch loader rebuilt to skip the
        # first ones, and the same optimizer steps (the same weights at the end)
        assert len(r["full"]) == 18
        assert r["tail"] == r["full"][8:]
        assert r["params"][-1] == r["params"][-2]
    epochs = [[[idx for idx, _ in r["remote"][e * 6 : e * 6 + 6]] for e in range(2)] for r in ranks]
    assert_sharded(epochs, per_rank=24)
