"""Pipeline specs for ``ipcsync-run``: parsing and validation, pure (no processes, no
sockets, no CUDA). ``load(path)`` reads TOML, ``from_cli(...)`` reads ``--stage``/``--edge``
arguments; both give the same ``PipelineSpec``, or a ``SpecError`` that names the source,
the key and what is wrong.

A spec::

    restart = 1                 # restart the whole group up to 1 time after a failure
    stop_timeout = 10           # seconds between SIGTERM and SIGKILL at teardown
    mps = "auto"                # "on": a private MPS daemon for a CUDA run; "auto" (default):
                                # one when two or more CUDA processes share a GPU; "off"

    [stages.loader]
    cmd = ["python3", "examples/loader.py"]     # or one string, split like a shell
    replicas = 2
    device = "cuda:0"           # "auto" (default), "cpu", "cuda", "cuda:N"; "{replica}"
                                # is replaced by the replica index, e.g. "cuda:{replica}"
    visible_devices = "0,1"     # optional CUDA_VISIBLE_DEVICES for this stage
    env = { LOG_LEVEL = "info" }
    cwd = "."                   # optional; relative to the spec file's directory
    node = 0                    # with ipcsync-run --nnodes N: the node it runs on (default
                                # 0), or nodes = [0, 1]: replica r runs on nodes[r % len]

    [stages.train]
    cmd = "python3 examples/train.py"

    [[edges]]
    from = "loader"
    to = "train"
    slots = 4                   # 1 to 1024 (limits.MAX_SLOTS)
    slot_bytes = "8MiB"         # an integer, or a string with B, KiB, MiB, GiB
    policy = "shard"            # or "broadcast" (with several consumer replicas)
    wait = "gpu"                # how the consumer waits on the producer's events
    timeout = 30                # seconds the two ends wait for each other to appear
                                # (the handshake); see below
    verify = false              # true: consumers check that no received item changes
                                # while they hold it (Consumer(verify=True); for CUDA)

    [[edges]]                   # a reply edge: answers going back upstream (the only
    from = "train"              # kind of edge allowed to close a cycle); its output()
    to = "loader"               # does not wait for consumers, so no order of input()
    reply = true                # and output() calls can deadlock

An edge's ``timeout`` is its connect timeout: how long a stage waits at ``input()`` /
``output()`` for the stage at the other end to appear (default
``limits.DEFAULT_CONNECT_TIMEOUT``, 30 s). Once connected, data calls wait as long as the
peer process lives, and end with ``PeerLostError`` when it is gone; no data call times
out by default.

Every value but ``cmd``, ``env``, ``cwd`` and ``visible_devices`` can be overridden from
the command line together with a spec file (``apply_overrides``): ``--replicas NAME=N``,
``--device NAME=DEVICE``, ``--edge-option FROM:TO:KEY=VALUE``, ``--restart``,
``--stop-timeout``, ``--mps`` (``mps_mode`` checks its value).
"""

from __future__ import annotations

import math
import os
import re
import shlex
import sys
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Iterable, Mapping

from ..core.waits import WAIT_MODES, wait_problem  # pure, as are the limits: a spec loads no endpoint, torch or zmq
from ..errors import ConfigError
from ..limits import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_SLOT_BYTES,
    DEFAULT_SLOTS,
    MAX_SLOT_BYTES,
    MAX_SLOTS,
    POLICIES,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "SpecError",
    "StageSpec",
    "EdgeSpec",
    "PipelineSpec",
    "load",
    "loads",
    "from_mapping",
    "from_cli",
    "parse_bytes",
    "apply_overrides",
    "Overrides",
    "DEFAULT_SLOT_BYTES",
    "MPS_MODES",
    "mps_mode",
    "Key",
    "TOP_KEYS",
    "STAGE_KEYS",
    "EDGE_KEYS",
]

