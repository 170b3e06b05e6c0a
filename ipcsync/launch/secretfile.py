"""The run's rendezvous secret: where a launcher gets it (``load_secret``), and the rules
for the file that holds it (``--rdzv-secret-file``).

Sources, first found: ``$IPCSYNC_RDZV_SECRET``; else ``--rdzv-secret-file PATH`` (node 0
writes a fresh secret there unless the file exists, then reuses it; another node waits up
to ``--rdzv-timeout`` for it to appear); else node 0 writes a fresh one into its runtime
directory (removed at the end) and says where. Stages never inherit the variable
(``plan.WITHHELD_ENV``).

File rules (a name another user could have made first, or can swap, must not give them
the run):

- **Read**: a regular file only, opened ``O_NONBLOCK | O_NOFOLLOW`` and checked on that
  descriptor (``system.files.read_regular``): a link, a FIFO, a directory or a device at
  the path is refused at once, never followed or waited on. The file must be owned by
  this launcher's user (or root), have one name (no hard link to it elsewhere) and give
  no access to group or others; at most 4 KiB.
- **Written** (node 0, a new secret): ``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 600, in one
  ``write``; never over an existing name. Its directory must be owned by this user or
  root and writable by no one else, unless sticky (``/tmp``: there nobody else can remove
  or rename the file, and a name another user made first is refused by the read rules).
- Every refusal is a ConfigError naming the path, what is wrong and the fix.

A node waiting for the file treats an empty one as not written yet (node 0 creates the
file, then writes the secret). Imports neither torch nor zmq.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import time
from typing import Callable

from ..core import seal
from ..envopts import RDZV_SECRET
from ..errors import ConfigError
from ..system import files
from .plan import SECRET_ENV

__all__ = ["load_secret", "read_secret", "write_secret", "SECRET_ENV", "MAX_SECRET_FILE"]

MAX_SECRET_FILE = 4096
_POLL_S = 0.1
_PRIVATE_DIR_HINT = "e.g. secret=$(mktemp -d)/run.secret"


def _check_file(path: str, what: str, st: os.stat_result) -> None:
    """The read rules on the open file's ``st`` (ConfigError if one fails)."""
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        raise ConfigError(f"{what} {path} is owned by another user (uid {st.st_uid}), not by this one (uid {me}): "
                          "whoever made it would hold the run's secret; remove it and use a file you made (node 0's "
                          "ipcsync-run writes a fresh one, mode 600), in a directory only you can write")
    if st.st_mode & 0o077:
        how = "read" if st.st_mode & 0o044 else "written"
        raise ConfigError(f"{what} {path} can be {how} by other users (mode {st.st_mode & 0o777:o}); "
                          f"chmod 600 {path}")
    if st.st_nlink != 1:
        raise ConfigError(f"{what} {path} has {st.st_nlink} names (hard links): another name can be another "
                          "user's way to it; copy it to a file of its own (mode 600)")


def read_secret(path: str, what: str = "--rdzv-secret-file") -> str:
    """The secret in file ``path``, checked by the read rules (module docstring);
    ConfigError otherwise. Never blocks."""
    try:
        raw = files.read_regular(path, MAX_SECRET_FILE, lambda st: _check_file(path, what, st))
    except OSError as exc:
        if exc.errno == errno.EFBIG:
            raise ConfigError(f"{what} {path} is larger than {MAX_SECRET_FILE} bytes: not a secret file; give the "
                              "file node 0's ipcsync-run wrote") from None
        raise ConfigError(f"{what} {path}: cannot read it ({exc.strerror or exc}); give a regular file of "
                          "your own, mode 600 (node 0's ipcsync-run writes one)") from None
    return raw.decode(errors="replace").strip()


