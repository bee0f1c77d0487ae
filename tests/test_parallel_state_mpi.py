"""parallel_state across real processes (mpirun -n 8, one device per process)."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from core import parallel_state as ps

pytestmark = pytest.mark.mpi(min_size=8)


def _comm():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def test_one_process_per_global_rank():
    assert jax.process_count() == _comm().Get_size()
    state = ps.initialize_model_parallel(4, 2)
    assert ps.get_global_rank() == _comm().Get_rank() == jax.process_index()
    assert state.world_size == jax.device_count()


@pytest.mark.parametrize("order", ["tp-cp-ep-dp-pp", "tp-cp-pp-ep-dp"])
@pytest.mark.parametrize("tp,pp", [(4, 2), (2, 2), (1, 4), (2, 1)])
def test_getters_agree_with_mesh_coordinates(order, tp, pp):
    state = ps.initialize_model_parallel(tp, pp, order=order)
    rank = _comm().Get_rank()
    gen = ps.RankGenerator(tp=tp, ep=1, dp=state.data_parallel_size, pp=pp, cp=1, order=order)

    def where(token):
        group = next(g for g in gen.get_ranks(token) if rank in g)
        return group, group.index(rank)

    tp_group, tp_rank = where("tp")
    pp_group, pp_rank = where("pp")
    dp_group, dp_rank = where("dp")
    assert ps.get_tensor_model_parallel_rank() == tp_rank
    assert ps.get_pipeline_model_parallel_rank() == pp_rank
    assert ps.get_data_parallel_rank() == dp_rank
    assert ps.get_tensor_model_parallel_world_size() == len(tp_group)
    assert ps.get_data_parallel_world_size() == len(dp_group)
    assert ps.is_pipeline_first_stage() == (pp_rank == 0)
    assert ps.is_pipeline_last_stage() == (pp_rank == pp - 1)
    assert ps.get_pipeline_model_parallel_next_rank() == pp_group[(pp_rank + 1) % pp]
    assert ps.get_pipeline_model_parallel_prev_rank() == pp_group[(pp_rank - 1) % pp]
    assert ps.get_embedding_ranks() == ([pp_group[0], pp_group[-1]] if pp > 1 else [pp_group[0]])

    # The traced ranks inside shard_map agree with the host getters on every device.
    mesh = ps.get_mesh()
    spec = P(*mesh.axis_names)

    def f(_):
        idx = [jax.lax.axis_index(a) for a in ("tp", "pp", ps.get_data_parallel_axis_name())]
        return jax.numpy.stack(idx).reshape((1,) * len(mesh.axis_names) + (3,))

    out = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=spec))(0.0)
    (local,) = [np.asarray(s.data).ravel() for s in out.addressable_shards]
    assert local.tolist() == [tp_rank, pp_rank, dp_rank]


def test_psum_over_tp_of_ones_times_rank():
    ps.initialize_model_parallel(tensor_model_parallel_size=4, pipeline_model_parallel_size=2)
    mesh = ps.get_mesh()
    rank = _comm().Get_rank()
    spec = P(*mesh.axis_names)
    x = jax.make_array_from_process_local_data(
        jax.NamedSharding(mesh, spec), np.full((1,) * len(mesh.axis_names) + (4,), rank, np.float32)
    )
    fn = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, ps.get_tensor_model_parallel_axis_name()),
                               mesh=mesh, in_specs=spec, out_specs=spec))
    (local,) = [np.asarray(s.data) for s in fn(x).addressable_shards]
    np.testing.assert_array_equal(local, 6.0 if rank < 4 else 22.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(tensor_model_parallel_size=3),
        dict(tensor_model_parallel_size=4, pipeline_model_parallel_size=4),
        dict(virtual_pipeline_model_parallel_size=2),
        dict(context_parallel_size=2, order="tp-dp-pp"),
    ],
)
def test_bad_input_same_error_on_every_rank(kwargs):
    try:
        ps.initialize_model_parallel(**kwargs)
        message = "no error"
    except (ValueError, RuntimeError) as err:
        message = f"{type(err).__name__}: {err}"
    messages = _comm().allgather(message)
    assert message != "no error"
    assert len(set(messages)) == 1, messages


def test_initialize_twice_raises_on_every_rank():
    ps.initialize_model_parallel(2, 2)
    with pytest.raises(RuntimeError, match="already initialized"):
        ps.initialize_model_parallel(2, 2)
