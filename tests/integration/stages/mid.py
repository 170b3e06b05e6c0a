#!/usr/bin/env python3
"""Middle stage: forwards every item of upstream ``--from`` to downstream ``--to``,
tensors and meta unchanged except meta["via"] = this replica's label."""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stagelib  # noqa: E402

stagelib.record_pid()

import ipcsync.stage as stage  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--from", dest="src", default="src")
    ap.add_argument("--to", default="sink")
    ap.add_argument("--raise-after", type=int, default=None, metavar="K",
                    help="raise RuntimeError inside the with-block once K items were forwarded")
    stagelib.add_crash_args(ap)
    args = ap.parse_args()

    me = stage.info()
    label = f"{me.stage}/{me.replica}"
    n = 0
    with stage.input(args.src) as inp, stage.output(args.to) as out:
        stagelib.mark("ready")
        for item in inp:
            stagelib.maybe_crash(args, n, me.replica, me.restart)
            if args.raise_after is not None and n == args.raise_after:
                raise RuntimeError(f"mid broke after {n} items")
            meta = dict(item.meta)
            meta["via"] = label
            meta["hop_source"] = item.source
            out.send({"x": item["x"], "y": item["y"]}, meta=meta)
            n += 1
        stagelib.maybe_crash(args, n, me.replica, me.restart)
    stagelib.say(event="forwarded", stage=me.stage, replica=me.replica, n=n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
