"""parallel_state in one process: rank math goldens/properties, mesh placement, bad input."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from core import parallel_state as ps


def legacy_groups(world: int, tp: int, pp: int) -> dict[str, list[list[int]]]:
    """Megatron's pre-RankGenerator loops for order tp-dp-pp (the golden reference)."""
    dp = world // (tp * pp)
    n_pp_groups = world // pp
    dp_groups = []
    for i in range(pp):
        start, end = i * n_pp_groups, (i + 1) * n_pp_groups
        for j in range(tp):
            dp_groups.append(list(range(start + j, end, tp)))
    tp_groups = [list(range(i * tp, (i + 1) * tp)) for i in range(world // tp)]
    pp_groups = [list(range(i, world, n_pp_groups)) for i in range(n_pp_groups)]
    mp_groups = []
    for i in range(dp):
        ranks = [g[i] for g in dp_groups]
        mp_groups.append(sorted(ranks))
    return {"dp": dp_groups, "tp": tp_groups, "pp": pp_groups, "tp-pp": mp_groups}


def test_rank_generator_golden_example():
    gen = ps.RankGenerator(tp=2, ep=1, dp=2, pp=4, cp=1, order="tp-cp-ep-dp-pp")
    assert gen.get_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert gen.get_ranks("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert gen.get_ranks("tp") == [[2 * i, 2 * i + 1] for i in range(8)]


@pytest.mark.parametrize("world", [8, 16, 64, 1344 * 8])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("pp", [1, 2, 4, 8])
def test_rank_generator_matches_legacy_loops(world, tp, pp):
    if world % (tp * pp):
        pytest.skip("does not divide")
    gen = ps.RankGenerator(tp=tp, ep=1, dp=world // (tp * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    want = legacy_groups(world, tp, pp)
    assert gen.get_ranks("dp") == want["dp"]
    assert gen.get_ranks("tp") == want["tp"]
    assert gen.get_ranks("pp") == want["pp"]
    assert sorted(sorted(g) for g in gen.get_ranks("tp-pp")) == sorted(want["tp-pp"])


def test_rank_offset():
    gen = ps.RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=1, order="tp-dp", rank_offset=8)
    assert gen.get_ranks("dp") == [[8, 10], [9, 11]]


@pytest.mark.parametrize("order", ["tp-cp-ep-dp-pp", "tp-cp-pp-ep-dp", "tp-pp-dp", "pp-dp-tp-cp-ep"])
@pytest.mark.parametrize("sizes", [(2, 1, 2, 2, 2), (1, 2, 3, 2, 1), (4, 1, 1, 3, 2)])
def test_rank_generator_properties(order, sizes):
    tp, ep, dp, pp, cp = sizes
    try:
        gen = ps.RankGenerator(tp=tp, ep=ep, dp=dp, pp=pp, cp=cp, order=order)
    except ValueError:
        assert any(n not in order for n, s in zip(("tp", "ep", "dp", "pp", "cp"), sizes) if s > 1)
        return
    world = tp * ep * dp * pp * cp
    size_of = {"tp": tp, "ep": ep, "dp": dp, "pp": pp, "cp": cp}
    for r in range(1, 4):
        for combo in itertools.combinations(size_of, r):
            token = "-".join(combo)
            groups = gen.get_ranks(token)
            # Partition of the world, groups of the right size.
            assert sorted(x for g in groups for x in g) == list(range(world))
            assert all(len(g) == int(np.prod([size_of[t] for t in combo])) for g in groups)
    # Orthogonality: groups along disjoint dimensions meet in exactly one rank.
    for a, b in itertools.combinations(size_of, 2):
        for ga in gen.get_ranks(a):
            for gb in gen.get_ranks(b):
                assert len(set(ga) & set(gb)) <= 1


@pytest.mark.parametrize("order", ["tp-cp-ep-dp-pp", "tp-cp-pp-ep-dp"])
@pytest.mark.parametrize(
    "tp,pp,cp,ep", [(1, 1, 1, 1), (2, 2, 1, 1), (4, 2, 1, 1), (2, 1, 2, 1), (2, 1, 1, 2), (1, 2, 1, 2), (1, 1, 1, 8)]
)
def test_mesh_placement_agrees_with_rank_generator(order, tp, pp, cp, ep):
    state = ps.build_parallel_state(tp, pp, None, cp, ep, order)
    dp = 8 // (tp * pp * cp)
    assert state.data_parallel_size == dp
    gen = ps.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    for token, axes in [("tp", ("tp",)), ("pp", ("pp",)), ("cp", ("cp",)), ("dp", state.data_parallel_axis_name),
                        ("dp-cp", state.data_parallel_with_context_axis_name), ("tp-pp", ("tp", "pp"))]:
        assert sorted(state.groups(state.axis_names(*axes))) == sorted(gen.get_ranks(token)), token
    # Global rank r is the r-th device.
    devs = sorted(jax.devices(), key=lambda d: d.id)
    for rank, dev in zip(state.device_ranks.flat, state.mesh.devices.flat):
        assert devs[rank] == dev


@pytest.mark.parametrize("order", ["tp-cp-ep-dp-pp", "tp-cp-pp-ep-dp"])
@pytest.mark.parametrize("tp,cp,ep", [(1, 2, 2), (2, 2, 2), (1, 2, 4)])
def test_expert_groups_with_context_parallelism_stay_inside_a_cp_rank(order, tp, cp, ep):
    # Megatron's expert-parallel groups may span cp ranks; here an ep group shares one cp (and
    # dp / ep) coordinate, and the expert-data-parallel group is dp / ep x cp.
    state = ps.build_parallel_state(tp, 1, None, cp, ep, order)
    for group in state.groups(("ep",)):
        assert len(group) == ep and len({state.coordinates(r)["cp"] for r in group}) == 1
    edp_cp = state.groups(state.replica_axes(expert=True))
    assert {len(g) for g in edp_cp} == {8 // (tp * ep)}
    for group in edp_cp:
        assert len({state.coordinates(r)["ep"] for r in group}) == 1
        assert len({state.coordinates(r)["cp"] for r in group}) == cp
    assert state.replica_axes(expert=False) == state.data_parallel_with_context_axis_name


def test_expert_data_parallel_getters_include_cp_as_megatron():
    # Megatron's expert-data-parallel group is world / (tp x ep x pp) ranks: cp included.
    ps.initialize_model_parallel(context_parallel_size=2, expert_model_parallel_size=2)
    try:
        assert ps.get_expert_data_parallel_axis_name() == ("dp", "cp")
        assert ps.get_expert_data_parallel_world_size() == 4
        assert 0 <= ps.get_expert_data_parallel_rank() < 4
    finally:
        ps.destroy_model_parallel()


def test_lax_axis_index_matches_host_group_rank():
    state = ps.build_parallel_state(2, 2)
    axes = ("tp", "pp", state.data_parallel_axis_name)

    def f(x):
        idx = [jax.lax.axis_index(a) for a in axes]
        return jnp.stack(idx)[None, None, None, None, None, :]

    out = jax.jit(jax.shard_map(f, mesh=state.mesh, in_specs=P(), out_specs=P(*state.mesh.axis_names)))(0.0)
    out = np.asarray(out)
    for rank in range(8):
        coords = state.coordinates(rank)
        got = out[tuple(coords[a] for a in state.mesh.axis_names)]
        want = [state.group_rank(rank, ("tp",)), state.group_rank(rank, ("pp",)),
                state.group_rank(rank, state.data_parallel_axis_name)]
        assert list(got) == want


def test_psum_over_tp_gives_6_and_22():
    ps.initialize_model_parallel(tensor_model_parallel_size=4, pipeline_model_parallel_size=2)
    mesh = ps.get_mesh()
    ranks = np.asarray(ps.get_parallel_state().device_ranks, np.float32)
    x = jax.device_put(ranks, jax.NamedSharding(mesh, P(*mesh.axis_names)))

    def f(v):
        return jax.lax.psum(v, ps.get_tensor_model_parallel_axis_name())

    out = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(*mesh.axis_names), out_specs=P(*mesh.axis_names)))(x)
    got = {int(r): float(v) for r, v in zip(ranks.flat, np.asarray(out).flat)}
    assert got == {r: (6.0 if r < 4 else 22.0) for r in range(8)}


def test_facade_getters_single_process():
    state = ps.initialize_model_parallel(2, 2, virtual_pipeline_model_parallel_size=2)
    assert ps.model_parallel_is_initialized()
    assert ps.get_parallel_state() is state
    assert ps.get_tensor_model_parallel_world_size() == 2
    assert ps.get_pipeline_model_parallel_world_size() == 2
    assert ps.get_data_parallel_world_size() == 2
    assert ps.get_virtual_pipeline_model_parallel_world_size() == 2
    # This process's first device is global rank 0: first stage, tp 0, dp 0.
    assert ps.get_global_rank() == 0
    assert (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()) == (0, 0)
    assert ps.is_pipeline_first_stage() and not ps.is_pipeline_last_stage()
    assert not ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=1)
    assert ps.get_pipeline_model_parallel_next_rank() == 4
    assert ps.get_pipeline_model_parallel_prev_rank() == 4
    assert ps.get_embedding_ranks() == [0, 4]
    assert ps.get_position_embedding_ranks() == [0]
    assert ps.get_data_parallel_axis_name() == ("dp", "ep")
    assert ps.get_data_parallel_axis_name(with_context_parallel=True) == ("dp", "ep", "cp")
    ps.destroy_model_parallel()
    assert not ps.model_parallel_is_initialized()
    with pytest.raises(RuntimeError, match="not initialized"):
        ps.get_tensor_model_parallel_world_size()


@pytest.mark.parametrize(
    "kwargs,exc,pattern",
    [
        (dict(tensor_model_parallel_size=3), RuntimeError, r"world_size \(8\) is not divisible.*\(3\)"),
        (dict(tensor_model_parallel_size=16), RuntimeError, r"world_size \(8\).*\(16\)"),
        (dict(pipeline_model_parallel_size=16), RuntimeError, r"pipeline_model_parallel_size \(16\)"),
        (dict(tensor_model_parallel_size=4, pipeline_model_parallel_size=4), RuntimeError, r"= 16"),
        (dict(virtual_pipeline_model_parallel_size=2), ValueError, r"needs pipeline_model_parallel_size > 1 \(got 1\)"),
        (dict(context_parallel_size=2, order="tp-dp-pp"), ValueError, r"size of cp is 2.*'tp-dp-pp'"),
        (dict(tensor_model_parallel_size=0), ValueError, r"positive int"),
        (dict(expert_model_parallel_size=3), RuntimeError, r"data_parallel_size \(8\).*expert_model_parallel_size \(3\)"),
        # ep 8 divides dp x cp but not dp: its groups would span cp ranks (Megatron's may; one mesh cannot).
        (dict(context_parallel_size=2, expert_model_parallel_size=8), RuntimeError,
         r"data_parallel_size \(4\).*expert_model_parallel_size \(8\)"),
        (dict(order="tp-xx-dp"), ValueError, r"must name each"),
    ],
)
def test_bad_input_raises_clear_error(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        ps.initialize_model_parallel(**kwargs)
    assert not ps.model_parallel_is_initialized()


def test_initialize_twice_without_destroy():
    ps.initialize_model_parallel(2)
    with pytest.raises(RuntimeError, match=r"already initialized \(tp=2, pp=1, dp=4\).*destroy_model_parallel"):
        ps.initialize_model_parallel(2)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(4)


# -- hosts: tensor parallelism stays inside a host ------------------------------------------
def _host_of(hosts):
    """Simulated hosts: device with id ``i`` sits on host ``hosts[i]``."""
    return lambda d: hosts[d.id]


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_groups_stay_in_a_host_whatever_the_process_placement(tp, recwarn):
    """``mpirun --map-by node`` numbers processes round-robin over two hosts (even ids on host 0,
    odd on host 1): the mesh still keeps every tp group on one host, and Megatron's rank math
    holds over the host-ordered ranks."""
    round_robin = _host_of({d.id: d.id % 2 for d in jax.devices()})
    state = ps.build_parallel_state(tp, 2 if tp == 2 else 1, host_of=round_robin)
    by_rank = dict(zip(state.device_ranks.flat, state.mesh.devices.flat))
    for group in state.groups(("tp",)):
        assert len({round_robin(by_rank[r]) for r in group}) == 1, group
    assert not [w for w in recwarn if "tensor-parallel" in str(w.message)]


def test_default_placement_is_unchanged_with_hosts_in_process_order():
    """Hosts holding consecutive processes (the launchers' default): the same mesh as without hosts."""
    contiguous = _host_of({d.id: d.id // 4 for d in jax.devices()})
    for tp, pp in [(2, 2), (4, 1), (1, 4)]:
        plain = ps.build_parallel_state(tp, pp)
        hosted = ps.build_parallel_state(tp, pp, host_of=contiguous)
        assert (plain.mesh.devices == hosted.mesh.devices).all()


def test_tp_wider_than_a_host_warns_with_the_numbers():
    two_per_host = _host_of({d.id: d.id // 2 for d in jax.devices()})
    with pytest.warns(UserWarning, match=r"tensor-parallel groups of 4 devices span up to 2 hosts \(the smallest "
                                         r"host has 2 devices\)"):
        ps.build_parallel_state(4, 1, host_of=two_per_host)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ps.build_parallel_state(2, 2, host_of=two_per_host)  # fits: no warning
