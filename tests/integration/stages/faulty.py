#!/usr/bin/env python3
"""Runs another stage script of this directory with a fault in its telemetry:
``faulty.py [--disk-full-after N] [--corrupt-stats] SCRIPT [ARGS...]``.

- ``--disk-full-after N``: after N successful writes, every byte ipcsync writes to a
  file fails with ENOSPC, as on a full runtime directory (through the library's one
  write seam, ``ipcsync.system.files.write_all``; creating an empty file still works,
  as on a full tmpfs).
- ``--corrupt-stats``: at exit, once ipcsync.stage wrote this process's exit stats,
  rewrite them as valid JSON of the wrong shape (every ``handoffs`` becomes "many").
"""

from __future__ import annotations

import argparse
import atexit
import errno
import json
import os
import runpy
import sys
from typing import Any

ap = argparse.ArgumentParser()
ap.add_argument("--disk-full-after", type=int, default=None)
ap.add_argument("--corrupt-stats", action="store_true")
ap.add_argument("script")
ap.add_argument("args", nargs=argparse.REMAINDER)
a = ap.parse_args()


def corrupt() -> None:
    path = json.loads(os.environ["IPCSYNC_WIRING"])["stats_path"]
    with open(path) as f:
        report = json.load(f)
    for side in ("inputs", "outputs"):
        for s in report.get(side, {}).values():
            s["handoffs"] = "many"
    with open(path, "w") as f:
        json.dump(report, f)


if a.corrupt_stats:
    atexit.register(corrupt)  # registered before ipcsync.stage's hook: runs after it

if a.disk_full_after is not None:
    from ipcsync.system import files

    real_write_all = files.write_all
    left = [a.disk_full_after]

    def write_all(fd: int, data: Any) -> None:
        if left[0] <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        left[0] -= 1
        real_write_all(fd, data)

    files.write_all = write_all  # type: ignore[assignment]

script = os.path.join(os.path.dirname(os.path.abspath(__file__)), a.script)
sys.argv = [script, *a.args]
runpy.run_path(script, run_name="__main__")
