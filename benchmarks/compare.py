#!/usr/bin/env python
"""Compare torchfeed's RemoteDataLoader with torch's DataLoader and write a markdown report.

    python benchmarks/compare.py                      # every case, results in benchmarks/results.md
    python benchmarks/compare.py --cases overhead cpu --seconds 3 --out /tmp/r.md

Runs the same cases as ``torchfeed bench`` (they live in :mod:`torchfeed.tools.bench`), prints
the table and writes it, with the machine's description and every run, as markdown.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

try:
    import torchfeed  # noqa: F401
except ImportError:  # a source checkout without `pip install -e .`: use src/, for the workers too
    SRC = str(HERE.parent / "src")
    sys.path.insert(0, SRC)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p)

from torchfeed.tools import bench, measure  # noqa: E402


def markdown_report(info, results, args, command: str) -> str:
    lines = [
        "# torchfeed vs torch DataLoader",
        "",
        f"Generated {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z} by `{command}`.",
        "",
        *[f"- {k}: {v}" for k, v in info.items()],
        f"- {args.workers} worker processes per side ({measure.STRAGGLER_WORKERS} in `straggler`); "
        f"best of {args.repeats} alternating runs of ~{args.seconds:g} s per side, after a warm-up",
        "",
        bench.format_markdown(results),
        "",
        f"Load average at the end: {bench.machine_info()['load average (1/5/15 min)']}.",
        "",
        "`ratio` is torchfeed / torch. For `straggler` the columns are each loader's rate as a "
        "fraction of the ideal rate (the sum of the workers' own rates) and the target applies "
        "to torchfeed's fraction. See benchmarks/README.md for what each case measures.",
        "",
        "## Details",
        "",
        *[f"- {line}" for line in bench.format_notes(results)],
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cases", nargs="*", default=[], choices=list(bench.CASES), help="cases to run (default: all)"
    )
    parser.add_argument("--workers", type=int, default=2, help="worker processes per side (default 2)")
    parser.add_argument("--seconds", type=float, default=6.0, help="approximate seconds per measurement")
    parser.add_argument("--repeats", type=int, default=2, help="measurements per side (the best is kept)")
    parser.add_argument("--out", default=str(HERE / "results.md"), help="markdown file to write")
    args = parser.parse_args(argv)

    info = bench.machine_info()
    for k, v in info.items():
        print(f"{k}: {v}")
    results = bench.run_cases(args.cases, args.workers, args.seconds, args.repeats)
    print()
    print(bench.format_table(results))
    print()
    for line in bench.format_notes(results):
        print(line)
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__), *sys.argv[1:]])
    Path(args.out).write_text(markdown_report(info, results, args, command))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
