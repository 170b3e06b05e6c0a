"""Shared helpers of the test stage scripts (tests/integration/stages/*.py), run by ipcsync-run.

Light on purpose (no torch, no ipcsync): a stage records its pid before anything heavy
is imported, so a test can find (and kill) it even if it hangs in an import.

State files go to ``$TEST_STAGE_DIR`` (set by the test in the launcher's environment,
which ipcsync-run passes on to every stage):

- ``pid-<stage>-<replica>-<restart>-<pid>``: JSON {"pid", "start", "stage", "replica", "restart"}
  (``start`` is the process start time from /proc, to tell a reused pid apart);
- ``<kind>-<stage>-<replica>-<restart>-<pid>``: markers (``ready``, ``recv``, ``sent``,
  ``sig-SIGTERM``, ...) written with :func:`mark`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Any

STATE = os.environ.get("TEST_STAGE_DIR")


def ident() -> tuple[str, str, int]:
    """(stage, replica, restart) from the launcher's environment, without ipcsync."""
    stage = os.environ.get("IPCSYNC_STAGE", "nostage")
    replica = os.environ.get("IPCSYNC_REPLICA", "x")
    try:
        restart = int(json.loads(os.environ.get("IPCSYNC_WIRING") or "{}").get("restart", 0))
    except (ValueError, AttributeError):
        restart = 0
    return stage, replica, restart


def start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (clock ticks since boot), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return int(data[data.rindex(b")") + 2:].split()[19])


def _write(name: str, text: str) -> None:
    if not STATE:
        return
    path = os.path.join(STATE, name)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def record_pid() -> None:
    """Record this stage's pid; with ``TEST_IGNORE_SIGTERM=1`` in its environment, also
    ignore SIGTERM (the launcher's stop) so that it ends only on its own."""
    if os.environ.get("TEST_IGNORE_SIGTERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    stage, replica, restart = ident()
    pid = os.getpid()
    _write(
        f"pid-{stage}-{replica}-{restart}-{pid}",
        json.dumps({"pid": pid, "start": start_time(pid), "stage": stage, "replica": replica,
                    "restart": restart}),
    )


def mark(kind: str, **data: Any) -> None:
    stage, replica, restart = ident()
    _write(f"{kind}-{stage}-{replica}-{restart}-{os.getpid()}", json.dumps(data))


def say(**kw: Any) -> None:
    print(json.dumps(kw, sort_keys=True), flush=True)


def add_crash_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--crash-after", type=int, default=None, metavar="K",
                    help="exit abruptly (os._exit) once K items were handled")
    ap.add_argument("--crash-code", type=int, default=7)
    ap.add_argument("--crash-replica", type=int, default=None, help="only this replica crashes")
    ap.add_argument("--crash-restart", type=int, default=None,
                    help="only on this attempt (ipcsync.stage.info().restart)")


def maybe_crash(args: argparse.Namespace, handled: int, replica: int, restart: int) -> None:
    """os._exit(crash_code) when the crash options say so for ``handled`` items."""
    if args.crash_after is None or handled != args.crash_after:
        return
    if args.crash_replica is not None and replica != args.crash_replica:
        return
    if args.crash_restart is not None and restart != args.crash_restart:
        return
    say(event="crashing", handled=handled, code=args.crash_code)
    mark("crashing", handled=handled)
    sys.stdout.flush()
    os._exit(args.crash_code)


def item_value(replica: int, i: int) -> int:
    """The offset item ``i`` of source replica ``replica`` carries in every element."""
    return replica * 1_000_000 + i
