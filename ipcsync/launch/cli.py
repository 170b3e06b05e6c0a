"""``ipcsync-run``: the command line. ``parse_args -> config_from_args (a LaunchConfig) -> run``.

    ipcsync-run pipeline.toml
    ipcsync-run --stage loader="python3 loader.py" --stage train="python3 train.py" \\
                --edge loader:train --replicas loader=2
    ipcsync-run pipeline.toml --replicas loader=4 --dry-run
    ipcsync-run pipeline.toml --mps on     # the stages under a private MPS daemon (mps.py, mps_daemon.py)
    ipcsync-run pipeline.toml --nnodes 2 --node-rank 0 --rdzv-endpoint node0:29400 \\
                --rdzv-secret-file ~/run.secret          # on node 0: writes the run's secret
    ipcsync-run pipeline.toml --nnodes 2 --node-rank 1 --rdzv-endpoint node0:29400 \\
                --rdzv-secret-file ~/run.secret          # on node 1: a copy of node 0's file

Neither importing this module nor ``--help``, ``--version`` or ``--dry-run`` loads torch,
zmq or a backend: ``--help`` answers at once. The supervisor is loaded only when a
pipeline runs, and torch only to count GPUs, when a stage may use one on a host that has
a GPU driver (``visible_gpus``). With ``--nnodes`` > 1, torch.distributed (the rendezvous
store) and zmq (CURVE keys) are loaded when the pipeline runs (``nodes.py``).
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import shutil
import sys
import traceback
from dataclasses import replace
from typing import TYPE_CHECKING, NoReturn, Sequence

from .. import __version__
from ..errors import ConfigError
from ..envopts import LOG_LEVEL
from ..logs import LEVELS, LOG_LEVEL_ENV, CliLogging, parse_level
from .commands import command_problem
from .config import LaunchConfig
from .plan import OMP_THREADS, Nodes, Plan, RemoteEndpoint, place, remote_producers, resolve
from .spec import MAX_RESTART, MPS_MODES, Overrides, PipelineSpec, SpecError, from_cli, load, mps_mode

if TYPE_CHECKING:  # loaded only when a pipeline runs
    from .mps import MpsDecision
    from .mps_daemon import PrivateMps
    from .monitor import Observer
    from .nodes import NodeGroup

__all__ = [
    "main", "parse_args", "build_parser", "config_from_args", "spec_from_args", "LaunchConfig", "check_plan", "run", "visible_gpus", "needs_gpu_count",
    "EXIT_LAUNCHER_ERROR",
]

EXIT_LAUNCHER_ERROR = 125  # as docker run: the launcher itself failed; no stage can be blamed

_EPILOG = """\
exit status:
  0        every stage exited 0
  N        the first failing stage's own exit code
  125      ipcsync-run itself failed: bad arguments, bad spec, --dry-run check
           failed, --mps on without an MPS daemon, or an internal error (no
           stage ran, or none is to blame)
  127      a stage's command could not be started
  128+N    a stage was killed by signal N, or ipcsync-run was interrupted by
           signal N (130 for Ctrl-C)

