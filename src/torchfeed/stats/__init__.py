"""Is the trainer waiting for data? Live loader and per-worker statistics.

:class:`Accounting` (:mod:`torchfeed.stats.accounting`) holds one loader's counters, updated
by its passes; :meth:`Accounting.snapshot` gives a :class:`LoaderStats` with per-worker
:class:`WorkerStats` and one sentence of advice (:mod:`torchfeed.stats.report`).
"""

from __future__ import annotations

from .accounting import WINDOW, Accounting
from .report import INPUT_BOUND, LINK_BOUND, LoaderStats, WorkerStats, advise

__all__ = ["Accounting", "LoaderStats", "WorkerStats", "advise", "INPUT_BOUND", "LINK_BOUND", "WINDOW"]
