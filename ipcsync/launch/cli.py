"""``ipcsync-run``: the command line. ``parse_args -> config -> run``.

    ipcsync-run pipeline.toml
    ipcsync-run --stage loader="python3 loader.py" --stage train="python3 train.py" \\
                --edge loader:train --replicas loader=2
    ipcsync-run pipeline.toml --dry-run
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Sequence

from .plan import Plan, resolve
from ..errors import ConfigError
from .spec import MAX_RESTART, PipelineSpec, SpecError, from_cli, load

__all__ = ["main", "parse_args", "config_from_args", "run"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="ipcsync-run",
        description="Launch and supervise a pipeline of ipcsync stage processes.",
        epilog="Spec format: see the README (ipcsync-run) or ipcsync/launch/spec.py.",
    )
    ap.add_argument("spec", nargs="?", help="pipeline spec (TOML); or give --stage/--edge instead")
    ap.add_argument("--stage", action="append", default=[], metavar="NAME=CMD",
                    help="a stage and its command (split like a shell); repeatable")
    ap.add_argument("--edge", action="append", default=[], metavar="FROM:TO",
                    help="stage FROM feeds stage TO; repeatable")
    ap.add_argument("--replicas", action="append", default=[], metavar="NAME=N",
                    help="processes of a stage (default 1)")
    ap.add_argument("--device", action="append", default=[], metavar="NAME=DEVICE",
                    help="device of a stage: auto (default), cpu, cuda, cuda:N, cuda:{replica}")
    ap.add_argument("--edge-option", action="append", default=[], metavar="FROM:TO:KEY=VALUE",
                    help="an edge option (slots, slot_bytes, policy, wait, timeout)")
    ap.add_argument("--restart", type=int, default=None, metavar="N",
                    help="restart the whole group up to N times after a failure (overrides the spec)")
    ap.add_argument("--stop-timeout", type=float, default=None, metavar="SECONDS",
                    help="between SIGTERM and SIGKILL when stopping (overrides the spec)")
    ap.add_argument("--dry-run", action="store_true", help="print the resolved plan and exit")
    ap.add_argument("--no-summary", action="store_true", help="do not print the per-edge summary")
    return ap.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> PipelineSpec:
    """The validated spec (SpecError if anything is wrong)."""
    if args.spec and args.stage:
        raise SpecError("<command line>: give a spec file or --stage options, not both")
    if args.spec:
        extra = [f for f, v in (("--edge", args.edge), ("--replicas", args.replicas), ("--device", args.device),
                                ("--edge-option", args.edge_option)) if v]
        if extra:
            raise SpecError(f"<command line>: {extra[0]} only goes with --stage; put it in {args.spec}")
        spec = load(args.spec)
    elif args.stage:
        spec = from_cli(args.stage, args.edge, args.replicas, args.device, edge_options=args.edge_option)
    else:
        raise SpecError("<command line>: give a pipeline spec file, or at least one --stage NAME=CMD")
    changes = {}
    if args.restart is not None:
        if not 0 <= args.restart <= MAX_RESTART:
            raise SpecError(f"<command line>: --restart must be from 0 to {MAX_RESTART}, got {args.restart}")
        changes["restart"] = args.restart
    if args.stop_timeout is not None:
        if not 0 < args.stop_timeout < math.inf:
            raise SpecError(f"<command line>: --stop-timeout must be positive, got {args.stop_timeout}")
        changes["stop_timeout"] = args.stop_timeout
    if changes:
        from dataclasses import replace

        spec = replace(spec, **changes)
    return spec


def visible_gpus() -> int:
    """CUDA devices this launcher can see (0 without torch CUDA)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def run(spec: PipelineSpec, *, dry_run: bool = False, summary: bool = True) -> int:
    from ..channel import runtime_dir
    from .supervisor import Supervisor

    base = runtime_dir()
    gpus = visible_gpus()

    def make_plan(run_id: str, run_dir: str, attempt: int) -> Plan:
        return resolve(spec, run_id=run_id, run_dir=run_dir, gpus=gpus, restart=attempt)

    # Resolved once up front, so that a bad device or path fails before anything starts.
    # Run ids are 8 hex digits, one per attempt; "xxxxxxxx" stands for them here.
    plan = make_plan("xxxxxxxx", os.path.join(base, "run-xxxxxxxx"), 0)
    if dry_run:
        print(plan.describe())
        return 0
    return Supervisor(
        make_plan, runtime_base=base, restart=spec.restart, stop_timeout=spec.stop_timeout, summary=summary
    ).run()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        spec = config_from_args(args)
        return run(spec, dry_run=args.dry_run, summary=not args.no_summary)
    except ConfigError as exc:  # SpecError included
        print(f"ipcsync-run: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
