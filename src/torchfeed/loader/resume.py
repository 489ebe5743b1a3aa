"""Starting a loader pass reproducibly, and the state that lets a new loader resume it.

A pass is fully determined by what it starts from: the epoch and seed (or the base seed
drawn like torch's DataLoader), the states of the random generators the samplers use,
and the state of a torchfeed elastic sampler. ``begin_pass`` records these; a state dict
is that record plus how many batches and samples were consumed. A new loader (in a new
process, on other workers) replays the record, skips the consumed batches of indices
(cheap: no data is loaded) and yields exactly the remaining batches. Elastic samplers
skip by themselves, by global position, so the number of ranks may change.
"""

from __future__ import annotations

import itertools
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from ..util import is_count
from .audit import Audit
from .checks import job_ranks
from .sampling import DistributedSampler, mix_seed

FORMAT = "torchfeed.RemoteDataLoader/3"
# Older formats resume as they are unless they hold a torchfeed.DistributedSampler position
# that cannot be trusted: format 1 shuffled with another seeding (every such state is refused);
# format 2 counted the samples of a resumed pass twice (its states whose sampler had moved
# past the user's start, all taken after a resume, are refused).
_FORMAT_1 = "torchfeed.RemoteDataLoader/1"
_FORMAT_2 = "torchfeed.RemoteDataLoader/2"
_OLD_FORMATS = (_FORMAT_1, _FORMAT_2)
_SHUFFLE_TAG = 0x5F1E
_INT63 = (1 << 63) - 1


@dataclass
class PassRecord:
    epoch: int
    seed: int | None
    base_seed: int
    global_rng: bytes | None = None
    generators: dict[str, bytes] = field(default_factory=dict)
    sampler: dict[str, int] | None = None
    # the base seed was drawn after the generator states were recorded (a resume draws it
    # again to use the generators as the pass did); False when iter() drew it before
    draws: bool = False


@dataclass
class Progress:
    """How far the current pass got (shared by a loader and its latest iterator).

    ``batches`` and ``samples`` count the epoch on this rank, a resumed pass's included;
    ``folded_batches`` and ``folded_samples`` of those are already in ``record.sampler``'s start
    (an elastic sampler resumed there). ``recent`` holds the last
    batches handed out (their sizes and keys), so a state can leave them out
    (:func:`state_of`), and ``confirmed`` says whether the consumer came back for a batch after
    the last one. ``audit`` records the keys handed out (``audit=True``), ``position`` says
    where a state stands job-wide (for the audit: the elastic sampler's global position, else
    the batches consumed).
    """

    record: PassRecord
    batches: int = 0
    samples: int = 0
    finished: bool = False
    folded_batches: int = 0
    folded_samples: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)  # a state reads a whole batch's update
    recent: deque[Handed] = field(default_factory=lambda: deque(maxlen=RECENT))
    confirmed: bool = True
    audit: Audit | None = None
    position: Callable[[dict[str, Any]], int] = field(default=lambda state: int(state["batches"]))
    end: int | None = None  # the job-wide position where the epoch ends, when known

    def handed(self, samples: int, keys: Sequence[Any] | None = None) -> None:
        """A batch of ``samples`` samples (``keys``, map-style) was handed to the consumer."""
        if self.audit is not None:
            self.audit.handed(keys or ())  # first: keys it refuses leave the counts as they were
        with self.lock:
            self.batches += 1
            self.samples += samples
            self.recent.append(Handed(samples, keys or ()))
            self.confirmed = False

    def confirm(self) -> None:
        """The consumer came back for the next batch: the last one is done."""
        self.confirmed = True


@dataclass(frozen=True)
class Handed:
    """A batch handed to the consumer: its size and (map-style) keys."""

    samples: int
    keys: Sequence[Any]


RECENT = 2  # how many of the last batches a state can leave out (a consumer that reads one ahead)


def _to_bytes(state: torch.Tensor) -> bytes:
    return state.numpy().tobytes()


def _from_bytes(raw: bytes) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy())


