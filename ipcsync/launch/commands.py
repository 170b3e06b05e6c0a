"""Whether a stage's command can start here, checked without running it: for
``ipcsync-run --dry-run`` (``cli.check_plan``) and ``ipcsync doctor --spec``.

- its ``cwd`` is a directory;
- its program is an executable file (a path, taken from the cwd) or is found on the
  stage's PATH;
- for a Python interpreter (``python``, ``python3``, ``python3.N``, by any path), what it
  would run: a script (a file, or a directory or zip with ``__main__.py``) that exists
  from the cwd, or for ``-m MOD`` a module that the launcher's own interpreter can find
  from the cwd and the stage's PYTHONPATH (only when the stage runs under that
  interpreter, as a ``python`` command does under ipcsync-run). The module is looked up
  on the file system and by the import system's finders: nothing is imported or run, so
  a package's ``__init__`` never runs here. ``-c``, ``-`` and options that only print
  (``--version``) have nothing to check.

Reads the file system only; never starts a process.
"""

from __future__ import annotations

import importlib.machinery
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from .plan import is_python_word

__all__ = ["command_problem", "python_target"]

_OPTIONS_WITH_VALUE = "cmWX"  # python's one-letter options that take a value
_LONG_WITH_VALUE = ("--check-hash-based-pycs",)


def python_target(args: Sequence[str]) -> tuple[str, str] | None:
    """What a Python interpreter given ``args`` (its arguments, not itself) runs:
    ``("script", path)``, ``("module", name)``, or None (``-c``, stdin, ``--version``,
    a missing value)."""
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            return ("script", args[i + 1]) if i + 1 < len(args) else None
        if a == "-" or not a:
            return None
        if not a.startswith("-"):
            return ("script", a)
        if a.startswith("--"):
            if a in _LONG_WITH_VALUE:
                i += 2
                continue
            if a.split("=", 1)[0] in _LONG_WITH_VALUE:
                i += 1
                continue
            return None  # --help, --version, ...: the interpreter prints and exits
        for j, letter in enumerate(a[1:], start=1):
            if letter in _OPTIONS_WITH_VALUE:
                value = a[j + 1:]
                if not value:
                    i += 1
                    if i >= len(args):
                        return None
                    value = args[i]
                if letter == "m":
                    return ("module", value)
                if letter == "c":
                    return None
                break
            if letter in "hV?":
                return None
        i += 1
    return None


def command_problem(cmd: Sequence[str], cwd: str | None, env: Mapping[str, str]) -> tuple[str, str] | None:
    """Why ``cmd`` cannot start from ``cwd`` (None: the launcher's) with the stage's
    environment ``env`` (on top of the launcher's), as ``(field, message)`` with field
    ``"cwd"`` or ``"cmd"``; None when it can."""
    where = cwd or os.getcwd()
    if not os.path.isdir(where):
        return "cwd", f"{where!r} is not a directory"
    prog = cmd[0]
    if os.sep in prog:
        path = os.path.join(where, prog)  # prog itself if absolute
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            why = "is not executable" if os.path.isfile(path) else "does not exist"
            return "cmd", f"{prog!r} {why} (from directory {where})"
    else:
        search = env.get("PATH", os.environ.get("PATH", os.defpath))
        dirs = [d if os.path.isabs(d) else os.path.join(where, d or ".") for d in search.split(os.pathsep)]
        if shutil.which(prog, path=os.pathsep.join(dirs)) is None:
            return "cmd", f"{prog!r} is not found on PATH (from directory {where})"
    if not is_python_word(os.path.basename(prog)):
        return None
    target = python_target(cmd[1:])
    if target is None:
        return None
    kind, name = target
    if kind == "script":
        path = os.path.join(where, name)
        if not (os.path.isfile(path) or os.path.isfile(os.path.join(path, "__main__.py"))):
            return "cmd", f"the script {name!r} does not exist (from directory {where})"
        return None
    if prog != sys.executable:
        return None  # another interpreter: its modules are its own business
    pythonpath = env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    sys_path = [where] + [os.path.join(where, d) for d in pythonpath.split(os.pathsep) if d] + sys.path[1:]
    missing = _missing_module(name, sys_path)
    if missing is not None:
        return "cmd", f"{missing} (python -m {name}, from directory {where})"
    return None


def _missing_module(name: str, search: list[str]) -> str | None:
    """Why ``python -m name`` would find nothing to run with ``search`` as its sys.path,
    or None. Finds specs only: imports nothing."""
    parts = name.split(".")
    if not all(p.isidentifier() for p in parts):
        return f"{name!r} is not a module name"
    spec = _find(parts[0], None, search)
    for k in range(1, len(parts)):
        if spec is None or spec.submodule_search_locations is None:
            break
        spec = _find(".".join(parts[: k + 1]), list(spec.submodule_search_locations), search)
    if spec is None:
        return f"the module {name!r} is not found"
    if spec.submodule_search_locations is not None:  # a package runs its __main__
        if _find(f"{name}.__main__", list(spec.submodule_search_locations), search) is None:
            return f"the package {name!r} has no __main__ module, so it cannot be run with -m"
    return None


def _find(fullname: str, path: list[str] | None, search: list[str]) -> Any:
    """The spec of ``fullname`` (in ``path``, its parent package's locations; None for a
    top-level module, then on ``search``), from the path finder or, for a top-level
    module, any other finder of this interpreter (builtins, editable installs)."""
    try:
        spec = importlib.machinery.PathFinder.find_spec(fullname, path if path is not None else search)
        if spec is not None or path is not None:
            return spec
        for finder in sys.meta_path:
            if finder is importlib.machinery.PathFinder or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, None)
            if spec is not None:
                return spec
    except (ImportError, ValueError, OSError):
        return None
    return None
