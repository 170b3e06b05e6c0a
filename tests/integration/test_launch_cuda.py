"""ipcsync-run on the CUDA backend (run on a GPU by scripts/gpu-tests.sh): the demo
pipeline, a 3-stage pipeline with replicas and fan-in, and the restart policy recovering
from a stage SIGKILLed mid-record."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

ROOT = Path(__file__).resolve().parents[2]
STAGE = Path(__file__).resolve().parent / "stages" / "cuda_stage.py"

pytestmark = [pytest.mark.cuda]


@pytest.fixture
def launch(runtime_dir: Path) -> Iterator[Any]:
    """Runs ipcsync-run; kills its whole tree at teardown, pass or fail."""
    started: list[subprocess.Popen[bytes]] = []

    def run(args: list[str], timeout: float = 120.0, cwd: Path = ROOT) -> tuple[int, str, str]:
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        p = subprocess.Popen([sys.executable, "-m", "ipcsync.launch", *args], cwd=cwd, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        started.append(p)
        out, err = p.communicate(timeout=timeout)
        return p.returncode, out.decode(errors="replace"), err.decode(errors="replace")

    yield run
    for p in started:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)
    assert not [d for d in runtime_dir.iterdir() if d.name.startswith("run-")], "run directory left behind"


def results(out: str, event: str) -> list[dict[str, Any]]:
    found = []
    for line in out.splitlines():
        _, _, rest = line.partition("] ")
        if rest.startswith("{"):
            msg = json.loads(rest)
            if msg.get("event") == event:
                found.append(msg)
    return found


def write_spec(tmp_path: Path, text: str) -> str:
    path = tmp_path / "pipeline.toml"
    path.write_text(text)
    return str(path)


@pytest.mark.timeout(180)
def test_demo_pipeline_runs_on_cuda(launch: Any) -> None:
    rc, out, err = launch(["examples/pipeline.toml"], timeout=170)
    assert rc == 0, err[-3000:]
    assert "[loader/0] loader 0/2 on cuda:0" in out
    assert "[train/0] train: done, 400 steps from 2 loaders" in out
    assert "edge summary:" in err and "loader -> train: 400 items" in err


@pytest.mark.timeout(180)
def test_three_stage_cuda_pipeline_with_replicas(launch: Any, tmp_path: Path) -> None:
    spec = write_spec(tmp_path, f"""
stop_timeout = 5
[stages.src]
cmd = ["{sys.executable}", "{STAGE}", "src", "60"]
replicas = 2
[stages.mid]
cmd = ["{sys.executable}", "{STAGE}", "mid"]
[stages.sink]
cmd = ["{sys.executable}", "{STAGE}", "sink", "120", "mid"]
[[edges]]
from = "src"
to = "mid"
slot_bytes = "64KiB"
[[edges]]
from = "mid"
to = "sink"
slot_bytes = "64KiB"
""")
    rc, out, err = launch([spec], timeout=170)
    assert rc == 0, out[-3000:] + err[-3000:]
    (done,) = results(out, "sink-done")
    assert done["ok"] and done["got"] == 120 and done["device"] == "cuda:0", done


@pytest.mark.timeout(240)
def test_restart_recovers_from_a_stage_killed_mid_record(launch: Any, tmp_path: Path) -> None:
    # On the first attempt the producer SIGKILLs itself with a recorded event still pending:
    # its consumer (wait="gpu") may be wedged on that event for good. The supervisor tears
    # the group down (SIGKILL after stop_timeout) and restarts it; the second attempt
    # delivers everything. A teardown that waited on the wedged consumer would never end:
    # the launch's own timeout fails it.
    spec = write_spec(tmp_path, f"""
restart = 1
stop_timeout = 3
[stages.src]
cmd = ["{sys.executable}", "{STAGE}", "src", "40", "--die-mid-record"]
[stages.sink]
cmd = ["{sys.executable}", "{STAGE}", "sink", "40"]
[[edges]]
from = "src"
to = "sink"
slot_bytes = "64KiB"
wait = "gpu"
""")
    rc, out, err = launch([spec], timeout=230)
    assert rc == 0, out[-3000:] + err[-3000:]
    assert results(out, "dying") == [{"event": "dying", "attempt": 0}]
    assert "src/0" in err and "killed by SIGKILL" in err
    assert "restarting the whole group (restart 1 of 1)" in err
    done = results(out, "sink-done")
    assert done[-1]["ok"] and done[-1]["attempt"] == 1 and done[-1]["got"] == 40, done
