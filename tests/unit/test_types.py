"""The package type-checks: ``python -m mypy`` with the repository's configuration
(pyproject.toml ``[tool.mypy]``: strict, over ``ipcsync`` and the public API's probe in
``tests/typecheck``) reports no error. Skipped where mypy is not installed
(``scripts/setup.sh --test`` installs it)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MYPY_TIMEOUT = 600.0  # a cold run on a loaded 2-core machine takes about a minute


@pytest.mark.timeout(MYPY_TIMEOUT + 60)
def test_mypy_reports_no_error() -> None:
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (scripts/setup.sh --test installs it with the test extra)")
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")],
        cwd=ROOT, capture_output=True, text=True, timeout=MYPY_TIMEOUT,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Success: no issues found" in proc.stdout, (
        f"mypy exited with {proc.returncode}:\n{output}")
