"""Proposal channels: non-blocking point-to-point messages in preallocated fixed-size buffers.

A message is int64[5 + max_msg_tokens]: (prompt, epoch, start, count, slot, tokens...) (comm/wire.py).
``prompt`` is the prompt sequence number (stale messages from a finished prompt are
recognisable), ``epoch`` the receiver's rollback epoch the sender had seen, ``start`` the position
of the first token, ``slot`` the receiver's sequence where one link carries several (comm/mux.py).
A count of -1 closes the channel, -2 opens it. With sampling, float32 rows [max_msg_tokens, V] follow.

A link has a sending and a receiving class per transport. What they share lives in the base
classes: the message encoding, the sender's ring of send buffers (a buffer is reused only once
its send completed) and the chunking into messages, the receiver's close handshake. A transport
only says how to allocate a buffer, start a send or receive, and test it:
  mpi   mpi4py Isend / Irecv on numpy buffers (a send carries only the used prefix)
  gloo  torch.distributed isend / irecv on CPU tensors; gloo only reports a receive complete
        once it is waited on, so a helper thread waits (blocking, not spinning) and queues them
  nccl  torch.distributed on device tensors, staged through a host buffer; polled with
        ``is_completed``
  strict  gloo under NCCL's rules (comm/strict.py): what would break on NCCL is an error here

The receiver keeps ``depth`` receives posted ahead and takes them in posting order (MPI, gloo and
NCCL all keep point-to-point order per sender), so a stage never blocks on its upstream.
A ``LinkSpec`` says what a link is; ``open_sender(transport, comm, spec)`` and
``open_receiver(transport, comm, spec)`` (comm/links.py) build the transport's classes.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from pipespec_mpi.comm.wire import (
    CLOSE,
    HELLO,
    META,
    TAG,
    buffer_words,
    decode,
    encode,
    is_hello,
    used_words,
)
from pipespec_mpi.stage.ports import Proposal


@dataclass(frozen=True)
class LinkSpec:
    """What one end of a link is, whatever its transport: the rank at the other end, the receives
    kept posted (and send buffers), the tokens a message carries, the CUDA device of its buffers
    (nccl), the float32 row width of each token's distribution (0: none) and the tag that tells
    links of one pair apart (mpi, gloo)."""

    peer: int
    depth: int
    max_msg_tokens: int
    device: Any = None
    dist_width: int = 0
    tag: int = TAG


class _End:
    """An end of a link over ``comm``, the transport's communicator, with ``spec``'s fields as the
    attributes a transport reads (``width``: max_msg_tokens)."""

    def __init__(self, comm, spec: LinkSpec) -> None:
        self.comm, self.spec = comm, spec
        self.device, self.tag = spec.device, spec.tag  # what a transport needs of them
        self.peer, self.depth = spec.peer, spec.depth
        self.width, self.dist_width = spec.max_msg_tokens, spec.dist_width


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


# ---------------------------------------------------------------------------------------------
# sending


class Sender(_End):
    """Downstream side of a link (owned by the proposing stage): chunks tokens into messages and
    keeps the ring of send buffers. A transport supplies ``_new_buffer``, ``_host``, ``_start``
    and ``_done``; ``open_sender`` builds the transport's class."""

    def __init__(self, comm, spec: LinkSpec) -> None:
        super().__init__(comm, spec)
        self.ring = _SendRing(
            spec.depth, buffer_words(spec.max_msg_tokens, spec.dist_width), self._new_buffer, self._done
        )
        self.bytes_sent = 0

    def _new_buffer(self, words: int):
        """One send buffer of ``words`` int64."""
        raise NotImplementedError

    def _host(self, i: int) -> np.ndarray:
        """The host array that message ``i`` is encoded into."""
        raise NotImplementedError

    def _start(self, i: int, words: int) -> tuple[object, int]:
        """Send ring buffer ``i`` (at least its first ``words``); returns the request and the words
        that travel."""
        raise NotImplementedError

    def _done(self, req) -> bool:
        """Whether a send request has completed (called until it has, never after)."""
        raise NotImplementedError

    def try_send(
        self, prompt: int, epoch: int, start: int, tokens: list[int], dists=None, slot: int = 0
    ) -> int:
        """Post tokens for positions start.. in as many messages as their width needs, as far as
        free buffers allow; returns how many tokens were posted (never blocks).

        With sampling, ``dists`` [len(tokens), V] carries the distribution of each token; ``slot``:
        the receiver's sequence they are for (comm/mux.py)."""
        posted = 0
        for off in range(0, len(tokens), self.width):
            i = self.ring.try_acquire()
            if i is None:
                break
            chunk = tokens[off : off + self.width]
            rows = None if dists is None else dists[off : off + self.width]
            encode(self._host(i), prompt, epoch, start + off, chunk, rows, self.width, self.dist_width, slot)
            self.ring.reqs[i], words = self._start(i, used_words(len(chunk), self.width, self.dist_width))
            self.bytes_sent += 8 * words
            posted += len(chunk)
        return posted

    def hello(self, wait) -> None:
        """Open the link with a message the peer's first receive takes (and drops): a pair's
        first operation then happens while both ranks connect, as NCCL needs (comm/mux.py)."""
        i = self.ring.acquire(wait)
        self._host(i)[:META] = (0, 0, 0, HELLO, 0)
        self.ring.reqs[i], _ = self._start(i, META)

    def close(self, wait) -> None:
        """Match every receive the peer keeps posted with a close message, then drain."""
        for _ in range(self.depth):
            i = self.ring.acquire(wait)
            self._host(i)[:META] = (0, 0, 0, CLOSE, 0)
            self.ring.reqs[i], _ = self._start(i, META)
        wait(self.ring.drained, "close messages to be delivered")


