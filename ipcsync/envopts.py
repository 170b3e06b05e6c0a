"""Every ``IPCSYNC_*`` environment variable ipcsync reads, in one table (``SWITCHES``).

Each is a ``Switch``: its name, what it accepts (``Kind``), its default, and what it
means. Code reads one only through its switch (``LANE.get()``), never through
``os.environ`` (``tests/unit/test_envopts.py`` walks the package's AST to keep it so), so
each value is parsed one way: an unset or blank variable is the default, a value the
kind does not accept is a ConfigError naming the variable, what it got and what it
accepts. A flag is ``0`` or ``1`` everywhere.

``set_by`` says who sets it: ``"you"`` (a knob), or ``"ipcsync-run"`` (the launcher sets
it for its stage processes: the launcher-stage contract, ``ipcsync.stage_contract``).

Loads nothing but ``ipcsync.errors`` and ``ipcsync.limits``: the launcher uses it before
any pipeline runs.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Generic, Mapping, TypeVar

from .errors import ConfigError
from .limits import DEFAULT_LANE

__all__ = [
    "Kind", "Switch", "SWITCHES", "env_seconds", "flag", "seconds", "seconds_between", "count", "choice", "TEXT",
    "RUNTIME_DIR", "LANE", "NATIVE", "CUDA_VMM", "CPU_DESCRIPTORS", "LOG_LEVEL", "HOST_ID", "REMOTE_TIMEOUT",
    "REMOTE_TRANSPORT", "REMOTE_ADDR", "NODE_TIMEOUT", "RDZV_SECRET", "TRACE_MAX_EVENTS", "WIRING", "RUN_ID",
    "STAGE", "REPLICA", "DEVICE", "TELEMETRY_DIR", "TELEMETRY_INTERVAL", "TRACE_DIR", "MPS_PIPE", "MPS_CONTROL",
]

T = TypeVar("T")
K = TypeVar("K", covariant=True)


@dataclass(frozen=True)
class Kind(Generic[K]):
    """What a variable accepts: ``accepts`` (in words, for messages and the reference),
    ``set_to`` (short words for "set it to ..."), ``parse`` (the text to a value; raises
    ValueError saying what is wrong with it, e.g. ``"is not 0 or 1"``)."""

    accepts: str
    set_to: str
    parse: Callable[[str], K]


def _flag(raw: str) -> bool:
    text = raw.strip()
    if text not in ("0", "1"):
        raise ValueError("is not 0 or 1")
    return text == "1"


def flag() -> Kind[bool]:
    """``0`` (off) or ``1`` (on), surrounding blanks ignored."""
    return Kind("0 (off) or 1 (on)", "0 or 1", _flag)


def seconds_between(least: float, most: float, *, strict: bool = False) -> Kind[float]:
    """A number of seconds from ``least`` to ``most`` (more than ``least`` and less than
    ``most`` with ``strict``)."""
    def parse(raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            raise ValueError("is not a number of seconds") from None
        low = value > least if strict else value >= least
        if not (math.isfinite(value) and low):
            raise ValueError("is not positive" if strict and least == 0 else f"is below {least:g}")
        if not (value < most if strict else value <= most):
            raise ValueError(f"is not less than {most:g}" if strict else f"is above {most:g}")
        return value

    words = (f"a positive number of seconds (less than {most:g})" if strict and least == 0
             else f"a number of seconds from {least:g} to {most:g}")
    return Kind(words, "such a number", parse)


def seconds(most: float = 1e6) -> Kind[float]:
    """A positive number of seconds, less than ``most``."""
    return seconds_between(0.0, most, strict=True)


def count(least: int, most: int) -> Kind[int]:
    """A whole number from ``least`` to ``most``."""
    def parse(raw: str) -> int:
        try:
            value = int(raw.strip())
        except ValueError:
            raise ValueError("is not a whole number") from None
        if not least <= value <= most:
            raise ValueError(f"is not from {least} to {most}")
        return value

    return Kind(f"a whole number from {least} to {most}", "such a number", parse)


def choice(*values: str) -> Kind[str]:
    """One of ``values``, exactly."""
    def parse(raw: str) -> str:
        if raw not in values:
            raise ValueError("is not one of them")
        return raw

    words = " or ".join(repr(v) for v in values)
    return Kind(words, words, parse)


def _text(raw: str) -> str:
    return raw


TEXT: Kind[str] = Kind("any text", "any text", _text)


@dataclass(frozen=True)
class Switch(Generic[T]):
    """One environment variable: ``name``, ``kind`` (what it accepts), ``default`` (the
    value when it is unset or blank), ``meaning`` (one line), ``set_by`` (``"you"`` or
    ``"ipcsync-run"``) and ``shown_default`` (the default in words; empty: ``default``)."""

    name: str
    kind: Kind[T]
    default: T
    meaning: str
    set_by: str = "you"
    shown_default: str = ""

    def get(self, environ: Mapping[str, str] | None = None) -> T:
        """The value in ``environ`` (default: this process's environment), parsed; the
        default when unset or blank. ConfigError for a value the kind does not accept."""
        raw = (os.environ if environ is None else environ).get(self.name)
        if raw is None or not raw.strip():
            return self.default
        try:
            return self.kind.parse(raw)
        except ValueError as exc:
            raise ConfigError(
                f"${self.name}={raw!r} {exc}: ${self.name} must be {self.kind.accepts}; set it to "
                f"{self.kind.set_to}, or unset it for the default ({self.default_text})") from None

    def is_set(self, environ: Mapping[str, str] | None = None) -> bool:
        """Whether the variable has a value that is not blank (what the value is aside)."""
        raw = (os.environ if environ is None else environ).get(self.name)
        return raw is not None and bool(raw.strip())

    @property
    def default_text(self) -> str:
        """The default in words."""
        if self.shown_default:
            return self.shown_default
        if isinstance(self.default, bool):
            return "1" if self.default else "0"
        if isinstance(self.default, float):
            return f"{self.default:g}"
        return "unset" if self.default is None else str(self.default)


# ---------------------------------------------------------------------------- knobs
RUNTIME_DIR: Switch[str | None] = Switch(
    "IPCSYNC_RUNTIME_DIR", TEXT, None,
    "the private directory for bare endpoint names, run directories and the launcher's files "
    "(system.paths); it must be a directory of this user that no one else can enter",
    shown_default="$XDG_RUNTIME_DIR/ipcsync, else /tmp/ipcsync-<uid>")
LANE: Switch[bool] = Switch(
    "IPCSYNC_LANE", flag(), DEFAULT_LANE,
    "1: data frames between processes of one host travel on a lane (a SOCK_SEQPACKET socket beside "
    "ZeroMQ, runtime.transport.lane); 0: on ZeroMQ only. Read when an endpoint is made")
NATIVE: Switch[bool] = Switch(
    "IPCSYNC_NATIVE", flag(), True,
    "1: the compiled helpers (copy into a slot, the SIGSEGV handler that explains a write to received "
    "memory) where ipcsync._native is built; 0: torch's copy and the ctypes handler. Read once per process",
    shown_default="1 (where built)")
CUDA_VMM: Switch[bool] = Switch(
    "IPCSYNC_CUDA_VMM", flag(), False,
    "1: a CUDA producer shares its memory by descriptor (CUDA's virtual memory API, flags ordering the "
    "items; backends.cuda_vmm) where the driver can; 0: CUDA IPC memory and interprocess events")
CPU_DESCRIPTORS: Switch[bool] = Switch(
    "IPCSYNC_CPU_DESCRIPTORS", flag(), False,
    "1: a CPU producer shares its memory by descriptor (sealed memfds, host flags; "
    "backends.cpu_descriptors), the path CUDA's sharing by descriptor takes, for tests without a GPU; "
    "0: POSIX shared memory by name")
LOG_LEVEL: Switch[str | None] = Switch(
    "IPCSYNC_LOG_LEVEL", TEXT, None,
    "debug, info, warning, error or critical: the level of ipcsync's log lines in a process that "
    "configured no logging of its own (ipcsync.logs); ipcsync-run --log-level sets it for its stages",
    shown_default="unset: warnings and errors only")
HOST_ID: Switch[str | None] = Switch(
    "IPCSYNC_HOST_ID", TEXT, None,
    "added to this host's boot id in the identity peers compare (system.host): processes with different "
    "values count as different hosts, so their edges are remote edges (one machine posing as several)")
REMOTE_TIMEOUT: Switch[float] = Switch(
    "IPCSYNC_REMOTE_TIMEOUT", seconds(), 120.0,
    "seconds one rendezvous or one item's transfer of a remote edge may take before the edge counts "
    "as lost (runtime.remote.io)")
REMOTE_TRANSPORT: Switch[str] = Switch(
    "IPCSYNC_REMOTE_TRANSPORT", choice("auto", "gloo"), "auto",
    "a producer's transport for remote edges: auto (NCCL between two CUDA ends, else gloo) or gloo "
    "(also between CUDA ends, staged through host memory)")
REMOTE_ADDR: Switch[str | None] = Switch(
    "IPCSYNC_REMOTE_ADDR", TEXT, None,
    "the address consumers on other hosts reach a producer bound to a wildcard (tcp://*:PORT) at",
    shown_default="this host's name")
NODE_TIMEOUT: Switch[float] = Switch(
    "IPCSYNC_NODE_TIMEOUT", seconds(), 30.0,
    "seconds a node of ipcsync-run --nnodes may stay silent before the others count it as lost "
    "(launch.nodes)")
RDZV_SECRET: Switch[str | None] = Switch(
    "IPCSYNC_RDZV_SECRET", TEXT, None,
    "the rendezvous secret of a run over several nodes (the contents of node 0's secret file; "
    "launch.secretfile), at least 32 characters; never passed on to a stage",
    shown_default="unset: --rdzv-secret-file, or node 0 writes one")
TRACE_MAX_EVENTS: Switch[int] = Switch(
    "IPCSYNC_TRACE_MAX_EVENTS", count(0, 1 << 40), 1_000_000,
    "trace events one process writes at most under ipcsync-run --trace; the others are counted as "
    "dropped (runtime.telemetry)")

# ---------------------------------------------------------------------------- set by ipcsync-run
WIRING: Switch[str | None] = Switch(
    "IPCSYNC_WIRING", TEXT, None,
    "this stage's wiring as JSON: who it is, its inputs and outputs, where its reports go "
    "(read by ipcsync.stage; its presence means the process runs under ipcsync-run)", "ipcsync-run")
RUN_ID: Switch[str | None] = Switch(
    "IPCSYNC_RUN_ID", TEXT, None,
    "the run's id (8 lowercase hex digits; another value is ignored): shared memory segments made in "
    "the process carry it, so the launcher removes them when the stage dies (system.shm)", "ipcsync-run")
STAGE: Switch[str | None] = Switch(
    "IPCSYNC_STAGE", TEXT, None, "the name of this process's stage (in trace file headers)", "ipcsync-run")
REPLICA: Switch[str | None] = Switch(
    "IPCSYNC_REPLICA", TEXT, None, "this process's replica number in its stage (in trace file headers)",
    "ipcsync-run")
DEVICE: Switch[str | None] = Switch(
    "IPCSYNC_DEVICE", TEXT, None,
    "this stage's device (cpu, cuda:N), for the stage's own code (ipcsync reads it from the wiring)",
    "ipcsync-run")
TELEMETRY_DIR: Switch[str | None] = Switch(
    "IPCSYNC_TELEMETRY_DIR", TEXT, None,
    "where the stage writes its stats snapshots every interval (ipcsync-run --monitor, --stats-file; "
    "runtime.telemetry)", "ipcsync-run")
TELEMETRY_INTERVAL: Switch[float] = Switch(
    "IPCSYNC_TELEMETRY_INTERVAL", seconds_between(0.01, 3600.0), 0.5,
    "seconds between two stats snapshots or trace flushes of a stage", "ipcsync-run")
TRACE_DIR: Switch[str | None] = Switch(
    "IPCSYNC_TRACE_DIR", TEXT, None,
    "where the stage appends its handoffs' trace events (ipcsync-run --trace; runtime.telemetry)",
    "ipcsync-run")
MPS_PIPE: Switch[str | None] = Switch(
    "IPCSYNC_MPS_PIPE", TEXT, None,
    "the pipe directory of the MPS daemon ipcsync-run started for the run: a CUDA process must be its "
    "client (ipcsync.mps_attach checks)", "ipcsync-run")
MPS_CONTROL: Switch[str] = Switch(
    "IPCSYNC_MPS_CONTROL", TEXT, "nvidia-cuda-mps-control",
    "the MPS control program ipcsync-run started that daemon with (asked for its clients)", "ipcsync-run")

SWITCHES: tuple[Switch[Any], ...] = (
    RUNTIME_DIR, LANE, NATIVE, CUDA_VMM, CPU_DESCRIPTORS, LOG_LEVEL, HOST_ID, REMOTE_TIMEOUT, REMOTE_TRANSPORT,
    REMOTE_ADDR, NODE_TIMEOUT, RDZV_SECRET, TRACE_MAX_EVENTS, WIRING, RUN_ID, STAGE, REPLICA, DEVICE,
    TELEMETRY_DIR, TELEMETRY_INTERVAL, TRACE_DIR, MPS_PIPE, MPS_CONTROL,
)


def env_seconds(name: str, default: float, most: float = 1e6) -> float:
    """``$name`` as a number of seconds, more than 0 and less than ``most``; ``default``
    when it is unset or empty. ConfigError for anything else (a switch of the table reads
    its own: ``REMOTE_TIMEOUT.get()``; this is for a name outside it)."""
    return Switch(name, seconds(most), default, "").get()
