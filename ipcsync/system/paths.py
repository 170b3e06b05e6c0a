"""Where bare endpoint names live: the private runtime directory of this user.

Torch-free and zmq-free: the launcher finds its run directories here without loading
the library's endpoints.
"""

from __future__ import annotations

import os
import stat
import warnings

from ..envopts import RUNTIME_DIR
from ..errors import ConfigError

__all__ = ["runtime_dir", "runtime_dir_choice", "FALLBACK_SUFFIX"]

FALLBACK_SUFFIX = "-alt"
_warned_fallback: set[str] = set()


def runtime_dir_choice() -> tuple[str, str]:
    """The runtime directory the environment names, and which setting named it
    (``"IPCSYNC_RUNTIME_DIR"``, ``"XDG_RUNTIME_DIR"`` or ``"the default"``), without
    creating or checking anything (``runtime_dir`` does that; ``ipcsync doctor`` reports)."""
    explicit = RUNTIME_DIR.get()
    if explicit:
        return explicit, RUNTIME_DIR.name
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return os.path.join(xdg, "ipcsync"), "XDG_RUNTIME_DIR"
    return f"/tmp/ipcsync-{os.getuid()}", "the default"


def runtime_dir() -> str:
    """The private directory for bare endpoint names; created 0700 if missing.

    ``$IPCSYNC_RUNTIME_DIR`` if set (missing parents are created), else
    ``$XDG_RUNTIME_DIR/ipcsync``, else ``/tmp/ipcsync-<uid>``. The directory itself must be
    a real directory (never a symlink: it is opened with O_NOFOLLOW | O_DIRECTORY and
    checked on that descriptor), owned by this user, with no access for others.

    - ``$IPCSYNC_RUNTIME_DIR`` that fails this is a ConfigError that says why.
    - A default path that is ours but open to others is made 0700 (only we could have
      made it so).
    - A default path taken by someone else (another owner, a symlink, not a directory)
      makes every process of this user use ``<default>-alt`` instead, checked the same
      way, with a warning once per process. It is deterministic, so producers and
      consumers still meet there; if it is taken too, that is a ConfigError telling the
      user to set IPCSYNC_RUNTIME_DIR. Nothing is ever used that another user controls.
    """
    chosen, source = runtime_dir_choice()
    if source == RUNTIME_DIR.name:
        explicit = chosen
        try:
            parent = os.path.dirname(explicit.rstrip("/"))
            if parent:
                os.makedirs(parent, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create the runtime directory {explicit}: {exc}") from None
        problem = _private_dir(explicit, fix_mode=False)
        if problem is not None:
            raise ConfigError(f"runtime directory {explicit} (IPCSYNC_RUNTIME_DIR) {problem}")
        return explicit
    base = chosen
    problem = _private_dir(base, fix_mode=True)
    if problem is None:
        return base
    alt = base + FALLBACK_SUFFIX
    alt_problem = _private_dir(alt, fix_mode=True)
    if alt_problem is not None:
        raise ConfigError(
            f"the runtime directory {base} {problem}, and the fallback {alt} {alt_problem}; "
            "set IPCSYNC_RUNTIME_DIR to a directory of your own (mode 0700), the same for "
            "producers and consumers"
        )
    if base not in _warned_fallback:
        _warned_fallback.add(base)
        warnings.warn(
            f"ipcsync: the runtime directory {base} {problem}; using {alt} instead. Set "
            "IPCSYNC_RUNTIME_DIR to choose the directory (the same for producers and consumers)",
            RuntimeWarning, stacklevel=3,
        )
    return alt


def _private_dir(path: str, fix_mode: bool) -> str | None:
    """Create ``path`` (0700) if missing and check it without following a symlink: None if
    it is a directory of this user that others cannot access, else what is wrong (a
    phrase that follows the path in a message)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        return f"cannot be created: {exc}"
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"cannot be examined: {exc}"
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link; refusing to follow it"
    if not stat.S_ISDIR(st.st_mode):
        return "exists and is not a directory"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        return f"cannot be opened: {exc}"
    try:
        st = os.fstat(fd)  # the directory we opened, whatever happened to the path since
        if st.st_uid != os.getuid():
            return f"belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})"
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            if not fix_mode:
                return f"is accessible to other users (mode {mode:o}); run chmod 700 {path}"
            os.fchmod(fd, 0o700)
    except OSError as exc:
        return f"cannot be made private: {exc}"
    finally:
        os.close(fd)
    return None
