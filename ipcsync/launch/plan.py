"""Resolve a PipelineSpec into the processes to start: one ``Instance`` per stage replica,
with its device, command, environment and wiring. Pure: the caller says how many GPUs
there are and where the run directory is; nothing is started or created here.

Wiring. Every (edge, upstream replica) pair is one producer endpoint, an ipc socket in
the run directory: ``<run dir>/<src>.<i>-<dst>.sock``. Every downstream replica connects
to every upstream replica of the edge, so an edge from m replicas to n replicas is m
producers with n consumers each (``policy`` decides shard or broadcast among the n) and
n consumers merging m sources (fair fan-in). Each process gets its part as JSON in
``IPCSYNC_WIRING`` (read by ``ipcsync.stage``); JSON, not pickle, since stage code parses it.

Several nodes (``ipcsync-run --nnodes N``). ``place`` says which node runs each replica
(the stages' ``node``/``nodes`` keys); each node's launcher resolves only its own replicas
(``Nodes.rank``). A producer replica with at least one consumer replica on another node
(``remote_producers``) binds ``tcp://<its node's address>:<port>`` instead of an ipc socket,
with CURVE keys made by its node's launcher and exchanged through the rendezvous
(``Nodes.remote``); every consumer of it, on its node or not, connects there. Edges whose
ends all run on one node stay ipc. The wiring carries the keys: ``outputs[dst].curve``
(``{"public", "secret", "clients"}``: the client keys it admits, those of the nodes its
consumers run on) for such a producer, ``inputs[src].curve_servers`` (the producers'
public keys, ``null`` for an ipc endpoint) and ``inputs[src].curve_client`` (its node's
client key pair, ``Nodes.client``) for a consumer, and ``insecure`` under ``--insecure``.

Commands. A command whose first word is ``python``, ``python3`` or ``python3.N`` runs
under the launcher's own interpreter (``python=``, ``sys.executable`` by default), as
torchrun does: the stages see the same environment (virtualenv) as ``ipcsync-run``.

Environment. A stage starts with the launcher's environment (``stage_environ``) less the
variables that hold the launcher's own secrets (``WITHHELD_ENV``: the run's rendezvous
secret), then its ``env`` and the wiring on top: stage code never sees the run's secret.

Threads. Every stage gets ``OMP_NUM_THREADS=1`` unless its ``env`` sets it, or the caller
says the launcher's environment does (``omp_default=False``): N stages each running one
OpenMP thread per core would oversubscribe the machine.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping

from .. import stage_contract as contract
from ..envopts import RDZV_SECRET
from ..limits import IPC_PATH_MAX
from .spec import PipelineSpec, SpecError, StageSpec

__all__ = [
    "Instance", "Plan", "resolve", "resolve_command", "is_python_word", "WIRING_VERSION", "ENV_WIRING",
    "IPC_PATH_MAX", "OMP_THREADS", "OMP_DEFAULT", "Nodes", "RemoteEndpoint", "ClientKey", "place",
    "remote_producers", "INCOMPLETE_SUFFIX", "SECRET_ENV", "WITHHELD_ENV", "stage_environ",
]

# The launcher-stage contract (ipcsync.stage_contract), under the names used here before.
WIRING_VERSION = contract.WIRING_VERSION
ENV_WIRING = contract.WIRING.name
INCOMPLETE_SUFFIX = contract.INCOMPLETE_SUFFIX
OMP_THREADS = "OMP_NUM_THREADS"
OMP_DEFAULT = "1"
SECRET_ENV = RDZV_SECRET.name  # the run's rendezvous secret (launch.nodes)
WITHHELD_ENV = contract.WITHHELD  # the launcher's variables no stage inherits
_PYTHON_RE = re.compile(r"^python(3(\.[0-9]+)?)?$")


ProducerKey = tuple[str, int, str]  # (producer stage, its replica, consumer stage)


@dataclass(frozen=True)
class RemoteEndpoint:
    """The endpoint of a producer replica with consumers on another node."""

    url: str  # tcp://ADDR:PORT on the producer's node
    public: str = ""  # its CURVE public key (Z85); "" under --insecure
    secret: str = ""  # its CURVE secret key: only in the plan of the producer's own node
    clients: tuple[str, ...] = ()  # the CURVE public keys of the nodes its consumers run on

    def __repr__(self) -> str:  # never print the secret
        return f"RemoteEndpoint(url={self.url!r}, public={self.public!r}, clients={self.clients!r})"


@dataclass(frozen=True)
class ClientKey:
    """This node's CURVE client key pair (Z85) for this attempt: every consumer of a
    producer on a tcp endpoint uses it, and those producers admit only the keys of the
    nodes their consumers run on."""

    public: str
    secret: str

    def __repr__(self) -> str:  # never print the secret
        return f"ClientKey(public={self.public!r})"


@dataclass(frozen=True)
class Nodes:
    """Where this launcher stands in a run over several nodes."""

    nnodes: int
    rank: int
    remote: Mapping[ProducerKey, RemoteEndpoint] = field(default_factory=dict)
    insecure: bool = False
    client: ClientKey | None = None  # None under --insecure (and in placeholders)


def place(spec: PipelineSpec, nnodes: int) -> dict[tuple[str, int], int]:
    """The node of every (stage, replica). SpecError for a node index not below
    ``nnodes``, or a node that runs no stage."""
    placement: dict[tuple[str, int], int] = {}
    for s in spec.stages:
        bad = [n for n in s.nodes if n >= nnodes]
        if bad:
            key = "node" if len(s.nodes) == 1 else "nodes"
            raise SpecError(
                f"{spec.source}: stages.{s.name}.{key}: node {bad[0]}, but there "
                f"{'is 1 node' if nnodes == 1 else f'are {nnodes} nodes'} (0 to {nnodes - 1}); "
                + ("run one ipcsync-run per node with --nnodes" if nnodes == 1 else "raise --nnodes or change the spec")
            )
        for r in range(s.replicas):
            placement[(s.name, r)] = s.node_of(r)
    idle = sorted(set(range(nnodes)) - set(placement.values()))
    if idle:
        raise SpecError(
            f"{spec.source}: node {idle[0]} runs no stage (--nnodes {nnodes}); give it one with "
            "node = N or nodes = [...] in a stage, or lower --nnodes"
        )
    return placement


def remote_producers(spec: PipelineSpec, placement: Mapping[tuple[str, int], int]) -> list[ProducerKey]:
    """The producer replicas, as (src, replica, dst), with at least one consumer replica
    of the edge on another node: their endpoints are tcp, the others ipc."""
    found = []
    for e in spec.edges:
        dst_nodes = {placement[(e.dst, j)] for j in range(spec.stage(e.dst).replicas)}
        for i in range(spec.stage(e.src).replicas):
            if dst_nodes - {placement[(e.src, i)]}:
                found.append((e.src, i, e.dst))
    return found


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
    nodes: Nodes | None = None

    def url(self, src: str, replica: int, dst: str) -> str:
        """The endpoint of producer replica ``src/replica`` towards ``dst``."""
        remote = self.nodes.remote.get((src, replica, dst)) if self.nodes is not None else None
        return remote.url if remote is not None else endpoint_url(self.run_dir, src, replica, dst)

    def describe(self) -> str:
        """The resolved plan, as ``--dry-run`` prints it."""
        n = self.nodes
        lines = [
            f"pipeline {self.spec.name!r} from {self.spec.source}: {len(self.spec.stages)} stages, "
            f"{len(self.instances)} processes{f' on node {n.rank} of {n.nnodes}' if n else ''}, "
            f"restart up to {self.spec.restart}, stop timeout {self.spec.stop_timeout:g} s",
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
            # The wait mode is how a CUDA consumer waits on its producer's events: not
            # shown when this node's consumers of the edge are all on the CPU.
            consumers = [i.device for i in self.instances if i.stage == e.dst]
            wait = f"wait {e.wait}, " if not consumers or any(d != "cpu" for d in consumers) else ""
            lines.append(
                f"  {e.src} -> {e.dst}{' (reply)' if e.reply else ''}: {src.replicas} producer(s) x "
                f"{dst.replicas} consumer(s), "
                f"policy {e.policy}, slots {e.slots}, slot_bytes {e.slot_bytes}, {wait}"
                f"timeout {e.timeout:g} s"
            )
            for i in range(src.replicas):
                remote = n.remote.get((e.src, i, e.dst)) if n is not None else None
                how = ""
                if n is not None and remote is not None:
                    how = " (between nodes: plain tcp, --insecure)" if n.insecure else " (between nodes: tcp with CURVE)"
                lines.append(f"    {e.src}/{i}: {self.url(e.src, i, e.dst)}{how}")
        return "\n".join(lines)


def endpoint_url(run_dir: str, src: str, replica: int, dst: str) -> str:
    return "ipc://" + os.path.join(run_dir, f"{src}.{replica}-{dst}.sock")


def is_python_word(word: str) -> bool:
    """Whether ``word`` names a Python interpreter: ``python``, ``python3`` or ``python3.N``."""
    return _PYTHON_RE.fullmatch(word) is not None


def resolve_command(cmd: tuple[str, ...], python: str) -> tuple[str, ...]:
    """``cmd`` with a first word ``python``/``python3``/``python3.N`` replaced by ``python``."""
    if cmd and python and is_python_word(cmd[0]):
        return (python, *cmd[1:])
    return cmd


def resolve(
    spec: PipelineSpec, *, run_id: str, run_dir: str, gpus: int, restart: int = 0,
    python: str | None = None, omp_default: bool = True, nodes: Nodes | None = None,
) -> Plan:
    """The processes of ``spec``. ``gpus``: CUDA devices visible to the launcher.
    ``restart``: which attempt this is (0 first). ``python``: the interpreter for
    ``python``/``python3`` commands (default ``sys.executable``). ``omp_default``: give
    stages whose ``env`` does not set it ``OMP_NUM_THREADS=1`` (pass False when the
    launcher's environment sets it). ``nodes``: this launcher's place in a run over
    several nodes (None: one node); only its replicas are resolved. SpecError for a
    device that cannot be had, a stage on a node that does not exist, or an endpoint
    path over the OS limit."""
    python = sys.executable if python is None else python
    placement = place(spec, nodes.nnodes if nodes is not None else 1)
    rank = nodes.rank if nodes is not None else 0
    remote = nodes.remote if nodes is not None else {}
    missing = [k for k in remote_producers(spec, placement) if k not in remote]
    if missing:
        raise ValueError(f"no remote endpoint for producer(s) {missing}")  # the caller's bug
    devices = {  # this node's replicas: the GPUs counted are this node's
        (s.name, r): _device(spec, s, r, gpus) for s in spec.stages for r in range(s.replicas)
        if placement[(s.name, r)] == rank
    }
    for e in spec.edges:  # both ends of an edge must use the same backend
        kinds = {d.split(":")[0] for (n, _), d in devices.items() if n in (e.src, e.dst)}
        if len(kinds) > 1:
            raise SpecError(
                f"{spec.source}: edge {e.src} -> {e.dst}: its stages resolve to both cpu and cuda "
                "devices; ipcsync hands tensors over within one backend: give both stages cuda "
                "devices or both cpu"
            )
    for e in spec.edges:
        for i in range(spec.stage(e.src).replicas):
            if (e.src, i, e.dst) in remote:
                continue
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
            if placement[(s.name, r)] != rank:
                continue
            wiring = _wiring(spec, s, r, devices[(s.name, r)], run_id, run_dir, restart, nodes)
            env = dict(s.env)
            if omp_default and OMP_THREADS not in env:
                env[OMP_THREADS] = OMP_DEFAULT
            if s.visible_devices is not None:
                env["CUDA_VISIBLE_DEVICES"] = s.visible_devices
            env.update(contract.stage_env(wiring=json.dumps(wiring, separators=(",", ":")), run_id=run_id,
                                          stage=s.name, replica=r, device=devices[(s.name, r)]))
            instances.append(Instance(
                stage=s.name, replica=r, replicas=s.replicas, device=devices[(s.name, r)],
                cmd=resolve_command(s.cmd, python), env=env, cwd=s.cwd, wiring=wiring,
            ))
    return Plan(spec=spec, run_id=run_id, run_dir=run_dir, instances=tuple(instances), nodes=nodes)


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
            run_dir: str, restart: int, nodes: Nodes | None) -> dict[str, Any]:
    remote = nodes.remote if nodes is not None else {}
    insecure = nodes is not None and nodes.insecure

    def url(src: str, i: int, dst: str) -> str:
        ep = remote.get((src, i, dst))
        return ep.url if ep is not None else endpoint_url(run_dir, src, i, dst)

    inputs: dict[str, Any] = {}
    for e in spec.inputs_of(stage.name):
        src = spec.stage(e.src)
        inputs[e.src] = {
            "endpoints": [url(e.src, i, stage.name) for i in range(src.replicas)],
            "sources": [f"{e.src}/{i}" for i in range(src.replicas)],
            "wait": e.wait,
            "timeout": e.timeout,
        }
        if e.verify:
            inputs[e.src]["verify"] = True
        eps = [remote.get((e.src, i, stage.name)) for i in range(src.replicas)]
        if any(ep is not None for ep in eps):
            if insecure:
                inputs[e.src]["insecure"] = True
            else:
                inputs[e.src]["curve_servers"] = [ep.public if ep is not None else None for ep in eps]
                client = nodes.client if nodes is not None else None
                if client is not None:
                    inputs[e.src]["curve_client"] = {"public": client.public, "secret": client.secret}
    outputs: dict[str, Any] = {}
    for e in spec.outputs_of(stage.name):
        outputs[e.dst] = {
            "endpoint": url(stage.name, replica, e.dst),
            "consumers": spec.stage(e.dst).replicas,
            "slots": e.slots,
            "slot_bytes": e.slot_bytes,
            "policy": e.policy,
            "timeout": e.timeout,
            "reply": e.reply,
        }
        ep = remote.get((stage.name, replica, e.dst))
        if ep is not None:
            if insecure:
                outputs[e.dst]["insecure"] = True
            else:
                outputs[e.dst]["curve"] = {"public": ep.public, "secret": ep.secret, "clients": list(ep.clients)}
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
        "stats_path": contract.stats_path(run_dir, stage.name, replica),
    }


def stage_environ(launcher: Mapping[str, str], *overlays: Mapping[str, str]) -> dict[str, str]:
    """A stage's environment: ``launcher``'s (``os.environ``) without ``WITHHELD_ENV``,
    then each of ``overlays`` (the stage's ``env``, the observer's variables) on top."""
    env = {k: v for k, v in launcher.items() if k not in WITHHELD_ENV}
    for extra in overlays:
        env.update(extra)
    return env