@dataclass(frozen=True)
class Sampling:
    """A loader's sampling pieces, handed to this module and to prefetch.py explicitly (they
    never hold the loader): its ``seed``, ``generator``, ``sampler`` and ``batch_sampler``
    (the user's objects, used only on the consumer's thread) and ``per_sample_seeding``."""

    seed: int | None
    generator: torch.Generator | None
    sampler: Any
    batch_sampler: Any
    per_sample_seeding: bool
    audit: bool = False


@dataclass(frozen=True)
class Drawn:
    """A base seed drawn from the global generator (or the loader's ``generator``) when the
    iterator was made, before the pass began (and recorded the generators' states)."""

    seed: int


def _draw(generator: torch.Generator | None) -> int:
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item()) & ((1 << 64) - 1)


def draw_base_seed(generator: torch.Generator | None) -> Drawn:
    """Draw a pass's base seed exactly as torch's DataLoader iterator does in ``iter()``."""
    return Drawn(_draw(generator))


def shuffle_seed(seed: int, epoch: int) -> int:
    """The seed of a loader's own shuffle generator for ``epoch`` (with ``seed=``)."""
    return mix_seed(seed, epoch, _SHUFFLE_TAG) & _INT63


def _generators(loader: Sampling, shuffle_generator: torch.Generator | None) -> dict[str, torch.Generator]:
    """The generators this loader's sampling draws from, by a stable name: the loader's, and
    those of its sampler, its batch sampler and the samplers they wrap (``.sampler``,
    ``.batch_sampler``: Accelerate's ``BatchSamplerShard`` wraps the user's batch sampler), not
    the loader's own shuffle generator, which is reseeded from (seed, epoch) every pass."""
    found: dict[str, torch.Generator] = {}
    seen: set[int] = set()

    def visit(name: str, obj: Any, depth: int) -> None:
        g = getattr(obj, "generator", None)
        if isinstance(g, torch.Generator) and g is not shuffle_generator and id(g) not in seen:
            seen.add(id(g))
            found[name] = g
        if depth < 3:
            for attr in ("sampler", "batch_sampler"):
                inner = getattr(obj, attr, None)
                if inner is not None and inner is not obj:
                    visit(f"{name}.{attr}", inner, depth + 1)

    if isinstance(loader.generator, torch.Generator) and loader.generator is not shuffle_generator:
        seen.add(id(loader.generator))
        found["loader"] = loader.generator
    visit("sampler", loader.sampler, 1)
    if loader.batch_sampler is not None:
        visit("batch_sampler", loader.batch_sampler, 1)
    return found


