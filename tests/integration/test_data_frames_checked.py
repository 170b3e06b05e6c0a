"""Every frame the producer sends, data included, passes its protocol machine
(``ipcsync.core.states``): a READY to a consumer whose conversation is not ACTIVE is a
ProtocolError naming the frame and the state, never a frame on the wire.

The state is forced here (the library never delivers outside ACTIVE: the ring hands items
to attached consumers only, and a producer says BYE only with nothing queued), so the test
shows the check is on the data path, not that the path is reached."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import ipcsync
from ipcsync.core import protocol as P


@pytest.mark.timeout(60)
def test_a_ready_outside_active_is_refused_by_the_producers_machine(endpoints: Any) -> None:
    out = endpoints.producer("frames-checked", slots=4, slot_bytes=4096, heartbeat=None, timeout=10)
    inp = endpoints.consumer("frames-checked", heartbeat=None, timeout=10)
    out.wait_for_consumers(1, timeout=10)
    out.send({"x": torch.zeros(4)}, timeout=10)
    assert inp.get(timeout=10)["x"].sum().item() == 0.0
    (peer,) = list(out.port.peers)
    conv = peer.session.conv
    conv.state = P.State.BYE_SENT  # (as if our BYE had gone first)
    try:
        with pytest.raises(ipcsync.ProtocolError, match=r"the producer may not send READY in state 'bye_sent'"):
            out.send({"x": torch.ones(4)}, timeout=10)
    finally:
        conv.state = P.State.ACTIVE
    with pytest.raises(ipcsync.IpcTimeoutError):
        inp.get(timeout=0.5)  # nothing reached the wire
