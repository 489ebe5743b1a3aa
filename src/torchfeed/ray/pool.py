"""torchfeed workers as Ray actors, for :func:`torchfeed.autoscale` (:class:`RayPool`).

One actor per torchfeed worker, one CPU each, placed by Ray resources (``resources=``) or
node labels (``label_selector=``) so that data workers land on CPU nodes, not on the GPU
nodes the trainers use. Ray schedules; the pool only asks:

* ``scale(n)`` creates actors up to ``n`` and tells Ray's autoscaler what they need
  (``ray.autoscaler.sdk.request_resources``); actors that stay unplaced for
  ``place_timeout`` seconds are reported once per request, with what Ray says it has;
* an actor is started in two steps: it is placed and says on which node; the pool checks
  that the secret may travel there (:mod:`torchfeed.ray.nodes`) and only then sends it
  (or a secret file's path) with the call that starts the worker;
* ``retire(addresses)`` stops those (drained) workers and kills their actors;
* an actor or worker that dies (a node lost, ``ray.kill``) leaves :meth:`RayPool.addresses`;
  the loader requeues its batches, and the pool starts a replacement (the target holds).

One thread (``torchfeed-ray-pool``, :class:`~torchfeed.scaling.pool.BasePool`) owns every change;
public methods only read or queue.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray

from ..protocol import auth
from ..scaling.pool import BasePool
from ..worker.options import WorkerOptions
from . import nodes
from .actor import WorkerActor

log = logging.getLogger("torchfeed.ray")

BACKOFF_MAX = 30.0  # seconds between two tries to start a worker that keeps failing

_actor_class: Any = None


def actor_class() -> Any:
    """The Ray actor class of :class:`~torchfeed.ray.actor.WorkerActor` (made once per process)."""
    global _actor_class
    if _actor_class is None:
        _actor_class = ray.remote(WorkerActor)
    return _actor_class


def _reason(exc: BaseException) -> str:
    """What went wrong in an actor's call, without Ray's per-actor details (pids, ids): the
    exception the method raised, or Ray's own error for a dead actor."""
    cause = getattr(exc, "cause", None)
    shown = cause if isinstance(cause, BaseException) else exc
    text = str(shown).strip()
    return f"{type(shown).__name__}: {text}" if text else type(shown).__name__


def node_address(node_id: str) -> str:
    """The address Ray reaches node ``node_id`` at (its node manager's; what its channels use)."""
    for node in ray.nodes():
        if node.get("NodeID") == node_id:
            return node["NodeManagerAddress"]
    raise LookupError(f"Ray lists no node {node_id}")


@dataclass
class _Member:
    """One actor and where it is in its life: placing -> starting -> ready."""

    handle: Any
    asked: float  # when it was created
    state: str = "placing"  # placing | starting | ready
    pending: Any = None  # the ObjectRef being waited for: node(), start() or watch()
    address: str = ""
    node: str = ""


