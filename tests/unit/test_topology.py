import pytest

from pipespec_mpi.host.placement import CpuShare, binds, share_cpus
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


def shares(hosts, affinities, n_stages, threads=None, light=frozenset()):
    aff = [frozenset(a) for a in affinities]
    return [share_cpus(r, hosts, aff, n_stages, threads, light) for r in range(len(hosts))]


def test_a_pipeline_on_fewer_cpus_than_ranks_gives_its_last_stage_a_cpu_of_its_own():
    got = shares(["a"] * 3, [{0, 1}] * 3, 3)
    assert got == [CpuShare(1, (0,)), CpuShare(1, (0,)), CpuShare(1, (1,), solo=2)]
    # the bound CPUs are disjoint between the last stage and the rest, and cover the node
    assert not set(got[2].cpus) & set(got[0].cpus)


def test_two_replicas_on_one_node_bind_each_last_stage_apart():
    got = shares(["a"] * 6, [range(4)] * 6, 3)
    assert [g.cpus for g in got] == [(0, 1), (0, 1), (2,), (0, 1), (0, 1), (3,)]
    assert {g.threads for g in got} == {1}
    assert [g.solo for g in got] == [None, None, 2, None, None, 2]  # AR: half the node each


def test_nobody_is_bound_where_the_cpus_suffice_or_are_too_few_for_a_spare():
    # as many CPUs as ranks: split, the OS places them
    assert shares(["a"] * 3, [range(6)] * 3, 3) == [CpuShare(2), CpuShare(2), CpuShare(2, solo=6)]
    # two replicas on 2 CPUs: the last stages would take them all
    assert shares(["a"] * 6, [{0, 1}] * 6, 3) == [CpuShare(1)] * 6
    # one-stage pipelines (AR): every rank is a last stage
    assert shares(["a"] * 3, [{0, 1}] * 3, 1) == [CpuShare(1)] * 3


def test_a_model_free_stage_leaves_the_cores_to_the_model_stages():
    # suffix -> target on 2 cores: the target computes on both, the drafter gets one thread
    assert shares(["a"] * 2, [{0, 1}] * 2, 2, light=frozenset({0})) == [CpuShare(1), CpuShare(2)]
    # suffix -> copy -> target on 4 cores: 2 each for the model stages (an even split gave 1)
    assert shares(["a"] * 3, [range(4)] * 3, 3) == [CpuShare(1), CpuShare(1), CpuShare(1, solo=4)]
    got = shares(["a"] * 3, [range(4)] * 3, 3, light=frozenset({0}))
    assert got == [CpuShare(1), CpuShare(2), CpuShare(2, solo=4)]
    # two replicas of suffix -> target on 8 cores: 4 for each target
    got = shares(["a"] * 4, [range(8)] * 4, 2, light=frozenset({0}))
    assert got == [CpuShare(1), CpuShare(4), CpuShare(1), CpuShare(4)]
    # outnumbered CPUs still bind the last stage apart, a light stage beside the others
    got = shares(["a"] * 3, [{0, 1}] * 3, 3, light=frozenset({0}))
    assert got == [CpuShare(1, (0,)), CpuShare(1, (0,)), CpuShare(1, (1,), solo=2)]
    # a stage's own threads setting still decides the count
    assert shares(["a"] * 2, [{0, 1}] * 2, 2, threads=3, light=frozenset({0})) == [CpuShare(3)] * 2


@pytest.mark.parametrize(
    "hosts, affinities, n_stages, light, cores",
    [
        (["a"] * 2, [{0, 1}] * 2, 2, {0}, [0, 2]),  # suffix -> target on 2 cores: both the target's
        (["a"] * 3, [range(4)] * 3, 3, {0}, [0, 2, 2]),
        (["a"] * 3, [range(6)] * 3, 3, set(), [2, 2, 2]),
        (["a"] * 4, [range(8)] * 4, 2, {0}, [0, 4, 0, 4]),  # two replicas, 4 each
        (["a"] * 3, [{0, 1}] * 3, 3, {0}, [0.5, 0.5, 1]),  # outnumbered: the last stage's own CPU
        (["a"] * 6, [{0, 1}] * 6, 3, set(), [1 / 3] * 6),  # too few for a spare: all share
        (["a"] * 3, [{0}, {1}, {2, 3}], 3, {0}, [1, 1, 2]),  # a launcher's binding: held
        (["a", "b"], [{0, 1}, {0, 1}], 2, {0}, [2, 2]),  # a drafter alone on its node holds it
    ],
)
def test_the_cores_a_rank_accounts_for_add_up_to_its_nodes(hosts, affinities, n_stages, light, cores):
    got = shares(hosts, affinities, n_stages, light=frozenset(light))
    assert [g.cores for g in got] == pytest.approx(cores)
    for host in set(hosts):  # a node's ranks account for every CPU it has, no more
        on = [r for r, h in enumerate(hosts) if h == host]
        if all(affinities[r] == affinities[on[0]] for r in on):
            assert sum(got[r].cores for r in on) == pytest.approx(len(set(affinities[on[0]])))
    assert shares(["a"] * 2, [{0, 1}] * 2, 2, threads=3, light=frozenset({0}))[0].cores == 0  # not threads


