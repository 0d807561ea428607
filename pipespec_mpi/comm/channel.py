"""Proposal channels: non-blocking point-to-point messages in preallocated fixed-size buffers.

A message is int64[4 + max_msg_tokens]: (prompt, epoch, start, count, tokens...). ``prompt`` is
the prompt sequence number (stale messages from a finished prompt are recognisable), ``epoch``
the receiver's rollback epoch the sender had seen, ``start`` the position of the first token.
A count of -1 closes the channel.

The receiver keeps ``depth`` receives posted ahead and polls them in posting order (MPI and gloo
both keep point-to-point order per sender), so a stage never blocks on its upstream. Three
transports with one interface:
  mpi   mpi4py Isend / Irecv on numpy buffers
  gloo  torch.distributed isend / irecv on CPU tensors; gloo only reports a receive complete
        once it is waited on, so a helper thread waits (blocking, not spinning) and queues them
  nccl  torch.distributed on device tensors; receives polled with ``is_completed``
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from dataclasses import dataclass

import numpy as np

META = 4
CLOSE = -1
TAG = 7


@dataclass(frozen=True)
class Proposal:
    prompt: int
    epoch: int
    start: int
    tokens: list[int]
    dists: np.ndarray | None = None  # [count, V] float32: the distribution each token was drawn from


def buffer_words(max_msg_tokens: int, dist_width: int) -> int:
    """int64 words of one message: header, token ids, then (sampling) float32 rows [T, V]."""
    return META + max_msg_tokens + (max_msg_tokens * dist_width + 1) // 2


def _rows_view(buf: np.ndarray, width: int, dist_width: int) -> np.ndarray:
    start = 2 * (META + width)
    return buf.view(np.float32)[start : start + width * dist_width].reshape(width, dist_width)


def encode(buf: np.ndarray, prompt: int, epoch: int, start: int, tokens: list[int],
           dists: np.ndarray | None = None, width: int = 0, dist_width: int = 0) -> None:  # fmt: skip
    buf[:META] = (prompt, epoch, start, len(tokens))
    buf[META : META + len(tokens)] = tokens
    if dists is not None:
        _rows_view(buf, width, dist_width)[: len(tokens)] = dists


def decode(buf: np.ndarray, width: int = 0, dist_width: int = 0) -> Proposal | None:
    count = int(buf[3])
    if count == CLOSE:
        return None
    dists = _rows_view(buf, width, dist_width)[:count].copy() if dist_width else None
    return Proposal(int(buf[0]), int(buf[1]), int(buf[2]), buf[META : META + count].tolist(), dists)


def used_words(n_tokens: int, width: int, dist_width: int) -> int:
    """The prefix of a message buffer that holds n tokens (and their rows): what MPI sends."""
    if not dist_width:
        return META + n_tokens
    return META + width + (n_tokens * dist_width + 1) // 2


def _gloo_done(work) -> bool:
    work.wait()
    return True


class _SendRing:
    """Preallocated send buffers; a buffer is reused only once its send completed."""

    def __init__(self, depth: int, width: int, make_buf, test) -> None:
        self.bufs = [make_buf(width) for _ in range(depth)]
        self.reqs: list = [None] * depth
        self.next = 0
        self._test = test

    def _free(self, i: int) -> bool:
        # a request is tested until it completes, never after (a gloo work must not be waited twice)
        if self.reqs[i] is not None and self._test(self.reqs[i]):
            self.reqs[i] = None
        return self.reqs[i] is None

    def _take(self) -> int:
        i = self.next
        self.next = (i + 1) % len(self.bufs)
        return i

    def try_acquire(self) -> int | None:
        """The next buffer if its previous send has completed, else None (never blocks)."""
        return self._take() if self._free(self.next) else None

    def acquire(self, wait) -> int:
        wait(lambda: self._free(self.next), "a free send buffer")
        return self._take()

    def drained(self) -> bool:
        return all(self._free(i) for i in range(len(self.bufs)))


class Sender:
    """Downstream side of a channel (owned by the proposing stage)."""

    def __init__(
        self, transport: str, comm, peer: int, depth: int, max_msg_tokens: int, device=None,
        dist_width: int = 0,
    ):  # fmt: skip
        self.transport, self.peer, self.width = transport, peer, max_msg_tokens
        self.depth, self.dist_width = depth, dist_width
        words = buffer_words(max_msg_tokens, dist_width)
        if transport == "mpi":
            self.comm = comm
            self.ring = _SendRing(depth, words, lambda w: np.zeros(w, dtype=np.int64), lambda r: r.Test())
        else:
            import torch

            self.device = device or torch.device("cpu")
            self.host = np.zeros(words, dtype=np.int64)
            # gloo reports a send complete only once it is waited on; the peer always keeps
            # receives posted, so that wait is short (the data is handed to the socket).
            test = (lambda r: r.is_completed()) if transport == "nccl" else _gloo_done
            self.ring = _SendRing(
                depth, words, lambda w: torch.zeros(w, dtype=torch.int64, device=self.device), test
            )
        self.bytes_sent = 0

    def _post(self, i: int, prompt: int, epoch: int, start: int, tokens: list[int], dists=None) -> None:
        enc = dict(dists=dists, width=self.width, dist_width=self.dist_width)
        if self.transport == "mpi":
            buf = self.ring.bufs[i]
            encode(buf, prompt, epoch, start, tokens, **enc)
            used = used_words(len(tokens), self.width, self.dist_width)  # MPI takes a prefix
            self.ring.reqs[i] = self.comm.Isend(buf[:used], dest=self.peer, tag=TAG)
            self.bytes_sent += 8 * used
        else:
            import torch
            import torch.distributed as dist

            encode(self.host, prompt, epoch, start, tokens, **enc)
            self.ring.bufs[i].copy_(torch.from_numpy(self.host), non_blocking=False)
            self.ring.reqs[i] = dist.isend(self.ring.bufs[i], dst=self.peer, tag=TAG)
            self.bytes_sent += 8 * self.ring.bufs[i].numel()  # torch p2p sends whole buffers

    def try_send(self, prompt: int, epoch: int, start: int, tokens: list[int], dists=None) -> int:
        """Post tokens for positions start.. in as many messages as their width needs, as far as
        free buffers allow; returns how many tokens were posted (never blocks).

        With sampling, ``dists`` [len(tokens), V] carries the distribution of each token."""
        posted = 0
        for off in range(0, len(tokens), self.width):
            i = self.ring.try_acquire()
            if i is None:
                break
            chunk = tokens[off : off + self.width]
            rows = None if dists is None else dists[off : off + self.width]
            self._post(i, prompt, epoch, start + off, chunk, rows)
            posted += len(chunk)
        return posted

    def close(self, wait) -> None:
        """Match every receive the peer keeps posted with a close message, then drain."""
        for _ in range(self.depth):
            i = self.ring.acquire(wait)
            if self.transport == "mpi":
                buf = self.ring.bufs[i]
                buf[:META] = (0, 0, 0, CLOSE)
                self.ring.reqs[i] = self.comm.Isend(buf, dest=self.peer, tag=TAG)
            else:
                import torch
                import torch.distributed as dist

                self.host[:META] = (0, 0, 0, CLOSE)
                self.ring.bufs[i].copy_(torch.from_numpy(self.host))
                self.ring.reqs[i] = dist.isend(self.ring.bufs[i], dst=self.peer, tag=TAG)
        wait(self.ring.drained, "close messages to be delivered")


class Receiver:
    """Upstream side of a channel (owned by the verifying stage)."""

    def __init__(
        self, transport: str, comm, peer: int, depth: int, max_msg_tokens: int, device=None,
        dist_width: int = 0,
    ):  # fmt: skip
        self.transport, self.peer, self.depth = transport, peer, depth
        self.width, self.dist_width = max_msg_tokens, dist_width
        width = buffer_words(max_msg_tokens, dist_width)
        self.closed = 0
        if transport == "mpi":
            self.comm = comm
            self.bufs = [np.zeros(width, dtype=np.int64) for _ in range(depth)]
            self.posted: deque = deque()
            for i in range(depth):
                self.posted.append((i, comm.Irecv(self.bufs[i], source=peer, tag=TAG)))
        elif transport == "gloo":
            import torch

            self.queue: queue.Queue = queue.Queue()
            self.bufs = [torch.zeros(width, dtype=torch.int64) for _ in range(depth)]
            self.thread = threading.Thread(target=self._gloo_loop, name=f"recv<-{peer}", daemon=True)
            self.error: BaseException | None = None
            self.thread.start()
        else:  # nccl
            import torch
            import torch.distributed as dist

            self.device = device
            self.bufs = [torch.zeros(width, dtype=torch.int64, device=device) for _ in range(depth)]
            self.posted = deque((i, dist.irecv(self.bufs[i], src=peer, tag=TAG)) for i in range(depth))

    def _gloo_loop(self) -> None:
        import torch.distributed as dist

        # depth receives posted ahead, completed in order by blocking waits on this thread
        try:
            works = deque((i, dist.irecv(self.bufs[i], src=self.peer, tag=TAG)) for i in range(self.depth))
            closes = 0
            while works:
                i, w = works.popleft()
                w.wait()
                msg = decode(self.bufs[i].numpy(), self.width, self.dist_width)
                if msg is None:
                    closes += 1
                    self.queue.put(None)
                    continue
                self.queue.put(msg)
                works.append((i, dist.irecv(self.bufs[i], src=self.peer, tag=TAG)))
        except BaseException as err:  # surfaced on the main thread by poll()
            self.error = err
            self.queue.put(None)

    def poll(self) -> list[Proposal]:
        """All messages that have arrived, in order; never blocks."""
        out: list[Proposal] = []
        if self.transport == "gloo":
            while True:
                try:
                    msg = self.queue.get_nowait()
                except queue.Empty:
                    break
                if msg is None:
                    if self.error is not None:
                        raise RuntimeError(f"gloo receive from rank {self.peer} failed") from self.error
                    self.closed += 1
                else:
                    out.append(msg)
            return out
        while self.posted:
            i, req = self.posted[0]
            if self.transport == "mpi":
                if not req.Test():
                    break
                msg = decode(self.bufs[i], self.width, self.dist_width)
            else:
                if not req.is_completed():
                    break
                msg = decode(self.bufs[i].cpu().numpy(), self.width, self.dist_width)
            self.posted.popleft()
            if msg is None:
                self.closed += 1
                continue
            out.append(msg)
            self._repost(i)
        return out

    def _repost(self, i: int) -> None:
        if self.transport == "mpi":
            self.posted.append((i, self.comm.Irecv(self.bufs[i], source=self.peer, tag=TAG)))
        else:
            import torch.distributed as dist

            self.posted.append((i, dist.irecv(self.bufs[i], src=self.peer, tag=TAG)))

    def close(self, wait) -> None:
        """Consume messages until the sender's close messages matched every posted receive."""
        wait(lambda: (self.poll() is not None) and self.closed >= self.depth, "the channel to close")
        if self.transport == "gloo":
            self.thread.join(timeout=5)
