"""The model both sides of the weight-sync example hold, and how each side checks it.

- ``build_model(dim, layers, device)``: a stack of bf16 ``Linear(dim, dim)`` layers with a
  LayerNorm each (2 + 2 tensors per layer: many tensors per sync). Both sides build it the
  same way; only the trainer ever changes it.
- ``update(model, version, seed)``: the trainer's "optimizer step": every parameter
  redrawn in place from a generator seeded by (seed, version), so the weights of each
  version are known exactly (``matches(model, version, seed)`` redraws them one tensor at
  a time and compares bit for bit, with at most one tensor's worth of scratch memory).
- ``fingerprint(tensors)``: a checksum of every tensor's bits (the 16-bit words of each
  bf16 tensor summed as int64, over the whole tensor and over its even positions), as a
  hex string: the trainer puts it in each sync's meta, the worker recomputes it from its
  own parameters after loading.
"""

from __future__ import annotations

import argparse
import hashlib
from typing import Iterable, Sequence

import torch

from ipcsync.backends import resolve_device

DTYPE = torch.bfloat16


def parser(doc: str | None, what: str) -> argparse.ArgumentParser:
    """The options trainer and worker share (the same model on both sides)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--endpoint", default="wsync")
    ap.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=32, help="default 4096 x 32: ~1 GiB of bf16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds any wait may take")
    ap.add_argument("--die-at-sync", type=int, default=0, help=f"fault test: die halfway through {what} sync K")
    return ap


def setup(args: argparse.Namespace) -> tuple[torch.device, torch.nn.Module, list[torch.nn.Parameter]]:
    """This process's device (made current on CUDA), its model and the model's parameters."""
    device = resolve_device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = build_model(args.dim, args.layers, device)
    return device, model, list(model.parameters())


def build_model(dim: int, layers: int, device: torch.device | str) -> torch.nn.Module:
    """``layers`` x (Linear(dim, dim) + LayerNorm(dim)) in bf16 on ``device``."""
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(dim, dim, device=device, dtype=DTYPE),
                   torch.nn.LayerNorm(dim, device=device, dtype=DTYPE)]
    model = torch.nn.Sequential(*blocks)
    model.requires_grad_(False)
    return model


def model_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _generator(version: int, seed: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed * 1_000_003 + version)
    return g


@torch.no_grad()
def update(model: torch.nn.Module, version: int, seed: int) -> None:
    """Redraw every parameter in place: the weights of ``version``."""
    params = list(model.parameters())
    g = _generator(version, seed, params[0].device)
    for p in params:
        p.normal_(0.0, 0.02, generator=g)


@torch.no_grad()
def matches(model: torch.nn.Module, version: int, seed: int) -> bool:
    """Whether every parameter equals the weights of ``version`` bit for bit."""
    params = list(model.parameters())
    g = _generator(version, seed, params[0].device)
    ok = True
    for p in params:
        ref = torch.empty_like(p).normal_(0.0, 0.02, generator=g)
        ok = ok and torch.equal(p.view(torch.int16), ref.view(torch.int16))
    return ok


@torch.no_grad()
def fingerprint(tensors: Iterable[torch.Tensor]) -> str:
    """A hex checksum of the bits of ``tensors`` (2-byte dtypes), in order."""
    sums: list[int] = []
    for t in tensors:
        words = t.detach().reshape(-1).view(torch.int16)
        sums += [int(words.sum(dtype=torch.int64)), int(words[::2].sum(dtype=torch.int64)), words.numel()]
    return hashlib.sha256(repr(sums).encode()).hexdigest()[:32]


def slot_bytes(tensors: Sequence[torch.Tensor], align: int = 256) -> int:
    """A slot holding ``tensors``: each placed at the alignment ipcsync's layout uses, plus
    slack for the layout's header, rounded up to 1 MiB."""
    n = sum((t.numel() * t.element_size() + align - 1) // align * align for t in tensors) + (64 << 10)
    return (n + (1 << 20) - 1) // (1 << 20) * (1 << 20)


@torch.no_grad()
def load_(model: torch.nn.Module, received: Sequence[torch.Tensor]) -> None:
    """Copy ``received`` (one tensor per parameter, in order) into the model in place."""
    params = list(model.parameters())
    if len(received) != len(params):
        raise ValueError(f"a sync of {len(received)} tensors for a model of {len(params)} parameters: "
                         f"start trainer and workers with the same --dim and --layers")
    for p, r in zip(params, received):  # every tensor checked before any is copied
        if r.shape != p.shape or r.dtype != p.dtype:
            raise ValueError(f"a received tensor {tuple(r.shape)} {r.dtype} for a parameter "
                             f"{tuple(p.shape)} {p.dtype}: start both sides with the same sizes")
    # One batched copy for all parameters (a copy_ each costs ~7 us of host dispatch: ~1 ms
    # for a model of 128 tensors); torch before 2.1 has no _foreach_copy_.
    foreach_copy = getattr(torch, "_foreach_copy_", None)
    if foreach_copy is not None:
        foreach_copy(params, list(received))
    else:
        for p, r in zip(params, received):
            p.copy_(r)
