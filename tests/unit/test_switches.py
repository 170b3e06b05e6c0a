"""Every ``IPCSYNC_*`` variable ipcsync reads is a switch of one table (``ipcsync.envopts``),
read only through it, and parsed one way: blank is the default, a value its kind does not
accept a ConfigError naming the variable, the value and what it accepts. The launcher and
its stages share the contract's names (``ipcsync.stage_contract``), never literals."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from ipcsync import envopts, stage_contract
from ipcsync.envopts import SWITCHES, TEXT, Switch
from ipcsync.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "ipcsync"
TABLE = PKG / "envopts.py"
NAME = re.compile(r"IPCSYNC_[A-Z0-9_]+")
# Set by ipcsync-run for the stage's own code; ipcsync itself reads the wiring instead.
FOR_STAGE_CODE = {envopts.DEVICE.name}


def modules() -> Iterator[tuple[str, Path]]:
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        yield ".".join(parts), path


def resolve(node: ast.AST, space: dict[str, Any]) -> Any:
    """What ``node`` (a constant, or a dotted name of module scope) is in ``space``, or
    None where that cannot be said without running the code."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return space.get(node.id)
    if isinstance(node, ast.Attribute):
        base = resolve(node.value, space)
        return getattr(base, node.attr, None) if base is not None else None
    return None


def keys_read(tree: ast.AST) -> Iterator[tuple[int, ast.AST]]:
    """Every expression used as a key to read a mapping (``m.get(k)``, ``m[k]``, ``k in m``,
    ``os.getenv(k)``, ``m.pop(k)``, ``m.setdefault(k)``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args \
                and node.func.attr in ("get", "getenv", "pop", "setdefault"):
            yield node.lineno, node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            yield node.lineno, node.slice
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            yield node.lineno, node.left


def test_no_name_is_spelled_outside_the_table() -> None:
    """A literal ``"IPCSYNC_..."`` outside envopts.py would be a variable read or set past
    the table (messages that mention a name in a longer text are fine)."""
    found = []
    for path in [*PKG.rglob("*.py"), *(ROOT / "scripts").rglob("*.py")]:
        if path == TABLE:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not found, "spell these through ipcsync.envopts (SWITCH.name):\n" + "\n".join(found)


def test_no_module_reads_a_switch_past_the_table() -> None:
    """No module reads an IPCSYNC_ variable from the environment (or any mapping) by its
    name: it calls its switch's ``get()``."""
    found = []
    for name, path in modules():
        if path == TABLE or path.name == "__main__.py":
            continue
        space = vars(importlib.import_module(name))
        for line, key in keys_read(ast.parse(path.read_text(), filename=str(path))):
            value = resolve(key, space)
            if isinstance(value, str) and NAME.fullmatch(value):
                found.append(f"{path.relative_to(ROOT)}:{line}: reads {ast.unparse(key)} ({value})")
    assert not found, "read these through their switch's get():\n" + "\n".join(found)


def test_every_switch_is_read_somewhere() -> None:
    """A switch of the table that nothing reads is a knob that does nothing."""
    read: set[str] = set()
    mentioned: set[str] = set()
    for name, path in modules():
        if path == TABLE or path.name == "__main__.py":
            continue
        space = vars(importlib.import_module(name))
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Attribute):
                target = resolve(node.value, space)
                if isinstance(target, Switch):
                    (read if node.attr in ("get", "is_set") else mentioned).add(target.name)
    unread = {s.name for s in SWITCHES} - read - FOR_STAGE_CODE
    assert not unread, f"declared in ipcsync.envopts but read nowhere: {sorted(unread)}"
    assert FOR_STAGE_CODE <= mentioned, "the launcher sets these for stage code"


def test_the_table_holds_every_switch_once_each_documented() -> None:
    names = [s.name for s in SWITCHES]
    assert len(names) == len(set(names))
    declared = {v.name for v in vars(envopts).values() if isinstance(v, Switch)}
    assert declared == set(names)
    for s in SWITCHES:
        assert NAME.fullmatch(s.name) and s.meaning and s.kind.accepts and s.default_text, s
        assert s.set_by in ("you", "ipcsync-run"), s


CHECKED = [s for s in SWITCHES if s.kind is not TEXT]


@pytest.mark.parametrize("switch", CHECKED, ids=[s.name for s in CHECKED])
def test_a_bad_value_is_a_config_error_naming_the_variable(monkeypatch: pytest.MonkeyPatch,
                                                          switch: Switch[Any]) -> None:
    monkeypatch.setenv(switch.name, "bogus value")
    with pytest.raises(ConfigError) as info:
        switch.get()
    text = str(info.value)
    assert f"${switch.name}='bogus value'" in text and switch.kind.accepts in text, text
    assert switch.default_text in text, text


@pytest.mark.parametrize("switch", SWITCHES, ids=[s.name for s in SWITCHES])
@pytest.mark.parametrize("raw", [None, "", "  "], ids=["unset", "empty", "blank"])
def test_unset_or_blank_is_the_default(monkeypatch: pytest.MonkeyPatch, switch: Switch[Any], raw: str | None) -> None:
    if raw is None:
        monkeypatch.delenv(switch.name, raising=False)
    else:
        monkeypatch.setenv(switch.name, raw)
    assert switch.get() == switch.default and switch.is_set() is False


FLAGS = [s for s in SWITCHES if isinstance(s.default, bool)]


