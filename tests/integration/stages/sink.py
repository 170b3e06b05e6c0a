#!/usr/bin/env python3
"""Sink stage: receives everything from upstream ``--from`` and checks it.

For each item: the tensors match the meta's (origin, i) (see src.py); ``i`` increases
strictly per (item.source, origin) (each source's order is kept); no (origin, i) twice;
meta["via"], if any, names item.source. At the end prints one line
{"event": "result", "counts": {origin: n}, "contiguous": {origin: bool}, "errors": [...], ...}
and exits 1 if anything was wrong.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stagelib  # noqa: E402

stagelib.record_pid()

import torch  # noqa: E402

import ipcsync.stage as stage  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--from", dest="src", default="src")
    ap.add_argument("--size", type=int, default=64)
    stagelib.add_crash_args(ap)
    args = ap.parse_args()

    me = stage.info()
    seen: dict[str, set[int]] = {}
    last: dict[tuple[str, str], int] = {}
    by_source: dict[str, int] = {}
    errors: list[str] = []
    dups = 0
    n = 0
    with stage.input(args.src) as inp:
        stagelib.mark("ready")
        for item in inp:
            stagelib.maybe_crash(args, n, me.replica, me.restart)
            meta = item.meta
            origin, i = meta["origin"], meta["i"]
            replica = int(origin.rsplit("/", 1)[1])
            value = stagelib.item_value(replica, i)
            x, y = item["x"], item["y"]
            if not (x.dtype == torch.int64 and x.shape == (args.size,)
                    and torch.equal(x, torch.arange(args.size, dtype=torch.int64, device=x.device) + value)):
                errors.append(f"{origin} item {i}: wrong x from {item.source}")
            if not (y.shape == (2, 3) and bool((y == i + 0.5).all())):
                errors.append(f"{origin} item {i}: wrong y from {item.source}")
            if "via" in meta and meta["via"] != item.source:
                errors.append(f"{origin} item {i}: via {meta['via']} but source {item.source}")
            if "via" not in meta and origin != item.source:
                errors.append(f"{origin} item {i}: came from {item.source}")
            key = (item.source, origin)
            if key in last and i <= last[key]:
                errors.append(f"{origin} item {i} after item {last[key]} from {item.source}: out of order")
            last[key] = i
            got = seen.setdefault(origin, set())
            if i in got:
                dups += 1
                errors.append(f"{origin} item {i} twice")
            got.add(i)
            by_source[item.source] = by_source.get(item.source, 0) + 1
            n += 1
            if n == 1:
                stagelib.mark("recv")
        stagelib.maybe_crash(args, n, me.replica, me.restart)
    stagelib.say(
        event="result", stage=me.stage, replica=me.replica, restart=me.restart, total=n,
        counts={o: len(s) for o, s in seen.items()},
        contiguous={o: s == set(range(len(s))) for o, s in seen.items()},
        by_source=by_source, dups=dups, errors=errors[:10],
    )
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
