"""Writing files safely: the one way the library and the launcher write files (telemetry
snapshots, trace files, exit stats, failure reports, the run's owner record, the merged
trace, the ``--stats-file`` lines).

Rules:

- **No name is trusted.** A file is created with ``O_CREAT | O_EXCL | O_NOFOLLOW``: a
  name another user planted (a symbolic link in a shared sticky directory such as /tmp,
  where a root launcher would otherwise overwrite the link's target) makes the open fail;
  it is never followed and no existing file is reused.
- **Whole or not at all.** ``write_atomic`` writes a temporary beside the target, under an
  unpredictable name, then ``os.replace``\\ s it onto the target (a rename replaces a link
  planted at the target itself, never what it points to): a reader sees the old file or the
  new one. A failed write removes its temporary and raises the OSError (ENOSPC included).
- **Appends never follow a link** (``O_NOFOLLOW``) at the file's own name.
- **Every byte goes through ``write_all``**: the one seam a test replaces to simulate a
  full disk.

Imports neither torch nor zmq.
"""

from __future__ import annotations

import errno
import os
import secrets
from typing import Iterable

__all__ = ["write_all", "create_new", "temp_name", "write_atomic", "open_append", "append", "PRIVATE", "SHARED"]

PRIVATE = 0o600  # run-internal files
SHARED = 0o666  # files the user asked for (the umask applies, as with open())
_TRIES = 16  # temporary names tried before giving up
_CHUNK = 1 << 20  # bytes gathered from an iterable before a write

_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_APPEND = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


def write_all(fd: int, data: bytes) -> None:
    """Write every byte of ``data`` to ``fd`` (raises the OSError of a failed write)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def create_new(path: str, mode: int = PRIVATE) -> int:
    """A new, empty file at ``path``, open for writing. FileExistsError when anything
    (a file, a link, planted or not) has that name: nothing is followed or reused."""
    return os.open(path, _NEW, mode)


def temp_name(path: str) -> str:
    """A name for a temporary beside ``path``, unpredictable to other users (hidden,
    ending in ``.tmp``: readers that look for ``.json``/``.jsonl`` files skip it)."""
    directory, base = os.path.split(path)
    return os.path.join(directory, f".{base}.{secrets.token_hex(8)}.tmp")


def write_atomic(path: str, data: bytes | str | Iterable[str], mode: int = PRIVATE) -> None:
    """Replace ``path`` with a file holding ``data`` (bytes, text, or text in pieces such
    as ``json.JSONEncoder().iterencode``'s), whole or not at all: see the module rules.
    Raises OSError (a full disk: ENOSPC; FileExistsError when every temporary name tried
    was taken, i.e. someone plants names there)."""
    for _ in range(_TRIES):
        tmp = temp_name(path)
        try:
            fd = create_new(tmp, mode)
        except FileExistsError:
            continue
        break
    else:
        raise FileExistsError(errno.EEXIST, f"cannot create a temporary file beside {path}: {_TRIES} fresh names "
                              "were all taken (is another process planting files in that directory?)", path)
    try:
        try:
            if isinstance(data, (bytes, str)):
                write_all(fd, data.encode() if isinstance(data, str) else data)
            else:
                _write_pieces(fd, data)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _write_pieces(fd: int, pieces: Iterable[str]) -> None:
    buf: list[str] = []
    size = 0
    for piece in pieces:
        buf.append(piece)
        size += len(piece)
        if size >= _CHUNK:
            write_all(fd, "".join(buf).encode())
            buf, size = [], 0
    if buf:
        write_all(fd, "".join(buf).encode())


def open_append(path: str, mode: int = PRIVATE) -> int:
    """``path`` opened for appending (created if missing), never through a symbolic link
    at its own name (OSError ELOOP)."""
    return os.open(path, _APPEND, mode)


def append(path: str, data: bytes, mode: int = PRIVATE) -> None:
    """Append ``data`` to ``path`` (``open_append``, ``write_all``, close)."""
    fd = open_append(path, mode)
    try:
        write_all(fd, data)
    finally:
        os.close(fd)
