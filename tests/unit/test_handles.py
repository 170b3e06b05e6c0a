"""backends.handles: the SETUP handle of an arena shared by descriptor is read as a peer
wrote it: anything but ``[magic, positive int, ...]`` of the right length is not one (None)
or a clear BackendError, never an exception of msgpack's or a wrong size."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, strategies as st

from ipcsync.backends import handles
from ipcsync.backends.cpu_descriptors import parse_descriptor as cpu_size
from ipcsync.backends.cuda_vmm import parse_descriptor as vmm_size
from ipcsync.errors import BackendError


def test_a_handle_round_trips() -> None:
    h = handles.pack("m", 3, 4096)
    assert handles.unpack(h, "m", 2) == [3, 4096]
    assert handles.unpack(h, "other", 2) is None


@pytest.mark.parametrize("fields", [["m"], ["m", 1], ["m", 1, 2, 3], ["m", 0, 2], ["m", -1, 2], ["m", 1, "2"],
                                    ["m", 1, 2.0], ["m", True, 2]])
def test_a_malformed_handle_of_the_kind_is_refused(fields: list[Any]) -> None:
    with pytest.raises(BackendError, match="malformed"):
        handles.unpack(msgpack.packb(fields), "m", 2)


@given(st.one_of(st.binary(max_size=80), st.text(max_size=20),
                 st.builds(msgpack.packb, st.recursive(st.integers(-(2**63), 2**64 - 1) | st.text(max_size=8) | st.binary(max_size=8),
                                                       lambda c: st.lists(c, max_size=4), max_leaves=10))))
def test_whatever_a_peer_sends_is_none_a_size_or_a_backend_error(handle: Any) -> None:
    for parse in (cpu_size, vmm_size):
        try:
            size = parse(handle)
        except BackendError:
            continue
        assert size is None or (type(size) is int and size > 0)
