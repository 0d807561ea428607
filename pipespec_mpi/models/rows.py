"""What one forward of the engine runs over: its rows and their layout (``Batch``), and the
attention back-end's interface (``Attention``). Apart from models/engine.py so that the back-ends
(models/attention.py, models/cpu/attention.py) and the engine import it, not each other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pipespec_mpi.speculative.transfer import upload


@dataclass
class Batch:
    """The rows of one forward, on the weights' device, and what the host knows of their layout.

    ``rows`` holds every row's token, position, slot and write position, and (its first
    ``n_keep`` entries) the rows whose logits are returned: one tensor, one host-to-device copy,
    one input to a compiled forward. Ragged (the row back-ends): each sequence's rows contiguous,
    ``seqs`` and ``bounds`` say where. Grid (the SDPA back-end): ``grid_slots`` x ``width`` rows,
    a slot's real rows first, the rest padding at position 0 writing the scratch position (the
    last of every slot); every row attends at most the first ``span`` positions."""

    rows: torch.Tensor  # [5, R] int64
    n_keep: int
    seqs: tuple[tuple[int, int, int], ...] = ()  # ragged: (slot, first position, rows) per sequence
    bounds: tuple[int, ...] = ()  # ragged: row offsets of the sequences (len(seqs) + 1)
    grid_slots: slice | None = None  # grid: the slots' range
    width: int = 0  # grid: rows per slot
    span: int = 0  # grid: positions attended (beyond every real row's own)

    @classmethod
    def of(
        cls,
        device: torch.device,
        tokens: list[int],
        pos: list[int],
        slot: list[int],
        write: list[int],
        keep: list[int],
        **layout: object,
    ) -> Batch:
        """The rows from the host's lists in one copy (pinned and asynchronous to a GPU)."""
        r = len(tokens)
        host = torch.tensor([*tokens, *pos, *slot, *write, *keep, *[0] * (r - len(keep))], dtype=torch.long)
        rows = upload(host.view(5, r), device)
        return cls(rows, len(keep), **layout)  # type: ignore[arg-type]

    @property
    def tokens(self) -> torch.Tensor:
        return self.rows[0]

    @property
    def pos(self) -> torch.Tensor:
        """Each row's position (RoPE; what it may attend)."""
        return self.rows[1]

    @property
    def slot(self) -> torch.Tensor:
        """The cache slot each row belongs to."""
        return self.rows[2]

    @property
    def write(self) -> torch.Tensor:
        """Where each row's keys and values go (its position; the scratch one for padding)."""
        return self.rows[3]

    @property
    def keep(self) -> torch.Tensor:
        """The rows whose logits are returned, in order."""
        return self.rows[4, : self.n_keep]


class Attention(Protocol):
    """An attention back-end: every row's attention over its slot's cache up to its own position
    (the rows' keys and values already written)."""

    layout: str  # "ragged" | "grid": how the host lays out the rows (Batch)
    exact: bool  # a row's result never depends on the rows beside it

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: Batch, scale: float
    ) -> torch.Tensor:
        """q [R, heads, D], one layer's cache k, v [S, kv_heads, C, D] -> [R, heads * D]."""
