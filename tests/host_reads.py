"""Counting the host reads of tensor code: every way Python turns a tensor's values into host
values (``tolist``, ``item``, ``numpy``, ``int(t)``, ``bool(t)``, ...). On a GPU each is a wait for
the device; counted on the CPU, where the same calls run, they tell how often a step would wait."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

READS = {
    torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.numpy, torch.Tensor.__int__, torch.Tensor.__float__,
    torch.Tensor.__bool__, torch.Tensor.__index__, torch.Tensor.__array__, torch.Tensor.cpu,
}  # fmt: skip


class HostReads(TorchFunctionMode):
    """Counts host reads while active (``paused`` for code whose reads are not being counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.paused = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in READS and not self.paused:
            self.count += 1
        return func(*args, **(kwargs or {}))
