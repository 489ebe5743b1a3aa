"""Deprecated: ``torchfeed.pools.Pool`` is :class:`torchfeed.scaling.WorkerPool`."""

from __future__ import annotations

from .deprecation import moved_module

__getattr__ = moved_module(__name__)
