"""The demo (``torchfeed demo``) and the benchmark cases (``torchfeed bench``,
``benchmarks/compare.py``): programs built on the library, kept out of its top level.

``demo`` trains a small CNN fed by local workers; ``bench`` and ``bench_epochs`` hold the
cases compared with torch's DataLoader; ``measure`` the datasets and timing they share.
"""

__all__: list[str] = []
