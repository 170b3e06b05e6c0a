"""What a new user runs first: the demo pipeline (examples/pipeline.toml) through the
launcher, and the producer/consumer pair of the quickstart (examples/producer.py,
examples/consumer.py).

The demo must learn (its trainer's loss ends below half of chance, every batch checked
against its seed), and no process may print torch's "Failed to initialize NumPy" warning,
which ``import torch`` itself prints where numpy is missing: numpy is a runtime dependency.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

import test_launch_cli as cli
from conftest import wait_no_segments

ROOT = cli.ROOT
NUMPY_WARNING = "Failed to initialize NumPy"
DONE_RE = re.compile(
    r"\[train/0\] train: done, (\d+) steps from (\d+) loaders, loss ([0-9.]+) -> ([0-9.]+) "
    r"\(chance ([0-9.]+)\), accuracy (\d+)% on the last (\d+) batches, every batch checked, "
    r"\d+ samples/s"
)


@pytest.fixture
def launcher(tmp_path: Path, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[cli.Launcher]:
    # The spec's stages run "python3": the one of this interpreter's environment, as after
    # `. .venv/bin/activate`.
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    ln = cli.Launcher(tmp_path, runtime_dir)
    try:
        yield ln
    finally:
        ln.cleanup()


@pytest.mark.timeout(300)
def test_demo_pipeline_learns_and_checks_every_batch(launcher: cli.Launcher) -> None:
    run = launcher.run("examples/pipeline.toml", cwd=ROOT, timeout=240)
    assert run.proc.returncode == 0, run.dump()
    m = DONE_RE.search(run.out)
    assert m, run.dump()
    steps, loaders, first, final, chance, accuracy, last = (float(g) for g in m.groups())
    assert (steps, loaders, last) == (400, 2, 50), run.dump()
    assert chance == pytest.approx(math.log(9), abs=0.01)
    assert first > chance / 2 and final < chance / 2, run.dump()
    assert accuracy >= 90, run.dump()
    assert "does not hold what its loader sent" not in run.out, run.dump()
    cli.assert_summary(run, "loader", "train", 400)
    assert NUMPY_WARNING not in run.out + run.err, run.dump()
    launcher.assert_nothing_left()


@pytest.mark.timeout(180)
def test_producer_consumer_examples_without_numpy_warning(runtime_dir: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               IPCSYNC_RUNTIME_DIR=str(runtime_dir))
    argv = {
        "producer": [sys.executable, str(ROOT / "examples" / "producer.py"), "--endpoint", "quick",
                     "--batches", "60", "--batch-size", "4"],
        "consumer": [sys.executable, str(ROOT / "examples" / "consumer.py"), "--endpoint", "quick",
                     "--progress", "30"],
    }
    procs = {name: subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, env=env, cwd=str(ROOT), start_new_session=True)
             for name, cmd in argv.items()}
    try:
        outs = {name: p.communicate(timeout=150) for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        left = wait_no_segments([p.pid for p in procs.values()])
    for name, (out, err) in outs.items():
        text = f"{name} rc {procs[name].returncode}\n--- stdout:\n{out.decode()}\n--- stderr:\n{err.decode()}"
        assert procs[name].returncode == 0, text
        assert NUMPY_WARNING not in err.decode(), text
    assert "consumer: 60 batches" in outs["consumer"][0].decode() and "contents checked" in outs["consumer"][0].decode()
    assert not left, f"shared-memory segments left: {left}"


def test_numpy_is_a_runtime_dependency() -> None:
    """``import torch`` warns "Failed to initialize NumPy" in every process where numpy is
    missing, so the package installs it (scripts/setup.sh installs the runtime deps)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(re.match(r"numpy\b", d) for d in deps), deps