def test_batched_phases_bind_under_auto_and_batch_1_does_not():
    assert [binds("auto", b) for b in (1, 2, 16)] == [False, True, True]
    assert [binds("always", b) for b in (1, 4)] == [True, True]
    assert [binds("none", b) for b in (1, 4)] == [False, False]


def test_a_launcher_that_bound_the_ranks_decides():
    got = shares(["a"] * 3, [{0}, {1}, {2, 3}], 3)
    assert got == [CpuShare(1), CpuShare(1), CpuShare(2)]


def test_each_node_is_placed_on_its_own():
    # stage 0 and 1 on host a (2 CPUs, not outnumbered), the last stage alone on host b
    got = shares(["a", "a", "b"], [{0, 1}, {0, 1}, {0, 1}], 3)
    assert got == [CpuShare(1), CpuShare(1), CpuShare(2)]


def test_a_stage_threads_setting_sets_the_count_not_the_cpus():
    got = shares(["a"] * 3, [{0, 1}] * 3, 3, threads=2)
    assert [(g.threads, g.cpus) for g in got] == [(2, (0,)), (2, (0,)), (2, (1,))]


def test_ar_takes_the_idle_stages_cpus_whatever_the_pipelines_threads():
    # hierarchy=auto sets every stage's threads (one each for two model stages on 2 CPUs); AR's
    # last stage still computes on both, as auto priced it
    got = shares(["a"] * 3, [{0, 1}] * 3, 3, threads=1, light=frozenset({0}))
    assert [g.solo for g in got] == [None, None, 2]
    # a count above the node's share stays the count
    assert shares(["a"] * 3, [range(4)] * 3, 3, threads=8)[2].solo is None


def test_a_stage_s_neighbours_are_the_stages_beside_it_in_its_replica():
    assert place(0, 6, 3).neighbours == [1]
    assert place(1, 6, 3).neighbours == [0, 2]
    assert place(5, 6, 3).neighbours == [4]  # replica 1's last stage
    assert place(0, 1, 1).neighbours == []


def test_a_stage_s_peers_are_the_other_stages_of_its_replica():
    assert place(1, 6, 3).peers == [0, 2]
    assert place(3, 6, 3).peers == [4, 5]  # replica 1's first stage
    assert place(0, 1, 1).peers == []


def test_a_rank_on_a_route_has_the_routes_neighbours():
    from pipespec_mpi.topology import place

    # replica 1 of a 3-stage hierarchy on 6 ranks, decoding on stages 0 and 2
    first, middle, last = (place(r, 6, 3).on_route((0, 2)) for r in (3, 4, 5))
    assert (first.upstream, first.downstream) == (None, 5)
    assert (last.upstream, last.downstream, last.upstream_stage) == (3, None, 0)
    assert not middle.member and middle.neighbours == []
    assert last.is_last and last.leader == 5  # the replica's leader whatever the route
    whole = place(4, 6, 3)
    assert whole.on_route((0, 1, 2)) == whole and (whole.upstream, whole.downstream) == (3, 5)


def test_routes_end_with_the_last_stage_a_model_free_one_first():
    from pipespec_mpi.topology import parse_route, route_name, routes

    assert routes(3) == [(0, 1, 2), (0, 2), (1, 2), (2,)]
    assert routes(3, frozenset({1})) == [(0, 2), (1, 2), (2,)]
    assert all(parse_route(route_name(r)) == r for r in routes(4))
