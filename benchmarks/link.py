"""Over a real link: what a RemoteDataLoader delivers through a loopback shaped by tc's tbf.

Runs each batch kind (token ids, uint8 photos, float32 values) with 2 local workers, over
plain loopback and inside network namespaces (``unshare --net``, root) whose loopback is
capped at each rate; prints delivered MB/s and the share of the link's rate. The method
and the code are in :mod:`torchfeed.tools.link`.

Usage: ``python benchmarks/link.py [tokens photos floats] [--rates 1gbit,4gbit] [--seconds 5]``.
"""

from __future__ import annotations

import sys

from torchfeed.tools.link import main

if __name__ == "__main__":
    sys.exit(main())
