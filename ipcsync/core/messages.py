"""The ipcsync wire protocol's messages, as data: the message types (``MsgType``), one
frozen dataclass per message, and the schema of each (``SCHEMAS``: a validator per field,
in wire order), with the versions, the error codes and the hard caps (``Limits``) they are
checked against. No I/O.

A frame is one msgpack array ``[type, field, field, ...]`` whose fields follow the schema
of its type. Every validator takes a decoded value and the limits and returns the value
to store or raises :class:`~ipcsync.errors.ProtocolError` naming the reason; ``decode``
(``ipcsync.core.codec``) runs them before a message object exists. The conversation these
messages make: ``ipcsync.core.protocol``.
"""

from __future__ import annotations

import dataclasses
import reprlib
from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import Any, Callable, ClassVar, Final, Union

from ..errors import ProtocolError

__all__ = [
    "PROTOCOL_VERSION", "OLDEST_VERSION", "LANE_VERSION", "SENT_VERSION", "HIGHEST_VERSION", "LANE_TOKEN_BYTES",
    "SPEC_REQUIRES_GRAD", "SPEC_PARAMETER", "MAX_INT", "MAX_LAYOUT_IDS", "MsgType", "ErrorCode", "Limits",
    "DEFAULT_LIMITS", "VersionMismatch", "Validator", "describe", "SCALAR_META", "META_INT_MIN", "META_INT_END",
    "check_meta", "Hello", "Setup", "Attach", "Ready", "Release", "Heartbeat", "Bye", "Error", "Foreign",
    "ForwardReady", "Sent", "LaneOffer", "Switch", "Message", "SCHEMAS", "BY_TYPE", "FIELDS",
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
MAX_INT: Final = 2**62
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
    if type(v) is not int or v < 0 or v > MAX_INT:
        raise _fail(f"expected a non-negative integer, got {describe(v)}")
    return v


def _int(v: Any, lim: Limits) -> int:
    if type(v) is not int or abs(v) > MAX_INT:
        raise _fail(f"expected an integer, got {describe(v)}")
    return v


def _text(v: Any, lim: Limits) -> str:
    if type(v) is not str or len(v) > _MAX_TEXT:
        raise _fail(f"expected a string of at most {_MAX_TEXT} characters, got {describe(v)}")
    return v


def _opt_text(v: Any, lim: Limits) -> str | None:
    return None if v is None else _text(v, lim)


def _handle(v: Any, lim: Limits) -> bytes | str:
    if type(v) not in (bytes, str) or len(v) > _MAX_HANDLE_BYTES:
        raise _fail(f"expected a handle (bytes or str up to {_MAX_HANDLE_BYTES}), got {describe(v)}")
    handle: bytes | str = v
    return handle


def _list_of(item: Validator, cap: Callable[[Limits], int]) -> Validator:
    def check(v: Any, lim: Limits) -> list[Any]:
        if type(v) is not list:
            raise _fail(f"expected an array, got {describe(v)}")
        if len(v) > cap(lim):
            raise _fail(f"array of {len(v)} entries exceeds the limit of {cap(lim)}")
        return [item(x, lim) for x in v]

    return check


def _uint_triple(what: str) -> Validator:
    """A validator of ``[a, b, c]``, three unsigned ints; ``what`` names them in errors."""

    def check(v: Any, lim: Limits) -> tuple[int, int, int]:
        if type(v) is not list or len(v) != 3:
            raise _fail(f"{what}, got {describe(v)}")
        return (_uint(v[0], lim), _uint(v[1], lim), _uint(v[2], lim))

    return check


_slot_desc = _uint_triple("a slot descriptor is [arena, offset, nbytes]")
_release_entry = _uint_triple("a release entry is [seq, slot, gen]")


def _foreign_id(v: Any, lim: Limits) -> int:
    if type(v) is not int or not 0 <= v < lim.max_foreign:
        raise _fail(f"expected a foreign arena id below {lim.max_foreign}, got {describe(v)}")
    return v


def _lane_path(v: Any, lim: Limits) -> str:
    if (type(v) is not str or not v.startswith("/") or "\0" in v
            or len(v.encode("utf-8", "surrogatepass")) > _LANE_PATH_MAX):
        raise _fail(f"expected an absolute socket path of at most {_LANE_PATH_MAX} bytes, got {describe(v)}")
    return v


def _lane_token(v: Any, lim: Limits) -> bytes:
    if type(v) is not bytes or len(v) != LANE_TOKEN_BYTES:
        raise _fail(f"expected a token of {LANE_TOKEN_BYTES} bytes, got {describe(v)}")
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
            raise _fail(f"a tensor spec is [dtype, shape, stride, offset(, flags)], got {describe(spec)}")
        if len(spec) == 5 and (type(spec[4]) is not int or not 0 < spec[4] <= _SPEC_FLAGS):
            raise _fail(f"tensor spec flags must be an integer in 1..{_SPEC_FLAGS}, got {describe(spec[4])}")
        dtype, shape, stride, offset = spec[:4]
        if type(dtype) is not str or len(dtype) > 64:
            raise _fail(f"tensor dtype must be a short string, got {describe(dtype)}")
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
            raise _fail(f"layout node must be an index or a d/l/t container, got {describe(node)}")
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


def describe(v: Any) -> str:
    r = _REPR.repr(v)
    return f"{type(v).__name__} {r[:40]}{'...' if len(r) > 40 else ''}"


# Types of meta values that check_meta accepts at any max_depth >= 1 without looking
# further (an int needs its range checked too).
SCALAR_META: Final = (bool, float, str, bytes)
META_INT_MIN: Final = -(2**63)
META_INT_END: Final = 2**64


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
                    raise _fail(f"meta dict keys must be strings, got {describe(k)}")
                stack.append((c, depth + 1))
        elif node is not None and t not in (bool, int, float, str, bytes):
            raise _fail(f"meta may hold only plain msgpack data, got {describe(node)}")
        elif t is int and not META_INT_MIN <= node < META_INT_END:
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
    ``token`` as the first packet; the producer then says SWITCH (see
    ``ipcsync.core.protocol``). A consumer that cannot connect simply stays on ZeroMQ."""

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
BY_TYPE: Final[dict[int, type[Message]]] = {cls.TYPE: cls for cls in SCHEMAS}
FIELDS: Final[dict[type[Message], tuple[str, ...]]] = {
    cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in SCHEMAS
}
for _cls, _schema in SCHEMAS.items():
    assert len(_schema) == len(FIELDS[_cls]), _cls

