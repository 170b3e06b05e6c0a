"""Runs the scripts of an example (examples/<name>/*.py) as separate processes for the
examples' tests: each in its own session with this checkout first on PYTHONPATH and one
OMP thread; ``close()`` SIGKILLs every process group still there, pass or fail, and
keeps what each printed. ``leftovers()``: the shared-memory segments a process that exited
by itself left (none may be: it removes its own), after reclaiming those of processes
killed by a signal (the next producer or a consumer that lost its producer reclaims them,
when the kill is seen in time; here the test does)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator

from conftest import shm_segments, wait_no_segments

ROOT = Path(__file__).resolve().parents[2]


class ExampleProcs:
    def __init__(self, example: str) -> None:
        self.dir = ROOT / "examples" / example
        self.procs: list[tuple[str, subprocess.Popen[str]]] = []
        self.outputs: dict[str, str] = {}

    def start(self, label: str, script: str, *args: str) -> subprocess.Popen[str]:
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.Popen([sys.executable, str(self.dir / script), *args], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, env=env,
                                cwd=str(self.dir), start_new_session=True)
        self.procs.append((label, proc))
        return proc

    def finish(self, label: str, timeout: float) -> tuple[int, str]:
        """Wait for ``label`` to exit (killed after ``timeout``): its exit code and output."""
        proc = dict(self.procs)[label]
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill(proc)
            out, _ = proc.communicate(timeout=10)
        self.outputs[label] = out
        return proc.returncode, out

    def pids(self) -> list[int]:
        return [p.pid for _, p in self.procs]

    def dump(self) -> str:
        """Every process's exit code and output, for a failed assertion: the processes still
        running are killed first (their output so far is shown)."""
        self.close()
        return "\n".join(f"--- {label} (rc {p.returncode})\n{self.outputs.get(label, '')}" for label, p in self.procs)

    @staticmethod
    def kill(proc: subprocess.Popen[str]) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        for _, proc in self.procs:
            if proc.poll() is None:
                self.kill(proc)
        for label, proc in self.procs:
            try:
                out, _ = proc.communicate(timeout=10)
            except (subprocess.TimeoutExpired, ValueError):
                continue
            self.outputs.setdefault(label, out or "")

    def leftovers(self) -> list[str]:
        exited = [p.pid for _, p in self.procs if p.returncode is not None and p.returncode >= 0]
        killed = [p.pid for _, p in self.procs if p.pid not in exited]
        left = wait_no_segments(exited)
        from ipcsync.backends.cpu import reclaim_dead_segments  # noqa: PLC0415 - torch-heavy

        reclaim_dead_segments()
        return left + [s for pid in killed for s in shm_segments(pid)]


def example_procs(example: str) -> Iterator[ExampleProcs]:
    """For a fixture (``yield from``): the processes of ``example``, all killed after the
    test, pass or fail; and none may leave a shared-memory segment behind."""
    p = ExampleProcs(example)
    try:
        yield p
    finally:
        p.close()
    assert not p.leftovers(), p.dump()
