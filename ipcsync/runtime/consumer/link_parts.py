"""What the consumer link's jobs written as plain functions (``runtime.consumer.upstream_setup``:
the handshake and the producer's memory; ``runtime.consumer.upstream_loss``: liveness, loss and
teardown) use of the link, ``runtime.consumer.upstream.ProducerLink``: one interface, so those
modules need not import the link's (imports go one way: the link calls them).

Every function over a ``LinkParts`` runs under the consumer's lock, as the link's
methods do."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from ...core import protocol as P
from ...core.consumer_session import ConsumerSession
from ...core.ratelog import RateLog
from ...errors import IpcSyncError
from ...system import host
from ..transport.address import Endpoint
from .foreign import Downstream
from .ring_memory import RingMemory

if TYPE_CHECKING:  # (runtime.remote.io is loaded only where a remote edge is)
    from ..remote.io import RemoteWatch

__all__ = ["LinkParts"]


class LinkParts(Protocol):
    """The state and the sends of one consumer's connection to its producer (see
    ``ProducerLink``, which has them)."""

    endpoint: Endpoint
    chan: Any
    session: ConsumerSession
    backend: Any
    stream: Any
    ratelog: RateLog
    memory: RingMemory
    downstream: Downstream
    watch: host.ProcessWatch | RemoteWatch | None
    remote: Any
    shared_setup: tuple[P.Setup, Any] | None
    lender: Any
    reclaim_when_gone: bool

    def send(self, frame: bytes) -> bool: ...

    def send_errors(self) -> None: ...

    def fail(self, error: IpcSyncError, code: str | None) -> None: ...

    def producer_alive(self) -> bool: ...

    def let_go_of_memory(self) -> None: ...
