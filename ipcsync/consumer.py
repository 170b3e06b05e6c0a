"""The public Consumer: a facade. Every call is its runtime endpoint's
(``runtime.consumer.endpoint.ConsumerEndpoint``), which owns the consumer's state and
states the ordering rules of a receive.
"""

from __future__ import annotations

from functools import partial
from types import TracebackType
from typing import Any, Coroutine, Iterator

import torch

from . import limits
from .core import protocol as P
from .core.consumer_session import ConsumerSession
from .core.stats_types import ConsumerStats
from .item import Item
from .runtime import aio
from .runtime.transport.channel import CurveKeys, Endpoint
from .runtime.consumer.endpoint import ConsumerEndpoint
from .runtime.consumer.endpoint import aclose as aclose_endpoint
from .runtime.endpoint import UNSET, Unset
from .runtime.waiting import SourcePort

__all__ = ["Consumer", "Item"]


class Consumer:
    """Connects to a producer's ``endpoint`` and receives its items, in order.

    Args:
        endpoint: the producer's endpoint (bare name, ``ipc://...`` or ``tcp://...``).
        device: ``cpu`` / ``cuda[:N]``: the same kind of device as the producer's on one
            host; across hosts (a remote edge) either kind, the transfer copies.
        wait: ``"gpu"`` (the stream waits on the producer's event at once) or ``"host"``
            (poll until complete: never wedges if the producer dies).
        timeout: default for blocking calls (``get``, ``close``'s wait for forwarded
            items); None (the default) or inf: as long as the producer lives. Also how
            long a ring full of items this program holds (not released, or kept views
            that cannot be moved out) may last before ``get`` and iteration raise
            ``IpcTimeoutError`` naming them: no item can come then.
        connect_timeout: how long the handshake waits for a producer to appear and answer
            (seconds; None or inf: forever). Default: ``timeout`` when that is given,
            else 30 s.
        idle_timeout: how long iteration waits for the next item; None: as long as the
            producer is alive.
        heartbeat: seconds between liveness messages when idle. A producer silent for
            1.5x its heartbeat is reported as stalled (logged, ``stats()["producer_stalled"]``)
            and waited for; it is lost only when its process is provably gone or its
            connection closed without goodbye.
        credits: most items held at once (buffered + unreleased); default: all slots.
        auto_release: release the previous item at the next iteration.
        keep_refs_check: the reference rule (default True): a released item's slot goes
            back to the producer only once no tensor of this program views it any more
            (one C call per release); once views kept past release would stall the ring,
            their items' bytes are copied out of it into memory of their own (the views
            stay valid; a warning says once that ``clone()`` avoids the copy). False: a
            slot goes back at ``release()``, and a view kept past it may show a later
            item's data (for programs that never keep views).
        verify: check that no item is changed while this consumer holds it (an in-place
            op on a received tensor writes into memory other readers share): a checksum
            of the item's bytes when received and when released; a difference raises
            ``ItemWrittenError`` at the next call. Costs two reads of every item: for
            CUDA, where received memory cannot be mapped read-only (on the CPU backend it
            is: an in-place op faults at once).
        stream: CUDA stream for waits and release events (default: current at each call).
        curve: for a ``tcp://`` endpoint, ``CurveKeys`` with ``server`` = the producer's
            public key; refused without them unless ``insecure=True``.
        insecure: accept a plain tcp:// control channel.
        limits: caps on every frame received from the producer (``ipcsync.Limits``); a
            frame over one is refused as a ``ProtocolError``.

    Blocks until the handshake is done (up to ``connect_timeout``): IpcTimeoutError when no
    producer answered, ConfigError for a bad option or an endpoint whose producer cannot
    be used from here (another device kind, a wrong CURVE key), ProtocolError for a peer
    of another protocol version.

    ``session`` (read-only) is the protocol state (``ConsumerSession``); ``port`` is what
    FanIn uses of it (``SourcePort``). Every call is the consumer's runtime endpoint's
    (``runtime.consumer.endpoint.ConsumerEndpoint``), which owns its state.
    """

    def __init__(
        self, endpoint: str, *, device: str | torch.device | None = None, wait: str = "gpu",
        timeout: float | None = limits.DEFAULT_TIMEOUT, connect_timeout: float | None | Unset = UNSET,
        idle_timeout: float | None = None, heartbeat: float | None = limits.DEFAULT_HEARTBEAT,
        credits: int | None = None, auto_release: bool = True, stream: Any = None,
        curve: CurveKeys | None = None, insecure: bool = False, limits: P.Limits = P.DEFAULT_LIMITS,
        keep_refs_check: bool = True, verify: bool = False,
    ) -> None:
        self._endpoint = ConsumerEndpoint(
            endpoint, device=device, wait=wait, timeout=timeout, connect_timeout=connect_timeout,
            idle_timeout=idle_timeout, heartbeat=heartbeat, credits=credits, auto_release=auto_release,
            stream=stream, curve=curve, insecure=insecure, limits=limits, keep_refs_check=keep_refs_check,
            verify=verify)

    # ------------------------------------------------------------------ configuration
    @property
    def endpoint(self) -> Endpoint:
        """The producer's endpoint (``endpoint.name``, ``endpoint.url``)."""
        return self._endpoint.endpoint

    @property
    def device(self) -> torch.device:
        """Where received tensors live (``cpu`` or ``cuda:N``)."""
        return self._endpoint.device

    @property
    def wait_mode(self) -> str:
        """``"gpu"`` or ``"host"`` (a remote edge's items are always waited for on the host)."""
        return self._endpoint.wait_mode

    @property
    def auto_release(self) -> bool:
        """Release the previous item at the next iteration (settable)."""
        return self._endpoint.auto_release

    @auto_release.setter
    def auto_release(self, value: bool) -> None:
        self._endpoint.auto_release = bool(value)

    @property
    def source(self) -> str:
        """What ``Item.source`` says of this consumer's items (the endpoint as given;
        FanIn and stages relabel it)."""
        return self._endpoint.source

    @source.setter
    def source(self, value: str) -> None:
        self._endpoint.source = value

    @property
    def session(self) -> ConsumerSession:
        """The protocol state (read-only)."""
        return self._endpoint.session

    @property
    def closed(self) -> bool:
        """True once ``close()`` has been called."""
        return self._endpoint.closed

    # ------------------------------------------------------------------ public API
    def get(self, timeout: float | None = None) -> Item | None:
        """The next item, or None once the producer has closed and everything it sent was
        received. Blocks up to ``timeout`` (default: the consumer's), the wait for an
        announced item's data included (a remote transfer, or ``wait="host"``); raises
        IpcTimeoutError then (an item whose data was late stays first in line),
        PeerLostError if the producer died, ClosedError after close().
        """
        return self._endpoint.get(timeout)

    def __iter__(self) -> Iterator[Item]:
        # Each step is one call of the endpoint's next_item (iteration's own timeout:
        # idle_timeout), ending at its None: the steady path costs its calls only.
        ep = self._endpoint
        return iter(partial(ep.next_item, ep.iteration_timeout()), None)

    def __next__(self) -> Item:
        ep = self._endpoint
        item = ep.next_item(ep.iteration_timeout())
        if item is None:
            raise StopIteration
        return item

    # ------------------------------------------------------------------ asyncio
    def aget(self, timeout: float | None = None) -> Coroutine[Any, Any, Item | None]:
        """``get()`` for asyncio (``await inp.aget()``): the same result (the next item, or
        None at the end of the stream), ``timeout`` and errors (IpcTimeoutError,
        PeerLostError, ClosedError), and the event loop runs other tasks while it waits.

        Cancellation-safe: a cancelled ``aget`` took nothing; the item it was waiting for
        is returned by the next ``aget``/``get``. With ``auto_release``, the items
        ``aget`` returned to the calling task are released when that task calls ``aget``
        again, whichever task runs the call (``asyncio.wait_for(inp.aget(), T)``,
        ``asyncio.create_task(inp.aget())``): see ``runtime.aio.CallerItems``. Any number
        of tasks may wait on one consumer at once; none releases another's items. On CUDA
        with ``wait="host"`` the item's ready event is polled inline (bounded by the
        producer's copy); ``"gpu"``, the default, never waits on the host."""
        return self._endpoint.aget(timeout)

    def __aiter__(self) -> aio.AsyncItems:
        """``async for item in consumer``: like ``for``, on the event loop (each ``async
        for`` has its own current item, released at its next step with ``auto_release``;
        ``idle_timeout`` applies)."""
        return self._endpoint.aiter()

    def stats(self) -> ConsumerStats:
        """A frozen snapshot (``ConsumerStats``), read by attribute (``stats().handoffs``)
        or as a read-only mapping (``stats()["handoffs"]``); ``as_dict()`` for JSON:

        - ``role``: ``"consumer"``.
        - ``handoffs``, ``bytes``: items received (and their bytes) since the consumer was
          made; ``elapsed_s``: seconds since then; ``rate_per_s``, ``bytes_per_s``: those
          over it.
        - ``latency_s``: send-to-receive seconds of the latest 4096 items (the producer's
          send to this process taking the item), ``p50``, ``p90``, ``p99`` (None before the
          first item) and ``samples``.
        - ``waiting_s``: seconds blocked, by cause: ``producer`` (no item announced yet),
          ``event`` (an announced item's data not ready: ``wait="host"`` or a remote
          transfer). A cause appears once it was waited on.
        - ``held``: items received and not released; ``buffered``: announced, not yet taken.
        - ``kept``: items released but still viewed by the program's tensors (their slots
          are not given back yet); ``kept_moved``, ``kept_moved_bytes``: such items (and
          their bytes) copied out of the ring so it could flow (``keep_refs_check``).
        - ``forwarded_out``: items this consumer forwarded without a copy
          (``ipcsync.forward``) and that are still held downstream;
          ``forwarded_lost``: items forwarded to this consumer by a middle stage that
          were dropped because their memory could not be opened here.
        - ``producer_stalled``: the producer is silent now but alive;
          ``producer_stalled_total``: times it fell silent.
        - ``lane``: whether frames travel on a lane now (``IPCSYNC_LANE``)."""
        return self._endpoint.stats()

    @property
    def port(self) -> SourcePort[Item]:
        """What FanIn uses of this consumer (a new one each time: keep it)."""
        return self._endpoint.source_port()

    @property
    def slots(self) -> int:
        """Number of slots in the producer's ring."""
        setup = self._endpoint.setup
        return len(setup.slots) if setup else 0

    @property
    def producer_pid(self) -> int | None:
        """The producer's process id (None before the handshake)."""
        setup = self._endpoint.setup
        return setup.pid if setup else None

    def close(self, timeout: float | None = None) -> None:
        """Release everything held, say goodbye and disconnect. Idempotent. The goodbye
        waits at most ``min(timeout, 1 s)``; items this consumer forwarded zero-copy are
        waited for up to ``timeout`` (default: the consumer's; None: while their holders
        live). A call blocked in another thread raises ClosedError; a second close() from
        another thread waits for this one. Interrupted (Ctrl-C) while it waits, it still
        closes, then re-raises."""
        self._endpoint.close(timeout, forwarded_wait=True)

    async def aclose(self, timeout: float | None = None) -> None:
        """``close()`` for asyncio: the same result, its waits (for items this consumer
        forwarded, up to ``timeout``; for the producer's answer to the goodbye, up to 1 s)
        awaited without blocking the event loop. Idempotent. Cancelled while it waits,
        it still closes (at once), then re-raises."""
        await aclose_endpoint(self._endpoint, timeout)

    def __enter__(self) -> "Consumer":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        # An exception (Ctrl-C included) leaves at once: no wait for forwarded items.
        self._endpoint.close(None if exc_type is None else 0.0, forwarded_wait=exc_type is None)

    async def __aenter__(self) -> "Consumer":
        """``async with Consumer(...) as inp``: the consumer (the handshake is done: the
        constructor blocks up to ``connect_timeout`` for it, as with ``with``)."""
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        """``aclose()`` on a clean exit; an exception (a cancellation or Ctrl-C included)
        closes at once, as ``__exit__`` does."""
        if exc_type is None:
            await aclose_endpoint(self._endpoint, None)
        else:
            self._endpoint.close(0.0, forwarded_wait=False)
