"""A consumer's release of an item (``Releaser``): ``Item.release()``, and the implicit one
at the thread's next take (``auto_release``), lock held. Ordering rule 3 of a receive
(``runtime.consumer.endpoint``): the release event is recorded on the consumer's stream
before the RELEASE is queued.

Straight-line, the reference rule first: a released item a tensor of the program still
views waits in the link's ``kept`` (``runtime.consumer.keeping``) and goes back once nothing does;
otherwise the item stops holding the slot's storage, its release event or flag is
recorded (nothing to record where every event is complete on record, or once the
producer is gone: its events are never touched again), and RELEASE(seq, slot, gen) is
queued. Queued releases go out together (``ProducerLink.flush_releases``): at the next
call once ``release_batch`` gathered, when the consumer is about to wait for more items,
at once while a call waits, or from the service thread."""

from __future__ import annotations

from typing import Any

from ...backends.base import Backend, CurrentStream
from ...item import Item
from .foreign import Lender
from ..telemetry import EdgeTracer
from .upstream import ProducerLink

__all__ = ["Releaser"]


class Releaser:
    """Releases one consumer's items (``release``, the consumer's ``_release_locked``
    without ``verify``). Built once, from the consumer's parts: ``link`` (the session,
    the memory, the kept items, the foreign regions), ``lender`` (the items held),
    ``stream`` (the consumer's stream; None: the current one, of ``backend``), whether the
    reference rule is checked (``check_refs``), the trace (None unless traced)."""

    __slots__ = ("lender", "trace", "check_refs", "kept", "downstream", "session", "memory", "stream", "streams")

    def __init__(self, link: ProducerLink, lender: Lender, backend: Backend, stream: Any, check_refs: bool,
                 trace: EdgeTracer | None) -> None:
        self.lender, self.trace, self.check_refs = lender, trace, check_refs
        self.kept, self.downstream, self.session, self.memory = link.kept, link.downstream, link.session, link.memory
        self.stream = stream
        self.streams = CurrentStream(backend)  # (the current stream, looked up only when it changed)

    def release(self, item: Item, stream: Any) -> None:
        """Release ``item`` (lock held; ``stream``: where to record its release, None: the
        consumer's). Its RELEASE is queued."""
        if item.released:
            return
        item.released = True
        # The item stops viewing the slot: a leftover reference to it must not keep the
        # producer's memory mapped (see ProducerLink.let_go_of_memory).
        item.tensors = None
        seq, slot = item.seq, item.slot
        self.lender.unhold(seq, None)
        if self.trace is not None:
            self.trace.released(seq)
        store = item.store
        if self.check_refs and (store.count() > store.own or store.pyrefs() > store.own_py):
            # The program still views the slot: it goes back once nothing does (the
            # link polls it at every pump; a stall is reported at once).
            self.kept.add(item)
            return
        item.store = None  # given back: nor does a leftover item keep the slot's storage
        uses = self.downstream.uses  # (a forwarded item's region, by seq)
        if uses:
            uses.pop(seq, None)
        s = self.session
        mem = self.memory
        if s.error is None and not mem.complete_on_record:
            if stream is None and (stream := self.stream) is None:  # the current one
                cs = self.streams
                stream = cs.now if cs.key() == cs.seen else cs.resolve()
            if mem.shared:
                mem.release_events[slot].value = item.gen
            mem.record_release[slot](stream)
        s.queue_release((seq, slot, item.gen))
