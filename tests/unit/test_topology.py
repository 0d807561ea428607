import pytest

from pipespec_mpi.topology import TopologyError, check_world, device_for, place


@pytest.mark.parametrize("world,stages", [(3, 3), (6, 3), (2, 2), (8, 2), (1, 1), (4, 4)])
def test_every_rank_has_one_stage_of_one_replica(world, stages):
    seen = set()
    for r in range(world):
        p = place(r, world, stages)
        assert p.rank_of(p.stage) == r
        seen.add((p.replica, p.stage))
        if p.upstream is not None:
            assert place(p.upstream, world, stages).stage == p.stage - 1
        if p.downstream is not None:
            assert place(p.downstream, world, stages).replica == p.replica
        assert p.leader == p.rank_of(stages - 1)
    assert len(seen) == world


@pytest.mark.parametrize("world,stages", [(4, 3), (2, 3), (5, 2)])
def test_bad_world_size_names_the_numbers(world, stages):
    with pytest.raises(TopologyError, match=f"world size {world}.*{stages} stages"):
        check_world(world, stages)


def test_devices_follow_stage_gpu_counts():
    # 1B, 8B, 70B over 2 GPUs on a 4-GPU node: devices 0, 1, 2-3
    assert [device_for([1, 1, 2], s, s, 4) for s in range(3)] == [[0], [1], [2, 3]]
    # second replica on an 8-GPU node starts at device 4
    assert device_for([1, 1, 2], 0, 3, 8) == [4]
    # three ranks sharing one GPU (smoke test)
    assert [device_for([1, 1, 1], s, s, 1) for s in range(3)] == [[0], [0], [0]]
    assert device_for([1], 0, 0, 0) == []