Spec keys: docs/reference.md; the launcher: docs/launcher.md. With a spec file,
--replicas, --device, --edge-option, --restart, --stop-timeout and --mps override its values.
"""


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors exit with the launcher's own code (125), not 2: a
    stage may exit 2 itself."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_LAUNCHER_ERROR, f"{self.prog}: error: {message}\n")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``argv`` (default: ``sys.argv[1:]``) parsed by ``build_parser()``; a usage error
    exits with ``EXIT_LAUNCHER_ERROR``."""
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    """ipcsync-run's command line: every option, with its help (what docs/reference.md
    lists)."""
    ap = _Parser(
        prog="ipcsync-run",
        description="Launch and supervise a pipeline of ipcsync stage processes.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("spec", nargs="?", help="pipeline spec (TOML); or give --stage/--edge instead")
    ap.add_argument("--stage", action="append", default=[], metavar="NAME=CMD",
                    help="a stage and its command (split like a shell); repeatable")
    ap.add_argument("--edge", action="append", default=[], metavar="FROM:TO",
                    help="stage FROM feeds stage TO; repeatable")
    ap.add_argument("--replicas", action="append", default=[], metavar="NAME=N",
                    help="processes of a stage (default 1; overrides the spec)")
    ap.add_argument("--device", action="append", default=[], metavar="NAME=DEVICE",
                    help="device of a stage: auto (default), cpu, cuda, cuda:N, cuda:{replica}")
    ap.add_argument("--edge-option", action="append", default=[], metavar="FROM:TO:KEY=VALUE",
                    help="an edge option (slots, slot_bytes, policy, wait, timeout, reply, verify)")
    ap.add_argument("--restart", type=int, default=None, metavar="N",
                    help="restart the whole group up to N times after a failure (overrides the spec)")
    ap.add_argument("--stop-timeout", type=float, default=None, metavar="SECONDS",
                    help="between SIGTERM and SIGKILL when stopping (overrides the spec)")
    ap.add_argument("--mps", default=None, metavar="{" + ",".join(MPS_MODES) + "}",
                    help="a private MPS daemon for the run: on (for any run that uses CUDA), auto (when two "
                         "or more CUDA processes share a GPU; the default) or off (overrides the spec's mps)")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the resolved plan, check every stage's cwd and command, and exit")
    ap.add_argument("--no-summary", action="store_true", help="do not print the per-edge summary")
    ap.add_argument("--monitor", action="store_true",
                    help="print per-edge rates, slot use, who waits on whom and the bottleneck stage "
                         "every --monitor-interval seconds while the pipeline runs")
    ap.add_argument("--monitor-interval", type=float, default=1.0, metavar="SECONDS",
                    help="seconds between --monitor reports and --stats-file records (default 1)")
    ap.add_argument("--stats-file", default=None, metavar="PATH",
                    help="append per-edge, per-endpoint and pipeline stats to PATH as JSON lines every "
                         "interval (schema version 1: see docs/monitoring.md)")
    ap.add_argument("--trace", default=None, metavar="PATH",
                    help="write a Chrome/Perfetto trace (JSON) of every handoff of every stage to PATH "
                         "(open it in ui.perfetto.dev)")
    ap.add_argument("--log-level", type=str.lower, choices=LEVELS, default=None, metavar="LEVEL",
                    help=f"level of ipcsync's log lines, in the stages ({LOG_LEVEL_ENV}) and in "
                         f"ipcsync-run itself: {', '.join(LEVELS)} (default: warning)")
    nodes = ap.add_argument_group("several nodes (one ipcsync-run per node, as torchrun)")
    nodes.add_argument("--nnodes", type=int, default=1, metavar="N",
                       help="nodes that run the pipeline (default 1); a stage's node/nodes keys say where it runs")
    nodes.add_argument("--node-rank", type=int, default=None, metavar="R", help="this node's index, 0 to N-1")
    nodes.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                       help="where node 0's ipcsync-run serves the rendezvous store (the same on every node)")
    nodes.add_argument("--rdzv-timeout", type=float, default=300.0, metavar="SECONDS",
                       help="how long to wait for every node to join (default 300)")
    nodes.add_argument("--node-addr", default=None, metavar="ADDR",
                       help="the address other nodes reach this one at (default: this host's address "
                            "towards the rendezvous endpoint)")
    nodes.add_argument("--rdzv-secret-file", default=None, metavar="PATH",
                       help="the run's rendezvous secret: node 0 writes a fresh one to PATH (mode 600) unless "
                            "it exists; every other node reads its copy (or set $IPCSYNC_RDZV_SECRET). Without "
                            "either, node 0 writes one into its runtime directory and says where")
    nodes.add_argument("--insecure", action="store_true",
                       help="edges between nodes without CURVE, and no rendezvous secret needed: no "
                            "authentication, no encryption; only on a network you trust")
    ap.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return ap