MAX_REPLICAS = 256
MAX_RESTART = 1000
_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,31}$")
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:[0-9]{1,3})?)$")
_VISIBLE_RE = re.compile(r"^[A-Za-z0-9,:-]*$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_BYTES_RE = re.compile(r"^\s*([0-9]+)\s*(B|KiB|MiB|GiB|KB|MB|GB|k|K|M|G)?\s*$")
_UNITS = {None: 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "k": 1 << 10,
          "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "KB": 1000, "MB": 1000**2, "GB": 1000**3}

MPS_MODES = ("on", "auto", "off")  # ipcsync-run's private MPS daemon: always, when GPUs are shared, never
MAX_NODES = 1024


@dataclass(frozen=True)
class Key:
    """A key a spec table may hold: its TOML type, its default and what it means. The
    tables below are the keys a spec accepts (any other is refused, naming these) and
    what docs/reference.md lists."""

    type: str
    default: str
    meaning: str


TOP_KEYS: Mapping[str, Key] = MappingProxyType({
    "name": Key("string", '"pipeline"', "the pipeline's name (1-32 letters, digits, `_` and `-`, starting "
                "with a letter): `stage.info().pipeline`"),
    "restart": Key(f"integer, 0 to {MAX_RESTART}", "0", "restart the whole group (every stage) up to this "
                   "many times after a stage fails; `stage.info().restart` counts the attempts"),
    "stop_timeout": Key("seconds, > 0", "10", "when stopping: seconds between SIGTERM and SIGKILL"),
    "mps": Key("string: " + ", ".join(f'"{m}"' for m in MPS_MODES), '"auto"',
               '"on": the stages run under a private MPS daemon whenever the run uses CUDA; "auto": when '
               'two or more CUDA processes share a GPU; "off": never'),
    "stages": Key("table of tables", "required", "one `[stages.NAME]` table per stage (NAME: 1-32 letters, "
                  "digits, `_` and `-`, starting with a letter)"),
    "edges": Key("array of tables", "none", "one `[[edges]]` table per edge; edges may not form a cycle "
                 "(except through `reply` edges)"),
})
STAGE_KEYS: Mapping[str, Key] = MappingProxyType({
    "cmd": Key("string or list of strings", "required", "the command; a string is split like a shell. A "
               "command starting with `python`, `python3` or `python3.N` runs under ipcsync-run's interpreter"),
    "replicas": Key(f"integer, 1 to {MAX_REPLICAS}", "1", "processes running the stage"),
    "device": Key("string", '"auto"', '"auto" (cuda:0 when a GPU is visible, else cpu), "cpu", "cuda", '
                  '"cuda:N"; "{replica}" is replaced by the replica index ("cuda:{replica}")'),
    "visible_devices": Key("string or integer", "unset", "`CUDA_VISIBLE_DEVICES` for the stage (\"0,1\")"),
    "env": Key("table of strings, numbers or booleans", "{}", "environment variables set on top of "
               "ipcsync-run's own; `IPCSYNC_*` names are refused (ipcsync-run sets them)"),
    "cwd": Key("string", "ipcsync-run's directory", "the stage's working directory; a relative path is "
               "relative to the spec file's directory"),
    "node": Key(f"integer, 0 to {MAX_NODES - 1}", "0", "with `ipcsync-run --nnodes N`: the node every "
                "replica runs on (not with `nodes`)"),
    "nodes": Key("list of distinct integers", "[0]", "with `--nnodes N`: replica r runs on "
                 "`nodes[r % len(nodes)]`; needs at least as many replicas as nodes (not with `node`)"),
})
EDGE_KEYS: Mapping[str, Key] = MappingProxyType({
    "from": Key("string", "required", "the producer stage: each of its replicas binds an endpoint"),
    "to": Key("string", "required", "the consumer stage: each of its replicas connects to every replica "
              "of `from` (one Consumer, or a FanIn over several)"),
    "slots": Key(f"integer, 1 to {MAX_SLOTS}", str(DEFAULT_SLOTS), "slots in each producer's ring "
                 "(`Producer(slots=)`)"),
    "slot_bytes": Key('integer, or a string such as "8MiB" (units B, KiB or K, MiB or M, GiB or G, KB, MB, GB)',
                      f'"{DEFAULT_SLOT_BYTES >> 20}MiB"', "bytes in one slot, 1 B to 1 TiB "
                      "(`Producer(slot_bytes=)`); a larger message is refused"),
    "policy": Key("string: " + ", ".join(f'"{p}"' for p in POLICIES), '"shard"', "with several consumer "
                  "replicas: each item to one of them (shard) or to every one (broadcast)"),
    "wait": Key("string: " + ", ".join(f'"{w}"' for w in WAIT_MODES), '"gpu"', "how the consumers wait on the producer's ready events "
                "(`Consumer(wait=)`)"),
    "timeout": Key("seconds, > 0", f"{DEFAULT_CONNECT_TIMEOUT:g}", "how long the two ends wait for each "
                   "other to appear (the handshake, at `input()` and `output()`); once connected, data calls "
                   "wait as long as the peer process lives"),
    "reply": Key("boolean", "false", "a reply edge: answers going back upstream, the only kind of edge "
                 "that may close a cycle; its `output()` does not wait for consumers"),
    "verify": Key("boolean", "false", "consumers check that no received item changes while they hold it "
                  "(`Consumer(verify=True)`)"),
})


class SpecError(ConfigError):
    """A pipeline spec is invalid. The message names the source, the key and the problem."""


@dataclass(frozen=True)
class StageSpec:
    """One stage: a command run in ``replicas`` processes."""

    name: str
    cmd: tuple[str, ...]
    replicas: int = 1
    device: str = "auto"
    visible_devices: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    cwd: str | None = None
    nodes: tuple[int, ...] = (0,)  # replica r runs on node nodes[r % len(nodes)]

    def node_of(self, replica: int) -> int:
        """The node (``ipcsync-run --node-rank``) that runs replica ``replica``."""
        return self.nodes[replica % len(self.nodes)]

    def device_for(self, replica: int) -> str:
        """The device string of one replica (``{replica}`` substituted)."""
        return self.device.replace("{replica}", str(replica))


@dataclass(frozen=True)
class EdgeSpec:
    """A producer stage ``src`` feeding a consumer stage ``dst``."""

    src: str
    dst: str
    slots: int = DEFAULT_SLOTS
    slot_bytes: int = DEFAULT_SLOT_BYTES
    policy: str = "shard"
    wait: str = "gpu"
    timeout: float = DEFAULT_CONNECT_TIMEOUT  # the handshake: how long the ends wait to meet
    reply: bool = False  # a back edge (answers to an upstream stage): exempt from the cycle check
    verify: bool = False  # consumers check that no item changes while they hold it (Consumer verify=)

    @property
    def name(self) -> str:
        return f"{self.src}-{self.dst}"


@dataclass(frozen=True)
class PipelineSpec:
    """A validated pipeline: stages in a fixed order (upstream first), acyclic edges."""

    stages: tuple[StageSpec, ...]
    edges: tuple[EdgeSpec, ...] = ()
    restart: int = 0
    stop_timeout: float = 10.0
    name: str = "pipeline"
    source: str = "<spec>"
    mps: str = "auto"  # one of MPS_MODES (launch.mps decides what it means for a plan)

    def stage(self, name: str) -> StageSpec:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)

    def inputs_of(self, name: str) -> list[EdgeSpec]:
        return [e for e in self.edges if e.dst == name]

    def outputs_of(self, name: str) -> list[EdgeSpec]:
        return [e for e in self.edges if e.src == name]


# ---------------------------------------------------------------------------- entry points
def load(path: str, overrides: Overrides | None = None) -> PipelineSpec:
    """Read and validate a TOML spec file, with command-line ``overrides`` applied."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise SpecError(f"{path}: cannot read the spec: {exc.strerror or exc}") from None
    return loads(raw, source=path, base_dir=os.path.dirname(os.path.abspath(path)), overrides=overrides)


def loads(
    text: str | bytes, source: str = "<spec>", base_dir: str | None = None, overrides: Overrides | None = None
) -> PipelineSpec:
    """Validate a TOML spec given as text. A relative ``cwd`` of a stage is taken relative
    to ``base_dir`` (for a file: the file's directory). ``overrides`` (from the command
    line) are applied before validation, so overridden values are checked like the rest."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SpecError(f"{source}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{source}: not valid TOML: {exc}") from None
    if overrides is not None:
        data = apply_overrides(data, overrides)
    return from_mapping(data, source, base_dir)


def from_mapping(data: Mapping[str, Any], source: str = "<spec>", base_dir: str | None = None) -> PipelineSpec:
    """Validate a spec given as a mapping (what TOML parsing returns)."""
    where = _Where(source)
    if not isinstance(data, Mapping):
        raise where.error("", "the spec must be a table")
    where.unknown_keys("", data, TOP_KEYS)
    stages_raw = data.get("stages")
    if not isinstance(stages_raw, Mapping) or not stages_raw:
        raise where.error("stages", "define at least one stage, e.g. [stages.train] with cmd = [...]")
    stages = [_stage(where, name, body, base_dir) for name, body in stages_raw.items()]
    edges_raw = data.get("edges", [])
    if not isinstance(edges_raw, list):
        raise where.error("edges", "must be an array of tables ([[edges]])")
    names = {s.name for s in stages}
    edges = [_edge(where, f"edges[{i}]", body, names) for i, body in enumerate(edges_raw)]
    return _finish(
        where, stages, edges,
        restart=_int(where, "restart", data.get("restart", 0), 0, MAX_RESTART),
        stop_timeout=_seconds(where, "stop_timeout", data.get("stop_timeout", 10.0)),
        name=_name(where, "name", data.get("name", "pipeline")),
        mps=mps_mode(data.get("mps", "auto"), where.source),
    )


def from_cli(
    stages: Iterable[str],
    edges: Iterable[str] = (),
    replicas: Iterable[str] = (),
    devices: Iterable[str] = (),
    restart: int = 0,
    stop_timeout: float = 10.0,
    edge_options: Iterable[str] = (),
) -> PipelineSpec:
    """Build a spec from command-line pieces: ``NAME=CMD`` stages, ``A:B`` edges,
    ``NAME=N`` replicas, ``NAME=DEVICE`` devices, ``A:B:KEY=VALUE`` edge options."""
    where = _Where("<command line>")
    data: dict[str, Any] = {"stages": {}, "edges": [], "restart": restart, "stop_timeout": stop_timeout}
    for arg in stages:
        name, cmd = _split_pair(where, "--stage", arg, "NAME=COMMAND")
        if name in data["stages"]:
            raise where.error(f"--stage {name}", "stage given twice")
        data["stages"][name] = {"cmd": cmd}
    for arg in edges:
        parts = arg.split(":")
        if len(parts) != 2 or not all(parts):
            raise where.error(f"--edge {arg}", "expected FROM:TO, e.g. --edge loader:train")
        data["edges"].append({"from": parts[0], "to": parts[1]})
    data = apply_overrides(data, Overrides(tuple(replicas), tuple(devices), tuple(edge_options)), edges_from="--edge")
    return from_mapping(data, "<command line>")


@dataclass(frozen=True)
class Overrides:
    """Spec values given on the command line: ``NAME=N`` replicas, ``NAME=DEVICE``
    devices, ``FROM:TO:KEY=VALUE`` edge options."""

    replicas: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()
    edge_options: tuple[str, ...] = ()


def apply_overrides(data: Mapping[str, Any], overrides: Overrides, edges_from: str = "the spec") -> dict[str, Any]:
    """A copy of the spec mapping ``data`` with ``overrides`` applied (not yet validated).
    SpecError (source ``<command line>``) for a malformed override or one that names a
    stage or edge the spec does not have."""
    where = _Where("<command line>")
    out = dict(data)
    raw_stages = out.get("stages")
    stages: dict[str, Any] = {}
    if isinstance(raw_stages, Mapping):
        stages = {k: dict(v) if isinstance(v, Mapping) else v for k, v in raw_stages.items()}
        out["stages"] = stages
    raw_edges = out.get("edges", [])
    edges: list[Any] = []
    if isinstance(raw_edges, list):
        edges = [dict(e) if isinstance(e, Mapping) else e for e in raw_edges]
        out["edges"] = edges
    for opt, items in (("replicas", overrides.replicas), ("device", overrides.devices)):
        for arg in items:
            name, value = _split_pair(where, f"--{opt}", arg, f"NAME={opt.upper()}")
            body = stages.get(name)
            if not isinstance(body, dict):
                raise where.error(f"--{opt} {arg}", f"unknown stage {name!r}; stages: {sorted(stages)}")
            if opt == "replicas":
                try:
                    body[opt] = int(value)
                except ValueError:
                    raise where.error(f"--replicas {arg}", f"{value!r} is not an integer") from None
            else:
                body[opt] = value
    for arg in overrides.edge_options:
        parts = arg.split(":", 2)
        if len(parts) != 3 or "=" not in parts[2]:
            raise where.error(f"--edge-option {arg}", "expected FROM:TO:KEY=VALUE, e.g. loader:train:slots=8")
        found = [e for e in edges if isinstance(e, dict) and e.get("from") == parts[0] and e.get("to") == parts[1]]
        if not found:
            known = [f"{e.get('from')}:{e.get('to')}" for e in edges if isinstance(e, dict)]
            raise where.error(
                f"--edge-option {arg}",
                f"no edge {parts[0]}:{parts[1]} was given with {edges_from}; edges: {', '.join(known) or '(none)'}",
            )
        key, value = parts[2].split("=", 1)
        if key in ("from", "to"):
            raise where.error(f"--edge-option {arg}", "the ends of an edge are set by --edge FROM:TO")
        for edge in found:
            edge[key] = _cli_value(value)
    return out


# ---------------------------------------------------------------------------- pieces
class _Where:
    def __init__(self, source: str) -> None:
        self.source = source

    def error(self, key: str, problem: str) -> SpecError:
        return SpecError(f"{self.source}: {key}: {problem}" if key else f"{self.source}: {problem}")

    def unknown_keys(self, prefix: str, table: Mapping[str, Any], allowed: Mapping[str, Key]) -> None:
        extra = sorted(set(table) - set(allowed))
        if extra:
            key = f"{prefix}.{extra[0]}" if prefix else extra[0]
            raise self.error(key, f"unknown key; allowed here: {', '.join(sorted(allowed))}")


def _stage(where: _Where, name: Any, body: Any, base_dir: str | None) -> StageSpec:
    key = f"stages.{name}"
    _name(where, key, name)
    if not isinstance(body, Mapping):
        raise where.error(key, "must be a table with at least cmd = [...]")
    where.unknown_keys(key, body, STAGE_KEYS)
    if "cmd" not in body:
        raise where.error(f"{key}.cmd", "missing: the command to run, e.g. cmd = [\"python3\", \"stage.py\"]")
    cmd = _cmd(where, f"{key}.cmd", body["cmd"])
    device = body.get("device", "auto")
    if not isinstance(device, str):
        raise where.error(f"{key}.device", f"must be a string, got {device!r}")
    for probe in ("0", "1"):
        if not _DEVICE_RE.fullmatch(device.replace("{replica}", probe)):
            raise where.error(
                f"{key}.device", f"{device!r} is not a device; use auto, cpu, cuda, cuda:N or cuda:{{replica}}"
            )
    visible = body.get("visible_devices")
    if visible is not None and (
        not isinstance(visible, (str, int)) or isinstance(visible, bool) or not _VISIBLE_RE.fullmatch(str(visible))
    ):
        raise where.error(f"{key}.visible_devices", f"{visible!r} is not a CUDA_VISIBLE_DEVICES value like \"0,1\"")
    env = body.get("env", {})
    if not isinstance(env, Mapping):
        raise where.error(f"{key}.env", "must be a table of NAME = \"value\"")
    pairs = []
    for k, v in env.items():
        if not _ENV_NAME_RE.fullmatch(str(k)):
            raise where.error(f"{key}.env.{k}", "not a valid environment variable name")
        if str(k).startswith("IPCSYNC_"):
            raise where.error(f"{key}.env.{k}", "IPCSYNC_* variables are set by ipcsync-run itself")
        if not isinstance(v, (str, int, float, bool)):
            raise where.error(f"{key}.env.{k}", f"must be a string or number, got {type(v).__name__}")
        pairs.append((str(k), str(v).lower() if isinstance(v, bool) else str(v)))
    cwd = body.get("cwd")
    if cwd is not None and (not isinstance(cwd, str) or not cwd):
        raise where.error(f"{key}.cwd", "must be a non-empty path string")
    if cwd is not None and base_dir is not None and not os.path.isabs(cwd):
        cwd = os.path.normpath(os.path.join(base_dir, cwd))
    replicas = _int(where, f"{key}.replicas", body.get("replicas", 1), 1, MAX_REPLICAS)
    for r in range(replicas):
        if not _DEVICE_RE.fullmatch(device.replace("{replica}", str(r))):
            raise where.error(f"{key}.device", f"{device!r} gives {device.replace('{replica}', str(r))!r} for replica {r}")
    return StageSpec(
        name=name,
        cmd=cmd,
        replicas=replicas,
        device=device,
        visible_devices=None if visible is None else str(visible),
        env=tuple(pairs),
        cwd=cwd,
        nodes=_nodes(where, key, body, replicas),
    )


def _nodes(where: _Where, key: str, body: Mapping[str, Any], replicas: int) -> tuple[int, ...]:
    """The stage's ``node = N`` or ``nodes = [N, ...]`` (default node 0). Whether each
    index is below ``--nnodes`` is checked when the launcher knows it (``plan.place``)."""
    if "node" in body and "nodes" in body:
        raise where.error(f"{key}.nodes", "give node = N or nodes = [N, ...], not both")
    if "node" in body:
        return (_int(where, f"{key}.node", body["node"], 0, MAX_NODES - 1),)
    if "nodes" not in body:
        return (0,)
    raw = body["nodes"]
    if not isinstance(raw, list) or not raw:
        raise where.error(f"{key}.nodes", f"must be a non-empty list of node indices, e.g. [0, 1]; got {raw!r} "
                          "(a stage must run on some node)")
    nodes = tuple(_int(where, f"{key}.nodes[{i}]", n, 0, MAX_NODES - 1) for i, n in enumerate(raw))
    if len(set(nodes)) != len(nodes):
        raise where.error(f"{key}.nodes", f"{list(nodes)} names a node twice")
    if replicas < len(nodes):
        raise where.error(
            f"{key}.nodes", f"{len(nodes)} nodes but replicas = {replicas}: replica r runs on nodes[r % "
            f"{len(nodes)}], so node {nodes[replicas]} would run none; set replicas = {len(nodes)} or more"
        )
    return nodes


def _edge(where: _Where, key: str, body: Any, stages: set[str]) -> EdgeSpec:
    if not isinstance(body, Mapping):
        raise where.error(key, "must be a table with from = \"...\" and to = \"...\"")
    where.unknown_keys(key, body, EDGE_KEYS)
    ends = []
    for end in ("from", "to"):
        if end not in body:
            raise where.error(f"{key}.{end}", "missing: the name of a stage")
        value = body[end]
        if not isinstance(value, str) or value not in stages:
            raise where.error(f"{key}.{end}", f"unknown stage {value!r}; stages: {', '.join(sorted(stages))}")
        ends.append(value)
    if ends[0] == ends[1]:
        raise where.error(key, f"an edge from stage {ends[0]!r} to itself is a cycle")
    policy = body.get("policy", "shard")
    if policy not in POLICIES:
        raise where.error(f"{key}.policy", f"{policy!r}; use one of {', '.join(POLICIES)}")
    wait = body.get("wait", "gpu")
    if (problem := wait_problem(wait)) is not None:
        raise where.error(f"{key}.wait", problem)
    return EdgeSpec(
        src=ends[0],
        dst=ends[1],
        slots=_int(where, f"{key}.slots", body.get("slots", DEFAULT_SLOTS), 1, MAX_SLOTS),
        slot_bytes=parse_bytes(body.get("slot_bytes", DEFAULT_SLOT_BYTES), where, f"{key}.slot_bytes"),
        policy=policy,
        wait=wait,
        timeout=_seconds(where, f"{key}.timeout", body.get("timeout", DEFAULT_CONNECT_TIMEOUT)),
        reply=_bool(where, f"{key}.reply", body.get("reply", False)),
        verify=_bool(where, f"{key}.verify", body.get("verify", False)),
    )


def _finish(where: _Where, stages: list[StageSpec], edges: list[EdgeSpec], **top: Any) -> PipelineSpec:
    seen: set[tuple[str, str]] = set()
    for i, e in enumerate(edges):
        if (e.src, e.dst) in seen:
            raise where.error(f"edges[{i}]", f"edge {e.src} -> {e.dst} is given twice")
        seen.add((e.src, e.dst))
    forward = [e for e in edges if not e.reply]
    order = _topological(where, [s.name for s in stages], forward)
    for i, e in enumerate(edges):
        if e.reply and not _reaches(e.dst, e.src, forward):
            raise where.error(
                f"edges[{i}].reply", f"{e.src} -> {e.dst} answers nobody: a reply edge must go back "
                f"to a stage upstream of {e.src!r} (drop reply = true for an ordinary edge)"
            )
    by_name = {s.name: s for s in stages}
    return PipelineSpec(
        stages=tuple(by_name[n] for n in order), edges=tuple(edges), source=where.source, **top
    )


def _topological(where: _Where, names: list[str], edges: list[EdgeSpec]) -> list[str]:
    """Stages upstream first (stable in spec order); SpecError naming a cycle."""
    indeg = {n: 0 for n in names}
    succ: dict[str, list[str]] = {n: [] for n in names}
    for e in edges:
        indeg[e.dst] += 1
        succ[e.src].append(e.dst)
    rank = {n: i for i, n in enumerate(names)}
    order: list[str] = []
    ready = [n for n in names if indeg[n] == 0]
    while ready:
        n = min(ready, key=rank.__getitem__)  # of the stages that may come next, the first declared
        ready.remove(n)
        order.append(n)
        for m in succ[n]:
            indeg[m] -= 1
            if indeg[m] == 0:
                ready.append(m)
    if len(order) < len(names):
        left = [n for n in names if n not in order]
        cycle = _find_cycle(left, succ)
        raise where.error("edges", f"the edges form a cycle: {' -> '.join(cycle)}")
    return order


def _reaches(a: str, b: str, edges: list[EdgeSpec]) -> bool:
    """Stage ``b`` is downstream of ``a`` along ``edges``."""
    seen, todo = {a}, [a]
    while todo:
        n = todo.pop()
        for e in edges:
            if e.src == n and e.dst not in seen:
                if e.dst == b:
                    return True
                seen.add(e.dst)
                todo.append(e.dst)
    return False


def mps_mode(value: Any, source: str = "<spec>", key: str = "mps") -> str:
    """``value`` if it is one of ``MPS_MODES``; else SpecError naming ``source`` and ``key``
    (``mps`` in a spec, ``--mps`` on the command line)."""
    if not isinstance(value, str) or value not in MPS_MODES:
        raise _Where(source).error(
            key, f"{value!r} is not an MPS mode; use \"on\" (a private MPS daemon for every run that uses "
            "CUDA), \"auto\" (one when two or more CUDA processes share a GPU) or \"off\""
        )
    return value


def _bool(where: _Where, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise where.error(key, f"must be true or false, got {value!r}")
    return value


def _find_cycle(nodes: list[str], succ: dict[str, list[str]]) -> list[str]:
    """A cycle among ``nodes`` (those a topological sort could not place)."""
    inside = set(nodes)
    # Drop nodes downstream of a cycle (no successor left) until every node has one.
    changed = True
    while changed:
        changed = False
        for n in list(inside):
            if not any(m in inside for m in succ[n]):
                inside.discard(n)
                changed = True
    path: list[str] = []
    on_path: set[str] = set()
    node = next(n for n in nodes if n in inside)
    while node not in on_path:  # every node inside has a successor inside, so this ends
        path.append(node)
        on_path.add(node)
        node = next(m for m in succ[node] if m in inside)
    return path[path.index(node):] + [node]


def _name(where: _Where, key: str, value: Any) -> str:
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        raise where.error(
            key, f"{value!r} is not a valid name: 1-32 letters, digits, '_' and '-', starting with a letter"
        )
    return value


def _cmd(where: _Where, key: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        try:
            parts = shlex.split(value)
        except ValueError as exc:
            raise where.error(key, f"cannot split {value!r} like a shell: {exc}") from None
    elif isinstance(value, list) and all(isinstance(p, str) for p in value):
        parts = list(value)
    else:
        raise where.error(key, f"must be a string or a list of strings, got {value!r}")
    if not parts or not parts[0]:
        raise where.error(key, "is empty: give the command to run")
    return tuple(parts)


def _int(where: _Where, key: str, value: Any, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise where.error(key, f"must be an integer from {lo} to {hi}, got {value!r}")
    return value


def _seconds(where: _Where, key: str, value: Any) -> float:
    if (
        not isinstance(value, (int, float)) or isinstance(value, bool)
        or math.isnan(value) or math.isinf(value) or value <= 0
    ):
        raise where.error(key, f"must be a positive number of seconds, got {value!r}")
    return float(value)


def parse_bytes(value: Any, where: _Where | None = None, key: str = "size") -> int:
    """``8388608``, ``"8MiB"``, ``"512 KiB"`` -> bytes (1 B to 1 TiB)."""
    w = where or _Where("<value>")
    n: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, str):
        m = _BYTES_RE.fullmatch(value)
        if m:
            n = int(m.group(1)) * _UNITS[m.group(2)]
    if n is None:
        raise w.error(key, f"{value!r} is not a size; use an integer or e.g. \"8MiB\"")
    if not 1 <= n <= MAX_SLOT_BYTES:
        raise w.error(key, f"must be from 1 B to 1 TiB, got {n} bytes")
    return n


def _split_pair(where: _Where, flag: str, arg: str, form: str) -> tuple[str, str]:
    name, sep, value = arg.partition("=")
    if not sep or not name or not value:
        raise where.error(f"{flag} {arg}", f"expected {form}")
    return name, value


def _cli_value(text: str) -> Any:
    """An edge option value from the command line: an integer if it is one, else the text."""
    if text in ("true", "false"):
        return text == "true"
    if re.fullmatch(r"-?[0-9]+", text):
        return int(text)
    if re.fullmatch(r"-?[0-9]+\.[0-9]*([eE][-+]?[0-9]+)?", text):
        return float(text)
    return text
