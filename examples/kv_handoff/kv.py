"""The per-request KV cache of the KV-handoff example, and the first decode step.

A request's KV cache is 2 x ``layers`` tensors (K and V of each layer), each
``(heads, seq, head_dim)``, where ``seq`` (the prompt length) differs per request
(``seq_len``). ``fill_kv`` writes a request's KV in place, drawn from a generator seeded
by the request (stands for the prefill's forward pass), so that any process can tell
what a request's first token must be. ``first_token`` is the decode worker's first step:
a fixed query attends over every layer's K/V; the token is the argmax of the summed
outputs (a device scalar).
"""

from __future__ import annotations

import argparse
from typing import Sequence

import torch

from ipcsync.backends import resolve_device


def dtype_for(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def seq_len(req: int, max_seq: int) -> int:
    """The prompt length of request ``req``: varied, from max_seq/4 to max_seq."""
    lo = max(1, max_seq // 4)
    return lo + (req * 7919) % (max_seq - lo + 1)


def shapes(req: int, args: argparse.Namespace) -> list[tuple[int, int, int]]:
    """The shapes of request ``req``'s tensors: K0, V0, K1, V1, ..."""
    return [(args.heads, seq_len(req, args.max_seq), args.head_dim)] * (2 * args.layers)


def fill_kv(req: int, tensors: Sequence[torch.Tensor]) -> None:
    """Write request ``req``'s KV into ``tensors`` in place."""
    g = torch.Generator(device=tensors[0].device)
    g.manual_seed(req)
    for t in tensors:
        torch.randn(t.shape, generator=g, out=t)


def make_kv(req: int, args: argparse.Namespace, device: torch.device) -> list[torch.Tensor]:
    """Request ``req``'s KV as fresh tensors."""
    kv = [torch.empty(s, dtype=dtype_for(device), device=device) for s in shapes(req, args)]
    fill_kv(req, kv)
    return kv


def kv_bytes(args: argparse.Namespace, device: torch.device, seq: int | None = None) -> int:
    n = args.heads * (seq or args.max_seq) * args.head_dim * torch.empty(0, dtype=dtype_for(device)).element_size()
    return 2 * args.layers * n


def first_token(kv: Sequence[torch.Tensor]) -> torch.Tensor:
    """One decode step over the received KV (read only): the first token, on the device."""
    heads, _, head_dim = kv[0].shape
    q = torch.ones(heads, 1, head_dim, dtype=kv[0].dtype, device=kv[0].device) / head_dim ** 0.5
    out = torch.zeros(heads, 1, head_dim, dtype=torch.float32, device=kv[0].device)
    for k, v in zip(kv[0::2], kv[1::2]):
        out += torch.softmax(q @ k.transpose(1, 2), dim=-1).float() @ v.float()
    return out.sum(0).argmax()


def parser(doc: str | None) -> argparse.ArgumentParser:
    """The options both workers share (the same sizes on both sides)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--endpoint", default="kvh", help="requests go to ENDPOINT, first tokens come back on ENDPOINT-tok")
    ap.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8, help="KV heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--max-seq", type=int, default=2048, help="the longest prompt, in tokens")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds any wait may take")
    return ap


def device_of(args: argparse.Namespace) -> torch.device:
    """This process's device (default: the current GPU if any), made current on CUDA."""
    device = resolve_device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device