@pytest.mark.parametrize("switch", FLAGS, ids=[s.name for s in FLAGS])
def test_every_flag_is_zero_or_one_the_same_way(monkeypatch: pytest.MonkeyPatch, switch: Switch[bool]) -> None:
    for raw, want in (("1", True), (" 1 ", True), ("0", False), ("0\n", False)):
        monkeypatch.setenv(switch.name, raw)
        assert switch.get() is want, raw
    for raw in ("yes", "true", "on", "2", "01"):
        monkeypatch.setenv(switch.name, raw)
        with pytest.raises(ConfigError, match=re.escape(f"${switch.name}={raw!r} is not 0 or 1")):
            switch.get()


def test_a_mapping_other_than_the_environment() -> None:
    assert envopts.LANE.get({"IPCSYNC_LANE": "0"}) is False
    assert envopts.TELEMETRY_INTERVAL.get({"IPCSYNC_TELEMETRY_INTERVAL": "2"}) == 2.0
    assert envopts.REMOTE_TRANSPORT.get({}) == "auto"


# ---------------------------------------------------------------------------- read sites
def test_read_sites_refuse_what_they_once_took_silently(monkeypatch: pytest.MonkeyPatch) -> None:
    """A value that is not 0 or 1 used to mean "off" (IPCSYNC_CUDA_VMM,
    IPCSYNC_CPU_DESCRIPTORS) or the default (IPCSYNC_TELEMETRY_INTERVAL,
    IPCSYNC_TRACE_MAX_EVENTS): now each says what is wrong."""
    from ipcsync.backends import cpu_descriptors, cuda
    from ipcsync.runtime import telemetry

    monkeypatch.setenv("IPCSYNC_CPU_DESCRIPTORS", "yes")
    with pytest.raises(ConfigError, match=r"\$IPCSYNC_CPU_DESCRIPTORS='yes' is not 0 or 1"):
        cpu_descriptors.enabled()
    monkeypatch.setenv("IPCSYNC_CUDA_VMM", "true")
    backend = object.__new__(cuda.CudaBackend)  # (no GPU here: the switch is read first)
    backend.index = 99
    with pytest.raises(ConfigError, match=r"\$IPCSYNC_CUDA_VMM='true' is not 0 or 1"):
        backend.descriptor_problem()
    monkeypatch.setenv("IPCSYNC_TELEMETRY_DIR", "/nonexistent/telemetry")
    monkeypatch.setenv("IPCSYNC_TELEMETRY_INTERVAL", "fast")
    with pytest.raises(ConfigError, match=r"\$IPCSYNC_TELEMETRY_INTERVAL='fast' is not a number of seconds"):
        telemetry.publish_periodically("s.0", dict)
    monkeypatch.setenv("IPCSYNC_TRACE_DIR", "/nonexistent/trace")
    monkeypatch.setenv("IPCSYNC_TRACE_MAX_EVENTS", "lots")
    monkeypatch.setattr(telemetry, "_buffer", None)
    with pytest.raises(ConfigError, match=r"\$IPCSYNC_TRACE_MAX_EVENTS='lots' is not a whole number"):
        telemetry.tracer_for("x")


# ---------------------------------------------------------------------------- the contract
def test_the_contract_loads_neither_torch_nor_zmq() -> None:
    out = subprocess.run([sys.executable, "-c", "import sys, ipcsync.stage_contract, ipcsync.envopts; "
                          "print('torch' in sys.modules, 'zmq' in sys.modules)"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.split() == ["False", "False"], out.stderr


def test_the_launcher_sets_what_the_stage_reads(tmp_path: Path) -> None:
    """A plan's stage environment is the contract's (every stage variable, the wiring the
    stage parses, its stats path the contract's), and the observer's and the MPS
    daemon's variables are the ones the stage side reads."""
    from ipcsync.launch import loads
    from ipcsync.launch.monitor import Observer
    from ipcsync.launch.plan import resolve as plan

    spec = loads('name = "p"\n[stages.a]\ncmd = "python a.py"\n[stages.b]\ncmd = "python b.py"\n'
                 '[[edges]]\nfrom = "a"\nto = "b"\n')
    for inst in plan(spec, run_id="0badcafe", run_dir=str(tmp_path), gpus=0).instances:
        env = inst.env
        assert {s.name for s in stage_contract.EVERY_STAGE} <= set(env)
        assert stage_contract.WIRING.get(env) is not None and stage_contract.RUN_ID.get(env) == "0badcafe"
        assert (stage_contract.STAGE.get(env), stage_contract.REPLICA.get(env)) == (inst.stage, str(inst.replica))
        assert inst.wiring["stats_path"] == stage_contract.stats_path(str(tmp_path), inst.stage, inst.replica)
        assert inst.wiring["version"] == stage_contract.WIRING_VERSION
    observer = Observer(monitor=True, interval=1.0, stats_file=None, trace_file=str(tmp_path / "t.json"))
    env = observer.env(str(tmp_path))
    assert stage_contract.TELEMETRY_DIR.get(env) == str(tmp_path / stage_contract.TELEMETRY_SUBDIR)
    assert stage_contract.TELEMETRY_INTERVAL.get(env) == 0.5
    assert stage_contract.TRACE_DIR.get(env) == str(tmp_path / stage_contract.TRACE_SUBDIR)
    mps = stage_contract.mps_env(pipe="/p", control="/c")
    assert (stage_contract.MPS_PIPE.get(mps), stage_contract.MPS_CONTROL.get(mps)) == ("/p", "/c")
    assert stage_contract.failure_report_path("/r/stats/a.0.json") == "/r/stats/a.0.error"
    assert stage_contract.incomplete_marker_path("/r/stats/a.0.json") == "/r/stats/a.0.incomplete"
