"""The ipcsync wire protocol, sans-IO: bytes in, messages out. No sockets, no zmq, no torch.

A frame is one msgpack array ``[type, field, field, ...]`` whose fields follow the schema
of its type (``SCHEMAS``, written as data). Decoding is defensive: the frame size is
checked before msgpack sees it, msgpack gets hard caps on every length, extension types are
refused, nesting depth is bounded, and every field is validated before a message object
exists. Anything wrong raises :class:`~ipcsync.errors.ProtocolError` naming the reason.

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

Lanes (version 4, same-host ipc edges; ``ipcsync.runtime.lane``): after SETUP the producer
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

The per-connection state machine is ``TRANSITIONS``, one table for both parties: for each
role and state, which messages (sent by either side) are allowed and which state they lead
to; the lane's phases are a second region of it (``LANE_TRANSITIONS``). ``Conversation``
checks every frame a side receives and every frame it sends against them.
"""

from __future__ import annotations

import dataclasses
import reprlib
from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import Any, Callable, ClassVar, Final, Sequence, Union

import msgpack

from ..errors import ProtocolError

__all__ = [
    "PROTOCOL_VERSION",
    "READY_TYPE",
    "MsgType",
    "ErrorCode",
    "Role",
    "State",
    "LanePhase",
    "TRANSITIONS",
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
]

# 2: FOREIGN and FREADY (zero-copy forwarding). A peer of version 1 would fail on them
# mid-stream; the version makes the mismatch explicit at HELLO/SETUP instead.
# 3: a tensor spec may carry autograd flags (a fifth field), which version 2 refuses.
# 4: SENT (a remote edge's producer confirms its completed sends; a remote consumer of
# version 3 would never get one, so a remote edge needs version 4 at both ends), and LANE
# and SWITCH (a direct unix-socket lane per same-host consumer). A same-host peer of
# version 3 is still served, without a lane: HELLO and SETUP of version 3 are accepted,
# the producer answers a version-3 HELLO with a version-3 SETUP and offers it no lane, and
# a consumer whose version-4 HELLO a version-3 producer refused says HELLO again as 3.
PROTOCOL_VERSION: Final = 4
OLDEST_VERSION: Final = 3  # the oldest version this process still speaks
LANE_VERSION: Final = 4  # the first version with lanes
SENT_VERSION: Final = 4  # the first version with SENT (a remote edge needs it at both ends)
# A HELLO of a later version gets a version error, and a consumer that said it says HELLO
# again one version lower (version 5, an opt-in shared-memory doorbell, is not spoken).
HIGHEST_VERSION: Final = 4  # the newest version this process understands
LANE_TOKEN_BYTES: Final = 16  # a lane token: random bytes, the first packet on the lane
_LANE_PATH_MAX: Final = 107  # sockaddr_un.sun_path minus its NUL (limits.IPC_PATH_MAX)

# Autograd flags of a tensor spec (its optional fifth field, absent when 0): the tensor
# requires grad; it is an nn.Parameter (with or without requires_grad).
SPEC_REQUIRES_GRAD: Final = 1
SPEC_PARAMETER: Final = 2
_SPEC_FLAGS: Final = SPEC_REQUIRES_GRAD | SPEC_PARAMETER

# Largest integer accepted in any integer field (sequence numbers, offsets, sizes, pids).
_MAX_INT: Final = 2**62
# A handle (shared-memory name, CUDA IPC handle) is small; cap it to keep frames small.
_MAX_HANDLE_BYTES: Final = 4096
_MAX_TEXT: Final = 4096
# torch tensors have at most 64 dimensions.
_MAX_NDIM: Final = 64
# Layout ids are 1..MAX_LAYOUT_IDS (0: "not cached"). A producer reuses them (LRU), so a
# consumer caches at most this many layouts per producer.
MAX_LAYOUT_IDS: Final = 4096


class MsgType(IntEnum):
    """The first element of every frame: which message it is."""

    HELLO = 1
    SETUP = 2
    ATTACH = 3
    READY = 4
    RELEASE = 5
    HEARTBEAT = 6
    BYE = 7
    ERROR = 8
    FOREIGN = 10
    FORWARD_READY = 11
    SENT = 12
    LANE_OFFER = 13
    SWITCH = 14


# Plain ints for the hot paths (packing an IntEnum member takes msgpack's slower path).
_READY: Final = int(MsgType.READY)
READY_TYPE: Final = _READY  # the first field of a READY frame (Encoder.plain's callers)
_RELEASE: Final = int(MsgType.RELEASE)
_FORWARD_READY: Final = int(MsgType.FORWARD_READY)


class ErrorCode(str, Enum):
    """``Error.code``: why a peer refused or ended a connection (machine-readable)."""

    PROTOCOL = "protocol"  # a malformed or out-of-order frame
    VERSION = "version"  # another protocol version
    FAILED = "failed"  # the producer's with-block raised, or it called abort()
    CLOSING = "closing"  # the producer is closing and takes no new consumers
    BACKEND = "backend"  # cpu against cuda, or memory/events that cannot be opened
    HOST = "host"  # another host, boot or PID namespace where one is needed
    DEVICE = "device"  # a GPU the peer cannot read
    CREDITS = "credits"  # a consumer asking for fewer than one credit
    IDENTITY = "identity"  # the connection's process is not the one the message names
    UID = "uid"  # another user
    SETUP = "setup"  # an inconsistent SETUP
    DROPPED = "dropped"  # a remote consumer silent past the loss rule was dropped (remote_session)


class Role(str, Enum):
    """The two parties of a connection. A ``str`` enum: roles compare equal to their names."""

    PRODUCER = "producer"
    CONSUMER = "consumer"


