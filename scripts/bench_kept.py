#!/usr/bin/env python3
"""The handoff when the consumer keeps received tensors (no ``clone()``), against the same
handoff when it keeps nothing: what the move of kept items out of the ring costs, and that
a consumer keeping nothing pays nothing for it.

Keeping consumer: every received ``item["x"]`` goes into a list of the last ``slots``
items (what a loop that collects batches does, bounded so that 64 MiB items fit in
memory). Each item is kept until ``slots`` later items arrived, so the ring would stall at
every item: ipcsync copies the kept item's bytes out of its slot into memory of its own
(the reference rule, ``docs/architecture.md``) and the ring goes on. The rows are
``scripts/bench.py``'s handoff rows (``--keep both``): "ipcsync send" / "ipcsync slot"
(nothing kept) and "... keeps views" (kept); see bench.py for how a row is measured.

The keeping consumer is ``benchkeep.kept_consumer``. This script runs them for several
devices in one run (``--devices cpu,cuda``; a device missing here is skipped with a line
saying so) at 4 KiB and 64 MiB by default.

Usage:
    python3 scripts/bench_kept.py [--devices cpu,cuda] [--sizes 4K,64M] [--quick] [--slots 4]
"""

from __future__ import annotations

import argparse
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default="cpu,cuda", help="comma-separated (default cpu,cuda)")
    ap.add_argument("--sizes", default="4K,64M")
    ap.add_argument("--modes", default="send,slot")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="a tenth of the messages")
    ap.add_argument("--start-method", default="spawn")
    args = ap.parse_args(argv)
    import bench

    command = " ".join(["python3 scripts/bench_kept.py", *(argv if argv is not None else sys.argv[1:])])
    for device in args.devices.split(","):
        if device.startswith("cuda") and not torch.cuda.is_available():
            print(f"\n{device}: no CUDA device here, skipped")
            continue
        opts = ["--suite", "handoff", "--device", device, "--sizes", args.sizes, "--modes", args.modes,
                "--slots", str(args.slots), "--keep", "both", "--no-floor", "--start-method", args.start_method]
        bargs = bench.parse_args(opts + (["--quick"] if args.quick else []))
        bench.use_start_method(bargs.start_method)
        rows = bench.run_handoff(bargs)
        bench.print_handoff(rows, device, args.slots, command)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
    raise SystemExit(main())
