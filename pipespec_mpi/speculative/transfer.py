"""Host <-> device copies made the way a step needs them: asynchronous uploads and one read.

A GPU step uploads its host lists once (pinned memory, non-blocking) and reads its results once
(into pinned memory, waiting on that stream alone, never the whole device: a posted NCCL receive
would hold a device-wide sync forever). On the CPU both are plain.
"""

from __future__ import annotations

import torch


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device``: pinned and asynchronous to a GPU (ordered on the current stream)."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def read(t: torch.Tensor) -> list:
    """The values of ``t`` on the host: the one wait of a step for its device (CUDA: a
    non-blocking copy into pinned memory, then the current stream's event)."""
    if t.device.type == "cuda":
        buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        buf.copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
        t = buf
    return t.tolist()
