"""What one forward of the engine runs over: its rows and their layout (``Batch``), and the
attention back-end's interface (``Attention``). Apart from models/engine.py so that the back-ends
(models/attention.py, models/cpu/attention.py) and the engine import it, not each other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class Batch:
    """The rows of one forward, on the weights' device, and what the host knows of their layout.

    Ragged (the row back-ends): each sequence's rows contiguous, ``seqs`` and ``bounds`` say
    where. Grid (the SDPA back-end): ``grid_slots`` x ``width`` rows, a slot's real rows first,
    the rest padding at position 0 writing the scratch position (the last of every slot)."""

    tokens: torch.Tensor  # [R] int64
    pos: torch.Tensor  # [R] each row's position (RoPE; what it may attend)
    slot: torch.Tensor  # [R] the cache slot it belongs to
    write: torch.Tensor  # [R] where its keys and values go (its position; scratch for padding)
    keep: torch.Tensor  # [K] the rows whose logits are returned, in order
    seqs: tuple[tuple[int, int, int], ...] = ()  # ragged: (slot, first position, rows) per sequence
    bounds: tuple[int, ...] = ()  # ragged: row offsets of the sequences (len(seqs) + 1)
    grid_slots: slice | None = None  # grid: the slots' range
    width: int = 0  # grid: rows per slot


class Attention(Protocol):
    """An attention back-end: every row's attention over its slot's cache up to its own position
    (the rows' keys and values already written)."""

    layout: str  # "ragged" | "grid": how the host lays out the rows (Batch)
    exact: bool  # a row's result never depends on the rows beside it

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: Batch, scale: float
    ) -> torch.Tensor:
        """q [R, heads, D], one layer's cache k, v [S, kv_heads, C, D] -> [R, heads * D]."""
