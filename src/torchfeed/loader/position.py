"""Where a RemoteDataLoader's loading stands between passes: :class:`Position`.

It holds the epoch of the next pass, the latest pass's progress, the latest iterator made
(a pass starts at its first ``next()``: :mod:`torchfeed.loader.pending`), a state loaded and
not resumed yet, the latest iterable-style pass (read while it runs, its snapshot once it
closed) and the base seed persistent workers keep. The loader (loader/dataloader.py) owns
one, updates it as passes start, and makes its ``state_dict`` from it
(:func:`torchfeed.loader.resume.state_of`) and its ``load_state_dict`` into it.

Threads: it takes no lock. The loader's user thread makes iterators, starts passes and takes
states; an iterable-style pass reports where it stood when it closes
(:meth:`Position.iterable_closed`, its ``PassPlan.on_snapshot`` hook), on whichever thread
closes it and possibly after a newer pass replaced it, so the latest iterable-style pass is
read once wherever it is used.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import resume
from .iterable import IterablePass
from .pending import PendingPass


@dataclass
class LatestIterablePass:
    """The loader's latest iterable-style pass: read while it runs, its snapshot once it closed
    (what ``state_dict`` saves)."""

    pass_id: int
    running: weakref.ref[IterablePass]
    snapshot: dict | None = None
    trained: dict | None = None  # the snapshot without a batch the consumer did not come back from


class Position:
    """One loader's position: what its next pass continues from, and what a state says."""

    def __init__(self) -> None:
        self.epoch = 0  # epoch of the next pass
        self.progress: resume.Progress | None = None  # the latest pass
        self.resume_from: dict | None = None  # a state loaded and not resumed yet
        self.pending: weakref.ref[PendingPass] | None = None  # the latest iterator made
        self.iterable_pass: LatestIterablePass | None = None
        self.persistent_seed: int | None = None  # the base seed persistent workers keep

    def base_seed(
        self, seed: int | None, generator: torch.Generator | None, persistent: bool
    ) -> int | resume.Drawn | None:
        """Drawn when an iterator is made: the base seed of the pass it starts, if it is known then."""
        # torch's persistent workers draw their base seed once, at the first pass
        kept = self.persistent_seed if persistent else None
        # torch's iterator draws the base seed in iter(); so does this one, to use the global
        # generator at the same point (the draw is the only thing iter() does). A resumed pass
        # takes its base seed from the state: the pass it continues drew it before the checkpoint
        fresh = seed is None and kept is None and self.resume_from is None
        drawn = resume.draw_base_seed(generator) if fresh else None
        return kept if drawn is None else drawn

    def made(self, pending: PendingPass) -> None:
        """An iterator was made (not read yet: a state taken now starts the next pass afresh)."""
        self.pending = weakref.ref(pending)

    def take_resume(self) -> dict | None:
        """A pass starts: the loaded state it resumes, if any (it is used up)."""
        resume_from, self.resume_from = self.resume_from, None
        return resume_from

    def began(self, progress: resume.Progress, seed: int | None) -> None:
        """A pass began (``resume.begin_pass``): the next one is the epoch after it."""
        self.epoch = progress.record.epoch + 1
        self.progress = progress
        if seed is None:
            self.persistent_seed = progress.record.base_seed

    def iterable_started(self, running: IterablePass) -> None:
        self.iterable_pass = LatestIterablePass(running.pass_id, weakref.ref(running))

    def iterable_closed(self, pass_id: int, snapshot: dict, trained: dict) -> None:
        """Called by an iterable-style pass when it closes (``PassPlan.on_snapshot``): if it is
        the latest, keep where it stood (and where it stood without an unconfirmed batch)."""
        latest = self.iterable_pass  # read once: a new pass may replace it meanwhile
        if latest is not None and latest.pass_id == pass_id:
            latest.snapshot, latest.trained = snapshot, trained

    def state(self, seed: int | None, leave_out: int | None, full_batch: Callable[[], int | None]) -> dict:
        """The loader's ``state_dict(leave_out=...)`` (see there); ``full_batch()``: the samples
        of a full batch, when the loader knows it."""
        if self.resume_from is not None:  # loaded, not resumed yet: it still says where to go on
            return copy.deepcopy(self.resume_from)
        pending = self.pending() if self.pending is not None else None
        if pending is not None and not pending.started:
            # an iterator was made and not read yet: the next pass starts afresh, as it will
            return resume.state_of(None, self.epoch, seed)
        progress = self.progress
        if leave_out is None:
            leave_out = int(progress is not None and not progress.confirmed and resume.interrupted())
        elif not 0 <= leave_out <= resume.RECENT:
            raise ValueError(f"leave_out must be between 0 and {resume.RECENT}, got {leave_out}")
        latest = self.iterable_pass
        if latest is not None and leave_out > 1:
            raise ValueError("an iterable-style pass can leave out only the batch last handed out")
        state = resume.state_of(progress, self.epoch, seed, leave_out=leave_out, batch_size=full_batch())
        if state["active"] and latest is not None:
            running = latest.running()
            streams: dict | None
            if running is not None:
                streams = running.snapshot(trained_only=leave_out > 0)
            else:
                streams = latest.trained if leave_out else latest.snapshot
            if streams is not None:
                state["streams"] = streams
        return state

    def load(self, state: dict, seed: int | None) -> None:
        """``load_state_dict``: the next pass continues where ``state`` stopped."""
        resume.check_state(state, seed)
        self.epoch = state["epoch"]
        self.resume_from = state if state["active"] else None
