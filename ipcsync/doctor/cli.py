"""``ipcsync doctor``'s command line: every check in report order (``run_checks``), the
options, and the report on stdout (text, or one JSON object per check)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import IO, Callable, Iterator, Sequence

from .. import __version__
from ..system.paths import runtime_dir_choice
from .cuda import check_cuda, visible_gpus
from .host import check_namespaces, check_nofile, check_runtime_dir, check_shm, check_versions
from .probe import DEFAULT_IPC_TIMEOUT
from .report import FAIL, PASS, STATUSES, WARN, Check, exit_status
from .spec import check_spec

__all__ = ["run_checks", "build_parser", "parse_args", "main"]

log = logging.getLogger(__name__)


def run_checks(spec_path: str | None = None, cuda_ipc: bool = True,
               ipc_timeout: float = DEFAULT_IPC_TIMEOUT) -> Iterator[Check]:
    """Every check, in report order; a check that breaks is a FAIL naming the error."""
    spec, spec_check = None, None
    if spec_path is not None:
        from ..launch.spec import SpecError, load

        try:
            spec = load(spec_path)
            spec_check = Check(PASS, "spec", f"{spec_path}: {len(spec.stages)} stage(s), {len(spec.edges)} edge(s)")
        except SpecError as exc:
            spec_check = Check(FAIL, "spec", str(exc), "correct the spec; ipcsync-run --dry-run checks it the same way")
    gpus = visible_gpus()
    steps: list[tuple[str, Callable[[], Check | list[Check]]]] = [
        ("versions", check_versions),
        ("/dev/shm", lambda: check_shm(spec, gpus=gpus)),
        ("runtime dir", check_runtime_dir),
        ("RLIMIT_NOFILE", check_nofile),
        ("namespaces", check_namespaces),
        ("cuda", lambda: check_cuda(ipc=cuda_ipc, ipc_timeout=ipc_timeout)),
    ]
    if spec_check is not None:
        steps.append(("spec", lambda: [spec_check] + (
            check_spec(spec, gpus, runtime_dir_choice()[0]) if spec is not None else [])))
    for name, step in steps:
        try:
            got = step()
        except Exception as exc:  # a broken check must not hide the others
            log.debug("check %s failed", name, exc_info=True)
            got = Check(FAIL, name, f"the check itself failed: {type(exc).__name__}: {exc}",
                        "report this with the output of ipcsync doctor --json")
        yield from (got if isinstance(got, list) else [got])


def build_parser(prog: str = "ipcsync doctor") -> argparse.ArgumentParser:
    """The doctor's command line, every option with its help (docs/reference.md lists them)."""
    ap = argparse.ArgumentParser(prog=prog, epilog="exit status: 0 no check failed, 1 a check failed, 2 bad usage",
                                 description="Check that this machine can run ipcsync (and a given pipeline); "
                                             "say how to fix what not.")
    ap.add_argument("--spec", metavar="PIPELINE.toml", help="also check this pipeline spec (ipcsync-run's format)")
    ap.add_argument("--json", action="store_true", help="print one JSON object per check instead of text")
    ap.add_argument("--no-cuda-ipc", action="store_true", help="skip the two-process CUDA IPC test")
    ap.add_argument("--ipc-timeout", type=float, default=DEFAULT_IPC_TIMEOUT, metavar="SECONDS",
                    help=f"time limit of the CUDA IPC test (default {DEFAULT_IPC_TIMEOUT:g})")
    ap.add_argument("--log-level", default="WARNING", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                    help="logging of the doctor itself (ipcsync.* loggers), on stderr (default WARNING); "
                         "its report is program output, on stdout, whatever the level")
    ap.add_argument("--version", action="version", version=f"ipcsync {__version__}")
    return ap


def parse_args(argv: Sequence[str] | None = None, prog: str = "ipcsync doctor") -> argparse.Namespace:
    args = (ap := build_parser(prog)).parse_args(argv)
    if not args.ipc_timeout > 0:
        ap.error("--ipc-timeout must be a positive number of seconds")
    return args


def main(argv: Sequence[str] | None = None, out: IO[str] | None = None) -> int:
    """``ipcsync doctor``: print the checks; 0 when none failed, 1 when one did, 2 for
    bad usage."""
    try:
        args = parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0)
    logging.basicConfig(level=args.log_level, format="ipcsync doctor: %(levelname)s %(message)s")
    stream = out or sys.stdout
    checks = []
    for c in run_checks(args.spec, cuda_ipc=not args.no_cuda_ipc, ipc_timeout=args.ipc_timeout):
        checks.append(c)
        stream.write((json.dumps(c.as_dict()) if args.json else c.text()) + "\n")
        stream.flush()
    if not args.json:
        counts = {s: sum(1 for c in checks if c.status == s) for s in STATUSES}
        stream.write(f"ipcsync doctor: {len(checks)} checks, {counts[FAIL]} failed, {counts[WARN]} warned\n")
    return exit_status(checks)