class MpiSender(Sender):
    """mpi4py Isend of the used prefix of a numpy buffer."""

    def _new_buffer(self, words: int) -> np.ndarray:
        return np.zeros(words, dtype=np.int64)

    def _host(self, i: int) -> np.ndarray:
        return self.ring.bufs[i]

    def _start(self, i: int, words: int) -> tuple[object, int]:
        return self.comm.Isend(self.ring.bufs[i][:words], dest=self.peer, tag=self.tag), words

    def _done(self, req) -> bool:
        return req.Test()


class _TorchSender(Sender):
    """torch.distributed isend of a whole tensor buffer (torch p2p sends whole tensors)."""

    def _new_buffer(self, words: int):
        import torch

        return torch.zeros(words, dtype=torch.int64, device=self.device)

    def _start(self, i: int, words: int) -> tuple[object, int]:
        import torch.distributed as dist

        buf = self.ring.bufs[i]
        return dist.isend(buf, dst=self.peer, tag=self.tag), buf.numel()


class GlooSender(_TorchSender):
    """CPU tensors, encoded in place. gloo reports a send complete only once it is waited on; the
    peer always keeps receives posted, so that wait is short (the data is handed to the socket)."""

    def __init__(self, comm, spec: LinkSpec) -> None:
        super().__init__(comm, replace(spec, device=None))  # always CPU tensors

    def _host(self, i: int) -> np.ndarray:
        return self.ring.bufs[i].numpy()  # shares the tensor's memory

    def _done(self, req) -> bool:
        req.wait()  # at most once per request: the ring drops a request once it completed
        return True


def nccl_device(device):
    """The CUDA device of an nccl link's buffers (there is no default: the rank's GPU)."""
    if device is None:
        raise ValueError("an nccl link needs the CUDA device of its buffers")
    return device


class NcclSender(_TorchSender):
    """Device tensors: a message is encoded in a host buffer and copied to its device buffer
    (synchronously, so the host buffer is free again at once); sends polled with is_completed."""

    def __init__(self, comm, spec: LinkSpec) -> None:
        super().__init__(comm, replace(spec, device=nccl_device(spec.device)))
        self.host = np.zeros(buffer_words(spec.max_msg_tokens, spec.dist_width), dtype=np.int64)

    def _host(self, i: int) -> np.ndarray:
        return self.host

    def _start(self, i: int, words: int) -> tuple[object, int]:
        import torch

        self.ring.bufs[i].copy_(torch.from_numpy(self.host), non_blocking=False)
        return super()._start(i, words)

    def _done(self, req) -> bool:
        return req.is_completed()


# ---------------------------------------------------------------------------------------------
# receiving


class Receiver(_End):
    """Upstream side of a link (owned by the verifying stage): ``depth`` receives posted ahead,
    taken in posting order; ``closed`` counts the close messages seen; ``open_receiver`` builds
    the transport's class."""

    def __init__(self, comm, spec: LinkSpec) -> None:
        super().__init__(comm, spec)
        self.words = buffer_words(spec.max_msg_tokens, spec.dist_width)
        self.closed = 0

    def _decode(self, host: np.ndarray) -> Proposal | None:
        return decode(host, self.width, self.dist_width)

    def poll(self) -> list[Proposal]:
        """All messages that have arrived, in order; never blocks."""
        raise NotImplementedError

    def close(self, wait) -> None:
        """Consume messages until the sender's close messages matched every posted receive."""

        def all_closed() -> bool:
            self.poll()  # proposals still in flight are dropped
            return self.closed >= self.depth

        wait(all_closed, "the channel to close")


