"""The process groups of remote edges: an edge's transport and time limit
(``transport_for``, ``op_timeout``), building its two-rank group on the edge's store
(``make_group``: gloo, or NCCL with its communicator made at once), ordering an NCCL
transfer on the edge's stream (``nccl_transfer``), and ending a group
(``shut_down_or_abort``: NCCL's shutdown or abort in a thread of its own, which
``runtime.remote.completer.settle_at_exit`` waits for at exit). Read
``runtime.remote.io`` first."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import threading
from typing import Any, Callable, Iterator

import torch

from ...backends import NATIVE_TRANSPORT, Event
from ...envopts import HOST_ID, REMOTE_TIMEOUT, REMOTE_TRANSPORT
from ..transport.address import Endpoint
from ...system.host import host_identity
from .completer import aborting, lingering_lock

__all__ = ["OP_TIMEOUT_ENV", "DEFAULT_OP_TIMEOUT", "TRANSPORT_ENV", "op_timeout", "transport_for", "tcp_host",
           "local_address_towards", "nccl_transfer", "make_group", "shut_down_or_abort", "NCCL_HOST_ID_ENV",
           "NCCL_ABORT_WAIT_S", "NCCL_SHUTDOWN_WAIT_S"]

log = logging.getLogger(__name__)

NCCL_ABORT_WAIT_S = 0.1  # (see _abort)
NCCL_SHUTDOWN_WAIT_S = 5.0  # a clean close waits this long for NCCL's shutdown (see shut_down_or_abort)

OP_TIMEOUT_ENV = REMOTE_TIMEOUT.name
DEFAULT_OP_TIMEOUT = REMOTE_TIMEOUT.default  # seconds: one rendezvous, or one item's transfer, at most


def op_timeout() -> float:
    """How long one rendezvous or one transfer may take before the edge is declared lost
    (``$IPCSYNC_REMOTE_TIMEOUT``, seconds; default 120)."""
    return REMOTE_TIMEOUT.get()


TRANSPORT_ENV = REMOTE_TRANSPORT.name


def transport_for(device: torch.device, consumer_backend: str) -> str:
    """The transport of an edge from a producer on ``device`` to a consumer on a
    ``consumer_backend`` device: the one both ends' memory travels by as it is
    (``backends.NATIVE_TRANSPORT``: NCCL when both are on CUDA), else gloo, whose CUDA
    end (if any) stages each item through pinned host memory. ``$IPCSYNC_REMOTE_TRANSPORT``
    (the producer's): ``auto`` (default) or ``gloo`` (gloo for CUDA pairs too, e.g. where
    NCCL's network transport cannot reach the peer)."""
    forced = REMOTE_TRANSPORT.get()
    # (A device's type is the name of the backend serving it: backends.backend_for.)
    native = NATIVE_TRANSPORT.get(device.type, "gloo")
    if forced == "auto" and NATIVE_TRANSPORT.get(consumer_backend) == native:
        return native
    return "gloo"


def tcp_host(endpoint: Endpoint) -> tuple[str, int]:
    rest = endpoint.url[len("tcp://"):]
    host, _, port = rest.rpartition(":")
    return host.strip("[]"), int(port) if port.isdigit() else 0


def local_address_towards(host: str, port: int) -> str:
    """The address of this host's interface that routes to ``host`` (no packet is sent)."""
    try:
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(fam, socket.SOCK_DGRAM) as s:
            s.connect((host, port or 9))
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostname()


NCCL_HOST_ID_ENV = "NCCL_HOSTID"
_NCCL_ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
_ENV_LOCK = threading.Lock()

def nccl_transfer(ev: Any, stream: Any, after: Event, post: Callable[[], Any]) -> None:
    """Post an NCCL send or recv (``post``) on the edge's ``stream`` after ``after`` (the
    slot's ready event for a send, its release event for a recv), and record ``ev``'s CUDA
    event after the transfer.

    ProcessGroupNCCL runs a transfer on a CUDA stream of its own, which first waits for the
    stream current at the call; nothing orders the current stream after it. ``work.wait()``
    under ``stream`` does (on the GPU: the host does not wait), so the event completes only
    with the transfer. Without it the event completed at once: an item was served before
    its bytes arrived, and a slot written again while its send still read it
    (test_remote_conformance.py, test_gpu_work_still_running_when_an_item_is_sent)."""
    with torch.cuda.stream(stream):
        after.wait(stream)
        ev.work = post()
        ev.work.wait()
        cuda_event = ev.cuda_event or torch.cuda.Event()
        cuda_event.record(stream)
        ev.cuda_event = cuda_event


@contextlib.contextmanager
def _env_during(name: str, value: str) -> Iterator[None]:
    """``$name`` is ``value`` for the block (and as before after it); one block at a time."""
    with _ENV_LOCK:
        saved = os.environ.get(name)
        os.environ[name] = value
        try:
            yield
        finally:
            if saved is None:
                del os.environ[name]
            else:
                os.environ[name] = saved


def _nccl_counts_hosts_as_ipcsync_does() -> None:
    """Before this process's first NCCL communicator: NCCL tells hosts apart by a hash of
    the hostname and boot id, or of ``$NCCL_HOSTID`` when that is set; ipcsync adds
    ``$IPCSYNC_HOST_ID`` to the boot id (``host.host_identity``). Two processes of one
    machine that ipcsync counts as different hosts must be different hosts to NCCL too:
    else NCCL joins them by its intra-host paths (peer-to-peer, shared memory), and
    refuses two of them on one GPU ("Duplicate GPU detected"). So where
    ``$IPCSYNC_HOST_ID`` is set, ``$NCCL_HOSTID`` is set to ipcsync's identity, unless the
    user set it. Then NCCL goes over its network transport, as between hosts."""
    if HOST_ID.get() and NCCL_HOST_ID_ENV not in os.environ:
        os.environ[NCCL_HOST_ID_ENV] = host_identity()


def make_group(transport: str, store: Any, rank: int, device: torch.device, data_host: str,
                timeout: float) -> Any:
    """A two-rank process group of ``transport`` on ``store`` (the edge's SealedStore);
    blocks until both ranks joined (or raises after ``timeout``)."""
    import torch.distributed as dist  # noqa: PLC0415 (only for remote edges)

    td = datetime.timedelta(seconds=timeout)
    if transport == "gloo":
        # torch's stubs omit the Gloo group's (private, bound) _Options; it exists at run time.
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=data_host)]
        opts._timeout = td
        return dist.ProcessGroupGloo(store, rank, 2, opts)
    # NCCL: the same point-to-point code. Its communicator is made at the first operation,
    # which blocks until the peer's first one: done here, by one byte each way (the
    # producer's group is built in a thread, the consumer's before its ATTACH), so that
    # no item's send or recv, posted under the endpoint's lock, waits for it.
    _nccl_counts_hosts_as_ipcsync_does()
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = td
    torch.cuda.set_device(device)
    # A peer's death must never end this process: torch's default (3) has the group's
    # watchdog abort the process about a minute after a transfer failed, even once the
    # group was aborted; 2 aborts the group's communicator and nothing else. Read by the
    # group's constructor only, so set for that call alone.
    with _env_during(_NCCL_ERROR_HANDLING_ENV, "2"):
        pg = dist.ProcessGroupNCCL(store, rank, 2, opts)
    probe = torch.zeros(1, dtype=torch.uint8, device=device)
    # torch's stubs declare send/recv on ProcessGroup only; ProcessGroupNCCL has both at run time.
    (pg.send([probe], 1, 0) if rank == 0 else pg.recv([probe], 0, 0)).wait()  # type: ignore[attr-defined]
    torch.cuda.synchronize(device)
    return pg


