#!/usr/bin/env python3
"""A stage that double-forks a daemon (a new session running ``sleep 300``), waits until
the daemon has written its ``daemon`` marker (whose name ends with the daemon's pid), and
exits 0, leaving the daemon behind."""

from __future__ import annotations

import glob
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stagelib  # noqa: E402

stagelib.record_pid()
child = os.fork()
if child == 0:
    os.setsid()  # out of the stage's session and process group
    if os.fork() == 0:
        stagelib.mark("daemon")
        os.execvp("sleep", ["sleep", "300"])
    os._exit(0)
os.waitpid(child, 0)
deadline = time.monotonic() + 30
while not glob.glob(os.path.join(stagelib.STATE or ".", "daemon-*")) and time.monotonic() < deadline:
    time.sleep(0.02)
print("daemon started; leader done", flush=True)
