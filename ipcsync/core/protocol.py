"""The ipcsync wire protocol, sans-IO: bytes in, messages out. No sockets, no zmq, no torch.

This module is the protocol's one name for its users (``from ..core import protocol as
P``); its parts live in three modules, each with one job:

- ``ipcsync.core.messages``: the message types and dataclasses, their schemas as data
  (``SCHEMAS``), the versions, error codes and hard caps (``Limits``);
- ``ipcsync.core.codec``: frames to validated messages and back (``encode``, ``decode``),
  the hot-path encoders and fast decoders, the sender's checks;
- ``ipcsync.core.states``: the per-connection state machine: one machine per sender
  (``MACHINES``), the joint rules (``JOINT``, ``LANE_TRANSITIONS``) and ``Conversation``,
  the same in both processes.

Conversation (one consumer connection)::

    consumer                         producer
    HELLO{version, pid, ...}   ->
                               <-    SETUP{slots, arena handles, ready-event handles}
    ATTACH{release-event handles} ->
                               <-    READY{seq, slot, gen, layout_id, [layout], meta}
                               <-    FOREIGN{id, another producer's arena}   (zero-copy forwarding:
                               <-    FREADY{READY's fields, id, offset, nbytes}  see below)
    RELEASE{[(seq, slot, gen)...]} ->                                         (batched)
    HEARTBEAT                  <->   HEARTBEAT                                (when idle)
                               <-    SENT{seq}    (remote edges only: every send of an item
                                                   up to seq has completed; see remote_session)
    BYE{reason}                <->   BYE{reason}              (either side; a consumer's BYE is
                                                               always acknowledged with a BYE)
    ERROR{code, message}       <->   ERROR{code, message}                     (then close)

Lanes (version 4, same-host ipc edges; ``ipcsync.runtime.transport.lane``): after SETUP the producer
may offer a direct AF_UNIX SOCK_SEQPACKET connection that carries the rest of the session::

                               <-    LANE{path, token}        (after SETUP, on ZeroMQ)
    (connects to path, sends token as its first packet; the producer checks it and the
     connection's SO_PEERCRED)
                               <-    SWITCH                   (the producer's last ZeroMQ frame)
    SWITCH                     ->                             (the consumer's last ZeroMQ frame)
    ... every later frame of that direction travels on the lane ...

The ordering rule: SWITCH is the last frame a side sends on ZeroMQ, and a receiver reads
the lane only after it has handled the peer's SWITCH, so every frame sent before the
switch is handled before every frame sent after it, in both directions. A side sends its
SWITCH only once the lane is usable (the producer: token and credentials checked; the
consumer: after the producer's SWITCH), so nothing is ever sent on a lane that the other
side may refuse.

Zero-copy forwarding (``ipcsync.forward``): a middle stage hands on memory it received from
an upstream producer. FOREIGN describes that upstream arena (its export handle as the
upstream SETUP carried it, size, device, owner) under a small id, once per consumer, before
the first FREADY naming the id; a later FOREIGN with the same id replaces it (sent only once
no item of the old one is held). FREADY is a READY (same slot, generation, layout cache and
release) whose tensors lie in ``nbytes`` bytes at ``offset`` of foreign arena ``id``
instead of in the slot. Ordinary items keep the plain READY (and its fast path).
"""

from __future__ import annotations

from .codec import (
    READY_TYPE,
    SWITCH_FRAME,
    Encoder,
    check_outgoing,
    decode,
    decode_readies,
    decode_ready,
    decode_release,
    decode_releases,
    encode,
    encode_ready,
    sendable_layout,
)
from .messages import (
    DEFAULT_LIMITS,
    FIELDS,
    HIGHEST_VERSION,
    LANE_TOKEN_BYTES,
    LANE_VERSION,
    MAX_LAYOUT_IDS,
    OLDEST_VERSION,
    PROTOCOL_VERSION,
    SCHEMAS,
    SENT_VERSION,
    SPEC_PARAMETER,
    SPEC_REQUIRES_GRAD,
    Attach,
    Bye,
    Error,
    ErrorCode,
    Foreign,
    ForwardReady,
    Heartbeat,
    Hello,
    LaneOffer,
    Limits,
    Message,
    MsgType,
    Ready,
    Release,
    Sent,
    Setup,
    Switch,
    VersionMismatch,
    check_meta,
    describe,
)
from .states import (
    DEAF,
    DUE,
    ENDED,
    INITIAL,
    LANE_DUE,
    LANE_TRANSITIONS,
    LANE_TYPES,
    JOINT,
    MACHINES,
    PEER_OF,
    Conversation,
    Event,
    LanePhase,
    Role,
    State,
)

__all__ = [
    "PROTOCOL_VERSION",
    "READY_TYPE",
    "MsgType",
    "ErrorCode",
    "Role",
    "State",
    "LanePhase",
    "MACHINES",
    "JOINT",
    "DEAF",
    "LANE_TRANSITIONS",
    "LANE_TYPES",
    "INITIAL",
    "ENDED",
    "DUE",
    "LANE_DUE",
    "PEER_OF",
    "Event",
    "Limits",
    "DEFAULT_LIMITS",
    "Hello",
    "Setup",
    "Attach",
    "Ready",
    "Release",
    "Heartbeat",
    "Bye",
    "Error",
    "Foreign",
    "ForwardReady",
    "Sent",
    "LaneOffer",
    "Switch",
    "SWITCH_FRAME",
    "OLDEST_VERSION",
    "LANE_VERSION",
    "SENT_VERSION",
    "HIGHEST_VERSION",
    "LANE_TOKEN_BYTES",
    "Message",
    "encode",
    "decode",
    "encode_ready",
    "decode_ready",
    "decode_readies",
    "decode_release",
    "decode_releases",
    "Encoder",
    "Conversation",
    "VersionMismatch",
    "check_meta",
    "MAX_LAYOUT_IDS",
    "sendable_layout",
    "check_outgoing",
    "SPEC_REQUIRES_GRAD",
    "SPEC_PARAMETER",
    "SCHEMAS",
    "FIELDS",
    "describe",
]
