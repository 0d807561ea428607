"""The rendezvous' bounded steps (comm/rendezvous.py): who did not come is named, within the bound."""

from __future__ import annotations

import socket
import time

import pytest

from pipespec_mpi.comm import rendezvous as rv

HOSTS = ["h0", "h0", "h1"]


class Req:
    def __init__(self, value=None, done=True) -> None:
        self.value, self.done = value, done

    def test(self):
        return (self.done, self.value if self.done else None)


class FakeComm:
    """Rank ``rank`` of 3; ``came``: the ranks whose check-in reaches rank 0; ``answer``: rank 0's
    answer to this rank (None: none comes)."""

    def __init__(self, rank: int, came=(1, 2), answer=None) -> None:
        self.rank, self.came, self.answer = rank, set(came), answer
        self.sent: list[tuple[object, int]] = []

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return 3

    def irecv(self, source: int, tag: int) -> Req:
        assert tag == rv.CHECK_IN_TAG
        if self.rank == 0:
            return Req(source, done=source in self.came)
        return Req(self.answer, done=self.answer is not None)

    def isend(self, obj, dest: int, tag: int) -> Req:
        self.sent.append((obj, dest))
        return Req()

    def send(self, obj, dest: int, tag: int) -> None:
        self.sent.append((obj, dest))


def test_rank_0_names_the_rank_that_never_checked_in_and_tells_the_others():
    comm = FakeComm(0, came=[1])
    t0 = time.monotonic()
    with pytest.raises(rv.RendezvousError, match=r"rank 2 \(h1\) did not reach the rendezvous within 0.3 s"):
        rv.check_in(comm, HOSTS, rv.Deadline(0.3))
    assert 0.3 <= time.monotonic() - t0 < 2
    assert comm.sent == [([2], 1)]  # rank 1 learns who is missing; rank 2 is not written to


def test_a_rank_told_of_a_missing_one_names_it_and_one_without_an_answer_names_rank_0():
    with pytest.raises(rv.RendezvousError, match=r"rank 2 \(h1\) did not reach"):
        rv.check_in(FakeComm(1, answer=[2]), HOSTS, rv.Deadline(5))
    with pytest.raises(rv.RendezvousError, match=r"rank 0 \(h0\) did not reach"):
        rv.check_in(FakeComm(2, answer=None), HOSTS, rv.Deadline(0.1), grace_s=0.1)


def test_everyone_came():
    rv.check_in(FakeComm(0), HOSTS, rv.Deadline(5))
    rv.check_in(FakeComm(2, answer=[]), HOSTS, rv.Deadline(5))


def test_the_store_connect_is_tried_again_until_the_deadline(monkeypatch):
    import torch.distributed as dist

    tries = []

    def store(*args, **kwargs):
        tries.append(kwargs)
        if len(tries) < 3:
            raise RuntimeError("connection refused")
        return "store"

    monkeypatch.setattr(dist, "TCPStore", store)
    assert rv.open_store(1, 3, "10.0.0.1", 29500, HOSTS, rv.Deadline(30)) == "store"
    assert len(tries) == 3 and all(not t["is_master"] and not t["wait_for_workers"] for t in tries)
    tries.clear()
    monkeypatch.setattr(dist, "TCPStore", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("refused")))
    with pytest.raises(
        rv.RendezvousError, match=r"rank 2 \(h1\) could not connect.*rank 0 \(h0\) at 10.0.0.1:29500"
    ):
        rv.open_store(2, 3, "10.0.0.1", 29500, HOSTS, rv.Deadline(0.5))


def test_a_rank_that_did_not_mark_the_store_is_named():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = rv.open_store(0, 3, "127.0.0.1", port, HOSTS, rv.Deadline(10))
    rv.mark(store, 0)
    rv.mark(store, 1)
    with pytest.raises(
        rv.RendezvousError, match=r"rank 2 \(h1\) did not join the rendezvous store within 0.5 s"
    ):
        rv.wait_marked(store, 3, HOSTS, rv.Deadline(0.5))
    rv.mark(store, 2)
    rv.wait_marked(store, 3, HOSTS, rv.Deadline(5))


def test_the_process_group_waits_as_long_as_a_link_may_idle_and_opens_pairs_lazily(monkeypatch):
    """After the start-up bound, a posted receive waits up to transport.op_timeout_s (torch's
    own default would end the job after 30 min of an idle gloo link, 10 of an NCCL one); the group
    is made without device_id (NCCL's eager init would put every pair on one stream)."""
    import datetime

    import torch
    import torch.distributed as dist

    made = []
    real = dist.init_process_group

    def init(*args, **kwargs):
        made.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(dist, "init_process_group", init)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    store = rv.open_store(0, 1, "127.0.0.1", port, ["h0"], rv.Deadline(10))
    try:
        rv.connect_pairs("gloo", store, 0, 1, ["h0"], rv.Deadline(10), op_timeout_s=12345.0)
        gloo = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        assert gloo.options._timeout == datetime.timedelta(seconds=12345)
    finally:
        dist.destroy_process_group()
    assert made and "device_id" not in made[0]


def test_no_batched_point_to_point_anywhere():
    """batch_isend_irecv runs a batch's operations as one group on one stream: a receive posted
    in it would hold back every send behind it (each link must stay independent)."""
    from pathlib import Path

    import pipespec_mpi

    root = Path(pipespec_mpi.__file__).parent
    found = [p.name for p in root.rglob("*.py") if "batch_isend_irecv" in p.read_text()]
    assert found == []