# A tag no item uses (items are sent with their slot's index as tag): a recv of it never
# completes, so a wait on it with a short timeout always times out (see _abort).
_POISON_TAG = 1 << 30


def _abort(pg: Any, keep: Any = None) -> None:
    """End a process group whose peer is gone or stuck: pending work is abandoned, never
    waited for, and every wait still pending on it returns now (so the edge's completion
    thread ends here, not later: one ending while the interpreter finalizes aborts the
    process, see ``Completer.join``).

    NCCL's ``abort`` ends its pending work, but may itself block for as long as the peer
    is paused (a transfer in flight to a SIGSTOPped process: on one H100 over NCCL's
    socket transport it had not returned after 60 s, and the consumer calling it, its
    endpoint's lock held, never raised PeerLostError). So it runs in a thread of its
    own, waited for ``NCCL_ABORT_WAIT_S``, which holds ``keep`` (the edge's device
    memory, which a transfer may still read or write) until the abort returned.

    Gloo's ``abort``/``shutdown`` (torch 2.13) do not wake a wait already pending; a
    wait that times out does: gloo then closes every pair of the group ("Application
    timeout caused pair closure"), and each pending send or recv fails at once. So for
    gloo a recv of an unused tag is waited for 1 ms first (tests/integration/
    test_remote.py, the stalled-producer test). Except the one transfer a pair was
    moving when it closed: its wait ends only at the group's timeout (``Completer``)."""
    import torch.distributed as dist  # noqa: PLC0415

    if not isinstance(pg, dist.ProcessGroupGloo):
        _end_nccl_in_thread(pg, keep, clean=False)
        return
    try:
        peer = 1 - int(pg.rank())
        # (torch's stubs declare recv on ProcessGroup only; ProcessGroupGloo has it at run time.)
        pg.recv([torch.empty(1, dtype=torch.uint8)], peer, _POISON_TAG).wait(  # type: ignore[attr-defined]
            datetime.timedelta(milliseconds=1))
    except Exception as exc:  # noqa: BLE001 (the timeout that closes the pairs: expected)
        log.debug("ipcsync remote edge: gloo pairs closed (%s)", exc)
    _end_group(pg)