def config_from_args(args: argparse.Namespace) -> LaunchConfig:
    """The validated launch: the spec with the command line's overrides, and every option
    (SpecError or ConfigError if anything is wrong)."""
    return LaunchConfig(
        spec_from_args(args), dry_run=args.dry_run, summary=not args.no_summary, monitor=args.monitor,
        monitor_interval=args.monitor_interval, stats_file=args.stats_file, trace=args.trace,
        nnodes=args.nnodes, node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint,
        rdzv_timeout=args.rdzv_timeout, node_addr=args.node_addr, insecure=args.insecure,
        rdzv_secret_file=args.rdzv_secret_file,
    )


def spec_from_args(args: argparse.Namespace) -> PipelineSpec:
    """The validated spec, from a spec file or ``--stage``/``--edge``, with ``--replicas``,
    ``--device``, ``--edge-option``, ``--restart``, ``--stop-timeout`` and ``--mps``
    applied (SpecError if anything is wrong)."""
    if args.spec and args.stage:
        raise SpecError("<command line>: give a spec file or --stage options, not both")
    if args.spec:
        if args.edge:
            raise SpecError(
                f"<command line>: --edge only goes with --stage; put the edge in {args.spec} "
                "(--edge-option FROM:TO:KEY=VALUE changes an edge of the spec)"
            )
        spec = load(args.spec, Overrides(tuple(args.replicas), tuple(args.device), tuple(args.edge_option)))
    elif args.stage:
        spec = from_cli(args.stage, args.edge, args.replicas, args.device, edge_options=args.edge_option)
    else:
        raise SpecError("<command line>: give a pipeline spec file, or at least one --stage NAME=CMD")
    if args.restart is not None:
        if not 0 <= args.restart <= MAX_RESTART:
            raise SpecError(f"<command line>: --restart must be from 0 to {MAX_RESTART}, got {args.restart}")
        spec = replace(spec, restart=args.restart)
    if args.stop_timeout is not None:
        if not 0 < args.stop_timeout < math.inf:
            raise SpecError(f"<command line>: --stop-timeout must be positive, got {args.stop_timeout}")
        spec = replace(spec, stop_timeout=args.stop_timeout)
    if args.mps is not None:
        spec = replace(spec, mps=mps_mode(args.mps, "<command line>", "--mps"))
    return spec


# Device files of GPU drivers torch can use as "cuda": NVIDIA, WSL2, ROCm. Without any of
# them torch sees no CUDA device, so the GPUs are counted (0) without importing it.
GPU_DRIVER_FILES = ("/dev/nvidiactl", "/dev/dxg", "/dev/kfd")


def visible_gpus() -> int:
    """CUDA devices this launcher can see (0 without torch CUDA). Imports torch only on a
    host with a GPU driver."""
    if not any(os.path.exists(p) for p in GPU_DRIVER_FILES):
        return 0
    try:
        import torch  # noqa: PLC0415 (1-2 s: only when there may be a GPU to count)

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def needs_gpu_count(spec: PipelineSpec) -> bool:
    """Whether resolving ``spec`` depends on how many GPUs there are (a stage whose device
    is not ``cpu``)."""
    return any(s.device != "cpu" for s in spec.stages)


def check_plan(plan: Plan) -> list[str]:
    """What would stop a stage from starting (``commands.command_problem``): a missing
    ``cwd``, a program that is not an executable file or not found on the stage's PATH,
    and for a Python command a script or ``-m`` module that is not there. One line per
    problem; empty when every stage can start."""
    problems = []
    seen: set[str] = set()
    for inst in plan.instances:
        if inst.stage in seen:  # replicas share cwd and command
            continue
        seen.add(inst.stage)
        problem = command_problem(inst.cmd, inst.cwd, inst.env)
        if problem is not None:
            problems.append(f"{plan.spec.source}: stages.{inst.stage}.{problem[0]}: {problem[1]}")
    return problems


def _say(line: str) -> None:
    """A status line of ipcsync-run (program output on stderr, not library logging: always
    shown, whatever --log-level says)."""
    print(f"ipcsync-run: {line}", file=sys.stderr, flush=True)


