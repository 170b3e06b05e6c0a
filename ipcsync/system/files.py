"""Reading and writing files safely: the one way the library and the launcher write files
(telemetry snapshots, trace files, exit stats, failure reports, the run's owner record,
the merged trace, the ``--stats-file`` lines) and the one way the launcher reads what
stages leave (``read_json``, ``read_regular``, ``open_regular``) and its secret file.

Rules:

- **No name is trusted.** A file is created with ``O_CREAT | O_EXCL | O_NOFOLLOW``: a
  name another user planted (a symbolic link in a shared sticky directory such as /tmp,
  where a root launcher would otherwise overwrite the link's target) makes the open fail;
  it is never followed and no existing file is reused.
- **Whole or not at all.** ``write_atomic`` writes a temporary beside the target, under an
  unpredictable name, then ``os.replace``\\ s it onto the target (a rename replaces a link
  planted at the target itself, never what it points to): a reader sees the old file or the
  new one. A failed write removes its temporary and raises the OSError (ENOSPC included).
- **Appends never follow a link** (``O_NOFOLLOW``) at the file's own name, never block
  (``O_NONBLOCK``: a FIFO planted at the name is refused, not waited on) and go to
  regular files only.
- **Reads are of regular files only, and never block.** A file is opened with
  ``O_NONBLOCK | O_NOFOLLOW`` and ``fstat``-checked: a FIFO, a device, a directory or a
  link at the name is an ``OSError`` naming what it is, at once. Reads are size-capped
  (``EFBIG`` past the cap) and a JSON document that cannot be decoded, nested too deeply
  included, is a ``ValueError``: the reader skips the file and says why (``why``).
- **Every byte goes through ``write_all``**: the one seam a test replaces to simulate a
  full disk.

Imports neither torch nor zmq.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import stat
from typing import Any, Callable, Iterable, Iterator

__all__ = ["write_all", "create_new", "temp_name", "write_atomic", "open_append", "append", "PRIVATE", "SHARED",
           "open_regular", "read_regular", "read_json", "read_lines", "why", "kind"]

PRIVATE = 0o600  # run-internal files
SHARED = 0o666  # files the user asked for (the umask applies, as with open())
_TRIES = 16  # temporary names tried before giving up
_CHUNK = 1 << 20  # bytes gathered from an iterable before a write

_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_APPEND = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


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
    """``path`` opened for appending (created if missing), a regular file only: OSError
    for a symbolic link at its own name (never followed), a FIFO (never waited on), a
    directory or a device, with ``strerror`` saying which."""
    try:
        fd = os.open(path, _APPEND, mode)
    except OSError as exc:
        raise _explained(exc, path) from None
    return _regular(fd, path)[0]


def append(path: str, data: bytes, mode: int = PRIVATE) -> None:
    """Append ``data`` to ``path`` (``open_append``, ``write_all``, close)."""
    fd = open_append(path, mode)
    try:
        write_all(fd, data)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- reading
def kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words ("a FIFO", "a directory", ...)."""
    for test, what in ((stat.S_ISREG, "a regular file"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISLNK, "a symbolic link"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return what
    return "not a regular file"


def _explained(exc: OSError, path: str) -> OSError:
    """``exc`` of an open with O_NOFOLLOW | O_NONBLOCK, saying what is at ``path`` when
    that made it fail (a link: ELOOP; a FIFO without a reader or a socket: ENXIO)."""
    if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
        try:
            what = kind(os.lstat(path).st_mode)
        except OSError:
            return exc
        return OSError(exc.errno, f"not a regular file ({what})", path)
    return exc


def _regular(fd: int, path: str) -> tuple[int, os.stat_result]:
    """``fd`` and its stat if it is a regular file, its O_NONBLOCK cleared; else closed
    and OSError."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"not a regular file ({kind(st.st_mode)})", path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def open_regular(path: str) -> tuple[int, os.stat_result]:
    """``path`` opened for reading, and its ``fstat``, if it is a regular file. Never
    blocks and never follows a link at its own name: anything else (a FIFO, a link, a
    directory, a device) is an OSError whose ``strerror`` says what it is. The caller
    closes the descriptor."""
    try:
        fd = os.open(path, _READ)
    except OSError as exc:
        raise _explained(exc, path) from None
    return _regular(fd, path)


def _read_fd(fd: int, limit: int, path: str) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while size <= limit:
        chunk = os.read(fd, min(_CHUNK, limit + 1 - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    if size > limit:
        raise OSError(errno.EFBIG, f"larger than {limit} bytes", path)
    return b"".join(chunks)


def read_regular(path: str, limit: int, check: Callable[[os.stat_result], None] | None = None) -> bytes:
    """The contents of regular file ``path`` (``open_regular``), at most ``limit`` bytes:
    OSError (EFBIG) if it is larger. ``check`` (if given) is called with the open file's
    ``fstat`` before anything is read (what it raises propagates): the file checked is
    the file read."""
    fd, st = open_regular(path)
    try:
        if check is not None:
            check(st)
        return _read_fd(fd, limit, path)
    finally:
        os.close(fd)


def read_json(path: str, limit: int) -> Any:
    """The JSON document in regular file ``path`` (``read_regular``). OSError if it cannot
    be read; ValueError if it is not JSON (nested too deeply included: json raises
    RecursionError for that)."""
    raw = read_regular(path, limit)
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def read_lines(path: str, limit: int, line_limit: int = 1 << 16) -> Iterator[bytes]:
    """The lines of regular file ``path`` (``open_regular``; OSError before the first
    line if it cannot be opened), up to ``limit`` bytes in all; a line longer than
    ``line_limit`` comes in pieces."""
    fd, _ = open_regular(path)
    f = os.fdopen(fd, "rb")
    return _lines(f, limit, line_limit)


def _lines(f: Any, limit: int, line_limit: int) -> Iterator[bytes]:
    with f:
        left = limit
        while left > 0:
            line = f.readline(min(line_limit, left))
            if not line:
                return
            left -= len(line)
            yield line


def why(exc: BaseException) -> str:
    """A file read's failure, in a few words, for the line that says it was skipped."""
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]
