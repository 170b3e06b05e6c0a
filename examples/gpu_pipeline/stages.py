"""The two model stages of the GPU-pipeline example and what both processes share.

- ``build(kind, dim, layers, vocab, device)``: the encoder (``layers`` x Linear + GELU)
  or the decoder (the same, then a Linear head to ``vocab`` logits), seeded, so every
  process that builds a stage holds the same weights. bf16 on CUDA, float32 on the CPU.
- ``make_input(step, ...)``: the step's input, drawn from a generator seeded by the step
  (stands for preprocessing on the GPU).
- ``checksum(logits)``: the sum of the argmax tokens of a step (an integer: the same in
  any order, so replicas' checksums add up to the single process's).
"""

from __future__ import annotations

import argparse

import torch

from ipcsync.backends import resolve_device


def dtype_for(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class Stage(torch.nn.Module):
    """Residual Linear + GELU blocks (the input's variation reaches the output), then an
    optional head."""

    def __init__(self, dim: int, layers: int, head: int, device: torch.device) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(dim, dim, device=device) for _ in range(layers))
        self.head = torch.nn.Linear(dim, head, device=device) if head else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.blocks:
            x = x + torch.nn.functional.gelu(lin(x))
        return x if self.head is None else self.head(x)


def build(kind: str, dim: int, layers: int, vocab: int, device: torch.device) -> torch.nn.Module:
    """The ``"encoder"`` or ``"decoder"`` stage, in inference mode, on ``device``."""
    torch.manual_seed(1 if kind == "encoder" else 2)
    model = Stage(dim, layers, vocab if kind == "decoder" else 0, device).to(dtype_for(device))
    model.requires_grad_(False)
    return model.eval()


def make_input(step: int, batch: int, dim: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator(device=device)
    g.manual_seed(step)
    return torch.randn(batch, dim, generator=g, device=device, dtype=dtype_for(device))


def checksum(logits: torch.Tensor) -> torch.Tensor:
    """The step's argmax tokens, each times its row number + 1, summed (a device scalar:
    int() of it waits for the step)."""
    rows = torch.arange(1, logits.shape[0] + 1, device=logits.device)
    return (logits.argmax(-1) * rows).sum()


def parser(doc: str | None) -> argparse.ArgumentParser:
    """The options both stages share (the same sizes on both sides)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--endpoint", default="gpipe")
    ap.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    ap.add_argument("--batch", type=int, default=4096, help="rows per step")
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4, help="Linear+GELU blocks per stage")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds any wait may take")
    return ap


def device_of(args: argparse.Namespace) -> torch.device:
    """This process's device (default: the current GPU if any), made current on CUDA."""
    device = resolve_device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device