def placeholder_nodes(spec: PipelineSpec, nnodes: int, rank: int, insecure: bool = False) -> Nodes:
    """Node ``rank``'s place with the edges between nodes shown as ``tcp://<node R>:<port>``
    (addresses and ports are known only at the rendezvous): for ``--dry-run`` and the
    checks made before it."""
    placement = place(spec, nnodes)
    remote = {
        key: RemoteEndpoint(f"tcp://<node {placement[(key[0], key[1])]}>:<port>")
        for key in remote_producers(spec, placement)
    }
    return Nodes(nnodes=nnodes, rank=rank, remote=remote, insecure=insecure)


_ANY_RUN_ID = "xxxxxxxx"  # run ids are 8 hex digits, one per attempt: this stands for them


def run(config: LaunchConfig) -> int:
    """Launch ``config``'s pipeline (or, with ``dry_run``, show and check its plan) and
    return the launcher's exit code; ConfigError for what the machine rules out."""
    from ..system.paths import runtime_dir

    base = runtime_dir()
    spec = config.spec
    gpus = visible_gpus() if needs_gpu_count(spec) else 0
    omp_default = OMP_THREADS not in os.environ

    def plan_before_run(rank: int, node_gpus: int) -> Plan:
        """The plan resolved before anything starts (a bad device or path fails here),
        with edges between nodes as placeholders."""
        nodes = placeholder_nodes(spec, config.nnodes, rank, config.insecure) if config.many else None
        return resolve(spec, run_id=_ANY_RUN_ID, run_dir=os.path.join(base, f"run-{_ANY_RUN_ID}"), gpus=node_gpus,
                       omp_default=omp_default, nodes=nodes)

    if config.dry_run and config.many:
        for r in range(config.nnodes) if config.node_rank is None else [config.node_rank]:
            print(f"node {r}:")
            print("\n".join("  " + line for line in plan_before_run(r, gpus if r == config.rank else 0)
                            .describe().splitlines()))
        plan = plan_before_run(config.rank, gpus)
        mps = _mps_decision(spec, plan)
        print(f"node {config.rank}: {mps.line()}")
        _dry_run_check(plan, mps)
        return 0
    plan = plan_before_run(config.rank, gpus)
    mps = _mps_decision(spec, plan)
    if omp_default and any(dict(s.env).get(OMP_THREADS) is None for s in spec.stages):
        _say(
            f"setting {OMP_THREADS}=1 for each stage (so that stages do not overload the machine with "
            f"one thread per core each); set it yourself to change that"
        )
    if config.dry_run:
        print(plan.describe())
        print(mps.line())
        _dry_run_check(plan, mps)
        return 0
    if mps.problem:
        raise ConfigError(mps.why)
    return _supervise(config, base, gpus, omp_default, mps)


def _mps_decision(spec: PipelineSpec, plan: Plan) -> MpsDecision:
    """What the spec's ``mps`` means for ``plan`` on this host (``mps.host_decision``)."""
    from .mps import host_decision

    return host_decision(spec.mps, plan)


def _start_mps(decision: MpsDecision, base: str) -> PrivateMps | None:
    """The run's private MPS daemon, started, if ``decision`` says to use one. Under
    ``"auto"``, one that cannot be started is said and the run goes on without MPS;
    under ``"on"`` it is a ConfigError."""
    if decision.tell:
        _say(decision.line())
    if not decision.use:
        return None
    from ..mps_attach import CONTROL
    from .mps_daemon import PrivateMps

    mps = PrivateMps(shutil.which(CONTROL) or CONTROL, base, say=_say)
    try:
        mps.start()
    except ConfigError as exc:
        if decision.mode == "on":
            raise
        _say(f"{exc}; the run goes on without MPS")
        return None
    _say(f"started a private MPS daemon (pid {mps.daemon[0] if mps.daemon else '?'}, pipe directory {mps.pipe})")
    return mps


