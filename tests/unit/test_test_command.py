"""What the README's test command (``python -m pytest -n auto``) promises.

- It loads only the pytest plugins the suite uses (pyproject.toml: autoload off, then
  ``-p xdist -p hypothesispytest``): a plugin that merely sits in the environment (a venv
  made with ``--system-site-packages`` inherits the system's, pytest-benchmark among them,
  which prints a ``PytestBenchmarkWarning`` per xdist process) is not loaded, and its
  warnings never reach the command's output.
- The README says how long it takes, and stays within 250 lines.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_a_plugin_installed_in_the_environment_is_not_loaded(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "foreign_plugin.py").write_text(
        "import warnings\n\n"
        "def pytest_configure(config):\n"
        "    warnings.warn('a foreign plugin was loaded')\n")
    info = site / "foreign_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: foreign-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[pytest11]\nforeign = foreign_plugin\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    env.pop("PYTEST_DISABLE_PLUGIN_AUTOLOAD", None)
    env.pop("PYTEST_ADDOPTS", None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--co", "-n", "2", "-p", "no:cacheprovider", "tests/unit/test_envopts.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=100)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "foreign" not in out and "Warning" not in out, out
    plugins = next(line for line in out.splitlines() if line.startswith("plugins:"))
    assert "xdist" in plugins and "hypothesis" in plugins, plugins


def test_the_readme_says_how_long_the_tests_take() -> None:
    text = (ROOT / "README.md").read_text()
    assert "python -m pytest -n auto" in text
    assert "tests take about 10–15 minutes on 2 cores" in " ".join(text.split())
    assert len(text.splitlines()) <= 250
