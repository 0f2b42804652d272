"""Every benchmark in one list: what it is, what it costs, its full and smoke arguments, what it needs.

    python -m benchmarks.harness.registry --list                 # the table
    python -m benchmarks.harness.registry --smoke [--jobs 2] [--only NAME ...] [--output DIR]
    python -m benchmarks.harness.registry --bench                # make bench
    python -m benchmarks.harness.registry --run NAME [--smoke] [-- EXTRA ARGS]

``--smoke`` (``make bench-smoke``) runs every entry whose needs are met with its smoke arguments, each
in its own process, into a temporary results folder (``--output DIR`` keeps them there; never
``benchmarks/results``): it checks that every script still runs, not what it measures. ``--bench``
(``make bench``) runs the entries marked ``bench`` with their full arguments, then ``plot``, into
``benchmarks/results``. ``--run NAME`` runs one entry (its full arguments into ``benchmarks/results``,
or ``--smoke``'s into a temporary folder), with any arguments after ``--`` appended. An entry whose needs are not met is skipped with the reason.

The entries, their costs and their needs are listed in ``entries.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from benchmarks.harness.entries import COSTS, ENTRIES, Entry
from benchmarks.harness.runner import run_entry, run_many, skip_reason, table

__all__ = ["COSTS", "ENTRIES", "Entry", "main"]

BY_NAME = {entry.name: entry for entry in ENTRIES}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--list", action="store_true", help="print every entry (the default)")
    action.add_argument(
        "--bench", action="store_true", help="make bench: the entries marked bench, full size"
    )
    action.add_argument("--run", metavar="NAME", choices=list(BY_NAME), help="run one entry")
    parser.add_argument("--smoke", action="store_true", help="smoke arguments (alone: every runnable entry)")
    parser.add_argument("--only", nargs="+", choices=list(BY_NAME), help="with --smoke: these entries only")
    parser.add_argument("--output", type=Path, help="results folder (--smoke alone: a temporary one)")
    parser.add_argument("--jobs", type=int, default=1, help="with --smoke: entries run at once (default 1)")
    parser.add_argument("extra", nargs="*", help="with --run, after --: arguments appended to the entry's")
    args = parser.parse_args(argv)
    if args.extra and not args.run:
        parser.error("arguments after -- go with --run NAME")
    if (args.jobs != 1 or args.only) and (args.run or not args.smoke):
        parser.error("--jobs and --only go with --smoke alone (a measurement runs alone)")
    output = args.output.resolve() if args.output else None
    if args.smoke and not args.bench and output is None:  # a smoke run never writes into benchmarks/results
        with tempfile.TemporaryDirectory(prefix="bench-smoke-") as folder:
            print(f"smoke results in {folder} (removed at the end; --output DIR keeps them)", flush=True)
            return dispatch(args, Path(folder))
    return dispatch(args, output)


def dispatch(args: argparse.Namespace, output: Path | None) -> int:
    """Run what ``args`` asks, with its results in ``output`` (None: benchmarks/results)."""
    if args.run:
        entry = BY_NAME[args.run]
        reason = skip_reason(entry, args.smoke)
        if reason is not None:
            print(f"{entry.name}: skipped: {reason}")
            return 0
        return run_entry(entry, args.smoke, output, args.extra)[0]
    if args.bench:
        return 1 if run_many([e for e in ENTRIES if e.bench], smoke=False, output=output) else 0
    if not args.smoke:
        print(table(ENTRIES))
        return 0
    entries = [BY_NAME[name] for name in args.only] if args.only else ENTRIES
    return 1 if run_many(entries, smoke=True, output=output, jobs=args.jobs) else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