class State(str, Enum):
    """Where one connection stands, seen from one side (see ``TRANSITIONS``). A ``str``
    enum: states compare equal to their names. The goodbye is part of the state: who said
    BYE first decides what may still come."""

    AWAIT_HELLO = "await_hello"  # producer: connected, nothing said yet
    SETUP_DUE = "setup_due"  # producer: HELLO received; SETUP (or ERROR) is our next frame
    AWAIT_ATTACH = "await_attach"  # producer: SETUP sent, waiting for the release events
    AWAIT_SETUP = "await_setup"  # consumer: HELLO sent
    ATTACH_DUE = "attach_due"  # consumer: SETUP received; ATTACH (or ERROR) is our next frame,
    #                            once its memory is open
    ACTIVE = "active"  # items flow
    ENDING = "ending"  # consumer: the producer said BYE; it releases what it holds, then says BYE
    BYE_SENT = "bye_sent"  # our BYE went first: the producer awaits the consumer's releases and
    #                        BYE; the consumer awaits the producer's acknowledging BYE
    AWAIT_ACK = "await_ack"  # consumer: its BYE answered the producer's; the ack is due
    ACK_DUE = "ack_due"  # producer: the consumer said BYE; our acknowledging BYE is the next frame
    CLOSED = "closed"  # both BYEs exchanged (or closed locally): nothing more is read
    ERROR = "error"  # ended by an ERROR (sent or received) or a frame that broke the protocol


class LanePhase(str, Enum):
    """The lane's region of the state machine (``LANE_TRANSITIONS``), the same for both
    roles: LANE and SWITCH must be allowed by the connection's ``State`` and by this."""

    NONE = "none"  # on ZeroMQ, no lane offered
    OFFERED = "offered"  # LANE said (the producer) or received (the consumer)
    SWITCHING = "switching"  # the producer's SWITCH said; the consumer's answering SWITCH is due
    SWITCHED = "switched"  # both SWITCHes: every later frame travels on the lane


@dataclass(frozen=True)
class Limits:
    """Hard caps applied to every received frame (``Producer(limits=)``,
    ``Consumer(limits=)``). A frame over any cap is refused as a ProtocolError.

    Attributes:
        max_frame: bytes in one frame (so also in one item's layout and meta).
        max_depth: nesting of arrays and maps (meta and layout trees).
        max_items: entries in one array or map (msgpack allocates a container when it
            reads its header: this bounds what a frame of nested headers allocates).
        max_tensors: tensors in one message.
        max_slots: slots in one producer's ring.
        max_release_batch: entries in one RELEASE frame.
        max_foreign: arenas of other producers whose items one producer forwards at once.
    """

    max_frame: int = 1 << 20
    max_depth: int = 32
    max_items: int = 4096
    max_tensors: int = 4096
    max_slots: int = 4096
    max_release_batch: int = 4096
    max_foreign: int = 64  # (FOREIGN.fid < this)


DEFAULT_LIMITS: Final = Limits()


class VersionMismatch(ProtocolError):
    """The peer speaks another protocol version."""

    def __init__(self, peer_version: object) -> None:
        self.peer_version = peer_version
        super().__init__(
            f"peer speaks ipcsync protocol version {peer_version!r}, this process speaks "
            f"version {PROTOCOL_VERSION}; install the same ipcsync version on both sides"
        )


# --------------------------------------------------------------------------- validators
# Each validator takes the decoded value and the limits, returns the value to store (possibly
# converted) or raises ProtocolError. They are composed into SCHEMAS below.

Validator = Callable[[Any, Limits], Any]


def _fail(what: str) -> ProtocolError:
    return ProtocolError(what)


def _uint(v: Any, lim: Limits) -> int:
    if type(v) is not int or v < 0 or v > _MAX_INT:
        raise _fail(f"expected a non-negative integer, got {_describe(v)}")
    return v


def _int(v: Any, lim: Limits) -> int:
    if type(v) is not int or abs(v) > _MAX_INT:
        raise _fail(f"expected an integer, got {_describe(v)}")
    return v


def _text(v: Any, lim: Limits) -> str:
    if type(v) is not str or len(v) > _MAX_TEXT:
        raise _fail(f"expected a string of at most {_MAX_TEXT} characters, got {_describe(v)}")
    return v


def _opt_text(v: Any, lim: Limits) -> str | None:
    return None if v is None else _text(v, lim)


def _handle(v: Any, lim: Limits) -> bytes | str:
    if type(v) not in (bytes, str) or len(v) > _MAX_HANDLE_BYTES:
        raise _fail(f"expected a handle (bytes or str up to {_MAX_HANDLE_BYTES}), got {_describe(v)}")
    handle: bytes | str = v
    return handle


def _list_of(item: Validator, cap: Callable[[Limits], int]) -> Validator:
    def check(v: Any, lim: Limits) -> list[Any]:
        if type(v) is not list:
            raise _fail(f"expected an array, got {_describe(v)}")
        if len(v) > cap(lim):
            raise _fail(f"array of {len(v)} entries exceeds the limit of {cap(lim)}")
        return [item(x, lim) for x in v]

    return check


def _uint_triple(what: str) -> Validator:
    """A validator of ``[a, b, c]``, three unsigned ints; ``what`` names them in errors."""

    def check(v: Any, lim: Limits) -> tuple[int, int, int]:
        if type(v) is not list or len(v) != 3:
            raise _fail(f"{what}, got {_describe(v)}")
        return (_uint(v[0], lim), _uint(v[1], lim), _uint(v[2], lim))

    return check


_slot_desc = _uint_triple("a slot descriptor is [arena, offset, nbytes]")
_release_entry = _uint_triple("a release entry is [seq, slot, gen]")


def _foreign_id(v: Any, lim: Limits) -> int:
    if type(v) is not int or not 0 <= v < lim.max_foreign:
        raise _fail(f"expected a foreign arena id below {lim.max_foreign}, got {_describe(v)}")
    return v


