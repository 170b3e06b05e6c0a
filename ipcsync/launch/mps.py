"""Whether a run of ``ipcsync-run`` gets a private MPS control daemon, and why.

``decide(mode, plan, ...)`` (pure) says what the spec's ``mps`` (or ``--mps``) means for a
resolved plan, as an ``MpsDecision`` with one line of why (``--dry-run`` prints it; the
launcher says it when the run starts):

- ``"off"``: never a daemon.
- ``"on"``: a private daemon for every run with a CUDA process; a problem (the launcher
  refuses to start, exit 125) if ``nvidia-cuda-mps-control`` is not on PATH.
- ``"auto"`` (the default): a private daemon when the plan puts two or more CUDA
  processes on one GPU and the control program is on PATH, unless the launcher's
  processes already run under an MPS daemon of the user's (``CUDA_MPS_PIPE_DIRECTORY``
  set, or one listening at the default pipe directory): then the stages use that one.

Why "auto" is the default: without MPS, processes sharing a GPU time-slice it, and every
wait of one on another's GPU work costs a context switch; a private daemon serves only
the run's own stages, so what MPS shares (a GPU fault in one client ends the others on
that GPU) stays inside the group, which ``ipcsync-run`` already stops and restarts as one
on any failure.

``host_decision`` gathers the host's facts for ``decide``; ``describe_host`` is what
``ipcsync doctor`` says about MPS. The daemon itself: ``mps_daemon``.
"""

from __future__ import annotations

import os
import shutil
import socket
from dataclasses import dataclass
from typing import Mapping

from ..limits import IPC_PATH_MAX
from ..mps_attach import CONTROL, PIPE_ENV
from .plan import Instance, Plan
from .spec import MPS_MODES

__all__ = [
    "MpsDecision", "decide", "host_decision", "user_daemon", "listens", "gpu_sharing", "describe_host",
    "MPS_MODES", "DEFAULT_PIPE", "AUTO_RULE", "SHARES",
]

DEFAULT_PIPE = "/tmp/nvidia-mps"  # where CUDA looks for a daemon without CUDA_MPS_PIPE_DIRECTORY

AUTO_RULE = ('mps = "auto" (the default) runs a private MPS daemon for a run that puts two or more CUDA '
             'processes on one GPU')
SHARES = ("under MPS a GPU fault in one process (a kernel bug, a write into a read-only received item) ends "
          "every process of that daemon on that GPU, and a process killed while its GPU work runs can take "
          "down the processes that share GPU memory with it; ipcsync-run then stops and restarts the group "
          "as for any failure (restart =)")


# ---------------------------------------------------------------------------- the decision
@dataclass(frozen=True)
class MpsDecision:
    """What a run gets: ``use`` a private daemon or not, and ``why`` (one line).
    ``problem``: the mode cannot be had here (``"on"`` without the control program): the
    launcher refuses to start. ``tell``: the launcher says ``why`` when the run starts."""

    mode: str
    use: bool
    why: str
    problem: bool = False
    tell: bool = False

    def line(self) -> str:
        """The decision as ``--dry-run`` prints it."""
        return f"mps {self.mode}: {self.why}"


def _gpu_of(inst: Instance, visible: str | None) -> str | None:
    """The GPU a CUDA instance runs on, as the host names it (an index or a UUID from
    CUDA_VISIBLE_DEVICES), or None for a CPU instance."""
    if not inst.device.startswith("cuda"):
        return None
    index = int(inst.device.split(":")[1]) if ":" in inst.device else 0
    names = inst.env.get("CUDA_VISIBLE_DEVICES", visible)
    ids = [d.strip() for d in names.split(",") if d.strip()] if names else []
    return ids[index] if index < len(ids) else str(index)


def gpu_sharing(plan: Plan, visible: str | None = None) -> dict[str, list[str]]:
    """The plan's CUDA processes by GPU (``visible``: the launcher's CUDA_VISIBLE_DEVICES,
    which a stage without ``visible_devices`` inherits): GPU -> process labels."""
    by_gpu: dict[str, list[str]] = {}
    for inst in plan.instances:
        gpu = _gpu_of(inst, visible)
        if gpu is not None:
            by_gpu.setdefault(gpu, []).append(inst.label)
    return by_gpu