def _dry_run_check(plan: Plan, mps: MpsDecision) -> None:
    if mps.problem:
        raise ConfigError(mps.why)
    problems = check_plan(plan)
    if problems:
        raise ConfigError("the dry run found stages that cannot start:\n  " + "\n  ".join(problems))


def _supervise(config: LaunchConfig, base: str, gpus: int, omp_default: bool, decision: MpsDecision) -> int:
    """Run the pipeline under a Supervisor, with its node group, observer and private MPS
    daemon if any. The daemon and its watchdog start before the Supervisor makes this
    process a child subreaper, so they are not among the descendants it kills after each
    attempt; the daemon is stopped after the last attempt."""
    from .supervisor import Supervisor

    spec = config.spec
    group: NodeGroup | None = None
    if config.many:
        from .nodes import NodeGroup

        assert config.rdzv_endpoint is not None  # LaunchConfig: needed unless dry_run
        group = NodeGroup(spec, nnodes=config.nnodes, rank=config.rank, rdzv=config.rdzv_endpoint,
                          insecure=config.insecure, addr=config.node_addr, rdzv_timeout=config.rdzv_timeout,
                          say=_say, secret_file=config.rdzv_secret_file, secret_dir=base)

    def make_plan(run_id: str, run_dir: str, attempt: int) -> Plan:
        nodes = group.rendezvous(attempt) if group is not None else None
        plan = resolve(spec, run_id=run_id, run_dir=run_dir, gpus=gpus, restart=attempt, omp_default=omp_default,
                       nodes=nodes)
        return mps.apply(plan) if mps is not None else plan

    observer = _observer(config) if config.observed else None
    mps: PrivateMps | None = None
    try:
        mps = _start_mps(decision, base)
        if group is not None:
            group.start()
        return Supervisor(
            make_plan, runtime_base=base, restart=spec.restart, stop_timeout=spec.stop_timeout,
            summary=config.summary, contain=True, observer=observer, group=group,
        ).run()
    finally:
        if mps is not None:
            mps.stop()
        if observer is not None:
            observer.close()
        if group is not None:
            group.close()


def _observer(config: LaunchConfig) -> Observer:
    """The ``--monitor`` / ``--stats-file`` / ``--trace`` observer; ConfigError for a path
    it cannot write to."""
    from .monitor import Observer

    trace, stats_file = config.trace, config.stats_file
    if trace and not os.path.isdir(os.path.dirname(os.path.abspath(trace))):
        raise ConfigError(f"--trace {trace}: its directory does not exist; create it or give another path")
    try:
        return Observer(monitor=config.monitor, stats_file=stats_file, trace_file=trace,
                        interval=config.monitor_interval)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError(f"--stats-file {stats_file} is a symbolic link: ipcsync-run never writes through "
                              "one (in a shared directory another user may have planted it); give the "
                              "file's own path") from None
        raise ConfigError(f"--stats-file {stats_file}: cannot open it for writing ({exc.strerror or exc}); "
                          "ipcsync-run appends only to a regular file: give a new name or a regular file's") from None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.log_level is not None:
        # Every stage inherits the launcher's environment: their ipcsync loggers use it
        # (ipcsync.logs.apply_env_level, unless the stage configures logging itself).
        os.environ[LOG_LEVEL_ENV] = args.log_level
    level = args.log_level or LOG_LEVEL.get() or "warning"
    try:
        logs = CliLogging(parse_level(level), "ipcsync-run")
    except ConfigError as exc:  # a bad $IPCSYNC_LOG_LEVEL
        _say(f"error: {exc}")
        return EXIT_LAUNCHER_ERROR
    try:
        return run(config_from_args(args))
    except ConfigError as exc:  # SpecError included
        _say(f"error: {exc}")
        return EXIT_LAUNCHER_ERROR
    except Exception:  # a bug of the launcher: say so, and do not pass for a stage's code
        traceback.print_exc()
        _say("internal error (above); please report it with the command line and spec")
        return EXIT_LAUNCHER_ERROR
    finally:
        logs.close()


if __name__ == "__main__":
    sys.exit(main())
