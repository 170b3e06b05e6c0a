"""What a stage's telemetry can do to the launcher, through real pipelines: exit stats of
the wrong shape are left out of the summary, said once, and the launcher still exits with
the stages' code; telemetry that cannot be written (a full runtime directory, simulated
in the stage through the library's write seam: tests/integration/stages/faulty.py) is
said once, in the stage's log and the launcher's output, and every figure it affects is
marked incomplete."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import test_launch_cli as cli
from specfile import toml_spec
from test_launch_monitor import launcher  # noqa: F401 (the fixture)

from ipcsync.launch.cli import EXIT_LAUNCHER_ERROR

pytestmark = pytest.mark.timeout(240)

NOTE = "incomplete: telemetry could not be written"


def two_stages(launcher: cli.Launcher, n: int, *sink_fault: object) -> Path:
    return launcher.spec_file(toml_spec(
        {"src": {"cmd": cli.stage("src.py", "--n", n, "--delay", 0.01), "device": "cpu"},
         "sink": {"cmd": cli.stage("faulty.py", *sink_fault, "sink.py"), "device": "cpu"}},
        [{"from": "src", "to": "sink", "slots": 2, "slot_bytes": "64KiB"}],
        name="telemetry", stop_timeout=5,
    ))


def test_exit_stats_of_the_wrong_shape_are_left_out_and_said(launcher: cli.Launcher) -> None:
    n = 20
    run = launcher.run(two_stages(launcher, n, "--corrupt-stats"))
    assert run.proc.returncode == 0, run.dump()
    assert "internal error" not in run.err and "Traceback" not in run.err, run.dump()
    lines = [line for line in run.err.splitlines() if "not of the expected shape" in line]
    assert lines == ["ipcsync-run: left out of the summary, not of the expected shape: "
                     "sink/0 input from 'src': 'handoffs' is 'many', not a count"], run.dump()
    # src's own stats are fine: its edge is still summed up.
    assert f"ipcsync-run:   src -> sink: {n} items" in run.err, run.dump()
    launcher.assert_nothing_left()


@pytest.mark.parametrize("after", [0, 3])
def test_telemetry_that_cannot_be_written_is_said_once_and_marked(launcher: cli.Launcher, tmp_path: Path,
                                                                   after: int) -> None:
    n = 30
    stats, trace = tmp_path / "stats.jsonl", tmp_path / "trace.json"
    run = launcher.run(two_stages(launcher, n, "--disk-full-after", after), "--monitor", "--monitor-interval",
                       "0.2", "--stats-file", stats, "--trace", trace)
    assert run.proc.returncode == 0, run.dump()  # the stages' code: telemetry never fails a run
    assert "Traceback" not in run.err + run.out, run.dump()
    # Said once by the stage (its log, relayed with its prefix) ...
    stage_says = [line for line in run.out.splitlines() if "telemetry could not be written" in line]
    assert len(stage_says) == 1 and stage_says[0].startswith("[sink/0]"), run.dump()
    assert "No space left on device" in stage_says[0] and "incomplete" in stage_says[0], run.dump()
    # ... and once by the launcher, naming the stage, before the figures it concerns.
    said = [line for line in run.err.splitlines() if line.startswith("ipcsync-run: telemetry could not be written")]
    assert len(said) == 1 and "sink/0" in said[0] and "IPCSYNC_RUNTIME_DIR" in said[0], run.dump()
    err = run.err.splitlines()
    assert err.index(said[0]) < min(i for i, line in enumerate(err) if "monitor (final)" in line), run.dump()
    # Every figure it affects is marked.
    assert f"ipcsync-run: edge summary ({NOTE}):" in err, run.dump()
    final_head = next(line for line in err if "monitor (final)" in line)
    assert final_head.endswith(f"({NOTE})"), run.dump()
    assert any(line.startswith("ipcsync-run: trace: ") and line.endswith(f"({NOTE})") for line in err), run.dump()
    records = [json.loads(line) for line in stats.read_text().splitlines()]
    finals = [r for r in records if r["final"]]
    assert finals and all(r["incomplete"] is True for r in finals), finals
    launcher.assert_nothing_left()


def test_complete_telemetry_is_not_marked(launcher: cli.Launcher, tmp_path: Path) -> None:
    stats = tmp_path / "stats.jsonl"
    run = launcher.run(two_stages(launcher, 10), "--monitor", "--monitor-interval", "0.2", "--stats-file", stats)
    assert run.proc.returncode == 0, run.dump()
    assert "incomplete" not in run.err and "could not be written" not in run.out, run.dump()
    assert "ipcsync-run: edge summary:" in run.err.splitlines(), run.dump()
    records = [json.loads(line) for line in stats.read_text().splitlines()]
    assert records and not any(r["incomplete"] for r in records), records[-3:]
    launcher.assert_nothing_left()


def test_stats_file_through_a_link_is_refused(launcher: cli.Launcher, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    link = tmp_path / "stats.jsonl"
    link.symlink_to(victim)
    run = launcher.run(two_stages(launcher, 3), "--stats-file", link)
    assert run.proc.returncode == EXIT_LAUNCHER_ERROR, run.dump()
    assert f"--stats-file {link} is a symbolic link" in run.err, run.dump()
    assert victim.read_text() == "precious\n"
    launcher.assert_nothing_left()


def test_stats_file_at_a_fifo_is_refused_at_once(launcher: cli.Launcher, tmp_path: Path) -> None:
    # Before: open() of the FIFO for appending waited for a reader, for ever, before any
    # stage started (another user's FIFO planted at the path held a root launcher).
    fifo = tmp_path / "stats.jsonl"
    os.mkfifo(fifo, 0o666)
    run = launcher.run(two_stages(launcher, 3), "--stats-file", fifo, timeout=60)
    assert run.proc.returncode == EXIT_LAUNCHER_ERROR, run.dump()
    said = [line for line in run.err.splitlines() if line.startswith("ipcsync-run: error: ")]
    assert said == [f"ipcsync-run: error: --stats-file {fifo}: cannot open it for writing (not a regular file "
                    "(a FIFO)); ipcsync-run appends only to a regular file: give a new name or a regular file's"], \
        run.dump()
    assert "started" not in run.err, run.dump()
    launcher.assert_nothing_left()


def planter(launcher: cli.Launcher, what: str, code: int = 0) -> Path:
    return launcher.spec_file(toml_spec(
        {"planter": {"cmd": cli.stage("planter.py", what, "--code", code), "device": "cpu"}},
        [], name="planted", stop_timeout=5,
    ))


@pytest.mark.parametrize("what, options, code, said", [
    ("nested-stats", [], 0, "ipcsync-run: skipped exit stats that cannot be read: planted.json (JSON nested too "
                            "deeply)"),
    ("fifo-stats", [], 0, "ipcsync-run: skipped exit stats that cannot be read: planted.json (not a regular file "
                          "(a FIFO))"),
    ("fifo-telemetry", ["--monitor", "--monitor-interval", "0.1"], 0,
     "ipcsync-run: monitor: skipping stage telemetry that cannot be used: planted.json: not a regular file (a FIFO)"),
    ("fifo-trace", ["--trace", "TRACE"], 0,
     "ipcsync-run: trace: skipped trace files that cannot be read: planted.jsonl: not a regular file (a FIFO)"),
    ("fifo-error", [], 3, None),
])
def test_what_a_stage_plants_where_the_launcher_reads_is_skipped_and_said(
        launcher: cli.Launcher, tmp_path: Path, what: str, options: list[str], code: int, said: str | None) -> None:
    # Before: a report nested too deeply made "ipcsync-run: internal error", exit 125,
    # after every stage exited 0 (json.loads raises RecursionError); a FIFO where the
    # launcher reads a .json, .jsonl or .error file held it in open() for ever.
    options = [str(tmp_path / "trace.json") if o == "TRACE" else o for o in options]
    run = launcher.run(planter(launcher, what, code), *options, timeout=90)
    assert run.proc.returncode == code, run.dump()  # the stages' code
    assert "internal error" not in run.err and "Traceback" not in run.err, run.dump()
    assert f"[planter/0] planted {what}" in run.out, run.dump()
    if said is not None:
        assert [line for line in run.err.splitlines() if line == said] == [said], run.dump()
    else:
        assert "root cause: stage planter/0 (pid " in run.err and "exited with code 3" in run.err, run.dump()
    launcher.assert_nothing_left()