def _elastic(loader: Sampling) -> DistributedSampler | None:
    for s in (loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
        if isinstance(s, DistributedSampler):
            return s
    return None


def check_state(state: dict[str, Any], seed: int | None) -> None:
    """Refuse what is not a loader state, one taken with another ``seed``, one an older
    torchfeed took wrongly, or one whose counts no loader makes."""
    if not isinstance(state, dict) or state.get("format") not in (FORMAT, *_OLD_FORMATS):
        raise ValueError("this is not a RemoteDataLoader state (made by RemoteDataLoader.state_dict())")
    sampler = state.get("sampler")
    if state["format"] == _FORMAT_1 and sampler is not None:
        raise ValueError(
            f"this loader state ({state['format']}) was taken by an older torchfeed whose "
            "DistributedSampler shuffled with another seeding (now torch's): resuming it would load "
            "other samples. Finish that epoch with the torchfeed that took it, or start the epoch again"
        )
    if state["format"] == _FORMAT_2 and sampler is not None and sampler.get("start", 0) > 0:
        raise ValueError(
            f"this loader state ({state['format']}) was taken after a resume by an older torchfeed, "
            "which counted the resumed pass's samples twice: resuming it would skip samples. Start "
            "the epoch again (or resume from the checkpoint taken before the first resume)"
        )
    if state["seed"] != seed:
        raise ValueError(
            f"the state was taken with seed={state['seed']}, this loader has seed={seed}: "
            "create the loader with the same seed to resume"
        )
    for name in ("batches", "samples", "epoch"):
        value = state.get(name)
        if not is_count(value, 0, _INT63 - 1):
            raise ValueError(f"this loader state's {name!r} is {value!r}: not a count a loader makes")


def begin_pass(
    loader: Sampling,
    epoch: int,
    resume: dict[str, Any] | None,
    base_seed: int | Drawn | None = None,
    *,
    index_sampler: Iterable,
    shuffle_generator: torch.Generator | None = None,
) -> tuple[Iterator, Progress]:
    """Start a pass (or resume one); return the index iterator and its progress record.

    ``loader`` is the loader's :class:`Sampling` (seed, generator, sampler, batch_sampler);
    ``index_sampler`` is what the pass iterates (the batch sampler, or the sampler without
    auto-collation); ``shuffle_generator`` is the loader's own shuffle generator, reseeded
    here from (seed, epoch). ``base_seed`` (the first pass's, for torch's persistent
    workers) is used instead of drawing one; a :class:`Drawn` one (drawn by ``iter()``) too, with
    the generator state it was drawn from.
    """
    if resume is not None:
        check_state(resume, loader.seed)
    gens = _generators(loader, shuffle_generator)
    elastic = _elastic(loader)
    user_global = None
    if resume is not None:
        epoch = resume["epoch"]
        for name, raw in resume["generators"].items():
            if name in gens:
                gens[name].set_state(_from_bytes(raw))
        if resume["global_rng"] is not None:
            user_global = torch.get_rng_state()
            torch.set_rng_state(_from_bytes(resume["global_rng"]))
        if elastic is not None and resume["sampler"] is not None:
            sampler_state = resume["sampler"]
            if resume["format"] == _FORMAT_2:  # its sampler entry is the pass's start
                sampler_state = {**sampler_state, "consumed_on_rank": resume["samples"]}
            elastic.load_state_dict(sampler_state)
    record = PassRecord(
        epoch=epoch,
        seed=loader.seed,
        base_seed=0,
        generators={n: _to_bytes(g.get_state()) for n, g in gens.items()},
        sampler=elastic.state_dict() if elastic is not None else None,
    )
    if loader.seed is not None:
        if shuffle_generator is not None:
            shuffle_generator.manual_seed(shuffle_seed(loader.seed, epoch))
        record.base_seed = mix_seed(loader.seed, epoch)
        indices = iter(index_sampler)
    else:
        # the states the sampler will draw from (replayed ones when resuming)
        record.global_rng = _to_bytes(torch.get_rng_state())
        indices = iter(index_sampler)
        if resume is not None:
            # the pass drew its base seed after recording these states: draw it again (and drop
            # it) so the sampler draws from where it did; one drawn by iter() came before them
            record.draws = bool(resume.get("draws", True))
            if record.draws:
                _draw(loader.generator)
            record.base_seed = resume["base_seed"]
        elif isinstance(base_seed, Drawn):  # drawn by iter(), as torch's iterator draws it
            record.base_seed = base_seed.seed
        elif base_seed is None:
            # drawn exactly as torch's DataLoader draws it (after iter(sampler), before the
            # first index), so the same global seed gives the same shuffle order as torch
            record.draws = True
            record.base_seed = _draw(loader.generator)
        else:  # kept: torch's persistent workers draw their base seed once
            record.base_seed = base_seed & ((1 << 64) - 1)
    progress = Progress(record)
    if resume is not None:
        skip = 0 if (elastic is not None and resume["sampler"] is not None) else resume["batches"]
        skipped = sum(1 for _ in itertools.islice(indices, skip))
        if skipped < skip:
            raise ValueError(
                f"this loader state is {skip} batches into its epoch, but this loader's sampler gives "
                f"{skipped}: it was taken with another dataset, sampler or batch size"
            )
        if user_global is not None:
            # samplers draw from the global generator lazily: pull the first batch under
            # the replayed state, then give the user back their own generator state
            head = list(itertools.islice(indices, 1))
            torch.set_rng_state(user_global)
            indices = itertools.chain(head, indices)
        progress.batches, progress.samples = resume["batches"], resume["samples"]
        if elastic is not None and resume["sampler"] is not None:
            # the sampler starts after them
            progress.folded_batches, progress.folded_samples = resume["batches"], resume["samples"]
    if loader.audit:
        progress.audit = _audit(loader, elastic, epoch, resume, progress)
    return indices, progress


def _audit(
    loader: Sampling, elastic: DistributedSampler | None, epoch: int, resume: dict | None, progress: Progress
) -> Audit:
    """The audit record of a pass: its rank and world (the sampler's, else the job's), where
    it begins job-wide, and what the state it resumes carried."""
    shard = elastic
    if shard is None:
        for s in (loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
            if isinstance(getattr(s, "num_replicas", None), int) and isinstance(
                getattr(s, "rank", None), int
            ):
                shard = s
                break
    rank, world = (shard.rank, shard.num_replicas) if shard is not None else job_ranks()
    if elastic is not None:
        progress.position = lambda state: elastic.position(state["sampler"])
        progress.end = elastic.end()
        origin = elastic.start
    else:
        origin = progress.batches
        try:
            progress.end = len(loader.batch_sampler if loader.batch_sampler is not None else loader.sampler)
        except TypeError:  # a sampler without a length: the epoch is complete when the pass ends
            pass
    resumed = resume.get("audit") if resume is not None else None
    return Audit(epoch, rank, world, origin, resumed)


def state_of(
    progress: Progress | None,
    next_epoch: int,
    seed: int | None,
    *,
    leave_out: int = 0,
    batch_size: int | None = None,
) -> dict[str, Any]:
    """Plain-data state: small (bytes, ints), safe to put in a checkpoint.

    ``leave_out`` of the last batches handed out (at most :data:`RECENT`, none from before a
    resume) count as not consumed: a resume loads them again; a finished pass is then
    resumable at its last batches. ``batch_size`` is what a full batch holds, when the loader
    knows it."""
    if progress is None:
        return _inactive(next_epoch, seed)
    with progress.lock:
        return _state_locked(progress, next_epoch, seed, leave_out, batch_size)


def _inactive(next_epoch: int, seed: int | None) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "epoch": next_epoch,
        "seed": seed,
        "active": False,
        "batches": 0,
        "samples": 0,
        "base_seed": None,
        "global_rng": None,
        "generators": {},
        "sampler": None,
    }


def _state_locked(
    progress: Progress, next_epoch: int, seed: int | None, leave_out: int, batch_size: int | None
) -> dict[str, Any]:
    leave_out = max(min(leave_out, len(progress.recent), progress.batches - progress.folded_batches), 0)
    if progress.finished and leave_out == 0:
        state = _inactive(next_epoch, seed)
        if progress.audit is not None:  # the record of the epoch that ended
            state["audit"] = progress.audit.to_state(progress.position(_ended(progress)), complete=True)
        return state
    left = list(progress.recent)[len(progress.recent) - leave_out :] if leave_out else []
    batches, samples = progress.batches - len(left), progress.samples - sum(h.samples for h in left)
    rec = asdict(progress.record)
    rec.update(format=FORMAT, active=True, batches=batches, samples=samples)
    if rec["sampler"] is not None:  # where the elastic sampler stands: its start and what followed
        rec["sampler"]["consumed_on_rank"] = samples - progress.folded_samples
        # what the job's batches could hold (unknown for a batch sampler without a batch size)
        if batch_size:
            rec["sampler"]["capacity"] = (batches - progress.folded_batches) * batch_size
    if progress.audit is not None:
        upto = progress.position(rec)
        rec["audit"] = progress.audit.to_state(
            upto,
            complete=progress.end is not None and upto >= progress.end,  # its last batch consumed
            left_out=[k for h in left for k in h.keys],
        )
    return rec


def _ended(progress: Progress) -> dict[str, Any]:
    """A state of a finished pass, for its job-wide position (the end of the epoch)."""
    sampler = progress.record.sampler
    if sampler is not None:
        sampler = {**sampler, "consumed_on_rank": 0, "start": sampler["num_samples_total"]}
    return {"batches": progress.batches, "sampler": sampler}


def interrupted() -> bool:
    """Whether the caller runs while an exception unwinds (an ``except``, ``finally`` or
    ``__exit__`` up the stack: Lightning's ``on_exception``, a save in ``except
    KeyboardInterrupt``): then the batch last handed out may not have been trained on.
    A signal handler is not told apart from a plain call of the same function (a save
    function used for both would leave out a trained batch at every checkpoint): a save in a
    handler passes ``leave_out=1`` itself."""
    exc = sys.exc_info()[1]
    return exc is not None and not isinstance(exc, (StopIteration, GeneratorExit))
