"""An attempt's root cause: which stage's failure it is, and the one line that says it.

The first stage to exit non-zero is the root cause, unless its failure report (a stage's
``.error``, ``reports.failure_report``) says it only died of a peer's failure (a
consumer's ProducerFailedError when its loader raised): then the stage that failed on its
own is, even if its process took longer to exit; ``root_cause`` waits up to
``PEER_FAILURE_GRACE`` seconds for one to report or exit non-zero, relaying output
meanwhile. A failure that stays a consequence is said so (``RootCause.consequence``):
over several nodes, another node's failure may be the cause.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .plan import Instance
from .reports import failure_report
from .stageproc import StageProc, describe, exit_code_of, reap

__all__ = ["RootCause", "root_cause", "fault_hint", "failure_report_of", "PEER_FAILURE_GRACE"]

PEER_FAILURE_GRACE = 3.0  # seconds to find the stage a consequence-failure came from


@dataclass(frozen=True)
class RootCause:
    """The first failure of an attempt."""

    line: str  # one line: which stage, how it ended, its report, a likely cause
    code: int  # the launcher's exit code for it
    consequence: bool  # the failure is only a peer's consequence (a PeerLostError), none found here


def fault_hint(inst: Instance, returncode: int | None) -> str:
    """What a stage's SIGSEGV most likely means when it reads inputs on the CPU backend,
    which maps received items read-only (the reference rule): "" otherwise."""
    inputs = inst.wiring.get("inputs") if isinstance(inst.wiring, dict) else None
    if returncode != -signal.SIGSEGV or not inputs or not str(inst.device).startswith("cpu"):
        return ""
    return ("; it receives items read-only (CPU backend), and a write into a received tensor (an in-place "
            "op such as x.mul_() or x.div_(), or x[...] = ...) faults: clone() it first (its stderr "
            "above shows the line)")


def failure_report_of(inst: Instance) -> dict[str, Any] | None:
    """The failure report a stage left (``reports.failure_report``), or None."""
    return failure_report(inst.wiring.get("stats_path") if isinstance(inst.wiring, dict) else None)


def root_cause(p: StageProc, procs: Sequence[StageProc], pump: Callable[[float], None]) -> RootCause:
    """The root cause when ``p``, one of ``procs``, exited non-zero first. ``pump(timeout)``
    relays the stages' output while it waits for the stage that failed on its own."""
    first = failure_report_of(p.inst)
    chosen, report = p, first
    consequence = bool(first is not None and first.get("consequence"))
    if first is not None and first.get("consequence"):
        deadline = time.monotonic() + PEER_FAILURE_GRACE
        found: tuple[StageProc, dict[str, Any] | None] | None = None
        while found is None and time.monotonic() < deadline:
            for q in procs:
                if q is p:
                    continue
                r = failure_report_of(q.inst)
                if r is not None and not r.get("consequence"):
                    found = (q, r)
                    break
                if not q.running or reap(q):
                    if q.returncode not in (0, None) and r is None:
                        found = (q, None)
                        break
            if found is None:
                pump(0.05)
        if found is not None:
            chosen, report = found
            consequence = False
            end = time.monotonic() + PEER_FAILURE_GRACE  # it is exiting: its code
            while chosen.running and not reap(chosen) and time.monotonic() < end:
                pump(0.05)
    pid = chosen.popen.pid if chosen.popen is not None else "?"
    how = describe(chosen.returncode) if chosen.returncode is not None else "failed"
    line = f"stage {chosen.inst.label} (pid {pid}) {how} after {time.monotonic() - chosen.started:.1f} s"
    if report is not None:
        line += f": {report.get('type')}: {str(report.get('message'))[:300]}"
    line += fault_hint(chosen.inst, chosen.returncode)
    if chosen is not p:
        line += f" (stage {p.inst.label} then failed because of it)"
    returncode = chosen.returncode if chosen.returncode is not None else p.returncode
    assert returncode is not None  # p has exited
    return RootCause(line, exit_code_of(returncode), consequence)
