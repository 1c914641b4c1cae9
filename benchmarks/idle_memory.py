"""What this machine charges for memory that sat idle, over longer idle times than the benchmark's own probe.

    python benchmarks/idle_memory.py [--idle 0,0.005,0.02,0.05,0.2,1,5,20] [--mb 25] [--rounds 2] [--out docs/benchmarks/idle-memory.json]

The first write into (or read of) pages nobody touched for milliseconds to seconds, against the same access a moment after
the pages were touched, for anonymous memory (4 KiB pages and transparent huge pages), POSIX shared memory (the
server's chunk buffers) and the page cache. :mod:`prefixshare.bench._memory` says what each kind is and why it
matters to a store's path; ``prefixshare bench`` records a short version of it (0, 0.05, 1 and 5 s) beside P3 and P6.
Figures are GB/s, medians over ``--rounds``, and each kind's ratio to its shortest idle time.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from _meta import run_header


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--idle", default="0,0.005,0.02,0.05,0.2,1,5,20", help="idle times in seconds, comma-separated")
    parser.add_argument("--mb", type=int, default=25, help="MiB per access (25: about a 1k-token request's KV)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    args = parser.parse_args(argv)
    from prefixshare.bench._memory import KINDS, idle_memory

    idles = sorted(float(x) for x in args.idle.split(","))
    result = {**run_header("idle_memory.py", argv), **idle_memory(idles, args.mb << 20, args.rounds)}
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    for kind in KINDS:
        row = result["gbps"][kind]
        sys.stdout.write(f"{kind}: " + ", ".join(f"{k} s {v:.2f} GB/s" for k, v in row.items()) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
