"""Pipeline spec files for tests: ``toml_spec(stages, edges, **top)`` writes the TOML that
``ipcsync-run`` reads (top-level keys, ``[stages.NAME]`` tables, ``[[edges]]``).
Importable from tests/unit and tests/integration alike (this directory, the conftest's,
is on sys.path)."""

from __future__ import annotations

import json
from typing import Any, Sequence


def toml_value(v: Any) -> str:
    """One value in TOML: booleans, numbers, strings, arrays, inline tables."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(v)


def toml_spec(stages: dict[str, dict[str, Any]], edges: Sequence[dict[str, Any]] = (), **top: Any) -> str:
    """A TOML spec: top-level keys, [stages.NAME] tables, [[edges]]."""
    lines = [f"{k} = {toml_value(v)}" for k, v in top.items()]
    for name, body in stages.items():
        lines.append(f"\n[stages.{name}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in body.items()]
    for e in edges:
        lines.append("\n[[edges]]")
        lines += [f"{k} = {toml_value(v)}" for k, v in e.items()]
    return "\n".join(lines) + "\n"
