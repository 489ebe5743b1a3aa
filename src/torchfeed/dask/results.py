"""Files and metrics from the ranks back to the driver (:class:`ResultsHandler`)."""

from __future__ import annotations

import asyncio
import io
import logging
import os
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import distributed
import torch

from ..datasets.storage import open_url
from ..util import atomic_write

log = logging.getLogger(__name__)


def check_result_path(path: str) -> str:
    """``path`` if it is a safe relative ``/``-separated path, else ValueError."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"result path must be a non-empty string, not {path!r}")
    parts = path.split("/")
    if path.startswith("/") or "\\" in path or any(p in ("", ".", "..") for p in parts):
        raise ValueError(
            f"result path {path!r} must be relative to the prefix, '/'-separated, without '', '.' "
            "or '..' components (e.g. 'rank0/metrics-3.json')"
        )
    return path


def _to_bytes(data: Any) -> bytes:
    if isinstance(data, str):
        return data.encode()
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    buf = io.BytesIO()
    torch.save(data, buf)  # state_dicts, tensors, any picklable object; read back with torch.load
    return buf.getvalue()


def _current_rank() -> int | None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    rank = os.environ.get("RANK")
    return int(rank) if rank and rank.isdigit() else None


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if hasattr(value, "item") and getattr(value, "shape", None) == ():
        return value.item()  # numpy scalars
    return value


def _write(fs, root: str, path: str, data: bytes) -> str:
    target = f"{root.rstrip('/')}/{path}"
    if "file" in (fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)):
        atomic_write(target, data)  # readers see the old file or the whole new one
        return target
    fs.pipe_file(target, data)  # one PUT: object stores publish an object whole or not at all
    return fs.unstrip_protocol(target)


class ResultsHandler:
    """Files and metrics from the ranks to the driver, through the Dask scheduler.

    Create it on the driver, pass it to the ranks (it pickles as its key), call
    :meth:`submit_result` / :meth:`submit_metrics` there, and :meth:`process_results`
    or :meth:`metrics` on the driver. Nothing is lost when the driver reads late:
    items wait in Dask queues. Payloads above ``inline_limit`` bytes stay on the rank's
    Dask worker and are fetched from it directly, not through the scheduler.

    Parameters
    ----------
    key : str, optional
        Names this handler's queues (random by default).
    inline_limit : int
        Largest payload sent through the scheduler.
    """

    def __init__(self, key: str | None = None, *, inline_limit: int = 1 << 20):
        self.key = key or uuid.uuid4().hex
        self.inline_limit = inline_limit
        self._queues: dict[str, distributed.Queue] = {}

    def __getstate__(self) -> dict:
        return {"key": self.key, "inline_limit": self.inline_limit}

    def __setstate__(self, state: dict) -> None:
        ResultsHandler.__init__(self, state["key"], inline_limit=state["inline_limit"])

    def _queue(self, kind: str) -> distributed.Queue:
        queue = self._queues.get(kind)
        if queue is None:
            try:
                client = distributed.get_client()
            except ValueError:
                raise RuntimeError(
                    "ResultsHandler needs Dask: call it inside a Dask task (e.g. a function "
                    "started by torchfeed.dask.run) or where a distributed.Client exists"
                ) from None
            queue = self._queues[kind] = distributed.Queue(f"torchfeed-{kind}-{self.key}", client=client)
        return queue

    # -- on the ranks

    def submit_result(self, path: str, data: str | bytes | Any) -> None:
        """Send ``data`` to be written at ``prefix/path`` by :meth:`process_results`.

        ``str`` is written UTF-8 encoded, ``bytes`` as they are, anything else (a
        ``state_dict``...) with ``torch.save`` (read it back with ``torch.load``).
        """
        check_result_path(path)
        payload = _to_bytes(data)
        if len(payload) <= self.inline_limit:
            self._queue("results").put({"path": path, "rank": _current_rank(), "data": payload})
            return
        client = distributed.get_client()
        here = [distributed.get_worker().address] if _in_worker() else None
        [future] = client.scatter([(path, _current_rank(), payload)], workers=here, hash=False)
        self._queue("results").put(future)

    def submit_metrics(self, metrics: Mapping[str, Any] | None = None, **values: Any) -> None:
        """Send one metrics dict (numbers, strings, lists; scalar tensors become numbers).

        ``rank`` is added when missing and known.
        """
        record = {k: _plain(v) for k, v in dict(metrics or {}, **values).items()}
        if "rank" not in record:
            record["rank"] = _current_rank()
        self._queue("metrics").put(record)

    # -- on the driver

    def process_results(
        self,
        prefix: str,
        futures,
        raise_errors: bool = True,
        *,
        storage_options: dict[str, Any] | None = None,
        on_metrics=None,
        poll_interval: float = 0.2,
    ) -> list[str]:
        """Write results under ``prefix`` as they arrive, until ``futures`` finish.

        Each file is written atomically: locally to a temporary name then renamed, on
        object stores with a single PUT.

        Parameters
        ----------
        prefix : str
            Local directory or fsspec URL (``s3://bucket/run1``).
        futures : Future or list of Future
            The ranks (from :func:`run`).
        raise_errors : bool
            Raise the first failure (after writing what arrived), or log failures and go on.
        storage_options : dict, optional
            fsspec options for ``prefix``.
        on_metrics : callable, optional
            Called with each metrics dict while waiting (otherwise metrics stay for :meth:`metrics`).
        poll_interval : float
            Longest wait between checks, in seconds.

        Returns
        -------
        list of str
            The paths written, in arrival order.
        """
        fs, root = open_url(prefix, storage_options)
        written: list[str] = []

        def drain() -> None:
            for item in self._queue("results").get(batch=True):
                if isinstance(item, distributed.Future):
                    path, _rank, data = item.result()
                    item.release()
                else:
                    path, data = item["path"], item["data"]
                written.append(_write(fs, root, check_result_path(path), data))
            if on_metrics is not None:
                for record in self._queue("metrics").get(batch=True):
                    on_metrics(record)

        for _ in self._follow(futures, raise_errors, poll_interval, drain):
            pass
        return written

    def metrics(
        self, futures, raise_errors: bool = True, poll_interval: float = 0.2
    ) -> Iterator[dict[str, Any]]:
        """Yield metrics dicts as the ranks send them, until ``futures`` finish."""
        pending: list[dict[str, Any]] = []
        for _ in self._follow(
            futures,
            raise_errors,
            poll_interval,
            lambda: pending.extend(self._queue("metrics").get(batch=True)),
        ):
            while pending:
                yield pending.pop(0)

    def _follow(self, futures, raise_errors: bool, poll_interval: float, drain) -> Iterator[None]:
        futures = [futures] if isinstance(futures, distributed.Future) else list(futures)
        reported = set()
        while True:
            finished = all(f.done() for f in futures)  # before draining: later items belong to a later pass
            drain()
            yield
            for f in futures:
                if f.key in reported or f.status not in ("error", "cancelled"):
                    continue
                reported.add(f.key)
                exc = (
                    f.exception()
                    if f.status == "error"
                    else distributed.client.FutureCancelledError(f.key, reason=None)
                )
                if raise_errors:
                    raise exc
                log.error("%s failed: %s", f.key, exc)
            if finished:
                return
            try:
                distributed.wait(
                    [f for f in futures if not f.done()], timeout=poll_interval, return_when="FIRST_COMPLETED"
                )
            except (TimeoutError, asyncio.TimeoutError):
                pass

    def close(self) -> None:
        """Release this process's handles on the queues (on the driver, after processing)."""
        for queue in self._queues.values():
            try:
                queue.close()
            except Exception:  # noqa: BLE001 - client already gone
                pass
        self._queues.clear()


def _in_worker() -> bool:
    try:
        distributed.get_worker()
        return True
    except ValueError:
        return False