def _lane_path(v: Any, lim: Limits) -> str:
    if (type(v) is not str or not v.startswith("/") or "\0" in v
            or len(v.encode("utf-8", "surrogatepass")) > _LANE_PATH_MAX):
        raise _fail(f"expected an absolute socket path of at most {_LANE_PATH_MAX} bytes, got {_describe(v)}")
    return v


def _lane_token(v: Any, lim: Limits) -> bytes:
    if type(v) is not bytes or len(v) != LANE_TOKEN_BYTES:
        raise _fail(f"expected a token of {LANE_TOKEN_BYTES} bytes, got {_describe(v)}")
    return v


def _meta(v: Any, lim: Limits) -> Any:
    check_meta(v, lim.max_depth)
    return v


def _layout(v: Any, lim: Limits) -> Any:
    """Structure of a message layout: ``[tree, specs]`` (see ipcsync.core.layout).

    tree  := int (index of a tensor spec) | ["d", [key, ...], [tree, ...]]
           | ["l", [tree, ...]] | ["t", [tree, ...]]
    spec  := [dtype name, [size, ...], [stride, ...], byte offset in slot(, flags)]
    flags := SPEC_REQUIRES_GRAD | SPEC_PARAMETER, nonzero when present

    Checked here: types, ranges, depth, that every spec is used exactly once. The dtype
    name and the bounds against the slot size are checked by ipcsync.core.layout.
    """
    if type(v) is not list or len(v) != 2:
        raise _fail("a layout is [tree, specs]")
    tree, specs = v
    if type(specs) is not list or len(specs) > lim.max_tensors:
        raise _fail(f"layout specs must be an array of at most {lim.max_tensors} tensors")
    for spec in specs:
        if type(spec) is not list or not 4 <= len(spec) <= 5:
            raise _fail(f"a tensor spec is [dtype, shape, stride, offset(, flags)], got {_describe(spec)}")
        if len(spec) == 5 and (type(spec[4]) is not int or not 0 < spec[4] <= _SPEC_FLAGS):
            raise _fail(f"tensor spec flags must be an integer in 1..{_SPEC_FLAGS}, got {_describe(spec[4])}")
        dtype, shape, stride, offset = spec[:4]
        if type(dtype) is not str or len(dtype) > 64:
            raise _fail(f"tensor dtype must be a short string, got {_describe(dtype)}")
        for dims, what in ((shape, "shape"), (stride, "stride")):
            if type(dims) is not list or len(dims) > _MAX_NDIM:
                raise _fail(f"tensor {what} must be an array of at most {_MAX_NDIM} integers")
            for d in dims:
                _uint(d, lim)
        if len(shape) != len(stride):
            raise _fail(f"tensor shape has {len(shape)} dims but stride has {len(stride)}")
        _uint(offset, lim)
    seen: set[int] = set()
    # Iterative walk: (node, depth).
    stack: list[tuple[Any, int]] = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > lim.max_depth:
            raise _fail(f"layout nesting exceeds depth {lim.max_depth}")
        if type(node) is int:
            if node < 0 or node >= len(specs) or node in seen:
                raise _fail(f"layout leaf {node} is out of range or used twice")
            seen.add(node)
            continue
        if type(node) is not list or not node or node[0] not in ("d", "l", "t"):
            raise _fail(f"layout node must be an index or a d/l/t container, got {_describe(node)}")
        if node[0] == "d":
            if len(node) != 3 or type(node[1]) is not list or type(node[2]) is not list:
                raise _fail("a dict layout node is ['d', keys, children]")
            keys, children = node[1], node[2]
            if len(keys) != len(children) or any(type(k) is not str for k in keys):
                raise _fail("dict layout keys must be strings, one per child")
            if len(set(keys)) != len(keys):
                raise _fail("dict layout keys must be distinct")
        else:
            if len(node) != 2 or type(node[1]) is not list:
                raise _fail(f"a {node[0]!r} layout node is [{node[0]!r}, children]")
            children = node[1]
        stack.extend((c, depth + 1) for c in children)
    if len(seen) != len(specs):
        raise _fail("layout has tensor specs that no tree leaf uses")
    return v


def _opt_layout(v: Any, lim: Limits) -> Any:
    return None if v is None else _layout(v, lim)


# A peer's value in an error message: bounded in depth and size before it is made (a
# plain repr of a hostile frame recurses as deep as it nests, and walks all of it).
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict = 3, 6, 6, 4
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 40


def _describe(v: Any) -> str:
    r = _REPR.repr(v)
    return f"{type(v).__name__} {r[:40]}{'...' if len(r) > 40 else ''}"


# Types of meta values that check_meta accepts at any max_depth >= 1 without looking
# further (an int needs its range checked too).
_SCALAR_META: Final = (bool, float, str, bytes)
_META_INT_MIN: Final = -(2**63)
_META_INT_END: Final = 2**64


