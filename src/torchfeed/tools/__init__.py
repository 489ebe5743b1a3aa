"""The demo (``torchfeed demo``) and the benchmark cases (``torchfeed bench``,
``benchmarks/compare.py``): programs built on the library, kept out of its top level.

``demo`` trains a small CNN fed by local workers; ``bench`` and ``bench_epochs`` hold the
cases compared with torch's DataLoader; ``measure`` the datasets and timing they share.
"""

# The benchmark cases, listed once: name -> what it measures. `torchfeed bench` lists and
# checks them from here without importing torch; tools/bench.py gives each its function.
BENCH_CASES = {
    "cpu": "Pillow JPEG decode + random crop, batch 32: samples/s",
    "transfer": "ready 3x224x224 float32 tensors, batch 64 (38.5 MB): MB/s",
    "overhead": "tiny samples, batch_size=1: items/s",
    "straggler": "4 sleep-bound workers, one 4x slower: % of ideal rate",
    "stall": "4 sleep-bound workers, one 4x slower, one stalling 5 s every 50 batches",
    "epochs": "4 sleep-bound workers, one 4x slower, 5 passes of 64 batches with the gaps between them",
    "tiny": "tiny samples, batch_size=1: items/s and the trainer's CPU per batch",
    "shared": "48 sleep-bound workers shared by 4 trainer processes: % of ideal",
    "cache": "600 JPEGs decoded + resized once (torchfeed.cached), random crop + flip each time: epoch 2 vs epoch 1",
}

__all__ = ["BENCH_CASES"]
