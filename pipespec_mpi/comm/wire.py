"""A proposal message's encoding in a channel's int64 buffers: (prompt, epoch, start, count, slot,
tokens...), then with sampling the float32 distribution rows; a count of -1 closes the link, -2
opens it (a hello: comm/mux.py). ``slot``: the batched-decoding sequence it belongs to, where
one link carries every slot's (comm/mux.py)."""

from __future__ import annotations

import numpy as np

from pipespec_mpi.stage.ports import Proposal

META = 5
CLOSE = -1
HELLO = -2
TAG = 7


def slot_tag(slot: int) -> int:
    """The tag of a batched-decoding slot's link (slot 0: ``TAG``, as without batching)."""
    return TAG + 16 * slot


def buffer_words(max_msg_tokens: int, dist_width: int) -> int:
    """int64 words of one message: header, token ids, then (sampling) float32 rows [T, V]."""
    return META + max_msg_tokens + (max_msg_tokens * dist_width + 1) // 2


def _rows_view(buf: np.ndarray, width: int, dist_width: int) -> np.ndarray:
    start = 2 * (META + width)
    return buf.view(np.float32)[start : start + width * dist_width].reshape(width, dist_width)


def encode(buf: np.ndarray, prompt: int, epoch: int, start: int, tokens: list[int],
           dists: np.ndarray | None = None, width: int = 0, dist_width: int = 0,
           slot: int = 0) -> None:  # fmt: skip
    buf[:META] = (prompt, epoch, start, len(tokens), slot)
    buf[META : META + len(tokens)] = tokens
    if dists is not None:
        _rows_view(buf, width, dist_width)[: len(tokens)] = dists


def decode(buf: np.ndarray, width: int = 0, dist_width: int = 0) -> Proposal | None:
    """The message in ``buf``: a Proposal, or None for a close (a hello: ``is_hello``)."""
    count = int(buf[3])
    if count == CLOSE:
        return None
    dists = _rows_view(buf, width, dist_width)[:count].copy() if dist_width else None
    return Proposal(
        int(buf[0]), int(buf[1]), int(buf[2]), buf[META : META + count].tolist(), dists, int(buf[4])
    )


def is_hello(buf: np.ndarray) -> bool:
    """Whether ``buf`` holds a link's opening message (comm/mux.py), which carries no proposal."""
    return int(buf[3]) == HELLO


def used_words(n_tokens: int, width: int, dist_width: int) -> int:
    """The prefix of a message buffer that holds n tokens (and their rows): what MPI sends."""
    if not dist_width:
        return META + n_tokens
    return META + width + (n_tokens * dist_width + 1) // 2
