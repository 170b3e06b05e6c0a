"""The public Producer: owns the slots, binds the endpoint, serves any number of consumers.

A facade: every call is its runtime endpoint's (``runtime.producer.port.ProducerPort``), which owns
the producer's state (lock, closed and closing flags, ring, memory, consumers) and names
the parts that do each job.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, ContextManager, Mapping, Sequence

import torch

from . import limits
from .core import protocol as P
from .core.stats_types import ProducerStats
from .item import SlotWriter
from .runtime.transport.channel import CurveKeys, Endpoint
from .runtime.producer.closing import DEFAULT_LINGER, Linger
from .runtime.endpoint import UNSET, Unset, bind_hot
from .runtime.producer.port import ProducerPort
from .slot_entry import AsyncSlotEntry, SlotEntry

__all__ = ["Producer", "SlotWriter"]

DEFAULT_SLOT_BYTES = limits.DEFAULT_SLOT_BYTES


class Producer:
    """Binds ``endpoint`` and hands messages (nested dicts/lists/tuples of tensors plus
    msgpack-able ``meta``) to the consumers that connect to it.

    Args:
        endpoint: a bare name (a private ipc socket), ``ipc:///abs/path`` or ``tcp://host:port``.
        slots: number of slots in the ring (items in flight at once).
        slot_bytes: capacity of one slot; a larger message is refused with a ConfigError.
        device: ``"cpu"`` or ``"cuda[:N]"``; default: the current CUDA device if any, else cpu.
        policy: with several consumers, ``"shard"`` (each item to one consumer, balanced by
            free credits) or ``"broadcast"`` (every item to every consumer).
        wait: how the producer waits on consumers' release events before reusing a slot
            (CUDA): ``"host"`` (default: poll until complete; a consumer that
            dies mid-record can never wedge the producer's stream; free in steady state,
            since a slot is reused long after its release) or ``"gpu"`` (enqueue at once).
        timeout: default for every blocking call (seconds). None (the default) or inf:
            wait as long as the consumers being waited for live, as ``mp.Queue.put``
            does; a consumer whose process is gone ends the wait.
        heartbeat: seconds between liveness messages when idle. A consumer silent for
            1.5x its heartbeat is reported as stalled (logged, ``stats()["consumers_stalled"]``)
            but keeps its slots while its process lives: a consumer is lost only when its
            process is provably gone, or it closed its connection and cannot be watched.
        stream: CUDA stream for copies and events (default: the current stream at each call).
        curve: CURVE keys (``ipcsync.CurveKeys``) for a ``tcp://`` endpoint; a tcp endpoint
            without them is refused unless ``insecure=True``. ipc endpoints need neither:
            only the same user can connect (file modes and the kernel's peer credentials).
        insecure: accept a plain tcp:// control channel (one interface only, never ``*``).
        limits: caps on every frame received from consumers (``ipcsync.Limits``); a frame
            over one is refused as a ``ProtocolError``.

    Raises ConfigError for a bad option or endpoint, or an endpoint a live producer
    already bound; BackendError when the slots' memory cannot be made.

    ``port`` is the runtime endpoint that owns the producer's state
    (``runtime.producer.port.ProducerPort``; other parts of ipcsync use it), not user API.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        slots: int = limits.DEFAULT_SLOTS,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        device: str | torch.device | None = None,
        policy: str = "shard",
        wait: str = "host",
        timeout: float | None = limits.DEFAULT_TIMEOUT,
        heartbeat: float | None = limits.DEFAULT_HEARTBEAT,
        stream: Any = None,
        curve: CurveKeys | None = None,
        insecure: bool = False,
        limits: P.Limits = P.DEFAULT_LIMITS,
    ) -> None:
        self.port = port = ProducerPort(
            endpoint, slots=slots, slot_bytes=slot_bytes, device=device, policy=policy, wait=wait,
            timeout=timeout, heartbeat=heartbeat, stream=stream, curve=curve, insecure=insecure, limits=limits)
        bind_hot(self, "send", port.send)  # (the steady send: no frame of the facade's)

    # ------------------------------------------------------------------ configuration
    @property
    def endpoint(self) -> Endpoint:
        """Where this producer is bound (``endpoint.name``, ``endpoint.url``)."""
        return self.port.endpoint

    @property
    def slots(self) -> int:
        """Number of slots in the ring."""
        return self.port.slots

    @property
    def slot_bytes(self) -> int:
        """Capacity of one slot, in bytes."""
        return self.port.slot_bytes

    @property
    def device(self) -> torch.device:
        """Where the slots live (``cpu`` or ``cuda:N``)."""
        return self.port.device

    @property
    def policy(self) -> str:
        """``"shard"`` or ``"broadcast"``."""
        return self.port.policy

    @property
    def wait_mode(self) -> str:
        """``"host"`` or ``"gpu"``: how a slot's release events are waited on (``wait=``)."""
        return self.port.wait_mode

    @property
    def closed(self) -> bool:
        """True once ``close()`` (or ``abort()``) has been called."""
        return self.port.closed

    # ------------------------------------------------------------------ public API
    def send(self, message: Any, meta: Any = None, *, timeout: float | None = None, stream: Any = None) -> int:
        """Copy ``message`` (a nested dict/list/tuple of tensors) into a free slot and hand
        it, with ``meta`` (msgpack-able: None, bool, int, float, str, bytes, lists and dicts
        of them), to a consumer. Returns its seq.

        Blocks while every slot is in use (backpressure: nothing is dropped or
        overwritten), up to ``timeout`` (default: the producer's). On CUDA the copy and the
        ready event go on ``stream`` (default: current) and the call returns without a host
        sync. Raises ConfigError for a message that does not fit a slot or a bad meta,
        IpcTimeoutError when no slot frees in time, ClosedError after (or during) close().
        """
        return self.port.send(message, meta, timeout=timeout, stream=stream)

    def slot(
        self,
        fields: Mapping[str, tuple[Sequence[int], torch.dtype]] | None = None,
        *,
        meta: Any = None,
        timeout: float | None = None,
        stream: Any = None,
        **named_fields: tuple[Sequence[int], torch.dtype],
    ) -> ContextManager[SlotWriter]:
        """Zero-copy send: reserve a slot, yield its tensors to write in place, send on exit.

        ``with out.slot(x=((64, 3, 224, 224), torch.uint8)) as s: s["x"].copy_(src)``.
        Fields are ``name=(shape, dtype)`` (``**named_fields``, or a ``fields`` mapping);
        the tensors are contiguous. ``meta`` is sent with them (set ``s.meta`` to change
        it). Entering waits up to ``timeout`` (default: the producer's) for a free slot,
        as ``send()`` does; on CUDA the ready event is recorded on ``stream`` (default:
        current) at exit. If the block raises, nothing is sent and the slot is given back;
        so too if close() began (in another thread) while the block ran, and its exit
        raises ClosedError. A tensor of the block still referenced at exit is not sent
        (``SlotKeptError``).
        """
        spec = {**fields, **named_fields} if fields else named_fields
        return SlotEntry(self.port, spec, meta, timeout, stream)

    # ------------------------------------------------------------------ asyncio
    async def asend(self, message: Any, meta: Any = None, *, timeout: float | None = None,
                    stream: Any = None) -> int:
        """``send()`` for asyncio: the same parameters (``message``, ``meta``, ``timeout``,
        ``stream``), copy, result and errors; while every slot is in use it awaits a release
        without blocking the event loop.

        Cancellation-safe: the only wait is before a slot is reserved, and the copy and
        publish then run without awaiting. So a cancelled ``asend`` sent nothing (the
        message was not copied, no slot is taken; send it again if you still want it), and
        an ``asend`` that returned a seq sent it. On CUDA with ``wait="host"`` (the
        default) a reused slot's previous readers' release events are polled inline
        (bounded by their GPU work on that slot); ``wait="gpu"`` enqueues that wait."""
        port = self.port
        return await port.when_slot_free(lambda: port.send(message, meta, timeout=0, stream=stream), timeout)

    def aslot(
        self,
        fields: Mapping[str, tuple[Sequence[int], torch.dtype]] | None = None,
        *,
        meta: Any = None,
        timeout: float | None = None,
        stream: Any = None,
        **named_fields: tuple[Sequence[int], torch.dtype],
    ) -> AsyncSlotEntry:
        """``slot()`` for asyncio: ``async with out.aslot(x=(shape, dtype)) as s: ...``,
        with ``slot()``'s parameters (``fields``, ``**named_fields``, ``meta``, ``timeout``,
        ``stream``). Entering awaits a free slot without blocking the event loop; a cancelled entry
        reserved nothing. The block itself is ``slot()``'s: sent on a clean exit, the slot
        given back if it raises (a cancellation inside it included)."""
        spec = {**fields, **named_fields} if fields else named_fields
        entry = SlotEntry(self.port, spec, meta, 0.0, stream)
        return AsyncSlotEntry(entry, lambda: self.port.when_slot_free(entry.__enter__, timeout))

    async def aclose(self, timeout: float | None = None, *, linger: float | None | Unset = UNSET) -> None:
        """``close()`` for asyncio: refuses new sends at once, awaits (without blocking the
        event loop) until every item sent was delivered, says goodbye, awaits until every
        item was released, or its holders are gone, then runs ``close()`` with what is left
        of ``timeout`` (default: the producer's), whose remaining goodbye exchange is a
        round trip. Lets consumers on the same event loop finish their items. Items
        queued while no consumer is attached wait ``linger`` and are dropped as
        ``close()`` drops them. Cancelled while it waits, it ends the stream as
        ``abort()`` does, then re-raises."""
        try:
            await self.port.aclose(timeout, _linger(linger))
        except BaseException as exc:  # cancelled or interrupted while it waited: no clean end
            self.abort(exc)
            raise

    def flush(self, timeout: float | None = None) -> None:
        """Block until every item sent so far has been released by its consumers (or they
        are gone). IpcTimeoutError after ``timeout``."""
        self.port.flush(timeout)

    def wait_for_consumers(self, n: int = 1, timeout: float | None = None) -> None:
        """Block until at least ``n`` consumers are attached. IpcTimeoutError after ``timeout``."""
        self.port.wait_for_consumers(n, timeout)

    @property
    def consumers(self) -> int:
        """Number of consumers attached now."""
        return self.port.consumers

    def stats(self) -> ProducerStats:
        """A frozen snapshot (``ProducerStats``), read by attribute (``stats().handoffs``)
        or as a read-only mapping (``stats()["handoffs"]``); ``as_dict()`` for JSON:

        - ``role``: ``"producer"``.
        - ``handoffs``, ``bytes``: items sent (and their bytes) since the producer was made;
          ``elapsed_s``: seconds since then; ``rate_per_s``, ``bytes_per_s``: those over it.
        - ``latency_s``: send-to-release seconds of the latest 4096 items, ``p50``, ``p90``,
          ``p99`` (None before the first release) and ``samples``.
        - ``waiting_s``: seconds blocked, by cause: ``slot`` (every slot in use),
          ``consumer`` (no consumer attached), ``release_event`` (a reused slot's release
          events, CUDA). A cause appears once it was waited on.
        - ``occupancy``: slots by state now: ``free``, ``writing`` (a ``slot()`` block or a
          copy), ``queued`` (sent, for no consumer yet), ``in_flight`` (with consumers).
        - ``consumers``: attached now; ``consumers_attached``: ever; ``consumers_lost``:
          gone without goodbye; ``consumers_stalled``: silent now but alive;
          ``consumers_stalled_total``: times one fell silent.
        - ``bad_frames``: frames from consumers refused (malformed, out of order).
        - ``forwarded``: items sent by ``ipcsync.forward`` without a copy;
          ``forwarded_held``: of those, in this producer's slots now.
        - ``layouts_inline``: notices to consumers that carried an item's full layout
          (the first item of each layout to each consumer; later ones carry its id).
        - ``lanes``: consumers whose frames travel on a lane now (``IPCSYNC_LANE``)."""
        return self.port.stats()

    def close(self, timeout: float | None = None, *, linger: float | None | Unset = UNSET) -> None:
        """Finish and shut down: a successful end of the stream. Items already sent (and
        queued ones, to a consumer that attaches meanwhile) are delivered; consumers end
        their iteration cleanly after the last one. Waits up to ``timeout`` (default: the
        producer's; None: as long as the consumers holding items live) for them to be
        released, saying on whom it waits every few seconds, then frees the slots and the
        endpoint. Idempotent; never raises for peers that are gone. A call blocked in
        another thread raises ClosedError; a second close() from another thread waits for
        this one. Interrupted (Ctrl-C) while it waits, it ends the stream as ``abort()``
        does, then re-raises.

        Bounded where nobody can end the wait:

        - ``linger``: how long items queued while no consumer is attached wait for one
          to attach (seconds; None or inf: up to ``timeout``); then they are dropped
          with a warning naming how many. Default: 10 s if no consumer ever attached
          (either side may start first), 2 s once every consumer that attached has left
          (``runtime.producer.closing``). ``wait_for_consumers()`` before close() waits for a
          consumer as long as you choose.
        - A tensor of a ``slot()`` block kept past the block (``SlotKeptError``): its
          item was never sent and only the program can drop it, so close() does not wait
          for it; it warns, naming the field, shape and dtype. The tensor stays valid.

        A consumer that is attached and alive is waited for (up to ``timeout``): memory
        it can still read is never freed under it."""
        self.port.close(timeout, _linger(linger))

    def abort(self, error: BaseException | str | None = None) -> None:
        """End the stream as failed, at once: no wait for items in flight. Consumers get
        ``ProducerFailedError`` (a ``PeerLostError``) carrying ``error`` (an exception's
        type and message, or a text) instead of a clean end; items they hold stay
        readable, items not yet received are dropped. What a ``with`` block does when
        it exits by an exception (Ctrl-C included). Idempotent, bounded (< 1 s)."""
        self.port.abort(error)

    def __enter__(self) -> "Producer":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort(exc)

    async def __aenter__(self) -> "Producer":
        """``async with Producer(...) as out``: the producer (bound by the constructor)."""
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        """``aclose()`` on a clean exit (a successful end of the stream); an exception (a
        cancellation or Ctrl-C included) ends the stream as failed, at once (``abort``),
        as ``__exit__`` does."""
        if exc_type is None:
            await self.aclose()
        else:
            self.abort(exc)


def _linger(linger: float | None | Unset) -> Linger:
    return DEFAULT_LINGER if isinstance(linger, Unset) else Linger.of(linger)
