"""The remote edge's backend objects (see ``transfer``); ``runtime.remote.io`` does its I/O."""

from .transfer import POLL_S, ReceiveArena, RecvEvent, ReleaseEvent, SendEvent, TransferEvent, slot_tensors, staged

__all__ = ["TransferEvent", "SendEvent", "RecvEvent", "ReleaseEvent", "ReceiveArena", "slot_tensors", "staged",
           "POLL_S"]
