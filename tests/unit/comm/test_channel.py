"""Proposal channels without a second process: the message encoding, the send-buffer ring, and
each transport's link classes (mpi over COMM_SELF; gloo and nccl over an in-process stand-in
for torch.distributed's isend/irecv, so the nccl classes run on CPU tensors)."""

from __future__ import annotations

import threading
from collections import deque

import numpy as np
import pytest
import torch
import torch.distributed

from pipespec_mpi.comm.channel import (
    CLOSE,
    HELLO,
    META,
    GlooReceiver,
    GlooSender,
    LinkSpec,
    MpiReceiver,
    MpiSender,
    NcclReceiver,
    NcclSender,
    Proposal,
    Receiver,
    Sender,
    _SendRing,
    buffer_words,
    decode,
    encode,
    is_hello,
    used_words,
)
from pipespec_mpi.comm.links import open_receiver, open_sender
from pipespec_mpi.host.wait import wait_until


def wait(cond, what):
    wait_until(cond, 10, what)


# --- the message encoding --------------------------------------------------------------------


@pytest.mark.parametrize("dist_width", [0, 5, 6])
@pytest.mark.parametrize("n", [0, 1, 3, 4])
def test_encode_decode_round_trip_and_the_used_prefix_suffices(n, dist_width):
    width = 4
    rng = np.random.default_rng(n + dist_width)
    tokens = rng.integers(0, 50_000, n).tolist()
    dists = rng.random((n, dist_width), dtype=np.float32) if dist_width else None
    buf = np.full(buffer_words(width, dist_width), -7, dtype=np.int64)  # stale words everywhere
    encode(buf, 3, 2, 17, tokens, dists, width, dist_width)
    prefix = np.zeros_like(buf)
    used = used_words(n, width, dist_width)
    assert used <= buf.size
    prefix[:used] = buf[:used]  # what MPI sends
    for b in (buf, prefix):
        p = decode(b, width, dist_width)
        assert (p.prompt, p.epoch, p.start, p.tokens) == (3, 2, 17, tokens)
        if dist_width:
            assert p.dists.dtype == np.float32 and np.array_equal(p.dists, dists)
        else:
            assert p.dists is None


def test_decoded_proposal_does_not_alias_the_buffer():
    buf = np.zeros(buffer_words(2, 3), dtype=np.int64)
    encode(buf, 1, 0, 0, [5, 6], np.ones((2, 3), np.float32), 2, 3)
    p = decode(buf, 2, 3)
    buf[:] = 0  # the buffer is reposted at once
    assert p.tokens == [5, 6] and np.array_equal(p.dists, np.ones((2, 3), np.float32))


def test_close_message_decodes_to_none():
    buf = np.zeros(buffer_words(4, 0), dtype=np.int64)
    buf[:META] = (0, 0, 0, CLOSE, 0)
    assert decode(buf) is None


def test_the_slot_travels_and_a_hello_is_no_proposal():
    buf = np.zeros(buffer_words(4, 0), dtype=np.int64)
    encode(buf, 3, 1, 10, [7, 8], slot=5)
    assert decode(buf) == Proposal(3, 1, 10, [7, 8], None, 5) and not is_hello(buf)
    buf[:META] = (0, 0, 0, HELLO, 0)
    assert is_hello(buf)


# --- the send-buffer ring --------------------------------------------------------------------


class CountedRequest:
    """Completes at its ``after``-th test; a test after it reported completion is an error."""

    def __init__(self, after: int) -> None:
        self.after, self.tests, self.reported = after, 0, False

    def test(self) -> bool:
        assert not self.reported, "request tested after it completed"
        self.tests += 1
        self.reported = self.tests >= self.after
        return self.reported


def test_ring_tests_a_request_until_it_completes_and_never_after():
    ring = _SendRing(2, 8, lambda w: np.zeros(w, np.int64), CountedRequest.test)
    reqs = [CountedRequest(3), CountedRequest(1)]
    for r in reqs:
        i = ring.try_acquire()
        ring.reqs[i] = r
    assert ring.try_acquire() is None  # buffer 0: 1st test
    assert ring.try_acquire() is None  # 2nd
    assert ring.try_acquire() == 0  # 3rd: completed
    assert ring.reqs[0] is None and reqs[0].tests == 3
    assert ring.drained()  # buffer 1 completes at its first test
    assert ring.drained() and ring.try_acquire() == 1  # and is not tested again
    assert [r.tests for r in reqs] == [3, 1]