def _check_dir(path: str, what: str) -> None:
    """The directory rule for a new secret file at ``path`` (ConfigError if it fails)."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        st = os.stat(directory)
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot use its directory {directory} ({exc.strerror or exc})") from None
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        raise ConfigError(f"{what} {path}: its directory {directory} is owned by another user (uid {st.st_uid}), "
                          "who could replace the file; create it in a directory only you can write, "
                          + _PRIVATE_DIR_HINT)
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise ConfigError(f"{what} {path}: its directory {directory} can be written by other users (mode "
                          f"{st.st_mode & 0o777:o}, not sticky), who could replace the file; create it in a "
                          "directory only you can write, " + _PRIVATE_DIR_HINT)


def write_secret(path: str, what: str = "--rdzv-secret-file") -> str:
    """A fresh secret, written to a new file ``path`` by the write rules (module
    docstring); ConfigError if it cannot be."""
    _check_dir(path, what)
    text = secrets.token_hex(32)
    try:
        fd = files.create_new(path, files.PRIVATE)
    except FileExistsError:
        raise ConfigError(f"{what} {path}: another process created that name while this one was making it; "
                          "start again (node 0 reuses a file of its own that exists)") from None
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot create it ({exc.strerror or exc})") from None
    try:
        files.write_all(fd, (text + "\n").encode())
    except OSError as exc:
        os.close(fd)
        os.unlink(path)
        raise ConfigError(f"{what} {path}: cannot write it ({exc.strerror or exc})") from None
    os.close(fd)
    return text


def _wait_for(path: str, wait: float, say: Callable[[str], None]) -> None:
    """Wait up to ``wait`` seconds for a file at ``path`` (anything there but an empty
    regular file ends the wait: the read that follows judges it)."""
    deadline = time.monotonic() + wait
    said = False
    while time.monotonic() < deadline:
        try:
            st = os.lstat(path)
            if not (stat.S_ISREG(st.st_mode) and st.st_size == 0):
                return
        except FileNotFoundError:
            pass
        except OSError:
            return
        if not said:
            say(f"waiting for the rendezvous secret file {path} (node 0's ipcsync-run writes it; copy it here)")
            said = True
        time.sleep(_POLL_S)
    if not os.path.lexists(path):
        raise ConfigError(f"--rdzv-secret-file {path}: cannot read it (it did not appear within {wait:g} s, "
                          "--rdzv-timeout); copy node 0's file there (or start node 0 first on this machine)")


def load_secret(rank: int, secret_file: str | None, insecure: bool, wait: float,
                say: Callable[[str], None], default_dir: str) -> tuple[bytes | None, str | None]:
    """The run's rendezvous secret (module docstring), and the file written into
    ``default_dir`` (to remove at the end), if any. None only under ``insecure`` without
    one. ConfigError otherwise."""
    written = None
    text = RDZV_SECRET.get()
    where = f"${SECRET_ENV}"
    if not text and secret_file:
        where = f"--rdzv-secret-file {secret_file}"
        if rank == 0 and not os.path.lexists(secret_file):
            text = write_secret(secret_file)
            say(f"wrote this run's rendezvous secret to {secret_file} (mode 600): give it to every other node "
                f"(copy the file there and pass --rdzv-secret-file, or set ${SECRET_ENV} to its contents)")
        else:
            if rank > 0:
                _wait_for(secret_file, wait, say)
            text = read_secret(secret_file)
    elif not text and rank == 0 and not insecure:
        path = written = os.path.join(default_dir, f"rdzv-secret-{os.getpid()}")
        text = write_secret(path, "the rendezvous secret file")
        say(f"wrote this run's rendezvous secret to {path} (mode 600): start every other node with "
            f"${SECRET_ENV} set to its contents, or with the file copied and --rdzv-secret-file")
    if not text:
        if insecure:
            return None, None
        raise ConfigError(
            f"node {rank}: no rendezvous secret: the launchers of a run prove to each other that they belong "
            f"to it with a secret node 0's ipcsync-run makes; set ${SECRET_ENV} to it or pass "
            "--rdzv-secret-file PATH (a copy of node 0's file); --insecure runs without one, on a network "
            "you trust"
        )
    if len(text) < seal.MIN_SECRET_CHARS:
        raise ConfigError(f"{where}: the rendezvous secret has {len(text)} characters, fewer than "
                          f"{seal.MIN_SECRET_CHARS}; use the one node 0's ipcsync-run writes (64 hex digits)")
    return text.encode(), written
