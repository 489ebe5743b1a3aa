"""torchfeed on Ray: :class:`Pool`, torchfeed workers as Ray actors for :func:`torchfeed.autoscale`.

Importing this package imports Ray (``pip install 'torchfeed[ray]'``).
"""

from __future__ import annotations

from ..scaling.ray_pool import Pool

__all__ = ["Pool"]