def decide(mode: str, plan: Plan, *, control: str | None, user_pipe: str | None = None,
           user_listens: bool = True, visible: str | None = None) -> MpsDecision:
    """Whether the run of ``plan`` gets a private MPS daemon under ``mode`` (one of
    ``MPS_MODES``). Pure: the caller says where ``nvidia-cuda-mps-control`` is
    (``control``, None: not on PATH), which daemon of the user's the launcher's processes
    would join (``user_pipe``: its pipe directory, None: none) and whether it listens, and
    the launcher's CUDA_VISIBLE_DEVICES (``visible``)."""
    if mode not in MPS_MODES:
        raise ValueError(f"mps mode {mode!r}")  # the caller's bug: the spec checks modes
    if mode == "off":
        return MpsDecision(mode, False, "no MPS daemon (processes that share a GPU time-slice it)")
    by_gpu = gpu_sharing(plan, visible)
    n = sum(len(labels) for labels in by_gpu.values())
    if not n:
        return MpsDecision(mode, False, "no MPS daemon: no process of the run uses CUDA")
    own = [i.label for i in plan.instances if i.device.startswith("cuda") and PIPE_ENV in i.env]
    if own:
        why = (f"stage process {own[0]} sets {PIPE_ENV} in its env (an MPS daemon of its own), which a private "
               "daemon would replace")
        if mode == "on":
            return MpsDecision(mode, False, f"cannot run a private MPS daemon: {why}; remove it from the stage's "
                               "env, or use --mps auto or off", problem=True)
        return MpsDecision(mode, False, f"no private MPS daemon: {why}", tell=True)
    shared = {gpu: labels for gpu, labels in by_gpu.items() if len(labels) > 1}
    where = "; ".join(f"{', '.join(labels)} share GPU {gpu}" for gpu, labels in shared.items())
    if mode == "auto" and user_pipe is not None:
        if not user_listens:
            return MpsDecision(mode, False, f"{PIPE_ENV}={user_pipe} in the launcher's environment names an MPS "
                               "daemon that does not answer: the stages run without MPS (start that daemon, "
                               "unset the variable, or use --mps on for a private one)", tell=True)
        return MpsDecision(mode, False, f"the stages run under the user's MPS daemon at {user_pipe} (no private "
                           "one is started)", tell=True)
    if mode == "auto" and not shared:
        return MpsDecision(mode, False, f"no MPS daemon: no GPU has two or more of the run's {n} CUDA "
                           f"process{'es' if n != 1 else ''}")
    if control is None:
        if mode == "on":
            return MpsDecision(mode, False, f"cannot run a private MPS daemon: {CONTROL} is not found on PATH "
                               "(it comes with the NVIDIA driver); add its directory to PATH, or use --mps auto "
                               "or off", problem=True)
        return MpsDecision(mode, False, f"no MPS daemon: {where}, but {CONTROL} is not found on PATH, so they "
                           "time-slice it", tell=True)
    why = f"a private MPS daemon for the run's {n} CUDA process{'es' if n != 1 else ''}"
    why += f" ({where})" if shared else ""
    if user_pipe is not None:
        why += f"; it replaces the user's daemon at {user_pipe} for the stages"
    return MpsDecision(mode, True, why, tell=True)


def listens(pipe_dir: str) -> bool:
    """Whether an MPS control daemon accepts connections on ``pipe_dir``'s control socket."""
    path = os.path.join(pipe_dir, "control")
    if len(path.encode()) > IPC_PATH_MAX:
        return os.path.exists(path)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(2.0)
        try:
            s.connect(path)
        except OSError:
            return False
    return True


def user_daemon(environ: Mapping[str, str] | None = None) -> tuple[str | None, bool]:
    """The MPS daemon a CUDA process started with ``environ`` would join: (its pipe
    directory, whether it listens), or (None, False) where there is none: the one named
    by CUDA_MPS_PIPE_DIRECTORY, else one listening at the default pipe directory."""
    env = os.environ if environ is None else environ
    named = env.get(PIPE_ENV)
    if named:
        return named, listens(named)
    return (DEFAULT_PIPE, True) if listens(DEFAULT_PIPE) else (None, False)


def host_decision(mode: str, plan: Plan) -> MpsDecision:
    """``decide`` with this host's facts: the control program on PATH, the user's daemon
    (not looked for under ``"off"``)."""
    pipe, up = user_daemon() if mode != "off" else (None, False)
    return decide(mode, plan, control=shutil.which(CONTROL), user_pipe=pipe, user_listens=up,
                  visible=os.environ.get("CUDA_VISIBLE_DEVICES"))


def describe_host(state: str | None) -> tuple[bool, str, str | None]:
    """For ``ipcsync doctor``: (a warning?, what it found, the fix) about MPS here: the
    daemon the processes started from here would join (``user_daemon``), one that does
    not answer (the warning), the daemon processes seen (``state``: ``doctor.mps_state``),
    whether the control program is on PATH, what ``mps = "auto"`` does, what MPS shares."""
    control = shutil.which(CONTROL)
    pipe, listening = user_daemon()
    if pipe is not None and not listening:
        return True, (f"{PIPE_ENV}={pipe}, but no MPS daemon answers there: CUDA processes started from here run "
                      "without MPS, silently, and ipcsync-run's auto mode starts no daemon of its own for them"), (
            f"start that daemon ({CONTROL} -d with that variable), unset {PIPE_ENV}, or run with ipcsync-run --mps on")
    if pipe is not None:
        what = (f"in use: an MPS daemon listens at {pipe}{f' ({state})' if state else ''}; CUDA processes started "
                "from here are its clients, and ipcsync-run's auto mode runs the stages under it (--mps on: a "
                "private daemon instead)")
    else:
        what = (f"MPS daemon processes run here ({state}), none at {PIPE_ENV} or the default path: processes "
                "started from here do not join them" if state else "not in use: processes sharing a GPU "
                "time-slice it (a 4 KiB round trip about 0.3 ms, against 0.09 ms under MPS on a GPU machine)")
        have = f"available ({control})" if control else f"not available ({CONTROL} is not on PATH: --mps on fails)"
        what += f"; MPS is {have}; ipcsync-run's {AUTO_RULE} (--mps on: for every run that uses CUDA; off: never)"
    return False, f"{what}; {SHARES} (docs/launcher.md, 'MPS')", None
