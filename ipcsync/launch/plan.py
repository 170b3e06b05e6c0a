"""Resolve a PipelineSpec into the processes to start: one ``Instance`` per stage replica,
with its device, command, environment and wiring. Pure: the caller says how many GPUs
there are and where the run directory is; nothing is started or created here.

Wiring. Every (edge, upstream replica) pair is one producer endpoint, an ipc socket in
the run directory: ``<run dir>/<src>.<i>-<dst>.sock``. Every downstream replica connects
to every upstream replica of the edge, so an edge from m replicas to n replicas is m
producers with n consumers each (``policy`` decides shard or broadcast among the n) and
n consumers merging m sources (fair fan-in). Each process gets its part as JSON in
``IPCSYNC_WIRING`` (read by ``ipcsync.stage``); JSON, not pickle, since stage code parses it.

Commands. A command whose first word is ``python``, ``python3`` or ``python3.N`` runs
under the launcher's own interpreter (``python=``, ``sys.executable`` by default), as
torchrun does: the stages see the same environment (virtualenv) as ``ipcsync-run``.

Threads. Every stage gets ``OMP_NUM_THREADS=1`` unless its ``env`` sets it, or the caller
says the launcher's environment does (``omp_default=False``): N stages each running one
OpenMP thread per core would oversubscribe the machine.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from typing import Any

from ..limits import IPC_PATH_MAX
from ..runtime.shm import ENV_RUN_ID
from .spec import PipelineSpec, SpecError, StageSpec

__all__ = [
    "Instance", "Plan", "resolve", "resolve_command", "WIRING_VERSION", "ENV_WIRING", "IPC_PATH_MAX",
    "OMP_THREADS", "OMP_DEFAULT",
]

WIRING_VERSION = 1
ENV_WIRING = "IPCSYNC_WIRING"
OMP_THREADS = "OMP_NUM_THREADS"
OMP_DEFAULT = "1"
_PYTHON_RE = re.compile(r"^python(3(\.[0-9]+)?)?$")


@dataclass(frozen=True)
class Instance:
    """One process of a stage."""

    stage: str
    replica: int
    replicas: int
    device: str
    cmd: tuple[str, ...]
    env: dict[str, str]  # variables to set on top of the launcher's environment
    cwd: str | None
    wiring: dict[str, Any]

    @property
    def label(self) -> str:
        return f"{self.stage}/{self.replica}"


@dataclass(frozen=True)
class Plan:
    spec: PipelineSpec
    run_id: str
    run_dir: str
    instances: tuple[Instance, ...]

    def describe(self) -> str:
        """The resolved plan, as ``--dry-run`` prints it."""
        lines = [
            f"pipeline {self.spec.name!r} from {self.spec.source}: {len(self.spec.stages)} stages, "
            f"{len(self.instances)} processes, restart up to {self.spec.restart}, "
            f"stop timeout {self.spec.stop_timeout:g} s",
            f"run directory {self.run_dir} (run id {self.run_id}; a new one per attempt)",
            "stages:",
        ]
        for inst in self.instances:
            vis = inst.env.get("CUDA_VISIBLE_DEVICES")
            lines.append(
                f"  {inst.label:<16} device {inst.device:<8}"
                + (f" CUDA_VISIBLE_DEVICES={vis}" if vis is not None else "")
                + f" cmd: {' '.join(inst.cmd)}"
            )
        lines.append("edges:")
        if not self.spec.edges:
            lines.append("  (none)")
        for e in self.spec.edges:
            src, dst = self.spec.stage(e.src), self.spec.stage(e.dst)
            lines.append(
                f"  {e.src} -> {e.dst}{' (reply)' if e.reply else ''}: {src.replicas} producer(s) x "
                f"{dst.replicas} consumer(s), "
                f"policy {e.policy}, slots {e.slots}, slot_bytes {e.slot_bytes}, wait {e.wait}, "
                f"timeout {e.timeout:g} s"
            )
            for i in range(src.replicas):
                lines.append(f"    {e.src}/{i}: {endpoint_url(self.run_dir, e.src, i, e.dst)}")
        return "\n".join(lines)


def endpoint_url(run_dir: str, src: str, replica: int, dst: str) -> str:
    return "ipc://" + os.path.join(run_dir, f"{src}.{replica}-{dst}.sock")


def resolve_command(cmd: tuple[str, ...], python: str) -> tuple[str, ...]:
    """``cmd`` with a first word ``python``/``python3``/``python3.N`` replaced by ``python``."""
    if cmd and python and _PYTHON_RE.fullmatch(cmd[0]):
        return (python, *cmd[1:])
    return cmd


def resolve(
    spec: PipelineSpec, *, run_id: str, run_dir: str, gpus: int, restart: int = 0,
    python: str | None = None, omp_default: bool = True,
) -> Plan:
    """The processes of ``spec``. ``gpus``: CUDA devices visible to the launcher.
    ``restart``: which attempt this is (0 first). ``python``: the interpreter for
    ``python``/``python3`` commands (default ``sys.executable``). ``omp_default``: give
    stages whose ``env`` does not set it ``OMP_NUM_THREADS=1`` (pass False when the
    launcher's environment sets it). SpecError for a device that cannot be had, or an
    endpoint path over the OS limit."""
    python = sys.executable if python is None else python
    devices = {
        (s.name, r): _device(spec, s, r, gpus) for s in spec.stages for r in range(s.replicas)
    }
    for e in spec.edges:  # both ends of an edge must use the same backend
        kinds = {devices[(n, r)].split(":")[0] for n in (e.src, e.dst) for r in range(spec.stage(n).replicas)}
        if len(kinds) > 1:
            raise SpecError(
                f"{spec.source}: edge {e.src} -> {e.dst}: its stages resolve to both cpu and cuda "
                "devices; ipcsync hands tensors over within one backend: give both stages cuda "
                "devices or both cpu"
            )
    for e in spec.edges:
        for i in range(spec.stage(e.src).replicas):
            path = endpoint_url(run_dir, e.src, i, e.dst)[len("ipc://"):]
            if len(path.encode()) > IPC_PATH_MAX:
                raise SpecError(
                    f"{spec.source}: edge {e.src} -> {e.dst}: socket path {path!r} is over the "
                    f"OS limit of {IPC_PATH_MAX} bytes; use shorter stage names or a shorter "
                    "IPCSYNC_RUNTIME_DIR"
                )
    instances = []
    for s in spec.stages:
        for r in range(s.replicas):
            wiring = _wiring(spec, s, r, devices[(s.name, r)], run_id, run_dir, restart)
            env = dict(s.env)
            if omp_default and OMP_THREADS not in env:
                env[OMP_THREADS] = OMP_DEFAULT
            if s.visible_devices is not None:
                env["CUDA_VISIBLE_DEVICES"] = s.visible_devices
            env.update({
                ENV_WIRING: json.dumps(wiring, separators=(",", ":")),
                ENV_RUN_ID: run_id,
                "IPCSYNC_STAGE": s.name,
                "IPCSYNC_REPLICA": str(r),
                "IPCSYNC_DEVICE": devices[(s.name, r)],
                "PYTHONUNBUFFERED": "1",
            })
            instances.append(Instance(
                stage=s.name, replica=r, replicas=s.replicas, device=devices[(s.name, r)],
                cmd=resolve_command(s.cmd, python), env=env, cwd=s.cwd, wiring=wiring,
            ))
    return Plan(spec=spec, run_id=run_id, run_dir=run_dir, instances=tuple(instances))


def _device(spec: PipelineSpec, stage: StageSpec, replica: int, gpus: int) -> str:
    dev = stage.device_for(replica)
    visible = gpus
    if stage.visible_devices is not None and gpus > 0:  # the stage sees only these
        visible = len([d for d in stage.visible_devices.split(",") if d.strip()])
    key = f"{spec.source}: stages.{stage.name}.device"
    if dev == "auto":
        return "cuda:0" if visible > 0 else "cpu"
    if dev == "cpu":
        return dev
    index = int(dev.split(":")[1]) if ":" in dev else 0
    if visible == 0:
        raise SpecError(f"{key}: {dev!r} for replica {replica}, but no CUDA GPU is visible here; use \"auto\" or \"cpu\"")
    if index >= visible:
        raise SpecError(
            f"{key}: {dev!r} for replica {replica}, but only {visible} CUDA device(s) are visible "
            f"to this stage (cuda:0 to cuda:{visible - 1})"
        )
    return f"cuda:{index}"


def _wiring(spec: PipelineSpec, stage: StageSpec, replica: int, device: str, run_id: str,
            run_dir: str, restart: int) -> dict[str, Any]:
    inputs = {}
    for e in spec.inputs_of(stage.name):
        src = spec.stage(e.src)
        inputs[e.src] = {
            "endpoints": [endpoint_url(run_dir, e.src, i, stage.name) for i in range(src.replicas)],
            "sources": [f"{e.src}/{i}" for i in range(src.replicas)],
            "wait": e.wait,
            "timeout": e.timeout,
        }
    outputs = {}
    for e in spec.outputs_of(stage.name):
        outputs[e.dst] = {
            "endpoint": endpoint_url(run_dir, stage.name, replica, e.dst),
            "consumers": spec.stage(e.dst).replicas,
            "slots": e.slots,
            "slot_bytes": e.slot_bytes,
            "policy": e.policy,
            "timeout": e.timeout,
            "reply": e.reply,
        }
    return {
        "version": WIRING_VERSION,
        "pipeline": spec.name,
        "stage": stage.name,
        "replica": replica,
        "replicas": stage.replicas,
        "device": device,
        "run_id": run_id,
        "restart": restart,
        "inputs": inputs,
        "outputs": outputs,
        "stats_path": os.path.join(run_dir, "stats", f"{stage.name}.{replica}.json"),
    }
