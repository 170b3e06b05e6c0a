"""The protocol's enums agree with the wire and with the library: every message class's
TYPE is its MsgType, the first element of its encoded frame and of the hot-path encoders'
frames; every error code the library sends is an ErrorCode; the state machine speaks only
in States."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Any, Iterator

import msgpack
import pytest

from ipcsync.core import protocol as P
from ipcsync.core.protocol import ErrorCode, MsgType, State

LIBRARY = Path(P.__file__).resolve().parents[1]  # ipcsync/


def _placeholder(cls: type) -> Any:
    """An instance of message class ``cls`` with placeholder fields (``encode`` packs the
    fields as they are; it validates nothing)."""
    return cls(*(0 for _ in dataclasses.fields(cls)))


# --------------------------------------------------------------------------- MsgType
def test_every_message_class_has_a_distinct_msgtype() -> None:
    types = [cls.TYPE for cls in P.SCHEMAS]
    assert all(isinstance(t, MsgType) for t in types)
    assert len(set(types)) == len(types)
    assert set(types) == set(MsgType), "a MsgType without a message class, or the reverse"


@pytest.mark.parametrize("cls", list(P.SCHEMAS), ids=lambda c: c.__name__)
def test_msgtype_matches_the_class_name_and_the_wire(cls: type) -> None:
    snake = "".join("_" + ch if ch.isupper() else ch for ch in cls.__name__).lstrip("_").upper()
    assert MsgType[snake] is cls.TYPE
    wire = msgpack.unpackb(P.encode(_placeholder(cls)))
    assert type(wire[0]) is int and wire[0] == cls.TYPE == MsgType[snake].value
    assert len(wire) == 1 + len(dataclasses.fields(cls))


def test_hot_path_encoders_put_the_same_type_first() -> None:
    ready = (7, 1, 3, 2**40, 0, None, {"i": 1})
    enc = P.Encoder()
    assert msgpack.unpackb(P.encode_ready(*ready))[0] == MsgType.READY
    assert P.encode_ready(*ready) == enc.ready(*ready) == P.encode(P.Ready(*ready))
    fready = (*ready, 9, 64, 128)
    assert enc.forward_ready(*fready) == P.encode(P.ForwardReady(*fready))
    assert msgpack.unpackb(enc.forward_ready(*fready))[0] == MsgType.FORWARD_READY
    assert enc.release([(1, 2, 3)]) == P.encode(P.Release([(1, 2, 3)]))
    assert msgpack.unpackb(enc.release([(1, 2, 3)]))[0] == MsgType.RELEASE


# --------------------------------------------------------------------------- ErrorCode
def _literal_codes(node: ast.AST) -> Iterator[tuple[str, int]]:
    """String constants an expression can evaluate to (both arms of ``a if c else b``);
    an ``ErrorCode.X`` attribute is its value."""
    if isinstance(node, ast.Attribute) and node.attr == "value":  # ErrorCode.X.value
        node = node.value
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value, node.lineno
    elif isinstance(node, ast.IfExp):
        yield from _literal_codes(node.body)
        yield from _literal_codes(node.orelse)
    elif isinstance(node, ast.Attribute) and (
        (isinstance(node.value, ast.Name) and node.value.id == "ErrorCode")
        or (isinstance(node.value, ast.Attribute) and node.value.attr == "ErrorCode")  # P.ErrorCode.X
    ):
        yield ErrorCode[node.attr].value, node.lineno


def _call_name(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def library_error_codes() -> dict[str, list[str]]:
    """Every error code the library sends or compares against, with where: the first
    argument of ``Error(...)``, the code argument of ``_fail(error, code)``, ``code = ...``
    assignments, the code of the ``(code, text)`` tuples ``*_problem`` methods return, and
    ``msg.code == ...`` comparisons."""
    found: dict[str, list[str]] = {}

    def add(node: ast.AST, path: Path) -> None:
        for code, line in _literal_codes(node):
            found.setdefault(code, []).append(f"{path.relative_to(LIBRARY.parent)}:{line}")

    for path in sorted(LIBRARY.rglob("*.py")):
        if "doctor" in path.parts or "launch" in path.parts:
            continue  # they speak to the user, not to a peer
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _call_name(node) == "Error" and node.args:
                add(node.args[0], path)
            elif isinstance(node, ast.Call) and _call_name(node) == "_fail" and len(node.args) >= 2:
                add(node.args[1], path)
            elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "code"
                                                       for t in node.targets):
                add(node.value, path)
            elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) \
                    and node.left.attr == "code":
                for right in node.comparators:
                    add(right, path)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.endswith("_problem"):
                for ret in ast.walk(node):
                    if isinstance(ret, ast.Return) and isinstance(ret.value, ast.Tuple) and ret.value.elts:
                        add(ret.value.elts[0], path)
    return found


def test_errorcode_covers_every_code_the_library_sends() -> None:
    found = library_error_codes()
    # The scan itself works: it sees codes that certainly are sent.
    assert {"protocol", "version", "failed", "uid", "identity", "host", "credits"} <= set(found), found
    known = {c.value for c in ErrorCode}
    unknown = {code: where for code, where in found.items() if code not in known}
    assert not unknown, f"error codes sent but missing from ErrorCode: {unknown}"


def test_errorcode_values_are_distinct_and_lower_case() -> None:
    values = [c.value for c in ErrorCode]
    assert len(set(values)) == len(values)
    assert all(v == v.lower() and v == c.name.lower() for c, v in zip(ErrorCode, values))
    assert ErrorCode.PROTOCOL == "protocol"  # a str enum: compares equal to the wire value


# --------------------------------------------------------------------------- State
def test_machines_and_joint_rules_use_only_roles_states_and_message_types() -> None:
    assert set(P.MACHINES) == set(P.Role)
    for role, states in P.MACHINES.items():
        for state, sends in states.items():
            assert isinstance(state, State), (role, state)
            assert all(t in P.MsgType and isinstance(nxt, State) for t, nxt in sends.items()), (role, state)
    for (sender, t), rule in P.JOINT.items():
        assert sender in P.Role and t in P.MsgType
        reader = P.PEER_OF[sender]
        assert set(rule) | set(rule.values()) <= set(P.MACHINES[reader]), (sender, t, rule)
        assert not set(rule) & P.ENDED, (sender, t)  # an ended party reads nothing
    for phase, table in P.LANE_TRANSITIONS.items():
        assert isinstance(phase, P.LanePhase)
        assert all(t in P.LANE_TYPES and isinstance(nxt, P.LanePhase) for (_, t), nxt in table.items())


def test_data_frames_move_no_state() -> None:
    """The steady paths check a batch of data frames once (``states.DATA_TYPES``)."""
    from ipcsync.core.states import DATA_TYPES
    for role, states in P.MACHINES.items():
        for state, sends in states.items():
            assert all(sends[t] is state for t in DATA_TYPES & set(sends)), (role, state)
        assert not any((role, t) in P.JOINT for t in DATA_TYPES), role
    assert not DATA_TYPES & P.LANE_TYPES


def test_every_state_a_transition_reaches_is_a_state_of_that_role() -> None:
    for role, states in P.MACHINES.items():
        reached = {nxt for sends in states.values() for nxt in sends.values()}
        reached |= {nxt for (sender, _t), rule in P.JOINT.items() if sender is P.PEER_OF[role]
                    for nxt in rule.values()}
        assert reached <= set(states), (role, reached - set(states))
        assert P.Conversation(role).state in states
        # Only the ends accept nothing (the producer, before the HELLO, says nothing but reads it).
        silent = {s for s, sends in states.items() if not sends}
        reads = {s for (sender, _t), rule in P.JOINT.items() if sender is P.PEER_OF[role] for s in rule}
        assert {s for s in silent if s not in reads} == P.ENDED


def test_state_values_are_their_lower_case_names() -> None:
    assert all(s.value == s.name.lower() for s in State)
    assert State.ACTIVE == "active"
