"""Logging: ``ipcsync-run --log-level`` sets the level of the stages' ``ipcsync.*`` loggers
(through ``$IPCSYNC_LOG_LEVEL``) and of the launcher's own; by default only warnings
show; a stage that configures logging itself keeps its configuration. Stages run under
the real launcher (test_launch_cli's ``Launcher``); the probe is ``stages/logprobe.py``.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest

import test_launch_cli as cli
from test_launch_cli import launcher  # noqa: F401 (the fixture)

pytestmark = pytest.mark.timeout(200)


def run_probe(launcher: Any, tmp_path: Path, *flags: str, probe_args: tuple[str, ...] = (),
              env: dict[str, str | None] | None = None) -> Any:
    return launcher.run("--stage", f"probe={shlex.join(cli.stage('logprobe.py', *probe_args))}",
                        "--device", "probe=cpu", *flags, cwd=tmp_path, env=env)


def probe_lines(run: Any) -> list[str]:
    return run.lines_of("probe/0")


def test_log_level_debug_shows_the_stages_debug_lines(launcher: Any, tmp_path: Path) -> None:
    run = run_probe(launcher, tmp_path, "--log-level", "debug")
    assert run.proc.returncode == 0, run.dump()
    lines = probe_lines(run)
    # A real debug line of the library, from a logger below ipcsync, with the stage's pid.
    assert any(line.startswith("DEBUG ipcsync.runtime.producer.connections[") and "attached" in line for line in lines), run.dump()
    for level in ("DEBUG", "INFO", "WARNING"):
        assert sum(f"{level} ipcsync.probe[" in line and f"probe {level.lower()}" in line
                   for line in lines) == 1, run.dump()
    # The launcher's own debug lines, on its stderr.
    assert "ipcsync-run: DEBUG ipcsync.launch.supervisor: started stage probe/0" in run.err, run.dump()
    launcher.assert_nothing_left()


def test_default_level_shows_warnings_only(launcher: Any, tmp_path: Path) -> None:
    run = run_probe(launcher, tmp_path, env={"IPCSYNC_LOG_LEVEL": None})
    assert run.proc.returncode == 0, run.dump()
    lines = probe_lines(run)
    assert "probe warning" in lines, run.dump()
    assert not any("probe debug" in line or "probe info" in line or "DEBUG" in line for line in lines), run.dump()
    assert "DEBUG" not in run.err and "INFO" not in run.err, run.dump()
    assert "ipcsync-run: started 1 process of" in run.err  # status lines are output, not logging


def test_log_level_error_hides_warnings(launcher: Any, tmp_path: Path) -> None:
    run = run_probe(launcher, tmp_path, "--log-level", "ERROR")
    assert run.proc.returncode == 0, run.dump()
    assert not any("probe" in line for line in probe_lines(run)), run.dump()


def test_a_stage_that_configures_logging_keeps_its_configuration(launcher: Any, tmp_path: Path) -> None:
    run = run_probe(launcher, tmp_path, "--log-level", "debug", probe_args=("--configure",))
    assert run.proc.returncode == 0, run.dump()
    lines = probe_lines(run)
    assert lines.count("USER INFO ipcsync.probe: probe info") == 1, run.dump()
    assert lines.count("USER WARNING ipcsync.probe: probe warning") == 1, run.dump()
    # Its level (INFO) holds, and no line is written a second time in ipcsync's format.
    assert not any("probe debug" in line or "ipcsync.probe[" in line for line in lines), run.dump()


@pytest.mark.parametrize("how", ["option", "env"])
def test_a_bad_level_is_a_launcher_error(launcher: Any, tmp_path: Path, how: str) -> None:
    if how == "option":
        run = run_probe(launcher, tmp_path, "--log-level", "loud")
        assert "--log-level" in run.err and "loud" in run.err, run.dump()
    else:
        run = run_probe(launcher, tmp_path, env={"IPCSYNC_LOG_LEVEL": "loud"})
        assert "IPCSYNC_LOG_LEVEL: unknown log level 'loud'" in run.err, run.dump()
    assert run.proc.returncode == 125, run.dump()
    assert not run.started_lines
