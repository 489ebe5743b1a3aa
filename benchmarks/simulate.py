"""Drive the real ``torchfeed.loader.scheduler.Scheduler`` with a fake clock, at scale.

Simulated workers and trainers, no sockets, no threads, no sleeps: an event queue in
simulated seconds. Every trainer owns one Scheduler per pass and calls it exactly the
way ``torchfeed.loader`` does (``wants_more``/``add_batch``/``exhausted``,
``next_dispatch``, ``completed``, ``hedge`` after each result and every 50 ms while it
waits, ``worker_lost``, ``add_worker``, ``take_delivered``/``finished``), with explicit
``now`` values.

The model
---------
* **Workers** are single FIFO servers shared by every trainer (a torchfeed worker runs
  its requests, from all connections, one at a time from one queue; ``parallel=1``).
  A worker's time per batch is ``base * slowness``; slowness is fixed per case (e.g. one
  worker 4x slower) or drawn from a Pareto distribution (heavy tail: a few workers are
  ten or more times slower). Each batch's work varies by a log-normal factor (mean 1).
  A cancelled request that has not started is skipped; a started one runs to the end.
* **Faults** (optional): workers die (their trainers learn it at once, as from a reset
  connection), stall (no progress for seconds, undetected, then resume) and new
  workers join mid-run (every trainer adds them, as from a watched workers file).
* **Trainers** consume instantly (loading is the bottleneck, which is where scheduling
  matters) and run passes of ``--pass`` batches back to back, a new Scheduler per pass as
  the loader does: the tail of every pass (the last batches waiting for a slow worker)
  is part of the measured time.

Metrics
-------
* **fraction of ideal**: batches delivered to trainers within the simulated time,
  divided by what the workers could have produced in that time (the integral of the
  sum of the speeds of the workers alive and not stalled). Work thrown away (hedged
  duplicates, batches of dead workers, cancelled work that had started) is lost
  capacity.
* **µs per dispatch / completion / poll**: thread CPU time spent inside the scheduler
  (``next_dispatch`` calls per dispatched batch; ``completed`` + the ``hedge`` that
  follows each result; the ``hedge`` of each 50 ms poll), the cost of the timer itself
  subtracted.

Run ``python benchmarks/simulate.py`` (all cases, < 2 minutes on one core) or see
``--help``; ``--scheduler FILE`` drives another version of scheduler.py (e.g. the one
before a change, from ``git show REV:src/torchfeed/loader/scheduler.py > /tmp/old.py``).
"""

from __future__ import annotations

import argparse
import gc
import heapq
import importlib.util
import inspect
import random
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

POLL = 0.05  # loader._POLL
STRAGGLER_FACTOR = 4.0  # RemoteDataLoader defaults
STRAGGLER_MIN_SECONDS = 0.05
MAX_RETRIES = 2


