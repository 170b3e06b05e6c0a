#!/usr/bin/env python3
"""A plain Python stage with Python's default signal handling: records its pid, writes a
``ready`` marker, then sleeps in a loop forever (no ipcsync, no handlers)."""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stagelib  # noqa: E402

stagelib.record_pid()
stagelib.mark("ready")
print("looping", flush=True)
while True:
    time.sleep(0.05)
