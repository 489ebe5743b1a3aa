"""What runs in each Ray actor of :class:`torchfeed.ray.Pool`: one ``torchfeed worker`` process.

The actor holds one CPU (and the resources or labels that place it on a CPU node). Its
methods are plain: :meth:`WorkerActor.node_id` says where it runs, :meth:`WorkerActor.start`
starts the worker (a :class:`~torchfeed.LocalWorkers` child that ends with the actor: it
watches a pipe from it), :meth:`WorkerActor.watch` returns only when the worker stops, so
the pool learns of a dead actor or worker from that call's result, and
:meth:`WorkerActor.stop` stops the worker. The secret arrives as a value only after the
pool checked the actor's node (:mod:`torchfeed.ray.nodes`), or as a file path.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

from ..local import LocalWorkers
from ..protocol import auth
from ..worker.options import WorkerOptions


class WorkerActor:
    """The body of a worker actor (made a Ray actor class by :func:`torchfeed.ray.pool.actor_class`)."""

    def __init__(self) -> None:
        self.workers: LocalWorkers | None = None
        self._stopped = threading.Event()

    def node_id(self) -> str:
        """Ray's id of the node this actor runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def start(
        self,
        secret: bytes | None,
        secret_file: str | None,
        host: str,
        options: WorkerOptions,
        worker_args: Sequence[str],
        timeout: float,
    ) -> str:
        """Start the torchfeed worker on ``host`` (the node's address as Ray knows it); its ``host:port``.

        ``secret``: the value (sent only where that is safe), or ``secret_file``: a path on
        this node. Nothing of the node's own ``TORCHFEED_SECRET`` is used.
        """
        env = {k: v for k, v in os.environ.items() if k not in (auth.ENV_SECRET, auth.ENV_SECRET_FILE)}
        if secret_file is not None:
            auth.secret_from_file(secret_file)  # checked here: a clear error names this node's file
            env[auth.ENV_SECRET_FILE] = secret_file
        elif secret is not None:
            env[auth.ENV_SECRET] = auth.load_secret(secret).value.decode()  # handed over on stdin
        else:
            raise ValueError("a torchfeed.ray worker needs the secret or a secret file")
        for name in (auth.ENV_SECRET, auth.ENV_SECRET_FILE):
            os.environ.pop(name, None)  # LocalWorkers reads the environment given, not the actor's
        self.workers = LocalWorkers(
            1, host=host, env=env, start_timeout=timeout, options=options, extra_args=list(worker_args)
        )
        return self.workers.addresses[0]

    def watch(self, every: float = 1.0) -> str:
        """Return when the worker stopped (or was stopped): why."""
        while not self._stopped.wait(every):
            w = self.workers
            if w is not None and w.processes and w.processes[0].poll() is not None:
                return f"the torchfeed worker exited with code {w.processes[0].returncode}"
        return "stopped"

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the worker (idempotent)."""
        self._stopped.set()
        if self.workers is not None:
            self.workers.close(timeout)
