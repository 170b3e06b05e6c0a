"""``ipcsync doctor``'s verdicts: ``Check`` (status, name, finding, fix), the statuses, the
exit status of a list of checks, and how a size is shown."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["PASS", "WARN", "FAIL", "STATUSES", "Check", "exit_status", "size_text"]

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"
STATUSES = (PASS, WARN, FAIL)


@dataclass(frozen=True)
class Check:
    """One check's verdict: ``status`` is PASS, WARN or FAIL; ``fix`` says what to do (for
    WARN and FAIL)."""

    status: str
    name: str
    found: str
    fix: str | None = None

    def text(self) -> str:
        """The report's lines for this check: ``STATUS  name: found`` and an indented fix."""
        line = f"{self.status}  {self.name}: {self.found}"
        if self.fix and self.status != PASS:
            line += f"\n      fix: {self.fix}"
        return line

    def as_dict(self) -> dict[str, Any]:
        return {"status": self.status, "name": self.name, "found": self.found, "fix": self.fix}


def exit_status(checks: Sequence[Check]) -> int:
    """0 when no check failed, else 1."""
    return 1 if any(c.status == FAIL for c in checks) else 0


def size_text(n: float) -> str:
    """``n`` bytes in GiB, MiB or KiB (one decimal), or in bytes."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"
