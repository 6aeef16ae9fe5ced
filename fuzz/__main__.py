"""`python -m fuzz --seconds N --seed S`: run seeded scenarios for N seconds (or `--one`); `--scenario TEXT`
runs one encoded scenario (the reproducer of a Hypothesis-built one). On a failure, print its one-line
reproducer and exit 1."""

from __future__ import annotations

import argparse
import sys
import time

from .run import FuzzFailure, run_one, run_seed
from .scenarios import decode


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m fuzz", description=__doc__)
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to keep drawing scenarios")
    parser.add_argument("--seed", type=int, default=0, help="the first seed; each scenario takes the next")
    parser.add_argument("--one", action="store_true", help="run only the scenario of --seed")
    parser.add_argument("--scenario", default=None, help="run only this encoded scenario (from a reproducer)")
    parser.add_argument("--backend", choices=["fake", "torch"], default="fake",
                        help="the fake backend (fast) or the tiny torch model (slower)")
    args = parser.parse_args()
    if args.scenario is not None:
        try:
            run_one(decode(args.scenario), args.backend)
        except FuzzFailure as failure:
            print(f"FAILED: {failure}", file=sys.stderr)
            return 1
        print("the scenario passed")
        return 0
    start, seed, count = time.monotonic(), args.seed, 0
    while True:
        try:
            run_seed(seed, args.backend)
        except FuzzFailure as failure:
            print(f"FAILED after {count} scenarios: {failure}", file=sys.stderr)
            return 1
        count += 1
        seed += 1
        if args.one or time.monotonic() - start >= args.seconds:
            break
    print(f"{count} scenarios passed (seeds {args.seed}..{seed - 1}) in {time.monotonic() - start:.1f} s")
    return 0


sys.exit(main())
