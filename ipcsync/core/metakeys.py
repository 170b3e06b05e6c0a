"""Where a meta holds a dict key that msgpack maps cannot carry to a consumer.

Meta travels as msgpack, and consumers decode maps with string keys only (``str``; an
``int``, ``bytes``, tuple or any other key is refused, as ``core.protocol.check_meta``
says). ``send()`` finds such a meta refused by the consumers' decoder; this names the key
and where it is, so the error says what to change. Pure; used only once a send was
refused (never on the steady path).
"""

from __future__ import annotations

import reprlib
from typing import Any

__all__ = ["non_str_key"]

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 40


def non_str_key(meta: Any, max_nodes: int = 100_000) -> str | None:
    """The first dict key of ``meta`` (depth first, in order) that is not a ``str``,
    described with its path (``meta['a'][0] has the int key 1``), or None if every key
    is a ``str`` (within ``max_nodes`` containers and values looked at)."""
    stack: list[tuple[Any, str]] = [(meta, "meta")]
    seen = 0
    while stack and seen < max_nodes:
        node, path = stack.pop()
        seen += 1
        if type(node) in (list, tuple):
            stack.extend((c, f"{path}[{i}]") for i, c in reversed(list(enumerate(node))))
        elif type(node) is dict:
            for k in node:
                if type(k) is not str:
                    return f"{path} has the {type(k).__name__} key {_REPR.repr(k)}"
            stack.extend((c, f"{path}[{_REPR.repr(k)}]") for k, c in reversed(list(node.items())))
    return None