def shut_down_or_abort(pg: Any, clean: bool, keep: Any) -> None:
    """End an edge's group: shut down when ``clean`` (nothing pending: ``shutdown()``
    waits for pending work), else, or if the shutdown raises, ``_abort``. NCCL's
    shutdown, like its abort, runs in a thread of its own (``_end_nccl_in_thread``): a
    peer that dies or is paused at that moment must not hold the closing endpoint."""
    if clean:
        import torch.distributed as dist  # noqa: PLC0415

        if not isinstance(pg, dist.ProcessGroupGloo):
            _end_nccl_in_thread(pg, keep, clean=True)
            return
        fn = getattr(pg, "shutdown", None)
        if fn is None:
            return
        try:
            fn()
            return
        except Exception:  # noqa: BLE001 (then aborted)
            pass
    _abort(pg, keep)


def _end_nccl_in_thread(pg: Any, keep: Any, clean: bool) -> None:
    """Shut down (``clean``) or abort an NCCL group in an ``ipcsync-nccl-end`` thread,
    waited for ``NCCL_SHUTDOWN_WAIT_S`` or ``NCCL_ABORT_WAIT_S``; ``keep`` (the edge's
    device memory) lives until the call returned, however long that takes."""
    t = threading.Thread(target=_end_nccl, args=(pg, keep, clean), daemon=True, name="ipcsync-nccl-end")
    with lingering_lock:
        aborting.add(t)
    t.start()
    wait = NCCL_SHUTDOWN_WAIT_S if clean else NCCL_ABORT_WAIT_S
    t.join(wait)
    if t.is_alive():
        log.info("ipcsync remote edge: NCCL's %s has not returned within %.1f s (its peer paused?); "
                 "it goes on in a thread of its own", "shutdown" if clean else "abort", wait)


def _end_nccl(pg: Any, keep: Any, clean: bool) -> None:
    """(Its own thread.) Shut down an NCCL group, or abort it when not ``clean`` or the
    shutdown raised; ``keep`` lives until then."""
    try:
        if clean:
            try:
                pg.shutdown()
                return
            except Exception as exc:  # noqa: BLE001 (then aborted)
                log.debug("ipcsync remote edge: NCCL shutdown() raised %s; aborting", exc)
        _end_group(pg)
    finally:
        del keep
        with lingering_lock:
            aborting.discard(threading.current_thread())


def _end_group(pg: Any) -> None:
    """The group's ``abort`` (or what this torch has of it)."""
    for name in ("abort", "_abort", "shutdown"):
        fn = getattr(pg, name, None)
        if fn is not None:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 (the peer is gone; nothing else to do)
                log.debug("ipcsync remote edge: %s() raised %s", name, exc)
            return