# -- the scheduler under test ---------------------------------------------------------
def load_scheduler(path: str | None):
    if path is None:
        src = Path(__file__).resolve().parents[1] / "src"
        sys.path.insert(0, str(src))
        from torchfeed.loader.scheduler import Scheduler

        return Scheduler
    spec = importlib.util.spec_from_file_location("scheduler_under_test", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.Scheduler


class Meter:
    """Thread CPU time of calls into the scheduler, the timer's own cost subtracted."""

    def __init__(self):
        self.ns: dict[str, float] = {}
        self.count: dict[str, int] = {}
        clock = time.thread_time_ns
        t0 = clock()
        for _ in range(20000):
            clock()
        self.overhead = (clock() - t0) / 20000

    def add(self, key: str, ns: float, n: int = 1) -> None:
        self.ns[key] = self.ns.get(key, 0) + max(ns - self.overhead, 0)
        self.count[key] = self.count.get(key, 0) + n

    def per(self, key: str, per_key: str | None = None) -> float:
        n = self.count.get(per_key or key, 0)
        return self.ns.get(key, 0) / n / 1000 if n else float("nan")


# -- simulated workers --------------------------------------------------------------
@dataclass(eq=False)
class Request:
    trainer: Trainer
    pass_id: int
    seq: int
    work: float  # seconds of this worker's time
    cancelled: bool = False


@dataclass(eq=False)
class Worker:
    address: str
    seconds: float  # mean time per batch
    alive: bool = True
    stalled: bool = False
    queue: deque = field(default_factory=deque)
    running: Request | None = None
    remaining: float = 0.0  # of the running request, as of `since`
    since: float = 0.0
    version: int = 0  # invalidates scheduled completion events


class Sim:
    def __init__(self, case: Case, scheduler_cls, mode: str, meter: Meter, seed: int):
        self.case = case
        self.rng = random.Random(seed)
        self.scheduler_cls = scheduler_cls
        self.mode = mode
        self.meter = meter
        self.now = 0.0
        self.events: list = []
        self.counter = 0
        self.workers: dict[str, Worker] = {}
        self.order: list[Worker] = []
        self.capacity = 0.0  # batches per second of the workers alive and not stalled
        self.capacity_integral = 0.0
        self.capacity_since = 0.0
        self.busy = 0.0  # batches per second of those of them that are running a request
        self.busy_integral = 0.0
        self.wasted = 0.0  # batches' worth of work whose result nobody used
        params = inspect.signature(scheduler_cls).parameters
        self.accepts = {name for name in ("clock", "pass_length", "estimates", "seed") if name in params}
        for slowness in case.slowness(self.rng, case.workers):
            self.new_worker(slowness)
        self.trainers = [Trainer(self, i) for i in range(case.trainers)]

    # -- event queue --------------------------------------------------------------
    def at(self, when: float, fn: Callable, *args) -> None:
        self.counter += 1
        heapq.heappush(self.events, (when, self.counter, fn, args))

    def run(self, duration: float) -> None:
        for t in self.trainers:
            t.start_pass()
            self.at(POLL, t.poll)
        self.plan_faults(duration)
        while self.events:
            when, _, fn, args = heapq.heappop(self.events)
            if when > duration:
                break
            self.now = when
            fn(*args)
        self.now = duration
        self.set_capacity(0.0)

    # -- capacity bookkeeping -------------------------------------------------------
    def set_capacity(self, delta: float, busy: float = 0.0) -> None:
        self.capacity_integral += self.capacity * (self.now - self.capacity_since)
        self.busy_integral += self.busy * (self.now - self.capacity_since)
        self.capacity_since = self.now
        self.capacity += delta
        self.busy += busy

    def new_worker(self, slowness: float) -> Worker:
        w = Worker(f"w{len(self.order)}", self.case.base * slowness)
        self.workers[w.address] = w
        self.order.append(w)
        self.set_capacity(1.0 / w.seconds)
        return w

    # -- worker service -------------------------------------------------------------
    def enqueue(self, worker: Worker, request: Request) -> None:
        worker.queue.append(request)
        if worker.running is None:
            self.start_next(worker)

    def start_next(self, worker: Worker) -> None:
        while worker.queue and worker.queue[0].cancelled:
            worker.queue.popleft()
        was_busy = worker.running is not None
        if not worker.queue:
            worker.running = None
            if was_busy and not worker.stalled:
                self.set_capacity(0.0, -1.0 / worker.seconds)
            return
        req = worker.queue.popleft()
        worker.running = req
        worker.remaining = req.work
        worker.since = self.now
        if not worker.stalled:
            if not was_busy:
                self.set_capacity(0.0, 1.0 / worker.seconds)
            self.at(self.now + worker.remaining, self.finish, worker, worker.version)

    def finish(self, worker: Worker, version: int) -> None:
        if version != worker.version or not worker.alive:
            return
        req = worker.running
        assert req is not None  # a finish is scheduled for the request the worker runs
        self.start_next(worker)
        if req.cancelled or not req.trainer.on_result(worker.address, req):
            self.wasted += req.work / worker.seconds  # nobody used this result

    def stall(self, worker: Worker, seconds: float) -> None:
        if not worker.alive or worker.stalled:
            return
        worker.stalled = True
        worker.version += 1
        busy = 0.0
        if worker.running is not None:
            worker.remaining -= self.now - worker.since
            busy = -1.0 / worker.seconds
        self.set_capacity(-1.0 / worker.seconds, busy)
        self.at(self.now + seconds, self.unstall, worker)

    def unstall(self, worker: Worker) -> None:
        if not worker.alive or not worker.stalled:
            return
        worker.stalled = False
        busy = 0.0
        if worker.running is not None:
            busy = 1.0 / worker.seconds
            worker.since = self.now
            self.at(self.now + max(worker.remaining, 0.0), self.finish, worker, worker.version)
        self.set_capacity(1.0 / worker.seconds, busy)

    def die(self, worker: Worker) -> None:
        if not worker.alive:
            return
        worker.alive = False
        worker.version += 1
        if not worker.stalled:
            running = worker.running is not None
            if running:
                self.wasted += (self.now - worker.since) / worker.seconds
            self.set_capacity(-1.0 / worker.seconds, -1.0 / worker.seconds if running else 0.0)
        elif worker.running is not None:
            self.wasted += (worker.running.work - worker.remaining) / worker.seconds
        worker.queue.clear()
        worker.running = None
        for t in self.trainers:
            t.on_lost(worker.address)

    def join(self, slowness: float) -> None:
        worker = self.new_worker(slowness)
        for t in self.trainers:
            t.on_join(worker.address)

    def plan_faults(self, duration: float) -> None:
        case, rng = self.case, self.rng
        for w in list(self.order):
            if rng.random() < case.death_fraction:
                self.at(rng.uniform(0.1, 0.9) * duration, self.die, w)
            if rng.random() < case.stall_fraction:
                self.at(rng.uniform(0.1, 0.9) * duration, self.stall, w, rng.uniform(*case.stall_seconds))
        for slowness in case.slowness(rng, case.joins):
            self.at(rng.uniform(0.1, 0.9) * duration, self.join, slowness)
        for kind, when, index, arg in case.scripted:
            if kind == "die":
                self.at(when * duration, self.die, self.order[index])
            elif kind == "stall":
                self.at(when * duration, self.stall, self.order[index], arg)
            elif kind == "join":
                self.at(when * duration, self.join, arg)

    def alive_addresses(self) -> list[str]:
        return [w.address for w in self.order if w.alive]


# -- simulated trainers (the loader's calls, in the loader's order) -------------------
class Trainer:
    def __init__(self, sim: Sim, index: int):
        self.sim = sim
        self.index = index
        self.pass_id = -1
        self.sched: Any = None  # the scheduler class under test, loaded from a file
        self.delivered = 0
        self.passes = 0
        self.pass_started = 0.0
        self.pass_seconds: list[float] = []
        self.poison = 0
        self.estimates = None

    def start_pass(self) -> None:
        sim, case = self.sim, self.sim.case
        if self.sched is not None and "estimates" in sim.accepts and sim.mode == "hints":
            self.estimates = self.sched.estimates()
        self.pass_id += 1
        self.pass_started = sim.now
        workers = sim.alive_addresses()
        n = max(len(workers), len(sim.order), 1)
        kwargs: dict[str, Any] = {}
        if "clock" in sim.accepts:
            kwargs["clock"] = lambda: sim.now
        if "seed" in sim.accepts:
            kwargs["seed"] = sim.rng.getrandbits(32)
        if sim.mode == "hints":
            if "pass_length" in sim.accepts:
                kwargs["pass_length"] = case.pass_length
            if "estimates" in sim.accepts and self.estimates:
                kwargs["estimates"] = self.estimates
        self.sched = None  # the previous pass's scheduler is freed outside the timing
        t0 = time.thread_time_ns()
        sched = sim.scheduler_cls(
            workers, credits=case.credits, window=max(2 * case.credits * n, n + 2 * case.credits), **kwargs
        )
        sim.meter.add("start", time.thread_time_ns() - t0)
        self.sched = sched
        self.added = 0
        self.results: set = set()
        self.requests: dict[int, dict[str, Request]] = {}
        self.dispatch()

    def end_pass(self) -> None:
        for requests in self.requests.values():
            for req in requests.values():
                req.cancelled = True
        self.requests.clear()
        self.passes += 1
        self.pass_seconds.append(self.sim.now - self.pass_started)
        self.start_pass()

    def dispatch(self) -> None:
        sched, sim, meter, clock = self.sched, self.sim, self.sim.meter, time.thread_time_ns
        while True:
            while sched.wants_more():
                if self.added >= sim.case.pass_length:
                    sched.exhausted = True
                    break
                sched.add_batch()
                self.added += 1
            t0 = clock()
            choice = sched.next_dispatch(sim.now)
            meter.add("dispatch", clock() - t0, 0)
            if choice is None:
                return
            meter.count["dispatch"] = meter.count.get("dispatch", 0) + 1
            self.send(*choice)

    def send(self, address: str, seq: int) -> None:
        sim = self.sim
        work = sim.workers[address].seconds * sim.rng.lognormvariate(
            -(sim.case.jitter**2) / 2, sim.case.jitter
        )
        req = Request(self, self.pass_id, seq, work)
        self.requests.setdefault(seq, {})[address] = req
        sim.enqueue(sim.workers[address], req)

    def hedge(self, key: str) -> None:
        clock = time.thread_time_ns
        t0 = clock()
        out = self.sched.hedge(STRAGGLER_FACTOR, STRAGGLER_MIN_SECONDS, self.sim.now)
        self.sim.meter.add(key, clock() - t0, 1 if key == "poll" else 0)
        for address, seq in out:
            self.send(address, seq)

    def on_result(self, address: str, req: Request) -> bool:
        """Whether the result was used."""
        if req.pass_id != self.pass_id:
            return False  # a request of a pass that has ended (the loader cancelled it)
        sched, clock = self.sched, time.thread_time_ns
        t0 = clock()
        accepted, others = sched.completed(address, req.seq, self.sim.now)
        self.sim.meter.add("completion", clock() - t0)
        requests = self.requests.pop(req.seq, {}) if accepted else {}
        if accepted:
            self.results.add(req.seq)
        for other in others:
            if other in requests:
                requests[other].cancelled = True
        self.hedge("completion")
        self.dispatch()
        self.consume()
        return accepted

    def consume(self) -> None:
        sched = self.sched
        while sched.delivered in self.results:
            self.results.discard(sched.delivered)
            sched.take_delivered()
            self.delivered += 1
            self.dispatch()
        if sched.finished():
            self.end_pass()

    def on_lost(self, address: str) -> None:
        state = self.sched.workers.get(address)
        if state is None or state.status == "lost":
            return
        requeued, blamed = self.sched.worker_lost(address)
        for seq in requeued:
            self.requests.get(seq, {}).pop(address, None)
        if blamed is not None and self.sched.losses.get(blamed, 0) > MAX_RETRIES:
            self.poison += 1  # the loader would raise PoisonSampleError; the simulation goes on
        self.dispatch()

    def on_join(self, address: str) -> None:
        self.sched.add_worker(address)
        self.dispatch()

    def poll(self) -> None:
        self.hedge("poll")
        self.dispatch()
        self.consume()
        self.sim.at(self.sim.now + POLL, self.poll)


# -- cases ------------------------------------------------------------------------------
def pareto(alpha: float, cap: float):
    def draw(rng: random.Random, n: int) -> list[float]:
        return [min(rng.paretovariate(alpha), cap) for _ in range(n)]

    return draw


def one_slow(factor: float):
    def draw(rng: random.Random, n: int) -> list[float]:
        return [factor if i == n - 1 else 1.0 for i in range(n)]

    return draw


@dataclass
class Case:
    name: str
    workers: int
    trainers: int
    slowness: Callable
    pass_length: int = 64
    seconds: float = 60.0
    credits: int = 2
    base: float = 0.2  # seconds per batch of a worker with slowness 1
    jitter: float = 0.25
    death_fraction: float = 0.0
    stall_fraction: float = 0.0
    stall_seconds: tuple = (1.0, 5.0)
    joins: int = 0
    scripted: tuple = ()


def cases() -> list[Case]:
    tail = pareto(2.0, 20.0)

    def pareto_faults(workers: int, trainers: int, seconds: float, joins: int) -> Case:
        """Pareto slowness and random faults: 5% of the workers die, 10% stall, ``joins`` join."""
        name = f"{workers}w/{trainers}t, Pareto, faults"
        return Case(
            name,
            workers,
            trainers,
            tail,
            seconds=seconds,
            death_fraction=0.05,
            stall_fraction=0.1,
            joins=joins,
        )

    return [
        Case("4w/1t, one 4x slower", 4, 1, one_slow(4.0), seconds=120),
        Case(
            "4w/1t, one 4x slower, faults",
            4,
            1,
            one_slow(4.0),
            seconds=120,
            scripted=(("stall", 0.3, 0, 3.0), ("die", 0.5, 1, None), ("join", 0.7, None, 1.0)),
        ),
        Case("48w/4t, Pareto", 48, 4, tail, seconds=60),
        pareto_faults(48, 4, seconds=60, joins=3),
        Case("48w/4t, Pareto, pass 1024", 48, 4, tail, pass_length=1024, seconds=120),
        Case("1000w/64t, Pareto", 1000, 64, tail, seconds=40),
        pareto_faults(1000, 64, seconds=40, joins=50),
        Case("1000w/8t, Pareto, pass 1024", 1000, 8, tail, pass_length=1024, seconds=40),
    ]


def run_case(case: Case, scheduler_cls, mode: str, seed: int, scale: float) -> dict:
    meter = Meter()
    sim = Sim(case, scheduler_cls, mode, meter, seed)
    # One process holds every trainer's schedulers here (each trainer has its own process
    # in reality): without this, full collections over all of them land on whichever
    # call happens to allocate, and the simulation itself makes no garbage cycles.
    gc.collect()
    gc.disable()
    wall = time.perf_counter()
    try:
        sim.run(case.seconds * scale)
    finally:
        gc.enable()
    wall = time.perf_counter() - wall
    delivered = sum(t.delivered for t in sim.trainers)
    passes = [s for t in sim.trainers for s in t.pass_seconds]
    return {
        "case": case.name,
        "mode": mode,
        "fraction": delivered / sim.capacity_integral,
        "busy": sim.busy_integral / sim.capacity_integral,
        "wasted": sim.wasted / sim.capacity_integral,
        "delivered": delivered,
        "passes": len(passes),
        "pass_s": sum(passes) / len(passes) if passes else float("nan"),
        "dispatch_us": meter.per("dispatch"),
        "completion_us": meter.per("completion"),
        "poll_us": meter.per("poll"),
        "start_ms": meter.per("start") / 1000,
        "poison": sum(t.poison for t in sim.trainers),
        "wall_s": wall,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheduler", help="path of a scheduler.py to drive (default: this checkout's)")
    parser.add_argument("--cases", nargs="*", help="substrings of the case names to run (default: all)")
    parser.add_argument(
        "--modes",
        nargs="*",
        default=["as-is", "hints"],
        help="as-is: the loader's current calls; hints: also pass_length= and the previous "
        "pass's estimates= (where the scheduler takes them)",
    )
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every case's simulated seconds")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    scheduler_cls = load_scheduler(args.scheduler)
    params = inspect.signature(scheduler_cls).parameters
    modes = [m for m in args.modes if m == "as-is" or "pass_length" in params]
    print(
        "| case | mode | fraction of ideal | passes | mean pass s | µs/dispatch | µs/completion | µs/poll | ms/pass start | busy | wasted | sim wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for case in cases():
        if args.cases and not any(c in case.name for c in args.cases):
            continue
        for mode in modes:
            r = run_case(case, scheduler_cls, mode, args.seed, args.scale)
            poison = f" ({r['poison']} poison)" if r["poison"] else ""
            print(
                f"| {r['case']} | {r['mode']} | {r['fraction']:.1%}{poison} | {r['passes']} | {r['pass_s']:.2f} | "
                f"{r['dispatch_us']:.1f} | {r['completion_us']:.1f} | {r['poll_us']:.1f} | {r['start_ms']:.2f} | "
                f"{r['busy']:.1%} | {r['wasted']:.1%} | {r['wall_s']:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
