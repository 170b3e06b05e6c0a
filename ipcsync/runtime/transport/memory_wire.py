"""The one packet that carries a connection's memory descriptors (memory shared by
descriptor: ``backends.cuda_vmm`` arenas and a ``backends.flags`` segment) from producer
to consumer, on the connection's lane (``runtime.transport.lane``), with ``SCM_RIGHTS``.

Ordering (with ``runtime.transport.lane``'s rule): the producer sends this packet on the lane as soon
as the lane's token and credentials are checked, **before** its SWITCH goes out on ZeroMQ;
the consumer reads it right after it handled that SWITCH, before any other lane frame. So
the memory is open before the first READY, and no READY can come on ZeroMQ: the producer
hands the consumer no item until this packet went out (``runtime.producer.port``).

Untrusted on receipt: the payload is a msgpack array ``[MAGIC, arenas]`` of at most a few
bytes; exactly ``arenas + 1`` descriptors must come (arenas, then the flag segment), never
cut short by the kernel (``MSG_CTRUNC``); on any mismatch every descriptor received is
closed and the caller gets a BackendError. No pickle: msgpack with hard caps.

Imports neither torch nor zmq.
"""

from __future__ import annotations

import array
import os
import select
import socket
import time

import msgpack

from ...errors import BackendError

__all__ = ["send_memory", "recv_memory", "MAGIC", "PLACEHOLDER"]

MAGIC = "ipcsync-memory"
# What SETUP carries as each ready event and ATTACH as each release event on an edge whose
# memory is shared by descriptor (the flags travel as one segment, not per event).
PLACEHOLDER = b"ipcsync-flag"
_MAX_ARENAS = 16
_PAYLOAD_MAX = 256


def send_memory(sock: socket.socket, arena_fds: list[int], flags_fd: int) -> None:
    """Send the descriptors (not closed: the caller's). OSError if the lane is broken or
    full (a new lane is empty, so full means broken here)."""
    payload: bytes = msgpack.packb([MAGIC, len(arena_fds)], use_bin_type=True)
    sent = socket.send_fds(sock, [payload], [*arena_fds, flags_fd])
    if sent != len(payload):
        raise OSError("the memory packet went out cut short")


def _recv_fds(sock: socket.socket, most: int) -> tuple[bytes, list[int], int]:
    """One packet, never blocking, with up to ``most`` descriptors (close-on-exec; more
    are closed by the kernel, which sets MSG_CTRUNC). ``socket.recv_fds`` is not used: it
    drops its flags argument (so it blocks)."""
    ints = array.array("i")
    data, ancdata, flags, _addr = sock.recvmsg(_PAYLOAD_MAX, socket.CMSG_SPACE(most * ints.itemsize),
                                               socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC)
    for level, kind, cdata in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            ints.frombytes(cdata[: len(cdata) - len(cdata) % ints.itemsize])
    return data, list(ints), flags


def recv_memory(sock: socket.socket, arenas: int, timeout: float) -> tuple[list[int], int]:
    """The arenas' descriptors and the flag segment's, read from the lane within
    ``timeout`` seconds. The caller closes them. BackendError for anything else."""
    if not 0 < arenas <= _MAX_ARENAS:
        raise BackendError(f"a producer announced {arenas} arenas")
    deadline = time.monotonic() + timeout
    while True:
        try:
            data, fds, flags = _recv_fds(sock, arenas + 1)
            break
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BackendError(f"the producer's GPU memory did not arrive on the lane within {timeout:g} s") from None
            select.select([sock], [], [], left)
        except OSError as exc:
            raise BackendError(f"cannot read the producer's GPU memory from the lane: {exc}") from None
    try:
        if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
            raise BackendError("the producer's memory packet came cut short")
        try:
            fields = msgpack.unpackb(data, raw=False, max_str_len=32, max_array_len=4, max_bin_len=0,
                                     max_map_len=0, max_ext_len=0)
        except Exception:
            fields = None
        if fields != [MAGIC, arenas] or len(fds) != arenas + 1:
            raise BackendError(f"the producer's memory packet is not what its SETUP announced "
                               f"({len(fds)} descriptors for {arenas} arenas and the flags)")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return list(fds[:arenas]), fds[arenas]
