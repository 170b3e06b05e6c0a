#!/usr/bin/env python3
"""A stage that leaves, where the launcher reads what stages leave, something that is not
a stage's file: ``planter.py WHAT [--code C]``, then sleeps a second (long enough for a
``--monitor`` interval) and exits with code C.

WHAT:
- ``fifo-stats``, ``fifo-telemetry``, ``fifo-trace``: a FIFO named ``planted.json`` in
  the run's stats directory, ``planted.json`` in ``$IPCSYNC_TELEMETRY_DIR``, or
  ``planted.jsonl`` in ``$IPCSYNC_TRACE_DIR`` (nothing ever opens it for writing);
- ``fifo-error``: a FIFO at this stage's own failure report (``<stats>.error``);
- ``nested-stats``: ``planted.json`` in the stats directory, a JSON document nested
  100,000 deep (``json.loads`` raises RecursionError on it).

No ipcsync endpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("what", choices=["fifo-stats", "fifo-telemetry", "fifo-trace", "fifo-error", "nested-stats"])
ap.add_argument("--code", type=int, default=0)
a = ap.parse_args()

stats_path = json.loads(os.environ["IPCSYNC_WIRING"])["stats_path"]
stats_dir = os.path.dirname(stats_path)
os.makedirs(stats_dir, exist_ok=True)
path = {
    "fifo-stats": os.path.join(stats_dir, "planted.json"),
    "fifo-telemetry": os.path.join(os.environ.get("IPCSYNC_TELEMETRY_DIR", stats_dir), "planted.json"),
    "fifo-trace": os.path.join(os.environ.get("IPCSYNC_TRACE_DIR", stats_dir), "planted.jsonl"),
    "fifo-error": stats_path[:-len(".json")] + ".error",
    "nested-stats": os.path.join(stats_dir, "planted.json"),
}[a.what]
if a.what.startswith("fifo-"):
    os.mkfifo(path, 0o600)
else:
    with open(path, "w") as f:
        f.write("[" * 100_000 + "]" * 100_000)
print(f"planted {a.what}", flush=True)
time.sleep(1.0)
sys.exit(a.code)
