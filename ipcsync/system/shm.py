"""Names of the CPU backend's shared-memory segments, and their removal by run id.

Torch-free (the launcher's supervisor imports it): ``ipcsync.backends.cpu`` creates the
segments and re-exports these names.

A segment is ``/dev/shm/ipcsync-<pid>-[r<run id>-]<start time>-<pid ns>-<token>``: the
run id (``launcher_run_id()``: IPCSYNC_RUN_ID, set by ipcsync-run) lets the launcher sweep
what a killed process group left behind; the owner's start time and pid namespace
prove it gone (``backends.cpu.reclaim_dead_segments``). Names without them
(``ipcsync-<pid>-[r<run id>-]<token>``) are still opened, never reclaimed.
"""

from __future__ import annotations

import os
import re

from ..stage_contract import RUN_ID

__all__ = ["SHM_DIR", "SHM_PREFIX", "NAME_RE", "RUN_ID_RE", "ENV_RUN_ID", "launcher_run_id", "remove_run_segments"]

SHM_DIR = "/dev/shm"
SHM_PREFIX = "ipcsync-"
NAME_RE = re.compile(
    r"^ipcsync-(?P<pid>[0-9]{1,10})-(?:r[0-9a-f]{8}-)?"
    r"(?:(?P<start>[0-9]{1,20})-(?P<ns>[0-9]{1,20})-)?[0-9a-f]{16}$"
)
RUN_ID_RE = re.compile(r"^[0-9a-f]{8}$")
ENV_RUN_ID = RUN_ID.name  # set by ipcsync-run in every stage process (ipcsync.stage_contract)


def launcher_run_id() -> str | None:
    """The id of the ipcsync-run run this process is a stage of, or None outside
    ipcsync-run (or for a value ipcsync-run would not have set).

    The one place the library reads ``$IPCSYNC_RUN_ID``; ``backends.backend_for`` passes
    the id to the backend. It comes from the environment, not from ``ipcsync.stage``,
    because stage code may create ``ipcsync.Producer`` directly: its segments must be
    tagged with the run all the same, so that the launcher's sweep removes them when the
    stage is killed."""
    run_id = RUN_ID.get()
    return run_id if run_id is not None and RUN_ID_RE.fullmatch(run_id) else None


def remove_run_segments(run_id: str) -> None:
    """Unlink every segment that arenas of ipcsync-run run ``run_id`` left (``create_arena``
    tags their names with it), whichever process made them."""
    tag = f"-r{run_id}-"
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    for name in names:
        if name.startswith(SHM_PREFIX) and tag in name:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except OSError:
                pass
