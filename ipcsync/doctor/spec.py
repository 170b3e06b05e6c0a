"""``ipcsync doctor --spec``'s checks of a pipeline: each stage's devices exist here and its
command can start, then the launcher's own plan for it (``ipcsync.launch.plan.resolve``)."""

from __future__ import annotations

import os
import sys
from typing import Any

from ..limits import IPC_PATH_MAX
from .report import FAIL, PASS, Check

__all__ = ["resolve_device", "check_spec"]


def resolve_device(stage: Any, replica: int, gpus: int) -> tuple[str, str | None]:
    """(the device a replica of ``stage`` gets, a problem or None): the launcher's rule
    (``auto`` is cuda:0 with a GPU, else cpu; ``visible_devices`` narrows what a stage sees)."""
    dev = stage.device_for(replica)
    visible = gpus
    if stage.visible_devices is not None and gpus > 0:
        ids = [d.strip() for d in stage.visible_devices.split(",") if d.strip()]
        visible = len(ids)
        bad = [d for d in ids if d.isdigit() and int(d) >= gpus]
        if bad:
            return dev, f"visible_devices {stage.visible_devices!r} names GPU(s) {', '.join(bad)}; this machine has {gpus}"
    if dev == "auto":
        return ("cuda:0" if visible > 0 else "cpu"), None
    if dev == "cpu":
        return dev, None
    index = int(dev.split(":")[1]) if ":" in dev else 0
    if visible == 0:
        return dev, f"{dev} for replica {replica}, but no CUDA GPU is visible here"
    if index >= visible:
        return dev, f"{dev} for replica {replica}, but only {visible} GPU(s) are visible to it"
    return f"cuda:{index}", None


def _command_problem(stage: Any) -> str | None:
    """Why ``stage``'s command cannot start here, or None: its cwd, its program (a path
    from the cwd, or found on PATH), and for a Python command its script or module."""
    from ..launch.commands import command_problem
    from ..launch.plan import resolve_command

    problem = command_problem(resolve_command(stage.cmd, sys.executable), stage.cwd, dict(stage.env))
    if problem is None:
        return None
    field, message = problem
    return f"cwd {message}" if field == "cwd" else message


def check_spec(spec: Any, gpus: int, run_base: str) -> list[Check]:
    """Each stage of ``spec`` (a PipelineSpec): devices that exist here and a command that
    can start; then the launcher's plan for it (``resolve``: backends, socket paths)."""
    from ..launch.plan import endpoint_url, resolve
    from ..launch.spec import SpecError

    out: list[Check] = []
    for s in spec.stages:
        devices, problems = [], []
        for r in range(s.replicas):
            dev, problem = resolve_device(s, r, gpus)
            devices.append(dev)
            if problem:
                problems.append(problem)
        shown = sorted(set(devices))
        cmd = _command_problem(s)
        found = f"{s.replicas} replica(s) on {', '.join(shown)}; cmd {' '.join(s.cmd)}"
        if cmd:
            problems.append(cmd)
        if problems:
            fixes = []
            if cmd:
                fixes.append("fix the stage's cmd or cwd (a relative path is taken from the cwd)")
            if len(problems) > (1 if cmd else 0):
                fixes.append("use device = \"auto\" or \"cpu\", or a cuda:N this machine has "
                             "(python -c 'import torch; print(torch.cuda.device_count())')")
            out.append(Check(FAIL, f"stage {s.name}", f"{found}: {'; '.join(problems)}", "; ".join(fixes)))
        else:
            out.append(Check(PASS, f"stage {s.name}", found))
    run_dir = os.path.join(run_base, "run-xxxxxxxx")
    try:
        plan = resolve(spec, run_id="xxxxxxxx", run_dir=run_dir, gpus=gpus)
    except SpecError as exc:
        out.append(Check(FAIL, "plan", f"ipcsync-run would refuse it: {exc}",
                         "change the spec as the message says; ipcsync-run --dry-run shows the plan"))
        return out
    paths = [endpoint_url(run_dir, e.src, i, e.dst) for e in spec.edges for i in range(spec.stage(e.src).replicas)]
    longest = max((len(p[len("ipc://"):].encode()) for p in paths), default=0)
    out.append(Check(PASS, "plan", f"{len(plan.instances)} process(es), {len(paths)} producer endpoint(s); "
                     f"longest socket path {longest} of {IPC_PATH_MAX} bytes"))
    from ..launch.mps import host_decision

    mps = host_decision(spec.mps, plan)
    out.append(Check(FAIL if mps.problem else PASS, "plan mps", mps.line(),
                     "change mps in the spec, or pass --mps" if mps.problem else None))
    return out
