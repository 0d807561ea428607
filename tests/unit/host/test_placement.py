"""A rank's threads and CPUs job by job (``host.placement.CpuPlacement``), on this process's own
affinity and torch threads, restored after each test."""

import os

import pytest
import torch

from pipespec_mpi.host.placement import CpuPlacement, CpuShare


@pytest.fixture
def restored():
    home, threads = os.sched_getaffinity(0), torch.get_num_threads()
    yield sorted(home)
    os.sched_setaffinity(0, home)
    torch.set_num_threads(threads)


def test_a_last_stage_computing_alone_takes_its_solo_threads_and_gives_them_back(restored):
    torch.set_num_threads(1)
    cpus = CpuPlacement(CpuShare(1, solo=3), "auto")
    seen = []
    for method in ("ar", "sd", "pipespec", "ar", "ar", "pipespec"):  # batch 1: methods alternate
        cpus.enter(1, method)
        seen.append((cpus.threads, torch.get_num_threads()))
    assert seen == [(3, 3), (1, 1), (1, 1), (3, 3), (3, 3), (1, 1)]
    assert "3 threads, unbound, in AR" in cpus.where


def test_a_bound_last_stage_runs_ar_unbound(restored):
    if len(restored) < 2:
        pytest.skip("needs two CPUs")
    torch.set_num_threads(1)
    cpus = CpuPlacement(CpuShare(1, (restored[1],), solo=2), "auto")
    cpus.enter(4, "pipespec")  # a batched phase binds (run.cpu_bind=auto)
    assert os.sched_getaffinity(0) == {restored[1]} and cpus.bound == [restored[1]]
    cpus.enter(4, "ar")  # alone: its launched CPUs, both threads
    assert os.sched_getaffinity(0) == set(restored) and cpus.bound is None
    assert cpus.threads == torch.get_num_threads() == 2
    cpus.enter(1, "pipespec")  # batch 1 does not bind
    assert os.sched_getaffinity(0) == set(restored) and cpus.threads == 1


def test_a_stage_without_solo_keeps_its_share_in_ar(restored):
    if len(restored) < 2:
        pytest.skip("needs two CPUs")
    torch.set_num_threads(1)
    cpus = CpuPlacement(CpuShare(1, (restored[0],)), "auto")  # a drafter: idle in AR
    cpus.enter(2, "ar")
    assert os.sched_getaffinity(0) == {restored[0]} and cpus.threads == 1


def test_one_count_keeps_the_threads_on_every_route(restored):
    """A compiled stage keeps one thread count (each count would compile its graphs again)."""
    torch.set_num_threads(1)
    cpus = CpuPlacement(CpuShare(1), "none", routes={(0, 2): CpuShare(2)})
    cpus.enter(1, "pipespec", route=(0, 2))
    assert cpus.threads == torch.get_num_threads() == 2  # the route's own share
    cpus.one_count()
    for route in ((0, 2), None, (0, 2)):
        cpus.enter(1, "pipespec", route=route)
        assert cpus.threads == torch.get_num_threads() == 1