def check_meta(v: Any, max_depth: int = DEFAULT_LIMITS.max_depth) -> None:
    """Raise ProtocolError unless ``v`` is plain msgpack data (None, bool, int, float, str,
    bytes, list/tuple, dict with str keys) nested at most ``max_depth`` deep."""
    stack: list[tuple[Any, int]] = [(v, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            raise _fail(f"meta nesting exceeds depth {max_depth}")
        t = type(node)
        if t in (list, tuple):
            stack.extend((c, depth + 1) for c in node)
        elif t is dict:
            for k, c in node.items():
                if type(k) is not str:
                    raise _fail(f"meta dict keys must be strings, got {_describe(k)}")
                stack.append((c, depth + 1))
        elif node is not None and t not in (bool, int, float, str, bytes):
            raise _fail(f"meta may hold only plain msgpack data, got {_describe(node)}")
        elif t is int and not _META_INT_MIN <= node < _META_INT_END:
            raise _fail(f"meta integer {node} does not fit in 64 bits")


# --------------------------------------------------------------------------- messages


@dataclass(frozen=True, slots=True)
class Hello:
    """Consumer -> producer, first message. Says who the consumer is and where it runs."""

    TYPE: ClassVar[int] = MsgType.HELLO
    version: int
    pid: int
    start_time: int  # process start time (clock ticks since boot); with pid, names a process
    boot_id: str  # /proc/sys/kernel/random/boot_id: same boot <=> same host and boot
    pid_ns: str  # PID namespace identity ("" where unknown)
    backend: str  # "cpu" or "cuda"
    device: str | None  # device identity (GPU UUID) or None on the CPU backend
    credits: int  # how many items this consumer will hold at once, at most
    heartbeat_ms: int  # 0: no heartbeat-based loss detection


@dataclass(frozen=True, slots=True)
class Setup:
    """Producer -> consumer: the ring. Arenas and events are exported once here."""

    TYPE: ClassVar[int] = MsgType.SETUP
    version: int
    pid: int  # the producer; with start_time, checked against the connection's peer
    start_time: int
    pid_ns: str
    backend: str
    device: str | None  # the GPU UUID of the arenas (None on the CPU backend)
    arenas: list[bytes | str]  # backend handles, one per arena
    arena_bytes: list[int]  # size of each arena
    slots: list[tuple[int, int, int]]  # per slot: (arena index, byte offset, nbytes)
    ready_events: list[bytes | str]  # per slot: handle of the producer's ready event
    heartbeat_ms: int


@dataclass(frozen=True, slots=True)
class Attach:
    """Consumer -> producer: the consumer's release-event handles, one per slot."""

    TYPE: ClassVar[int] = MsgType.ATTACH
    release_events: list[bytes | str]


@dataclass(frozen=True, slots=True)
class Ready:
    """Producer -> consumer: slot ``slot`` of generation ``gen`` holds item ``seq``."""

    TYPE: ClassVar[int] = MsgType.READY
    seq: int
    slot: int
    gen: int
    sent_ns: int  # producer's time.monotonic_ns() at send (same host: comparable)
    # Layouts travel once per connection: the first READY with a given layout_id carries
    # the layout, later ones carry None and the consumer uses the one it validated then.
    # layout_id 0 means "not cached": the layout is always present.
    layout_id: int
    layout: Any  # see _layout; None for a layout_id the consumer already has
    meta: Any


@dataclass(frozen=True, slots=True)
class Release:
    """Consumer -> producer: these items are released (batched)."""

    TYPE: ClassVar[int] = MsgType.RELEASE
    entries: list[tuple[int, int, int]]  # (seq, slot, gen)


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Either way, when a side has sent nothing for a while."""

    TYPE: ClassVar[int] = MsgType.HEARTBEAT


@dataclass(frozen=True, slots=True)
class Bye:
    """Either way: this side is closing. From the producer it follows the last READY."""

    TYPE: ClassVar[int] = MsgType.BYE
    reason: str


@dataclass(frozen=True, slots=True)
class Error:
    """Either way: the peer did something wrong; ``code`` is machine-readable."""

    TYPE: ClassVar[int] = MsgType.ERROR
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class Foreign:
    """Producer -> consumer: another producer's arena, which FREADY items reference (zero-copy
    forwarding). Sent once per consumer and ``fid`` before the first FREADY naming it."""

    TYPE: ClassVar[int] = MsgType.FOREIGN
    fid: int  # below Limits.max_foreign; reused only once no item of the old arena is held
    backend: str  # "cpu" or "cuda": the arena's owner's backend
    device: str | None  # GPU UUID of the arena (None on the CPU backend)
    pid: int  # the arena's owner (the upstream producer)
    start_time: int
    handle: bytes | str  # the arena handle exactly as the owner's SETUP carried it
    nbytes: int  # the arena's size


@dataclass(frozen=True, slots=True)
class ForwardReady:
    """Producer -> consumer (FREADY): a READY whose tensors lie in ``nbytes`` bytes at
    ``offset`` of foreign arena ``fid`` (layout offsets are relative to that region). The
    slot and generation are the sender's, released as for READY."""

    TYPE: ClassVar[int] = MsgType.FORWARD_READY
    seq: int
    slot: int
    gen: int
    sent_ns: int
    layout_id: int
    layout: Any
    meta: Any
    fid: int
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Sent:
    """Producer -> consumer, on a remote edge only: the producer's torch.distributed send
    of every item up to ``seq`` it sent this consumer has completed (cumulative; strictly
    increasing on a connection). A remote consumer serves an item only once it is covered
    (``core.remote_session``, invariant 7)."""

    TYPE: ClassVar[int] = MsgType.SENT
    seq: int


@dataclass(frozen=True, slots=True)
class LaneOffer:
    """Producer -> consumer (LANE), after SETUP, only to a consumer of version 4 or later
    on an ipc endpoint: connect to the SOCK_SEQPACKET socket at ``path`` and send
    ``token`` as the first packet; the producer then says SWITCH (see the module
    docstring). A consumer that cannot connect simply stays on ZeroMQ."""

    TYPE: ClassVar[int] = MsgType.LANE_OFFER
    path: str
    token: bytes


@dataclass(frozen=True, slots=True)
class Switch:
    """Either way (SWITCH): the last frame this side sends on ZeroMQ; every later frame
    of this direction travels on the lane, read only after this frame was handled."""

    TYPE: ClassVar[int] = MsgType.SWITCH


Message = Union[Hello, Setup, Attach, Ready, Release, Heartbeat, Bye, Error, Foreign, ForwardReady, Sent,
                LaneOffer, Switch]

# The schema of each message type, as data: field validators in wire order.
SCHEMAS: Final[dict[type[Message], tuple[Validator, ...]]] = {
    Hello: (_uint, _uint, _uint, _text, _text, _text, _opt_text, _uint, _uint),
    Setup: (
        _uint,
        _uint,
        _uint,
        _text,
        _text,
        _opt_text,
        _list_of(_handle, lambda lim: lim.max_slots),
        _list_of(_uint, lambda lim: lim.max_slots),
        _list_of(_slot_desc, lambda lim: lim.max_slots),
        _list_of(_handle, lambda lim: lim.max_slots),
        _uint,
    ),
    Attach: (_list_of(_handle, lambda lim: lim.max_slots),),
    Ready: (_uint, _uint, _uint, _uint, _uint, _opt_layout, _meta),
    Release: (_list_of(_release_entry, lambda lim: lim.max_release_batch),),
    Heartbeat: (),
    Bye: (_text,),
    Error: (_text, _text),
    Foreign: (_foreign_id, _text, _opt_text, _uint, _uint, _handle, _uint),
    ForwardReady: (_uint, _uint, _uint, _uint, _uint, _opt_layout, _meta, _foreign_id, _uint, _uint),
    Sent: (_uint,),
    LaneOffer: (_lane_path, _lane_token),
    Switch: (),
}
_BY_TYPE: Final[dict[int, type[Message]]] = {cls.TYPE: cls for cls in SCHEMAS}
_FIELDS: Final[dict[type[Message], tuple[str, ...]]] = {
    cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in SCHEMAS
}
for _cls, _schema in SCHEMAS.items():
    assert len(_schema) == len(_FIELDS[_cls]), _cls


def _reject_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack extension type {code} is not allowed")


def encode(msg: Message) -> bytes:
    """Encode a message to one frame."""
    cls = type(msg)
    frame: bytes = msgpack.packb(
        [cls.TYPE, *(getattr(msg, f) for f in _FIELDS[cls])], use_bin_type=True
    )
    return frame


def encode_ready(
    seq: int, slot: int, gen: int, sent_ns: int, layout_id: int, layout: Any, meta: Any
) -> bytes:
    """Hot-path encoder for READY, identical in output to ``encode(Ready(...))``."""
    frame: bytes = msgpack.packb([_READY, seq, slot, gen, sent_ns, layout_id, layout, meta], use_bin_type=True)
    return frame


class Encoder:
    """``encode_ready`` and ``encode(Release(...))`` with one reused msgpack Packer: the same
    bytes, without building a Packer (and its buffer) per frame. Not thread-safe: one per
    endpoint, used under that endpoint's lock."""

    __slots__ = ("_pack", "plain")

    def __init__(self) -> None:
        self._pack: Callable[[Any], bytes] = msgpack.Packer(use_bin_type=True).pack
        # A packer's own ``pack`` (a C call, no Python frame) for the steady READY: a list
        # of ints (each below 2**64) and None, which cannot fail to pack, so this packer is
        # never left holding a failed frame's bytes. The result is ``encode_ready``'s:
        # ``plain([READY_TYPE, seq, slot, gen, sent_ns, layout_id, None, None])``.
        self.plain: Callable[[Any], bytes] = msgpack.Packer(use_bin_type=True).pack

    def ready(
        self, seq: int, slot: int, gen: int, sent_ns: int, layout_id: int, layout: Any, meta: Any
    ) -> bytes:
        try:
            return self._pack([_READY, seq, slot, gen, sent_ns, layout_id, layout, meta])
        except BaseException:
            # Never reuse a Packer after a failed pack: some msgpack versions keep its bytes.
            self._pack = msgpack.Packer(use_bin_type=True).pack
            raise

    def forward_ready(
        self, seq: int, slot: int, gen: int, sent_ns: int, layout_id: int, layout: Any, meta: Any,
        fid: int, offset: int, nbytes: int,
    ) -> bytes:
        """``encode(ForwardReady(...))``."""
        try:
            return self._pack([_FORWARD_READY, seq, slot, gen, sent_ns, layout_id, layout, meta, fid, offset, nbytes])
        except BaseException:
            self._pack = msgpack.Packer(use_bin_type=True).pack
            raise

    def release(self, entries: list[tuple[int, int, int]]) -> bytes:
        try:
            return self._pack([_RELEASE, entries])
        except BaseException:
            self._pack = msgpack.Packer(use_bin_type=True).pack
            raise


# --------------------------------------------------------------------------- sender checks
# A producer checks what it sends with the decoder its consumers use, under the same
# Limits, so a message it accepts can never make a consumer fail: the layout once per new
# layout (sendable_layout), the READY/FREADY frame at each send (check_outgoing).

# Metas that msgpack bounds by itself: packing refuses an int outside 64 bits, and a str or
# bytes is bounded by the frame size. Any other meta is checked by decoding its frame.
_BOUNDED_META: Final = (int, float, str, bool, bytes)


def sendable_layout(layout: Any, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """``layout`` encoded, once ``decode`` (with ``limits``) accepts a READY carrying it:
    ProtocolError otherwise (too many tensors or entries in one dict/list, too deep, larger
    than a frame, ...)."""
    decode(encode_ready(0, 0, 0, 0, 1, layout, None), limits)
    packed: bytes = msgpack.packb(layout, use_bin_type=True)
    return packed


def check_outgoing(frame: bytes, meta: Any, layout_bytes: int, limits: Limits = DEFAULT_LIMITS) -> None:
    """ProtocolError unless a consumer decoding with ``limits`` accepts ``frame``, a READY
    or FREADY just encoded with ``meta``, also once a layout of ``layout_bytes`` bytes
    (checked by ``sendable_layout``; 0 when ``frame`` carries its layout already) takes the
    place of its ``None``. Cheap for a scalar meta: only the frame size is checked."""
    size = len(frame) + layout_bytes
    if size > limits.max_frame:
        raise ProtocolError(f"message description (layout + meta) is {size} bytes, over the frame limit of "
                            f"{limits.max_frame}")
    if meta is None or type(meta) in _BOUNDED_META:
        return
    # The consumer's fast path first (it accepts only what decode accepts), then decode,
    # which says what is wrong. A frame's parts are checked separately (depth, entries per
    # container), so the layout checked alone and the meta checked here make the whole.
    if decode_ready(frame, limits) is None:
        decode(frame, limits)


def _unpack(frame: bytes, limits: Limits) -> Any:
    return msgpack.unpackb(
        frame, raw=False, use_list=True, strict_map_key=True, ext_hook=_reject_ext, max_str_len=limits.max_frame,
        max_bin_len=limits.max_frame, max_array_len=limits.max_items, max_map_len=limits.max_items, max_ext_len=0,
    )


def decode_ready(frame: bytes, limits: Limits = DEFAULT_LIMITS) -> tuple[int, int, int, int, int, Any] | None:
    """The steady-state fast path of ``decode``: ``(seq, slot, gen, sent_ns, layout_id,
    meta)`` when ``decode(frame, limits)`` would return a READY without a layout, else None
    (then ``decode`` accepts or rejects the frame, with its reason). Never raises."""
    got = decode_readies((frame,), limits)
    return got[0] if got else None


def decode_readies(
    frames: Sequence[bytes], limits: Limits = DEFAULT_LIMITS
) -> list[tuple[int, int, int, int, int, Any]]:
    """``decode_ready`` of the leading frames of ``frames`` (a consumer's wake-up reads
    several at once): the decoded READYs without a layout, in order, up to the first
    frame that is not one (that frame and the rest are left to ``decode``). One call per
    batch, no Python call per frame on the steady path. Never raises."""
    out: list[tuple[int, int, int, int, int, Any]] = []
    max_frame = limits.max_frame
    if limits.max_depth < 1:  # depth: see check_meta
        return out
    unpackb, append = msgpack.unpackb, out.append
    for frame in frames:
        if len(frame) > max_frame or not frame:
            return out
        try:
            obj = unpackb(  # as _unpack
                frame, raw=False, use_list=True, strict_map_key=True, ext_hook=_reject_ext,
                max_str_len=max_frame, max_bin_len=max_frame, max_array_len=limits.max_items,
                max_map_len=limits.max_items, max_ext_len=0,
            )
        except Exception:
            return out
        if type(obj) is not list or len(obj) != 8:
            return out
        kind, seq, slot, gen, sent_ns, layout_id, layout, meta = obj
        if (
            type(kind) is not int or kind != _READY or layout is not None
            or type(seq) is not int or not 0 <= seq <= _MAX_INT
            or type(slot) is not int or not 0 <= slot <= _MAX_INT
            or type(gen) is not int or not 0 <= gen <= _MAX_INT
            or type(sent_ns) is not int or not 0 <= sent_ns <= _MAX_INT
            or type(layout_id) is not int or not 0 <= layout_id <= _MAX_INT
        ):
            return out
        if meta is not None and type(meta) not in _SCALAR_META:
            if type(meta) is int:
                if not _META_INT_MIN <= meta < _META_INT_END:
                    return out
            else:
                try:
                    check_meta(meta, limits.max_depth)
                except ProtocolError:
                    return out
        append((seq, slot, gen, sent_ns, layout_id, meta))
    return out


def decode_release(frame: bytes, limits: Limits = DEFAULT_LIMITS) -> list[tuple[int, int, int]] | None:
    """The fast path of ``decode`` for RELEASE: its entries when ``decode(frame, limits)``
    would return a Release, else None (then ``decode`` says what is wrong). Never raises."""
    entries: list[tuple[int, int, int]] = []
    return entries if decode_releases((frame,), limits, entries) else None


def decode_releases(frames: Sequence[bytes], limits: Limits, out: list[tuple[int, int, int]]) -> int:
    """``decode_release`` of the leading frames of ``frames`` (a producer's wake-up reads
    several at once): appends their entries to ``out``, in order, and returns how many
    frames it took, up to the first that is not a RELEASE ``decode`` would accept (that
    frame and the rest are left to ``decode``; none of its entries are in ``out``). One
    call per batch, no Python call per frame, no object built per entry (msgpack's arrays
    as tuples: each entry is the ``(seq, slot, gen)`` appended). Never raises."""
    max_frame, max_batch = limits.max_frame, limits.max_release_batch
    unpackb, max_items = msgpack.unpackb, limits.max_items
    n = 0
    for frame in frames:
        if len(frame) > max_frame or not frame:
            return n
        try:
            obj = unpackb(  # as _unpack, but arrays as tuples
                frame, raw=False, use_list=False, strict_map_key=True, ext_hook=_reject_ext, max_str_len=max_frame,
                max_bin_len=max_frame, max_array_len=max_items, max_map_len=max_items, max_ext_len=0,
            )
        except Exception:
            return n
        if type(obj) is not tuple or len(obj) != 2:
            return n
        kind, raw = obj
        if type(kind) is not int or kind != _RELEASE or type(raw) is not tuple or len(raw) > max_batch:
            return n
        for e in raw:
            if type(e) is not tuple or len(e) != 3:
                return n
            seq, slot, gen = e
            if (
                type(seq) is not int or not 0 <= seq <= _MAX_INT
                or type(slot) is not int or not 0 <= slot <= _MAX_INT
                or type(gen) is not int or not 0 <= gen <= _MAX_INT
            ):
                return n
        out += raw  # (the whole frame, or none of it)
        n += 1
    return n


def decode(frame: bytes, limits: Limits = DEFAULT_LIMITS) -> Message:
    """Decode and validate one frame. Raises ProtocolError naming the reason."""
    if len(frame) > limits.max_frame:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds the limit of {limits.max_frame}")
    if not frame:
        raise ProtocolError("empty frame")
    try:
        obj = _unpack(frame, limits)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several types for malformed input
        raise ProtocolError(f"malformed msgpack frame: {type(exc).__name__}: {exc}") from None
    if type(obj) is not list or not obj:
        raise ProtocolError(f"a frame must be a non-empty msgpack array, got {_describe(obj)}")
    kind = obj[0]
    cls = _BY_TYPE.get(kind) if type(kind) is int else None
    if cls is None:
        raise ProtocolError(f"unknown message type {_describe(kind)}")
    if cls is Hello or cls is Setup:
        # Check the version first, so a peer of another version gets a version error even
        # when its message has other fields.
        if len(obj) < 2 or type(obj[1]) is not int or not OLDEST_VERSION <= obj[1] <= HIGHEST_VERSION:
            raise VersionMismatch(obj[1] if len(obj) > 1 else None)
    schema = SCHEMAS[cls]
    if len(obj) - 1 != len(schema):
        raise ProtocolError(f"{cls.__name__.upper()} has {len(obj) - 1} fields, expected {len(schema)}")
    values = []
    for name, check, value in zip(_FIELDS[cls], schema, obj[1:]):
        try:
            values.append(check(value, limits))
        except ProtocolError as exc:
            raise ProtocolError(f"{cls.__name__.upper()}.{name}: {exc}") from None
    return cls(*values)


# --------------------------------------------------------------------------- conversation

# One state machine for both parties, as data (h11's EVENT_TRIGGERED_TRANSITIONS):
# TRANSITIONS[role][state][(sender, message type)] -> that role's next state. An event is
# a message and who sends it: for a role, an event of its own is a send, one of the peer's
# a receipt; absent from the state's table, it is a protocol violation (a peer's) or a bug
# (ours). The tests drive both roles' tables against each other (every frame one side may
# send in a state is accepted by the other in every state it can be in when it arrives).
# LANE and SWITCH also move the lane's region (LANE_TRANSITIONS), which both roles share.
Event = tuple[Role, MsgType]
_PRODUCER: Final = Role.PRODUCER
_CONSUMER: Final = Role.CONSUMER


def _events(sender: Role, to: State, *types: MsgType) -> dict[Event, State]:
    return {(sender, t): to for t in types}


def _table() -> dict[Role, dict[State, dict[Event, State]]]:
    p, c, m = _PRODUCER, _CONSUMER, MsgType
    st = State
    return {
        p: {
            # (A refused HELLO is answered by an ERROR without a conversation.)
            st.AWAIT_HELLO: {(c, m.HELLO): st.SETUP_DUE},
            st.SETUP_DUE: {(p, m.SETUP): st.AWAIT_ATTACH, (p, m.ERROR): st.ERROR},
            # (Before its ATTACH the consumer may only heartbeat, or end with ERROR.)
            st.AWAIT_ATTACH: {
                (c, m.ATTACH): st.ACTIVE, (c, m.HEARTBEAT): st.AWAIT_ATTACH, (c, m.ERROR): st.ERROR,
                **_events(p, st.AWAIT_ATTACH, m.LANE_OFFER, m.SWITCH, m.HEARTBEAT),
                (p, m.BYE): st.BYE_SENT, (p, m.ERROR): st.ERROR,
            },
            st.ACTIVE: {
                **_events(c, st.ACTIVE, m.RELEASE, m.HEARTBEAT, m.SWITCH),
                (c, m.BYE): st.ACK_DUE, (c, m.ERROR): st.ERROR,
                **_events(p, st.ACTIVE, m.READY, m.FOREIGN, m.FORWARD_READY, m.SWITCH, m.HEARTBEAT, m.SENT),
                (p, m.BYE): st.BYE_SENT, (p, m.ERROR): st.ERROR,
            },
            # (A consumer still handshaking may ATTACH after our BYE; SENT confirms the last
            # sends of a remote edge after it.)
            st.BYE_SENT: {
                **_events(c, st.BYE_SENT, m.ATTACH, m.RELEASE, m.HEARTBEAT, m.SWITCH),
                (c, m.BYE): st.ACK_DUE, (c, m.ERROR): st.ERROR,
                **_events(p, st.BYE_SENT, m.SWITCH, m.HEARTBEAT, m.SENT), (p, m.ERROR): st.ERROR,
            },
            st.ACK_DUE: {(p, m.BYE): st.CLOSED},
            st.CLOSED: {},
            st.ERROR: {},
        },
        c: {
            # (The producer answers a HELLO with SETUP or ERROR before anything else. HELLO
            # again: the same one after a reconnect, or one of the older version.)
            # (A consumer may heartbeat while it waits: ours starts at its ATTACH.)
            st.AWAIT_SETUP: {
                (p, m.SETUP): st.ATTACH_DUE, (p, m.ERROR): st.ERROR,
                (c, m.HELLO): st.AWAIT_SETUP, (c, m.HEARTBEAT): st.AWAIT_SETUP, (c, m.ERROR): st.ERROR,
            },
            st.ATTACH_DUE: {(c, m.ATTACH): st.ACTIVE, (c, m.ERROR): st.ERROR},
            st.ACTIVE: {
                **_events(p, st.ACTIVE, m.READY, m.FOREIGN, m.FORWARD_READY, m.HEARTBEAT, m.SENT, m.LANE_OFFER,
                          m.SWITCH),
                (p, m.BYE): st.ENDING, (p, m.ERROR): st.ERROR,
                **_events(c, st.ACTIVE, m.RELEASE, m.HEARTBEAT, m.SWITCH),
                (c, m.BYE): st.BYE_SENT, (c, m.ERROR): st.ERROR,
            },
            # (SENT after BYE: the producer's last items are confirmed once their sends complete.)
            st.ENDING: {
                **_events(p, st.ENDING, m.HEARTBEAT, m.SENT, m.SWITCH), (p, m.ERROR): st.ERROR,
                **_events(c, st.ENDING, m.RELEASE, m.HEARTBEAT, m.SWITCH),
                (c, m.BYE): st.AWAIT_ACK, (c, m.ERROR): st.ERROR,
            },
            # Items arriving after our BYE are dropped (the producer frees their slots when it
            # reads the BYE); a SWITCH is still answered, since the ack may come on the lane.
            st.BYE_SENT: {
                **_events(p, st.BYE_SENT, m.READY, m.FOREIGN, m.FORWARD_READY, m.HEARTBEAT, m.SENT,
                          m.LANE_OFFER, m.SWITCH),
                (p, m.BYE): st.CLOSED, (p, m.ERROR): st.ERROR,
                (c, m.SWITCH): st.BYE_SENT, (c, m.ERROR): st.ERROR,
            },
            st.AWAIT_ACK: {
                **_events(p, st.AWAIT_ACK, m.HEARTBEAT, m.SENT, m.SWITCH),
                (p, m.BYE): st.CLOSED, (p, m.ERROR): st.ERROR,
                (c, m.SWITCH): st.AWAIT_ACK, (c, m.ERROR): st.ERROR,
            },
            st.CLOSED: {},
            st.ERROR: {},
        },
    }


TRANSITIONS: Final[dict[Role, dict[State, dict[Event, State]]]] = _table()

# The lane's region: LANE, then the producer's SWITCH, then the consumer's (its answer).
_LANE: Final[dict[LanePhase, dict[Event, LanePhase]]] = {
    LanePhase.NONE: {(_PRODUCER, MsgType.LANE_OFFER): LanePhase.OFFERED},
    LanePhase.OFFERED: {(_PRODUCER, MsgType.SWITCH): LanePhase.SWITCHING},
    LanePhase.SWITCHING: {(_CONSUMER, MsgType.SWITCH): LanePhase.SWITCHED},
    LanePhase.SWITCHED: {},
}
LANE_TRANSITIONS: Final[dict[Role, dict[LanePhase, dict[Event, LanePhase]]]] = {
    _PRODUCER: _LANE, _CONSUMER: _LANE}
LANE_TYPES: Final = frozenset({MsgType.LANE_OFFER, MsgType.SWITCH})
INITIAL: Final[dict[Role, State]] = {_PRODUCER: State.AWAIT_HELLO, _CONSUMER: State.AWAIT_SETUP}
ENDED: Final = frozenset({State.CLOSED, State.ERROR})  # nothing more is read or said
# States, and lane phases, whose next event is a frame of our own, said before anything more
# is read: the SETUP answering a HELLO, the ATTACH answering a SETUP, the ack of a BYE, and
# the consumer's SWITCH answering the producer's.
DUE: Final = frozenset({State.SETUP_DUE, State.ATTACH_DUE, State.ACK_DUE})
LANE_DUE: Final[dict[Role, frozenset[LanePhase]]] = {
    _PRODUCER: frozenset(), _CONSUMER: frozenset({LanePhase.SWITCHING})}
PEER_OF: Final[dict[Role, Role]] = {_PRODUCER: _CONSUMER, _CONSUMER: _PRODUCER}


class Conversation:
    """The protocol state of one connection, seen from one side (``role``): its ``state``
    and its ``lane`` phase, moved by what it receives (``receive``) and what it sends
    (``send``), both checked against the same tables."""

    __slots__ = ("role", "peer", "state", "lane")

    def __init__(self, role: Role | str) -> None:
        try:
            self.role = Role(role)
        except ValueError:
            raise ValueError(f"role must be 'producer' or 'consumer', not {role!r}") from None
        self.peer = PEER_OF[self.role]
        self.state = INITIAL[self.role]
        self.lane = LanePhase.NONE

    def _next(self, sender: Role, t: MsgType) -> tuple[State, LanePhase] | str:
        """The states ``(sender, t)`` leads to, or why it is not allowed now."""
        event = (sender, t)
        nxt = TRANSITIONS[self.role][self.state].get(event)
        if nxt is None:
            return f"in state {self.state.value!r}"
        if t not in LANE_TYPES:
            return nxt, self.lane
        lane = LANE_TRANSITIONS[self.role][self.lane].get(event)
        if lane is None:
            return f"in state {self.state.value!r} with the lane {self.lane.value!r}"
        return nxt, lane

    def receive(self, msg: Message | MsgType) -> State:
        """Advance on a received message (or its type); return the new state. Raises
        ProtocolError naming the frame and the state for a message that is not allowed
        now (the state does not change)."""
        t = MsgType(msg if isinstance(msg, int) else msg.TYPE)
        if self.state in ENDED:
            how = "closed" if self.state is State.CLOSED else "ended with an error"
            raise ProtocolError(f"{t.name} received after the connection {how}")
        nxt = self._next(self.peer, t)
        if isinstance(nxt, str):
            raise ProtocolError(f"{t.name} is not allowed while the {self.role.value} is {nxt}")
        self.state, self.lane = nxt
        return self.state

    def may_send(self, t: MsgType) -> bool:
        return not isinstance(self._next(self.role, t), str)

    def send(self, t: MsgType) -> State:
        """Advance on a message this side sends; ProtocolError (a bug of ours, never the
        peer's) if the tables do not allow it now."""
        nxt = self._next(self.role, t)
        if isinstance(nxt, str):
            raise ProtocolError(f"the {self.role.value} may not send {t.name} {nxt}")
        self.state, self.lane = nxt
        return self.state

    def close(self) -> None:
        """Ended locally (connection dropped or closed): nothing more is read. An ERROR
        state stays."""
        if self.state is not State.ERROR:
            self.state = State.CLOSED

    def fail(self) -> None:
        """Ended by an error, whether or not an ERROR frame could be said."""
        self.state = State.ERROR


# The one SWITCH frame: a sender recognises its own marker by identity (``frame is
# SWITCH_FRAME``) when it leaves, to move the rest of that direction onto the lane.
SWITCH_FRAME: Final[bytes] = msgpack.packb([int(MsgType.SWITCH)], use_bin_type=True)
