"""``torchfeed top``: a live view of workers (CPU, memory, request and byte rates, load).

Each refresh asks every worker for its statistics over the normal authenticated
connection (a STATS message, see :mod:`torchfeed.worker.counters`; the secret is discovered
as for every client). ``--once --json`` prints one JSON document for scripts, whose rows
hold every column of the table under the column's own name (and a few more).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

# (name, format): a column's header is the key of its value in the JSON rows of --once --json
COLUMNS = [
    ("address", "{}"),
    ("pid", "{}"),
    ("cpu_percent", "{:.0f}"),
    ("rss_mb", "{:.0f}"),
    ("requests_per_s", "{:.1f}"),
    ("mb_per_s_sent", "{:.2f}"),
    ("wire_mb_per_s_sent", "{:.2f}"),  # after compression
    ("clients", "{}"),
    ("queued", "{}"),
    ("errors", "{}"),
    ("cache_mb", "{:.0f}"),
    ("cache_hit_percent", "{:.0f}"),
]
# every number a worker's statistics hold (see torchfeed.worker.counters); rss_mb is made here
NUMBERS = (
    "pid",
    "cpu_percent",
    "rss_bytes",
    "requests_per_s",
    "mb_per_s_sent",
    "wire_mb_per_s_sent",
    "clients",
    "queued",
    "errors",
    "requests",
    "bytes_sent",
    "wire_bytes_sent",
    "parallel",
    "uptime_s",
    "cache_budget",
    "cache_bytes",
    "cache_entries",
    "cache_notes",
    "cache_hits",
    "cache_misses",
    "cache_refused",
)
_BIG = 1 << 63
_CLEAR = "\x1b[H\x1b[2J"


HELP = "live view of workers: CPU, memory, requests/s, MB/s, clients, queue, errors"
DESCRIPTION = (
    "Show what workers are doing, refreshed every --interval seconds (Ctrl-C stops). Connects as a "
    "trainer does (same secret discovery)."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("addresses", nargs="*", metavar="HOST:PORT", help="workers to show")
    p.add_argument("--workers-file", metavar="F", help="also show the workers listed in this file")
    p.add_argument("--once", action="store_true", help="show one refresh and exit")
    p.add_argument("--json", action="store_true", help="with --once: print one JSON document")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default 2)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each worker (default 5)")


def collect(addresses: list[str], timeout: float) -> list[dict[str, Any]]:
    """One row per worker: its statistics, or ``{"address", "error"}`` when it did not answer."""
    from ..client import worker_stats as query

    def one(address: str) -> dict[str, Any]:
        try:
            return checked(address, query(address, timeout=timeout))
        except Exception as exc:  # noqa: BLE001 - shown in the row
            return {"address": address, "error": f"{type(exc).__name__}: {exc}"}

    if not addresses:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(addresses))) as pool:
        return list(pool.map(one, addresses))


def _number(value: Any) -> int | float | None:
    if type(value) is int and -_BIG < value < _BIG:
        return value
    if type(value) is float and math.isfinite(value):
        return value
    return None


def checked(address: str, stats: dict[str, Any]) -> dict[str, Any]:
    """A row from a worker's statistics: the numbers top knows, each an int or a finite float
    (else None); nothing else the worker sent (its strings never reach the terminal)."""
    row: dict[str, Any] = {"address": address}
    for key in NUMBERS:
        row[key] = _number(stats.get(key))
    rss = row["rss_bytes"]
    row["rss_mb"] = None if rss is None else rss / 1e6  # the table's unit, under the table's name
    cached, hits, misses = row["cache_bytes"], row["cache_hits"], row["cache_misses"]
    row["cache_mb"] = None if cached is None else cached / 1e6
    looked = (hits or 0) + (misses or 0)
    row["cache_hit_percent"] = 100.0 * hits / looked if hits is not None and looked > 0 else None
    return row


def printable(text: str) -> str:
    """``text`` with every non-printable character (escape sequences, BEL, newlines, Unicode
    controls and direction overrides) written as a Python escape, so a terminal shows it."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def format_rows(rows: list[dict[str, Any]]) -> str:
    table = [[name for name, _ in COLUMNS]]
    for row in rows:
        if "error" in row:
            table.append([printable(row["address"]), "-", "unreachable: " + printable(row["error"])[:60]])
            continue
        cells = [printable(row["address"])]
        for key, fmt in COLUMNS[1:]:
            value = _number(row.get(key))
            cells.append("-" if value is None else fmt.format(value))
        table.append(cells)
    widths = [max(len(r[i]) for r in table if i < len(r)) for i in range(len(COLUMNS))]
    return "\n".join(
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in table
    )


def _addresses(args) -> list[str]:
    from ..client import format_address
    from ..loader.membership import read_workers_file

    listed = [format_address(a) for a in args.addresses]
    if args.workers_file:
        listed += read_workers_file(args.workers_file)
    return list(dict.fromkeys(listed))


def run(args, out=None) -> int:
    out = out or sys.stdout
    if args.json and not args.once:
        print("torchfeed top: error: --json needs --once (one JSON document)", file=sys.stderr)
        return 2
    try:
        addresses = _addresses(args)
    except OSError as exc:
        print(f"torchfeed top: error: cannot read the workers file: {exc}", file=sys.stderr)
        return 2
    if not addresses:
        print(
            "torchfeed top: error: give worker addresses (HOST:PORT ...) or --workers-file F", file=sys.stderr
        )
        return 2
    if args.once:
        rows = collect(addresses, args.timeout)
        if args.json:
            out.write(json.dumps({"time": time.time(), "workers": rows}) + "\n")
        else:
            out.write(format_rows(rows) + "\n")
        return 1 if all("error" in r for r in rows) else 0
    try:
        while True:
            rows = collect(addresses, args.timeout)
            stamp = time.strftime("%H:%M:%S")
            out.write(f"{_CLEAR}torchfeed top  {stamp}  ({len(rows)} workers, every {args.interval:g} s)\n\n")
            out.write(format_rows(rows) + "\n")
            out.flush()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
