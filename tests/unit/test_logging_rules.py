"""The library logs through ``logging`` only: no ``print`` and no writes to
``sys.stdout``/``sys.stderr`` outside the command lines, whose output is program output
(``ipcsync-run``: launch/cli.py, the supervisor's relay and status lines, the monitor's lines and
the MPS watchdog's (launch/mps_daemon.py); ``ipcsync doctor``: doctor/cli.py
and its probe processes' JSON lines, doctor/probe.py; ``python -m
ipcsync``: __main__.py); every logger is named after its
module (``ipcsync.*``). Checked on the AST of every module."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest

from ipcsync.errors import ConfigError
from ipcsync.logs import LEVELS, parse_level

PKG = Path(__file__).resolve().parents[2] / "ipcsync"
CLI_MODULES = {"launch/cli.py", "launch/supervisor.py", "launch/monitor.py", "launch/mps_daemon.py", "doctor/cli.py",
               "doctor/probe.py", "__main__.py"}
MODULES = sorted(p for p in PKG.rglob("*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(PKG).as_posix()


def test_the_command_line_modules_exist() -> None:
    assert CLI_MODULES <= {_rel(p) for p in MODULES}


@pytest.mark.parametrize("path", [p for p in MODULES if _rel(p) not in CLI_MODULES], ids=_rel)
def test_no_print_and_no_stdout_outside_the_command_lines(path: Path) -> None:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
            found.append(f"line {node.lineno}: print()")
        if (isinstance(node, ast.Attribute) and node.attr in ("stdout", "stderr", "__stdout__", "__stderr__")
                and isinstance(node.value, ast.Name) and node.value.id == "sys"):
            found.append(f"line {node.lineno}: sys.{node.attr}")
    allowed = {
        "logs.py": {"sys.stderr"},  # the handlers it installs
        "stage.py": {"sys.stderr"},  # its excepthook's one line, in place of the interpreter's traceback
        "gpufaults.py": {"sys.stderr"},  # its excepthook's paragraph after the interpreter's traceback
    }.get(_rel(path), set())
    found = [f for f in found if f.split(": ", 1)[1] not in allowed]
    assert not found, f"{_rel(path)} writes to the terminal itself (log through logging.getLogger(__name__)): {found}"


@pytest.mark.parametrize("path", MODULES, ids=_rel)
def test_loggers_are_named_after_their_module(path: Path) -> None:
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "getLogger"
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "logging"):
            args = node.args
            named = len(args) == 1 and isinstance(args[0], ast.Name) and args[0].id == "__name__"
            # logs.py configures the package's logger and reads the root's.
            package = _rel(path) == "logs.py" and (not args or (isinstance(args[0], ast.Constant)
                                                                and args[0].value == "ipcsync"))
            assert named or package, f"{_rel(path)} line {node.lineno}: use logging.getLogger(__name__)"


@pytest.mark.parametrize("text", ["debug", "INFO", " Warning ", "error", "critical"])
def test_parse_level(text: str) -> None:
    assert parse_level(text) == getattr(logging, text.strip().upper())


def test_parse_level_refuses_what_is_not_a_level() -> None:
    with pytest.raises(ConfigError, match=r"IPCSYNC_LOG_LEVEL: unknown log level 'loud'; use one of debug"):
        parse_level("loud")
    assert LEVELS == ("debug", "info", "warning", "error", "critical")