class _PolledReceiver(Receiver):
    """Receives tested in posting order from the stage's own thread; a transport supplies
    ``_new_buffer``, ``_post``, ``_done`` and ``_host``."""

    def __init__(self, comm, spec: LinkSpec) -> None:
        super().__init__(comm, spec)
        self.bufs = [self._new_buffer(self.words) for _ in range(spec.depth)]
        self.posted: deque = deque((i, self._post(i)) for i in range(spec.depth))

    def _new_buffer(self, words: int):
        raise NotImplementedError

    def _post(self, i: int):
        """Post a receive into buffer ``i``; returns its request."""
        raise NotImplementedError

    def _done(self, req) -> bool:
        """Whether a receive has completed (called until it has, never after)."""
        raise NotImplementedError

    def _host(self, i: int) -> np.ndarray:
        """Buffer ``i`` as a host array, once its receive completed."""
        raise NotImplementedError

    def poll(self) -> list[Proposal]:
        """All messages that have arrived, in order; never blocks."""
        out: list[Proposal] = []
        while self.posted:
            i, req = self.posted[0]
            if not self._done(req):
                break
            self.posted.popleft()
            host = self._host(i)
            msg = None if is_hello(host) else self._decode(host)  # copies out before the repost
            if msg is None and not is_hello(host):
                self.closed += 1
                continue
            if msg is not None:
                out.append(msg)
            self.posted.append((i, self._post(i)))
        return out


class MpiReceiver(_PolledReceiver):
    """mpi4py Irecv into numpy buffers, polled with Test."""

    def _new_buffer(self, words: int) -> np.ndarray:
        return np.zeros(words, dtype=np.int64)

    def _post(self, i: int):
        return self.comm.Irecv(self.bufs[i], source=self.peer, tag=self.tag)

    def _done(self, req) -> bool:
        return req.Test()

    def _host(self, i: int) -> np.ndarray:
        return self.bufs[i]


class NcclReceiver(_PolledReceiver):
    """torch.distributed irecv into device tensors, polled with is_completed."""

    def __init__(self, comm, spec: LinkSpec) -> None:
        super().__init__(comm, replace(spec, device=nccl_device(spec.device)))

    def _new_buffer(self, words: int):
        import torch

        return torch.zeros(words, dtype=torch.int64, device=self.device)

    def _post(self, i: int):
        import torch.distributed as dist

        return dist.irecv(self.bufs[i], src=self.peer, tag=self.tag)

    def _done(self, req) -> bool:
        return req.is_completed()

    def _host(self, i: int) -> np.ndarray:
        return self.bufs[i].cpu().numpy()


class GlooReceiver(Receiver):
    """torch.distributed irecv into CPU tensors. gloo completes a receive only when it is waited
    on, so a helper thread keeps the receives posted, waits on them in order (blocking, not
    spinning) and queues what arrives; ``poll`` drains the queue."""

    def __init__(self, comm, spec: LinkSpec) -> None:
        import torch

        super().__init__(comm, replace(spec, device=None))  # always CPU tensors
        self.queue: queue.Queue = queue.Queue()
        self.bufs = [torch.zeros(self.words, dtype=torch.int64) for _ in range(spec.depth)]
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name=f"recv<-{spec.peer}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        import torch.distributed as dist

        # depth receives posted ahead, each waited on once, in order; ends after depth closes
        try:
            works = deque(
                (i, dist.irecv(self.bufs[i], src=self.peer, tag=self.tag)) for i in range(self.depth)
            )
            while works:
                i, w = works.popleft()
                w.wait()
                if is_hello(self.bufs[i].numpy()):
                    works.append((i, dist.irecv(self.bufs[i], src=self.peer, tag=self.tag)))
                    continue
                msg = self._decode(self.bufs[i].numpy())
                self.queue.put(msg)
                if msg is not None:
                    works.append((i, dist.irecv(self.bufs[i], src=self.peer, tag=self.tag)))
        except BaseException as err:  # surfaced on the main thread by poll()
            self.error = err
            self.queue.put(None)

    def poll(self) -> list[Proposal]:
        """All messages that have arrived, in order; never blocks."""
        out: list[Proposal] = []
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

    def close(self, wait) -> None:
        super().close(wait)
        self.thread.join(timeout=5)
