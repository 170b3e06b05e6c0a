"""The consumer's channel: its DEALER (``ConsumerChannel``), connected to the producer's
endpoint, and its lane once the producer offered one (``runtime.transport.lane``)."""

from __future__ import annotations

import logging
import socket

import zmq

from ...core import protocol as P
from ...errors import ConfigError
from .address import Endpoint
from .curve import CurveKeys, apply_curve
from .lane import Lane, LaneClosed, LaneMux, connect_lane, lane_enabled
from .socket_channel import SocketChannel, configure, context, raise_fd_limit

__all__ = ["ConsumerChannel"]

_log = logging.getLogger(__name__)
_NOBLOCK = int(zmq.NOBLOCK)


class ConsumerChannel(SocketChannel):
    """A consumer's DEALER, connected (ZeroMQ retries until the producer binds), and its
    lane once the producer offered one (``runtime.transport.lane``).

    Lane states: none; ``lane`` connected and its token sent, waiting for the producer's
    SWITCH (``lane_in`` False; an EOF now means the producer refused it: ``lane_refused``,
    the edge stays on ZeroMQ); switched (``switch_in``): frames are read from the lane,
    and, once our SWITCH went out on ZeroMQ (``lane_out``), sent on it. ``lane_lost``: a
    switched lane closed (the same evidence as a closed ZeroMQ connection)."""

    def __init__(self, endpoint: Endpoint, identity: bytes, max_frame: int,
                 curve: CurveKeys | None = None) -> None:
        self.endpoint = endpoint
        self.max_frame = max_frame
        raise_fd_limit()
        self.sock = context().socket(zmq.DEALER)
        try:
            configure(self.sock, max_frame)
            apply_curve(self.sock, curve, server=False)
            self.sock.setsockopt(zmq.ROUTING_ID, identity)
            self.sock.setsockopt(zmq.RECONNECT_IVL, 50)
            self._setup_monitor()
            self._bind_hot()
            self.sock.connect(endpoint.url)
        except BaseException:
            self.close()
            raise
        self.lane: Lane | None = None
        self.lane_in = False
        self.lane_out = False
        self.lane_refused = False
        self.lane_lost = False
        self.lane_unsendable = False  # a send on it failed: see _lane_send_failed
        # The lane while it carries every frame both ways (switched in and out, not lost):
        # what the consumer's steady pump reads (``read_lane``) and sends on; else None.
        self.steady_lane: Lane | None = None
        self._switch: bytes | None = None  # our SWITCH, until ZeroMQ took it
        if endpoint.path is not None and lane_enabled():
            try:
                self.mux = LaneMux()
            except OSError as exc:
                _log.info("ipcsync consumer %r: no lane (%s); staying on ZeroMQ", endpoint.name, exc)

    connection_fd = -1  # our end of the current connection (monitor: CONNECTED), -1 if none
    _held_events: list[tuple[int, int]] | None = None

    @property
    def lane_used(self) -> bool:
        """Frames travel on the lane in both directions now."""
        return self.lane_in and self.lane_out and not self.lane_lost

    def events(self) -> list[tuple[int, int]] | tuple[tuple[int, int], ...]:
        """As ``SocketChannel.events``; also keeps ``connection_fd`` up to date."""
        held, self._held_events = self._held_events, None
        got = super().events()
        out = held + list(got) if held else got
        for ev, fd in out:
            if ev == zmq.EVENT_CONNECTED:
                self.connection_fd = fd
            elif ev == zmq.EVENT_DISCONNECTED and fd == self.connection_fd:
                self.connection_fd = -1
        return out

    def current_connection_fd(self) -> int:
        """``connection_fd`` after the monitor events already queued (they are kept for the
        next ``events()`` call, so nothing is lost to the caller)."""
        pending = self.events()
        if pending:
            self._held_events = list(pending)
        return self.connection_fd

    def pending(self) -> bool:
        """As ``SocketChannel.pending``; monitor events held back above count too."""
        return bool(self._held_events) or super().pending()

    # ------------------------------------------------------------------ the lane
    def connect_lane(self, offer: P.LaneOffer, producer_pid: int | None) -> str | None:
        """Connect to the lane the producer offered and send its token; None if done,
        else why not (the edge stays on ZeroMQ)."""
        if self.mux is None or self.lane is not None or self.lane_refused:
            return "lanes are off for this consumer" if self.mux is None else "a lane was offered already"
        try:
            self.lane = connect_lane(offer.path, offer.token, self.max_frame, producer_pid)
        except (OSError, ConfigError) as exc:
            return str(exc)
        return None

    def check_lane(self) -> None:
        """Before the producer's SWITCH: an EOF on the lane means it refused it (close it,
        stay on ZeroMQ). Input already there is left for after the SWITCH."""
        lane = self.lane
        if lane is None or self.lane_in:
            return
        try:
            peek = lane.sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return
        except OSError:
            peek = b""
        if not peek:
            _log.info("ipcsync consumer %r: the producer refused the lane; staying on ZeroMQ", self.endpoint.name)
            lane.close()
            self.lane = None
            self.lane_refused = True

    def switch_in(self, frame: bytes) -> None:
        """The producer's SWITCH was handled: read the lane from now on; ``frame`` (our
        SWITCH) goes out on ZeroMQ as our last frame there, before any frame of ours
        goes on the lane."""
        self.lane_in = True
        if self.lane is None:
            # It accepted the lane and closed it since (it dropped us): a closed connection.
            self.lane_lost = True
            return
        assert self.mux is not None
        self.mux.add(self.lane.fd)
        self._switch = frame
        self._send_switch()

    def _send_switch(self) -> bool:
        self._sock_quiet = False  # a send processes the socket's commands (class docstring)
        try:
            self._send(self._switch, _NOBLOCK)
        except zmq.Again:
            return False
        except KeyboardInterrupt:  # (raised once the send returned: our SWITCH went out)
            self._switched_out()
            raise
        self._switched_out()
        return True

    def _switched_out(self) -> None:
        """Our SWITCH went out: our frames go on the lane from now on, and it is never
        sent twice (the producer refuses a second one)."""
        self._switch = None
        self.lane_out = True
        if self.lane_in and not self.lane_lost:
            self.steady_lane = self.lane

    def _lane_send_failed(self) -> None:
        """A send on the lane failed (the producer closed it): nothing more goes out, but
        what it sent before closing is still read, up to the EOF that makes the lane lost
        (a last word, an abort's ERROR, is never dropped by our failed send)."""
        self.lane_unsendable = True
        self.steady_lane = None

    def _lane_broken(self) -> None:
        self.lane_lost = True
        self.steady_lane = None
        lane = self.lane
        if lane is not None and self.mux is not None:
            self.mux.remove(lane.fd)

    def read_lane(self, out: list[bytes], most: int) -> None:
        """The steady path's read (``steady_lane`` set): append the frames that arrived on
        the lane, up to ``most``. A closed lane is marked lost (``lane_lost``) once the
        frames read before its EOF are in ``out``. ZeroMQ is not looked at: after the
        producer's SWITCH it sends nothing more there (``runtime.transport.lane``'s order rule),
        so only its monitor events can come, read at the next general pump."""
        lane = self.steady_lane
        if lane is None:  # (lost since the caller looked, or a send found it closed)
            return
        try:
            lane.recv_into(out, most)
        except LaneClosed:
            self._lane_broken()

    def recv(self) -> list[bytes] | None:
        if self.lane_in and not self.lane_lost and self.lane is not None:
            try:
                frame = self.lane.recv()
            except LaneClosed:
                self._lane_broken()
                frame = None
            if frame is not None:
                return [frame]
        # (After the switch a producer sends nothing more on ZeroMQ; anything that still
        # comes is handled after the lane's frames.)
        return self._recv_parts(True)

    def send(self, frame: bytes) -> bool:
        if self.lane_out:
            lane = self.lane  # (set while lane_out, until the channel closes)
            if lane is None or self.lane_lost or self.lane_unsendable:
                return True  # nothing reaches the producer any more; the loss is being handled
            try:
                return lane.send(frame)
            except OSError:
                self._lane_send_failed()
                return True
        if self._switch is not None:
            if not self._send_switch():
                return False
            return self.send(frame)  # our SWITCH went out (lane_out): the rest goes on the lane
        self._sock_quiet = False  # a send processes the socket's commands (class docstring)
        try:
            self._send(frame, _NOBLOCK)
            return True
        except zmq.Again:
            return False

    def flush_lane(self) -> None:
        """Our SWITCH, and what is left of a split frame on the lane, if anything is."""
        if self._switch is not None:
            self._send_switch()
        lane = self.lane
        if lane is not None and lane.tail and not self.lane_lost and not self.lane_unsendable:
            try:
                lane.flush()
            except OSError:
                self._lane_send_failed()

    def close(self) -> None:
        super().close()
        lane, self.lane = getattr(self, "lane", None), None
        self.steady_lane = None
        if lane is not None:
            lane.close()
        mux, self.mux = self.mux, None
        if mux is not None:
            mux.close()