def test_ring_hands_out_buffers_in_turn():
    ring = _SendRing(3, 4, lambda w: np.zeros(w, np.int64), lambda r: True)
    assert [ring.try_acquire() for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


# --- an in-process stand-in for torch.distributed's point-to-point calls ---------------------


class FakeWork:
    """A torch.distributed Work: ``wait`` blocks until done; waiting on or testing a work after it
    reported completion fails (a gloo send waited twice hangs)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.event = threading.Event()
        self.reported = False
        self.waits = 0

    def _report(self) -> None:
        assert not self.reported, f"{self.kind} work used after it completed"

    def is_completed(self) -> bool:
        self._report()
        self.reported = self.event.is_set()
        return self.reported

    def wait(self) -> bool:
        self._report()
        self.waits += 1
        assert self.event.wait(10), f"{self.kind} work never completed"
        self.reported = True
        return True


class Loopback:
    """One link's isend/irecv inside this process: sends and receives matched in order, whole
    tensors copied when they match (so a send buffer overwritten too early shows), and a send
    completes when a receive took it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sends: deque = deque()
        self.recvs: deque = deque()
        self.works: list[FakeWork] = []
        self.fail_recv = False

    def isend(self, tensor, dst, tag=0):
        return self._add(self.sends, tensor, "send")

    def irecv(self, tensor, src, tag=0):
        if self.fail_recv:
            raise RuntimeError("connection reset")
        return self._add(self.recvs, tensor, "recv")

    def _add(self, side: deque, tensor, kind: str) -> FakeWork:
        work = FakeWork(kind)
        with self.lock:
            self.works.append(work)
            side.append((tensor, work))
            while self.sends and self.recvs:
                (src, sw), (dst, rw) = self.sends.popleft(), self.recvs.popleft()
                assert src.numel() == dst.numel(), "torch p2p messages are whole buffers"
                dst.copy_(src)
                sw.event.set()
                rw.event.set()
        return work


@pytest.fixture
def loopback(monkeypatch):
    lb = Loopback()
    monkeypatch.setattr(torch.distributed, "isend", lb.isend)
    monkeypatch.setattr(torch.distributed, "irecv", lb.irecv)
    return lb


def make_link(transport: str, depth: int, width: int, dist_width: int = 0):
    """(sender, receiver) of one link: mpi to this process over COMM_SELF, torch ones through the
    loopback (nccl on CPU tensors)."""
    comm = None
    if transport == "mpi":
        from mpi4py import MPI

        comm = MPI.COMM_SELF
    device = torch.device("cpu") if transport == "nccl" else None
    spec = LinkSpec(0, depth, width, device, dist_width)
    rcv = open_receiver(transport, comm, spec)
    snd = open_sender(transport, comm, spec)
    return snd, rcv


def send_all(snd, rcv, runs, dists=None) -> list[Proposal]:
    """Send each run (prompt, epoch, start, tokens) completely, polling the receiver between
    tries as a stage's loop would; returns everything received."""
    got: list[Proposal] = []
    for k, (prompt, epoch, start, tokens) in enumerate(runs):
        done = 0
        while done < len(tokens):
            rows = None if dists is None else dists[k][done:]
            done += snd.try_send(prompt, epoch, start + done, tokens[done:], rows)
            got += rcv.poll()
    expected = sum(len(r[3]) for r in runs)

    def all_arrived() -> bool:
        got.extend(rcv.poll())
        return sum(len(p.tokens) for p in got) >= expected

    wait(all_arrived, "every proposal to arrive")
    return got


def close_link(snd, rcv) -> None:
    """Close both ends; the receiver keeps polling meanwhile, as its rank would concurrently."""
    snd.close(lambda cond, what: wait(lambda: rcv.poll() is not None and cond(), what))
    rcv.close(wait)
    assert rcv.closed == rcv.depth


TRANSPORTS = ["mpi", "gloo", "nccl"]


def test_sender_and_receiver_build_the_transport_classes(loopback):
    from mpi4py import MPI

    built = {
        "mpi": (MpiSender, MpiReceiver),
        "gloo": (GlooSender, GlooReceiver),
        "nccl": (NcclSender, NcclReceiver),
    }
    for transport, (s_cls, r_cls) in built.items():
        snd, rcv = make_link(transport, 2, 4)
        assert type(snd) is s_cls and type(rcv) is r_cls
        assert isinstance(snd, Sender) and isinstance(rcv, Receiver)
        close_link(snd, rcv)
    # the transport classes are called without the name; open_sender takes it as a keyword too
    rcv = MpiReceiver(MPI.COMM_SELF, LinkSpec(0, 1, 4))
    snd = open_sender(transport="mpi", comm=MPI.COMM_SELF, spec=LinkSpec(peer=0, depth=1, max_msg_tokens=4))
    assert type(snd) is MpiSender and (snd.depth, snd.width, snd.dist_width) == (1, 4, 0)
    assert (snd.peer, snd.tag, snd.device) == (0, 7, None) and snd.spec == LinkSpec(0, 1, 4)
    close_link(snd, rcv)
    with pytest.raises(ValueError, match="unknown transport 'tcp'"):
        open_sender("tcp", MPI.COMM_SELF, LinkSpec(0, 2, 4))
    with pytest.raises(ValueError, match="unknown transport 'shm'"):
        open_receiver("shm", MPI.COMM_SELF, LinkSpec(0, 2, 4))
    with pytest.raises(ValueError, match="CUDA device"):
        open_sender("nccl", None, LinkSpec(0, 2, 4))
    with pytest.raises(ValueError, match="CUDA device"):
        open_receiver("nccl", None, LinkSpec(0, 2, 4, dist_width=3))


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("depth,width", [(1, 1), (2, 3), (4, 8)])
def test_runs_arrive_chunked_and_in_order(loopback, transport, depth, width):
    snd, rcv = make_link(transport, depth, width)
    runs = [(1, 0, 0, list(range(10, 17))), (1, 1, 4, [99]), (2, 0, 0, list(range(20)))]
    got = send_all(snd, rcv, runs)
    flat = [(p.prompt, p.epoch, p.start + j, t) for p in got for j, t in enumerate(p.tokens)]
    assert flat == [(pr, ep, st + j, t) for pr, ep, st, toks in runs for j, t in enumerate(toks)]
    assert all(1 <= len(p.tokens) <= width for p in got)
    assert all(p.dists is None for p in got)
    n_msgs = sum(-(-len(r[3]) // width) for r in runs)
    assert len(got) == n_msgs
    if transport == "mpi":  # the used prefix of each message
        assert snd.bytes_sent == 8 * (META * n_msgs + sum(len(r[3]) for r in runs))
    else:  # torch p2p sends whole buffers
        assert snd.bytes_sent == 8 * n_msgs * buffer_words(width, 0)
    close_link(snd, rcv)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_distributions_travel_with_their_tokens(loopback, transport):
    width, vocab = 3, 7
    snd, rcv = make_link(transport, 2, width, vocab)
    rng = np.random.default_rng(0)
    runs = [(5, 0, 2, [1, 2, 3, 4, 5]), (5, 0, 7, [6, 6])]
    dists = [rng.random((len(r[3]), vocab), dtype=np.float32) for r in runs]
    got = send_all(snd, rcv, runs, dists)
    assert [p.tokens for p in got] == [[1, 2, 3], [4, 5], [6, 6]]
    assert np.array_equal(np.concatenate([p.dists for p in got]), np.concatenate(dists))
    assert got[0].dists.shape == (3, vocab)
    close_link(snd, rcv)


@pytest.mark.parametrize("transport", ["nccl"])
def test_polled_sender_posts_what_free_buffers_allow(loopback, transport):
    snd, rcv = make_link(transport, 2, 2)
    # 2 messages meet the posted receives; 2 more wait in reused buffers; the 5th finds none free
    assert snd.try_send(1, 0, 0, list(range(10))) == 8
    assert snd.try_send(1, 0, 8, [8, 9]) == 0
    got = rcv.poll()  # reposting lets the waiting two arrive as well
    assert [p.start for p in got] == [0, 2, 4, 6]
    assert snd.try_send(1, 0, 8, [8, 9]) == 2
    assert [p.start for p in rcv.poll()] == [8]
    close_link(snd, rcv)


def test_gloo_send_works_are_waited_once(loopback):
    snd, rcv = make_link("gloo", 2, 2)
    send_all(snd, rcv, [(1, 0, 0, list(range(15)))])
    close_link(snd, rcv)
    assert not rcv.thread.is_alive()
    sends = [w for w in loopback.works if w.kind == "send"]
    assert len(sends) == 8 + 2 and all(w.waits == 1 for w in sends)


def test_gloo_receive_failure_surfaces_on_poll(loopback):
    loopback.fail_recv = True
    rcv = open_receiver("gloo", None, LinkSpec(0, 2, 4))
    rcv.thread.join(5)
    with pytest.raises(RuntimeError, match="gloo receive from rank 0 failed"):
        rcv.poll()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_close_completes_with_proposals_never_polled(loopback, transport):
    snd, rcv = make_link(transport, 3, 2)
    assert snd.try_send(4, 0, 0, [1, 2, 3]) == 3  # never polled
    close_link(snd, rcv)
    assert rcv.poll() == []
