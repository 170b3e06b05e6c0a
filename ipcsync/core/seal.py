"""Sealing what crosses an unauthenticated c10d store, sans I/O: key names, records and
values that only holders of a shared secret can make or read.

Two stores use it: the launchers' rendezvous store (``launch.nodes``: the run's secret,
given to every launcher) and a producer's per-edge store (``runtime.remote.io``: the edge's
secret, sent only inside the CURVE-encrypted SETUP). Anyone who reaches a c10d store can
list, read, write and delete its keys; sealing turns that into "can break it, cannot
use it":

1. **Names.** A logical key ``k`` is stored as ``name(key, k)``: 32 hex digits of
   HMAC-SHA256 under the secret. Knowing one stored name tells nothing of another's (a
   squatter cannot claim a node rank or an edge's rank before its holder: it cannot
   compute the name), and a listing of the store shows only such names.
2. **Records** (``sign``/``verify``): JSON text with an HMAC over the logical key and
   the body, so a record copied from another key, attempt or run, or written by anyone
   without the secret, fails ``verify``. Readable by all: records carry public
   information only (addresses, ports, public keys).
3. **Values** (``seal``/``unseal``): encrypted and authenticated, for a store's values
   that must stay private (gloo's and NCCL's rendezvous data: a listening address an
   outsider could connect to first, NCCL's unique id). A keystream of HMAC-SHA256 in
   counter mode under a fresh 16-byte nonce, then an HMAC over nonce and ciphertext
   (encrypt-then-MAC, separate derived keys); ``unseal`` returns None for anything not
   sealed under the same secret.

Nonces and secrets are passed in (``os.urandom`` is the caller's); nothing here does I/O.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

__all__ = ["derive", "name", "sign", "verify", "seal", "unseal", "NONCE_BYTES", "MIN_SECRET_CHARS"]

NONCE_BYTES = 16
MAC_BYTES = 32
MIN_SECRET_CHARS = 16  # a user-given secret at least this long (the launcher makes 64 hex digits)


def derive(secret: bytes, purpose: str) -> bytes:
    """A 32-byte key for one purpose (names, records, cipher, mac) from ``secret``."""
    return hmac.new(secret, b"ipcsync-seal/1 " + purpose.encode(), hashlib.sha256).digest()


def _mac(key: bytes, *parts: bytes) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        h.update(len(p).to_bytes(8, "big"))
        h.update(p)
    return h.digest()


def name(secret: bytes, key: str) -> str:
    """The stored name of logical key ``key`` (invariant 1)."""
    return _mac(derive(secret, "names"), key.encode()).hex()[:32]


def sign(secret: bytes, key: str, body: dict[str, Any]) -> bytes:
    """``body`` as a record stored under ``key`` (invariant 2)."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    mac = _mac(derive(secret, "records"), key.encode(), text.encode()).hex()
    return json.dumps({"body": text, "mac": mac}, separators=(",", ":")).encode()


def verify(secret: bytes, key: str, raw: bytes) -> dict[str, Any] | None:
    """The body of a record ``sign`` made for ``key`` under ``secret``; None for anything
    else (malformed, another key's, another secret's)."""
    try:
        rec = json.loads(raw)
        text, mac = rec["body"], rec["mac"]
        if type(text) is not str or type(mac) is not str:
            return None
        good = _mac(derive(secret, "records"), key.encode(), text.encode()).hex()
        if not hmac.compare_digest(good, mac):
            return None
        body = json.loads(text)
    except (ValueError, KeyError, TypeError, RecursionError):
        return None
    return body if isinstance(body, dict) else None


def _keystream(key: bytes, nonce: bytes, n: int) -> bytes:
    out = bytearray()
    counter = 0
    while len(out) < n:
        out += hmac.new(key, nonce + counter.to_bytes(8, "big"), hashlib.sha256).digest()
        counter += 1
    return bytes(out[:n])


def seal(secret: bytes, key: str, value: bytes, nonce: bytes) -> bytes:
    """``value`` encrypted and authenticated, bound to logical key ``key`` (invariant 3);
    ``nonce``: NONCE_BYTES fresh random bytes."""
    if len(nonce) != NONCE_BYTES:
        raise ValueError(f"a seal's nonce is {NONCE_BYTES} bytes")
    stream = _keystream(derive(secret, "cipher"), nonce, len(value))
    body = bytes(a ^ b for a, b in zip(value, stream))
    return nonce + body + _mac(derive(secret, "mac"), key.encode(), nonce, body)


def unseal(secret: bytes, key: str, blob: bytes) -> bytes | None:
    """What ``seal`` sealed under ``secret`` for ``key``; None for anything else."""
    if len(blob) < NONCE_BYTES + MAC_BYTES:
        return None
    nonce, body, mac = blob[:NONCE_BYTES], blob[NONCE_BYTES:-MAC_BYTES], blob[-MAC_BYTES:]
    if not hmac.compare_digest(_mac(derive(secret, "mac"), key.encode(), nonce, body), mac):
        return None
    stream = _keystream(derive(secret, "cipher"), nonce, len(body))
    return bytes(a ^ b for a, b in zip(body, stream))
