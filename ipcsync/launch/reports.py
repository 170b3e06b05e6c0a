"""What a stage reports about its endpoints, checked before the launcher uses it.

A stage's telemetry snapshots (``telemetry/<stage>.<replica>.json``) and exit stats
(``stats/<stage>.<replica>.json``) are written by the stage's process: untrusted input,
like a peer's frames. ``clean_report`` keeps what has the shape ``ipcsync.stage`` writes
and drops the rest, saying what it dropped:

- the report: a JSON object whose ``stage`` is a string and whose ``inputs`` and
  ``outputs`` (if present) are objects; anything else is dropped whole;
- each endpoint's stats (``inputs[peer]``, ``outputs[peer]``): read as a typed
  ``reported.Reported`` (its counts integers from 0 to 2**63 - 1, its seconds finite and
  not negative, a FanIn's ``sources`` each such stats); an endpoint with one bad field is
  dropped whole (a partial entry would make its edge's figures silently wrong), the
  others kept, as ``Reported``.

The report's other fields (``replica``, ``pid``, ``mono``, ``final``, ...) are kept as they
are (readers check them where used).

``read_incomplete`` finds the stages whose telemetry could not be written (the markers
``runtime.telemetry.write_failed`` leaves, e.g. on a full runtime directory): the
launcher says so once and marks the figures it prints and writes with ``INCOMPLETE``.

Every file a stage leaves is read through ``system.files`` (regular files only, never
blocking, size-capped): ``read_stats`` (exit stats) and ``failure_report`` (a stage's
``.error`` report) skip a file that cannot be read or decoded, JSON nested too deeply
included, and ``read_stats`` returns a line for each one it skipped.
"""

from __future__ import annotations

import os
from typing import Any

from ..system import files
from ..stage_contract import INCOMPLETE_SUFFIX, failure_report_path
from .reported import MAX_COUNT, Reported, parse

__all__ = ["MAX_COUNT", "INCOMPLETE", "clean_report", "clean_reports", "read_incomplete", "incomplete_line",
           "read_stats", "failure_report", "MAX_REPORT"]

INCOMPLETE = "incomplete: telemetry could not be written"
_MAX_REASON = 400
MAX_REPORT = 1 << 20  # bytes of one exit stats file or snapshot, at most
_MAX_FAILURE_REPORT = 4096


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def clean_report(raw: Any, name: str) -> tuple[dict[str, Any] | None, list[str]]:
    """``raw`` (a parsed report file called ``name``) with only the endpoints of the
    expected shape (module docstring), and one line per thing dropped. None when the
    report itself is not of the expected shape."""
    if not isinstance(raw, dict) or not isinstance(raw.get("stage"), str):
        return None, [f"{name}: not a stage report (no 'stage' name)"]
    problems: list[str] = []
    report = dict(raw)
    label = f"{raw['stage']}/{raw.get('replica')}"
    for key, direction, towards in (("outputs", "output", "to"), ("inputs", "input", "from")):
        side = raw.get(key)
        if side is None:
            continue
        if not isinstance(side, dict):
            return None, [f"{label}: {key!r} is {_show(side)}, not an object"]
        kept: dict[str, Reported] = {}
        for peer, s in side.items():
            try:
                kept[peer] = parse(s)
            except ValueError as why:
                problems.append(f"{label} {direction} {towards} {peer!r}: {why}")
        report[key] = kept
    return report, problems


def clean_reports(raw: list[tuple[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """``clean_report`` over (file name, parsed report) pairs: the reports kept, and every
    problem."""
    out: list[dict[str, Any]] = []
    problems: list[str] = []
    for name, r in raw:
        report, why = clean_report(r, name)
        problems += why
        if report is not None:
            out.append(report)
    return out, problems


def read_incomplete(stats_dir: str) -> dict[str, str]:
    """``stage/replica`` -> why (the marker's text, printable, or "reason not recorded")
    for each process whose telemetry could not be written."""
    out: dict[str, str] = {}
    try:
        names = sorted(os.listdir(stats_dir))
    except OSError:
        return out
    for name in names:
        if not name.endswith(INCOMPLETE_SUFFIX):
            continue
        base = name[: -len(INCOMPLETE_SUFFIX)]
        stage, _, replica = base.rpartition(".")
        try:
            raw = files.read_regular(os.path.join(stats_dir, name), _MAX_REASON)
        except OSError:
            raw = b""
        text = "".join(c for c in raw.decode(errors="replace") if c.isprintable()).strip()
        out[f"{stage}/{replica}" if stage else base] = text or "reason not recorded"
    return out


def incomplete_line(incomplete: dict[str, str]) -> str:
    """The launcher's one line about ``read_incomplete``'s findings."""
    who = "; ".join(f"{label} ({why})" for label, why in sorted(incomplete.items())[:4])
    more = f" and {len(incomplete) - 4} more" if len(incomplete) > 4 else ""
    return (f"telemetry could not be written by {who}{more}: this run's figures (summary, monitor, "
            "--stats-file, trace) are incomplete; is the runtime directory full? Free space there or set "
            "IPCSYNC_RUNTIME_DIR to a directory with room")


def read_stats(directory: str) -> tuple[list[dict[str, Any]], list[str]]:
    """The per-process exit stats stages left in ``directory`` (JSON objects written by
    ipcsync.stage at exit), and a line for each ``.json`` file skipped (unreadable, not a
    regular file, too large, not JSON, nested too deeply, not an object)."""
    reports: list[dict[str, Any]] = []
    skipped: list[str] = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return [], []
    for name in names:
        if not name.endswith(".json"):
            continue
        try:
            report = files.read_json(os.path.join(directory, name), MAX_REPORT)
        except (OSError, ValueError) as exc:
            skipped.append(f"{name} ({files.why(exc)})")
            continue
        if isinstance(report, dict):
            reports.append(report)
        else:
            skipped.append(f"{name} (not a JSON object)")
    return reports, skipped


def failure_report(stats_path: Any) -> dict[str, Any] | None:
    """The failure report a stage left beside its exit stats ``stats_path`` (``.error``;
    ipcsync.stage writes it from sys.excepthook), or None: JSON, size-capped and
    type-checked, never anything else, and never a wait."""
    if not isinstance(stats_path, str):
        return None
    try:
        report = files.read_json(failure_report_path(stats_path), _MAX_FAILURE_REPORT)
    except (OSError, ValueError):
        return None
    if not isinstance(report, dict) or not isinstance(report.get("consequence"), bool):
        return None
    return report