class RayPool(BasePool):
    """torchfeed workers as Ray actors: a :class:`torchfeed.scaling.pool.WorkerPool` (see the module docstring).

    Its thread (``torchfeed-ray-pool``, see :class:`~torchfeed.scaling.pool.BasePool`) creates,
    starts, watches and kills the actors; :meth:`close` waits up to 30 s for it, then stops
    every worker and kills every actor of the pool.

    Parameters
    ----------
    n : int, optional
        Workers to ask for at once.
    resources : dict, optional
        Ray resources each actor needs besides its CPU, e.g. ``{"cpu_pool": 1}`` offered by
        the CPU nodes (``ray start --resources='{"cpu_pool": 16}'``).
    label_selector : dict, optional
        Node labels the actors must land on (Ray's ``label_selector``, Ray 2.49 and later),
        e.g. ``{"pool": "cpu"}`` for nodes started with ``ray start --labels='{"pool": "cpu"}'``.
    num_cpus : float
        CPUs per actor (one torchfeed worker process uses one).
    secret, secret_file, allow_insecure
        The secret (default: the session's, see :mod:`torchfeed.protocol.auth`), or a secret
        file every node has (only its path is sent); ``allow_insecure`` sends the secret over
        unencrypted Ray connections that leave this machine.
    host : str, optional
        Interface the workers bind (default: their node's IP as Ray knows it).
    options : WorkerOptions, optional
        How each torchfeed worker serves (``torchfeed worker``'s options, see
        :class:`torchfeed.worker.options.WorkerOptions`); ``parallel`` and ``threads``, when given, replace its own.
    worker_args
        Any other ``torchfeed worker`` arguments.
    start_timeout : float
        Seconds a placed actor's torchfeed worker may take to start (a failed start is
        reported once per reason and tried again later).
    place_timeout : float
        Seconds after which actors Ray has not placed are reported (once per request).
    poll : float
        Seconds between two looks at the actors.
    """

    label = "torchfeed.ray.Pool"
    thread_name = "torchfeed-ray-pool"
    close_timeout = 30.0
    unknown_holder = "no actor serves"
    wait_failed_text = (
        "{label}: {ready} of {n} workers ready after {timeout:g} s (asked Ray for {requested}); see the "
        "log of torchfeed.ray and `ray status`"
    )

    def __init__(
        self,
        n: int | None = None,
        *,
        resources: dict[str, float] | None = None,
        label_selector: dict[str, str] | None = None,
        num_cpus: float = 1,
        secret: auth.SecretLike = None,
        secret_file: str | os.PathLike[str] | None = None,
        allow_insecure: bool = False,
        host: str | None = None,
        parallel: int | None = None,
        threads: int | None = None,
        options: WorkerOptions | None = None,
        worker_args: Sequence[str] = (),
        start_timeout: float = 120.0,
        place_timeout: float = 60.0,
        poll: float = 0.5,
    ):
        if not ray.is_initialized():
            raise RuntimeError(
                "torchfeed.ray.Pool needs a connected Ray driver: call ray.init(address=...) first "
                "(ray.init(address='auto') joins the cluster started on this machine)"
            )
        if secret is not None and secret_file is not None:
            raise ValueError("give secret= or secret_file=, not both")
        self._file: str | None = None
        self._value: bytes | None = None
        if secret_file is not None:
            self._file = os.path.abspath(os.path.expanduser(os.fspath(secret_file)))
            self.secret = auth.secret_from_file(self._file)
        else:
            self.secret = auth.load_secret(secret) if secret is not None else auth.load_secret()
            try:
                self.secret.value.decode()
            except UnicodeDecodeError:
                raise ValueError(
                    "torchfeed.ray.Pool sends the secret as text: use a text secret (e.g. "
                    "secrets.token_hex(32)) or secret_file="
                ) from None
            self._value = self.secret.value
        self.allow_insecure = allow_insecure
        self.resources = dict(resources or {})
        self.label_selector = dict(label_selector or {})
        self.num_cpus = num_cpus
        self.host = host
        self.options = (options or WorkerOptions()).merged(parallel=parallel, threads=threads)
        self.worker_args = list(worker_args)
        self.start_timeout = start_timeout
        self.place_timeout = place_timeout
        self.driver_ip = node_address(ray.get_runtime_context().get_node_id())
        super().__init__(poll, log)
        self._members: dict[str, _Member] = {}  # actor id -> member (placing, starting, ready)
        self._said: set[str] = set()  # what was logged once (unplaced actors, refusals)
        self._backoff = 0.0  # seconds the last failed start made the next one wait
        self._grow_after = 0.0  # monotonic time before which no actor is created
        self._next_look = 0.0  # monotonic time of the next look at Ray's free resources
        self._start_thread()
        if n:
            self.scale(n)

    def actors(self) -> dict[str, Any]:
        """``address -> actor handle`` of the ready workers (e.g. to ``ray.kill`` one in a test)."""
        with self._lock:
            return {m.address: m.handle for m in self._members.values() if m.state == "ready"}

    # -- the engine's steps (BasePool's hooks) ---------------------------------------------
    def _ready_addresses(self) -> list[str]:
        return sorted(m.address for m in self._members.values() if m.state == "ready")

    def _claim(self, addresses: Sequence[str]) -> tuple[list[str], int, list[str]]:
        known = {m.address for m in self._members.values() if m.state == "ready"}
        gone = [a for a in addresses if a in known]
        return gone, len(gone), gone

    def _scaled(self, n: int) -> None:
        self._said.discard("unplaced")  # a new request: said again if it is not met either

    def _release(self) -> None:
        with self._lock:
            members, self._members = list(self._members.values()), {}
        self._stop(members)

    def _step(self) -> None:
        """Grow to the target, move each actor along, notice dead ones, report stuck ones."""
        with self._lock:
            missing = self._target - len(self._members)
        if missing > 0 and time.monotonic() >= self._grow_after:
            self._create(missing)
        with self._lock:
            members = list(self._members.items())
        waiting = {m.pending.hex(): (key, m) for key, m in members if m.pending is not None}
        if waiting:
            refs = [m.pending for _, m in waiting.values()]
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            for ref in done:
                key, m = waiting[ref.hex()]
                self._advance(key, m, ref)
        self._report_unplaced(time.monotonic())

    def _options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"num_cpus": self.num_cpus, "max_concurrency": 4, "max_restarts": 0}
        if self.resources:
            opts["resources"] = self.resources
        if self.label_selector:
            opts["label_selector"] = self.label_selector
        return opts

    def _create(self, count: int) -> None:
        with self._lock:
            total = self._target
        bundle = {"CPU": self.num_cpus, **self.resources}
        try:  # Ray's autoscaler (where there is one) brings nodes for all of them
            from ray.autoscaler.sdk import request_resources

            request_resources(bundles=[bundle] * total)
        except Exception as exc:  # noqa: BLE001 - no autoscaler: the actors wait for room
            self._say_once("request", f"torchfeed.ray.Pool: Ray's autoscaler refused the request: {exc}")
        cls = actor_class().options(**self._options())
        now = time.monotonic()
        for _ in range(count):
            handle = cls.remote()
            m = _Member(handle, now)
            m.pending = handle.node_id.remote()
            with self._lock:
                self._members[secrets.token_hex(8)] = m

    def _advance(self, key: str, m: _Member, ref: Any) -> None:
        try:
            value = ray.get(ref, timeout=10)
        except Exception as exc:  # noqa: BLE001 - the actor died or its call failed
            self._lost(key, m, _reason(exc))
            return
        if m.state == "placing":
            m.node = value = node_address(value)
            reason = (
                None
                if self._file is not None or self.allow_insecure
                else nodes.clear_reason(self.driver_ip, value)
            )
            if reason is not None:
                self._say_once("clear", nodes.refusal(f"torchfeed.ray.Pool (an actor on {value})", reason))
                self._drop(key, m)
                with self._lock:
                    self._target = max(self._target - 1, 0)
                return
            m.state = "starting"
            m.pending = m.handle.start.remote(
                self._value if self._file is None else None,
                self._file,
                self.host or value,
                self.options,
                self.worker_args,
                self.start_timeout,
            )
        elif m.state == "starting":
            self._backoff = 0.0
            m.address = value
            m.pending = m.handle.watch.remote()
            with self._lock:
                m.state = "ready"
            log.debug("torchfeed.ray.Pool: worker %s ready on node %s", value, m.node)
        else:  # watch() returned: the worker stopped
            self._lost(key, m, value)

    def _lost(self, key: str, m: _Member, why: str) -> None:
        self._drop(key, m)
        if self._closed:
            return
        if m.state == "ready":
            first = why.splitlines()[0][:300] if why else "no reason given"
            log.warning("torchfeed.ray.Pool: worker %s is gone (%s); starting another", m.address, first)
            return
        # a worker that did not start: the next try waits (doubling up to BACKOFF_MAX), and
        # the same reason is said once, not at every try
        self._backoff = min(max(2 * self._backoff, 1.0), BACKOFF_MAX)
        self._grow_after = time.monotonic() + self._backoff
        self._say_once(
            f"start:{why}",
            f"torchfeed.ray.Pool: a worker actor{' on ' + m.node if m.node else ''} could not start its "
            f"torchfeed worker: {why}; trying again in {self._backoff:g} s",
        )

    def _drop(self, key: str, m: _Member) -> None:
        with self._lock:
            self._members.pop(key, None)
        try:
            ray.kill(m.handle)
        except Exception:  # noqa: BLE001,S110 - already dead
            pass

    def _shrink(self, addresses: list[str]) -> None:
        with self._lock:
            going = [m for m in self._members.values() if m.state == "ready" and m.address in addresses]
            for key in [k for k, m in self._members.items() if m in going]:
                del self._members[key]
        self._stop(going)

    def _stop(self, members: list[_Member]) -> None:
        stops = [m.handle.stop.remote() for m in members if m.state != "placing"]
        if stops:
            ray.wait(stops, num_returns=len(stops), timeout=15)
        for m in members:
            try:
                ray.kill(m.handle)
            except Exception:  # noqa: BLE001,S110 - already dead
                pass

    def _report_unplaced(self, now: float) -> None:
        """Say once per request when actors wait past ``place_timeout`` and Ray has no room for
        one (actors whose processes are merely slow to start are not reported)."""
        with self._lock:
            said = "unplaced" in self._said
            waiting = sum(
                1
                for m in self._members.values()
                if m.state == "placing" and now - m.asked > self.place_timeout
            )
        if not waiting or said or now < self._next_look:
            return
        self._next_look = now + 5.0  # at most one look at Ray's resources per 5 s
        need = {"CPU": self.num_cpus, **self.resources}
        available, cluster = ray.available_resources(), ray.cluster_resources()
        free = {k: available.get(k, 0.0) for k in need}
        total = {k: cluster.get(k, 0.0) for k in need}
        if not self.label_selector and all(free[k] >= v for k, v in need.items()):
            return  # room for one more: they are being started (free is cluster-wide, labels per node)
        where = f" on nodes labelled {self.label_selector}" if self.label_selector else ""
        self._say_once(
            "unplaced",
            f"torchfeed.ray.Pool: {waiting} worker actor(s) asked for over {self.place_timeout:g} s are not "
            f"running: each needs {need}{where}; Ray reports {free} free of {total} in the cluster (the "
            "autoscaler was asked for them; see `ray status` for why no node came). Training goes on with "
            f"{len(self.addresses())} worker(s)",
        )

    def _say_once(self, key: str, text: str) -> None:
        with self._lock:
            if key in self._said:
                return
            self._said.add(key)
        log.warning(text)


Pool = RayPool  # the name torchfeed.ray.Pool documents

__all__ = ["RayPool", "Pool", "actor_class"]
