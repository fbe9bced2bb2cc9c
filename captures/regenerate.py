#!/usr/bin/env python
"""Regenerate the golden captures of the CI gate (captures/README.md, "Golden captures").

    python captures/regenerate.py                       # every golden into captures/ (overwrites them)
    python captures/regenerate.py --out /tmp/g tiny-sim # one golden elsewhere, e.g. to gate it in CI:
    dsv4debug gate /tmp/g/tiny-sim.h5 --baseline captures/tiny-sim.h5

Each golden is `dsv4debug run` on the embedded tiny model (seeded synthetic checkpoint), 64 tokens of
make_tokens(seed=0), on the CPU with one torch thread, both modes (free and teacher-forced), statistics of
every site plus 4 token rows of the logits. The settings live in dsv4debug/gate.py (GOLDENS).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from dsv4debug.errors import BadInput
from dsv4debug.gate import GOLDENS, golden_names, write_golden


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help=f"goldens to write (default: all of {', '.join(GOLDENS)})")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent,
                        help="directory to write NAME.h5 into (default: captures/, replacing the goldens)")
    args = parser.parse_args(argv)
    try:
        for name in golden_names(args.names):
            t0 = time.perf_counter()
            path = write_golden(name, args.out, force=True)
            print(f"{path}: {path.stat().st_size / 1024:.0f} KiB in {time.perf_counter() - t0:.1f} s")
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
