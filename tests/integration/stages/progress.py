#!/usr/bin/env python3
"""A stage that draws a progress bar the way tqdm does: ``\\r``-terminated segments, each
flushed, with pauses; then it sleeps until ``--exit-when FILE`` exists and exits 0."""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stagelib  # noqa: E402

stagelib.record_pid()
ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=3)
ap.add_argument("--exit-when", required=True, metavar="FILE")
args = ap.parse_args()
for i in range(1, args.steps + 1):
    sys.stdout.write(f"progress {i}/{args.steps}\r")
    sys.stdout.flush()
    time.sleep(0.2)
stagelib.mark("drawn")
while not os.path.exists(args.exit_when):
    time.sleep(0.05)
sys.stdout.write("\n")
