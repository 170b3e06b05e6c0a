"""What ``ipcsync-run`` and its stage processes agree on: the environment it gives them and
where in the run directory each writes for the other. Both sides import this module (the
launcher: ``launch.plan``, ``launch.monitor``, ``launch.mps_daemon``, ``launch.reports``;
the stage: ``ipcsync.stage``, ``runtime.telemetry``, ``system.shm``, ``mps_attach``);
the variables themselves, with their kinds and defaults, are switches of the one table
(``ipcsync.envopts``). Loads neither torch nor zmq.

The environment of a stage (``stage_env``, ``observer_env``, ``mps_env``):

- every stage: ``IPCSYNC_WIRING`` (JSON: who it is, its edges, where its reports go; its
  presence means "under ipcsync-run"), ``IPCSYNC_RUN_ID`` (shared memory segments made
  in the process carry it, so the launcher removes them when the stage dies),
  ``IPCSYNC_STAGE``, ``IPCSYNC_REPLICA`` and ``IPCSYNC_DEVICE`` (for the stage's own code
  and trace headers), and ``PYTHONUNBUFFERED=1``;
- under ``--monitor`` / ``--stats-file``: ``IPCSYNC_TELEMETRY_DIR`` and
  ``IPCSYNC_TELEMETRY_INTERVAL``; under ``--trace``: ``IPCSYNC_TRACE_DIR``;
- a CUDA stage under the run's private MPS daemon: ``IPCSYNC_MPS_PIPE`` and
  ``IPCSYNC_MPS_CONTROL`` (with the driver's ``CUDA_MPS_PIPE_DIRECTORY`` and
  ``CUDA_MPS_LOG_DIRECTORY``);
- inherited from the launcher's own environment: ``IPCSYNC_LOG_LEVEL`` (``--log-level``
  sets it there) and every other variable, except ``WITHHELD`` (the rendezvous secret).

The run directory (``<runtime dir>/run-<id>``; the wiring's ``stats_path`` names a stage's
place in it):

- ``stats/<stage>.<replica>.json``: the stage's per-edge ``stats()`` at exit
  (``ipcsync.stage``), read by the launcher's summary; beside it ``.error`` (the stage's
  failure report: the exception, and whether it is a peer's failure's consequence) and
  ``.incomplete`` (its telemetry could not be written);
- ``telemetry/<stage>.<replica>.json``: the latest snapshot of the same, every interval;
- ``trace/<pid>.jsonl``: the trace events of one process.

Everything a stage writes is untrusted input to the launcher (``launch.reports``).
"""

from __future__ import annotations

import os

from .envopts import (
    DEVICE, LOG_LEVEL, MPS_CONTROL, MPS_PIPE, RDZV_SECRET, REPLICA, RUN_ID, STAGE, TELEMETRY_DIR, TELEMETRY_INTERVAL,
    TRACE_DIR, WIRING, Switch,
)

__all__ = [
    "WIRING", "RUN_ID", "STAGE", "REPLICA", "DEVICE", "TELEMETRY_DIR", "TELEMETRY_INTERVAL", "TRACE_DIR", "MPS_PIPE",
    "MPS_CONTROL", "LOG_LEVEL", "EVERY_STAGE", "OBSERVED", "UNDER_MPS", "INHERITED", "WITHHELD", "WIRING_VERSION",
    "STATS_DIR", "TELEMETRY_SUBDIR", "TRACE_SUBDIR", "INCOMPLETE_SUFFIX", "ERROR_SUFFIX", "stage_env",
    "observer_env", "mps_env", "stats_path", "failure_report_path", "incomplete_marker_path",
]

EVERY_STAGE: tuple[Switch[str | None], ...] = (WIRING, RUN_ID, STAGE, REPLICA, DEVICE)
OBSERVED = (TELEMETRY_DIR, TELEMETRY_INTERVAL, TRACE_DIR)  # --monitor, --stats-file, --trace
UNDER_MPS = (MPS_PIPE, MPS_CONTROL)
INHERITED = (LOG_LEVEL,)  # from the launcher's environment, which --log-level sets
WITHHELD: tuple[str, ...] = (RDZV_SECRET.name,)  # the launcher's variables no stage inherits

WIRING_VERSION = 1  # of the JSON in IPCSYNC_WIRING: a stage reads only its own version

STATS_DIR = "stats"
TELEMETRY_SUBDIR = "telemetry"
TRACE_SUBDIR = "trace"
ERROR_SUFFIX = ".error"
INCOMPLETE_SUFFIX = ".incomplete"


def stage_env(*, wiring: str, run_id: str, stage: str, replica: int, device: str) -> dict[str, str]:
    """The variables ``ipcsync-run`` sets for every stage process (``wiring``: its JSON)."""
    return {WIRING.name: wiring, RUN_ID.name: run_id, STAGE.name: stage, REPLICA.name: str(replica),
            DEVICE.name: device, "PYTHONUNBUFFERED": "1"}


def observer_env(*, telemetry_dir: str | None, interval: float, trace_dir: str | None) -> dict[str, str]:
    """The variables that make a stage write its snapshots into ``telemetry_dir`` every
    ``interval`` seconds and its trace into ``trace_dir`` (None: not that one)."""
    env: dict[str, str] = {}
    if telemetry_dir is not None:
        env[TELEMETRY_DIR.name] = telemetry_dir
        env[TELEMETRY_INTERVAL.name] = str(interval)
    if trace_dir is not None:
        env[TRACE_DIR.name] = trace_dir
    return env


def mps_env(*, pipe: str, control: str) -> dict[str, str]:
    """The variables (of ipcsync's own) that make a CUDA stage check that it is a client of
    the run's MPS daemon at ``pipe``, asking it through ``control``."""
    return {MPS_PIPE.name: pipe, MPS_CONTROL.name: control}


def stats_path(run_dir: str, stage: str, replica: int) -> str:
    """Where stage ``stage``'s replica ``replica`` leaves its exit stats."""
    return os.path.join(run_dir, STATS_DIR, f"{stage}.{replica}.json")


def _base(stats_file: str) -> str:
    return stats_file[:-5] if stats_file.endswith(".json") else stats_file


def failure_report_path(stats_file: str) -> str:
    """Where a stage whose stats go to ``stats_file`` reports its failure."""
    return _base(stats_file) + ERROR_SUFFIX


def incomplete_marker_path(stats_file: str) -> str:
    """Where a stage whose stats go to ``stats_file`` marks its telemetry incomplete
    (``runtime.telemetry.write_failed``)."""
    return _base(stats_file) + INCOMPLETE_SUFFIX
