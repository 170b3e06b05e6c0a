"""Who may attach to a producer: the checks on a consumer's HELLO and on the kernel's word
about the connection, and how to watch the admitted consumer's process.

- ``hello_problem``: the same host and boot (else only a ``tcp://`` endpoint's remote edge,
  protocol ``SENT_VERSION`` or later, a device of ``BACKEND_NAMES``), the same backend, the
  backend's ``pid_namespace_rule``, credits of at least 1.
- ``credentials_problem``: on ipc endpoints the kernel's ``SO_PEERCRED``: our own user, and
  the process the HELLO names.
- ``watch_for``: the liveness rule watches the kernel's pid for the connection, never only
  the pid a HELLO claims.
"""

from __future__ import annotations

import os

from ...backends import BACKEND_NAMES, Backend
from ...core import protocol as P
from ...core.protocol import ErrorCode
from ...system import host

__all__ = ["is_remote", "hello_problem", "credentials_problem", "watch_for"]


def is_remote(hello: P.Hello) -> bool:
    """The consumer runs on another host (``host.host_identity``; see core.remote_session)."""
    return hello.boot_id != host.host_identity()


def hello_problem(hello: P.Hello, backend: Backend, device: object, remote_ok: bool = False) -> tuple[str, str] | None:
    """(error code, text) if a producer on ``backend``/``device`` must refuse ``hello``.
    ``remote_ok``: a consumer on another host is welcome (tcp endpoints: a remote edge).
    What depends on the backend is the backend's to say (``Backend.pid_namespace_rule``)."""
    remote = is_remote(hello)
    if remote and not remote_ok:
        return ErrorCode.HOST.value, (
            "consumer runs on another host or boot; shared memory and CUDA IPC need "
            "both processes on one machine (a tcp:// endpoint serves consumers on other hosts)"
        )
    if remote and hello.version < P.SENT_VERSION:
        return ErrorCode.VERSION.value, (
            f"a remote edge needs protocol version {P.SENT_VERSION} or later at both ends (its items are "
            f"served only once their sends are confirmed), the consumer speaks {hello.version}: run the "
            "same ipcsync version on every host"
        )
    if remote and hello.backend not in BACKEND_NAMES:
        return ErrorCode.BACKEND.value, (f"a remote consumer's device must be one of {', '.join(BACKEND_NAMES)}, "
                                         f"not {hello.backend[:16]!r}")
    if hello.backend != backend.name and not remote:
        # (A remote edge joins any two kinds of device: the transfer copies, see
        # runtime.remote.io.transport_for.)
        return ErrorCode.BACKEND.value, (
            f"producer uses the {backend.name} backend (device {device}) but "
            f"the consumer asked for {hello.backend}; use the same kind of device on both sides"
        )
    rule = backend.pid_namespace_rule
    if rule is not None and not remote and hello.pid_ns != host.pid_namespace():
        # (A consumer on another GPU of this host is welcome: it checks on SETUP that it
        # can see ours and has peer access to it; GPUs are matched by UUID, not index.)
        return ErrorCode.HOST.value, rule
    if hello.credits < 1:
        return ErrorCode.CREDITS.value, "consumer credits must be at least 1"
    return None


def credentials_problem(hello: P.Hello, cred: tuple[int, int, int] | None) -> tuple[str, str] | None:
    """On ipc endpoints the kernel says who connected (SO_PEERCRED): only our own
    user, and only the process the HELLO names: in our PID namespace its pid must be
    the kernel's; a HELLO claiming another namespace must name the one the kernel
    shows that process in. Only the kernel's word is trusted: liveness watches the
    kernel's pid, whatever the HELLO says (see watch_for). (The socket file is 0600
    in a 0700 directory already; this also holds for ipc:// paths the user chose.)
    ``cred``: the connection's (pid, uid, gid), None where the OS cannot say (tcp)."""
    if cred is None:
        return None
    pid, uid, _gid = cred
    if uid != os.getuid():
        return ErrorCode.UID.value, f"connection from uid {uid}; this producer accepts only its own user ({os.getuid()})"
    ours = host.pid_namespace()
    if hello.pid_ns == ours:
        if pid != hello.pid:
            return ErrorCode.IDENTITY.value, f"HELLO claims pid {hello.pid} but the connection belongs to pid {pid}"
    elif pid > 0:
        try:
            theirs = os.readlink(f"/proc/{pid}/ns/pid")
        except OSError:
            theirs = None  # cannot tell; the watch still uses the kernel's pid
        if theirs is not None and theirs != hello.pid_ns:
            return ErrorCode.IDENTITY.value, (f"HELLO claims PID namespace {hello.pid_ns!r} but the connecting "
                                              f"process (pid {pid} here) runs in {theirs!r}")
    return None


def watch_for(hello: P.Hello, cred: tuple[int, int, int] | None) -> host.ProcessWatch | None:
    """How to tell when this consumer's process has exited: the kernel's pid for the
    connection where there is one (ipc), else the HELLO's (pid, start time) if that
    process exists in our PID namespace; None if we cannot see it."""
    if cred is not None and cred[0] > 0:
        return host.ProcessWatch(cred[0])
    if hello.pid_ns == host.pid_namespace() and host.read_start_time(hello.pid) == hello.start_time:
        return host.ProcessWatch(hello.pid, hello.start_time)
    return None
