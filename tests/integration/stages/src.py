#!/usr/bin/env python3
"""Producer stage: sends ``--n`` items to downstream stage ``--to``.

Item ``i`` of replica ``r``: {"x": arange(size) + r*1e6 + i (int64), "y": full((2, 3), i + 0.5)},
meta {"origin": "<stage>/<r>", "i": i}. Prints {"event": "sent", ...} at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stagelib  # noqa: E402

stagelib.record_pid()

import torch  # noqa: E402

import ipcsync.stage as stage  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--to", default="sink")
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--delay", type=float, default=0.0, help="seconds between items")
    ap.add_argument("--zero-copy", action="store_true", help="use out.slot() instead of send()")
    ap.add_argument("--raise-after", type=int, default=None, metavar="K",
                    help="raise RuntimeError inside the output's with-block once K items were sent")
    ap.add_argument("--hold-until", default=None, metavar="FILE",
                    help="after closing the output, wait (up to 120 s) until FILE exists, then exit")
    stagelib.add_crash_args(ap)
    args = ap.parse_args()

    me = stage.info()
    label = f"{me.stage}/{me.replica}"
    with stage.output(args.to) as out:
        stagelib.mark("ready")
        for i in range(args.n):
            stagelib.maybe_crash(args, i, me.replica, me.restart)
            if args.raise_after is not None and i == args.raise_after:
                raise RuntimeError(f"src broke after {i} items")
            value = stagelib.item_value(me.replica, i)
            meta = {"origin": label, "i": i}
            if args.zero_copy:
                with out.slot(x=((args.size,), torch.int64), y=((2, 3), torch.float32), meta=meta) as s:
                    torch.arange(args.size, dtype=torch.int64, out=s["x"]).add_(value)
                    s["y"].fill_(i + 0.5)
            else:
                out.send({"x": torch.arange(args.size, dtype=torch.int64, device=me.device) + value,
                          "y": torch.full((2, 3), i + 0.5, device=me.device)}, meta=meta)
            if i == 0:
                stagelib.mark("sent")
            if args.delay:
                time.sleep(args.delay)
        stagelib.maybe_crash(args, args.n, me.replica, me.restart)
    stagelib.say(event="sent", stage=me.stage, replica=me.replica, restart=me.restart, n=args.n)
    deadline = time.monotonic() + 120
    while args.hold_until and not os.path.exists(args.hold_until) and time.monotonic() < deadline:
        time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main())
