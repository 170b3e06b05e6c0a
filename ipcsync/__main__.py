"""``python -m ipcsync`` and the ``ipcsync`` command: subcommands of the library's tools.

    ipcsync doctor [--spec pipeline.toml] [--json]    # check this machine (ipcsync.doctor)

The launcher stays its own command, ``ipcsync-run`` (``python -m ipcsync.launch``).
"""

from __future__ import annotations

import sys
from typing import Sequence

from . import __version__

__all__ = ["main"]

_USAGE = """\
usage: ipcsync <command> [options]

commands:
  doctor    check that this machine can run ipcsync (and a pipeline: --spec FILE)

ipcsync <command> --help describes a command; pipelines run with ipcsync-run.
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to a subcommand; 2 (and the usage on stderr) for an unknown one."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        sys.stdout.write(_USAGE)
        return 0
    if args and args[0] == "--version":
        sys.stdout.write(f"ipcsync {__version__}\n")
        return 0
    if args and args[0] == "doctor":
        from .doctor import main as doctor

        return doctor(args[1:])
    sys.stderr.write(_USAGE)
    if args:
        sys.stderr.write(f"ipcsync: error: unknown command {args[0]!r}\n")
    return 2


if __name__ == "__main__":
    sys.exit(main())
