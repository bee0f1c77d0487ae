"""jax.distributed as core.runtime.cluster starts it, in 8 real processes on one host."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from core import parallel_state as ps
from core.runtime import cluster

pytestmark = pytest.mark.mpi(min_size=8)


def test_one_host_every_process_one_device():
    from mpi4py import MPI

    assert jax.process_count() == MPI.COMM_WORLD.Get_size()
    assert jax.process_index() == MPI.COMM_WORLD.Get_rank()
    assert cluster._PROCESS_HOSTS == [0] * jax.process_count()
    assert jax.local_device_count() == 1


def test_round_robin_hosts_keep_tp_groups_together():
    """Processes placed round-robin over two (simulated) hosts: tp groups of 4 hold one host's
    processes, and a psum over tp adds exactly those processes' values."""
    host_of = lambda d: d.process_index % 2
    state = ps.build_parallel_state(4, 1, host_of=host_of)
    by_rank = dict(zip(state.device_ranks.flat, state.mesh.devices.flat))
    groups = [[by_rank[r].process_index for r in g] for g in state.groups(("tp",))]
    assert sorted(sorted(g) for g in groups) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    mesh = state.mesh
    local = np.full((1,) * len(mesh.axis_names), float(jax.process_index()), np.float32)
    x = jax.make_array_from_process_local_data(jax.NamedSharding(mesh, P(*mesh.axis_names)), local,
                                               mesh.devices.shape)
    out = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "tp"), mesh=mesh, in_specs=P(*mesh.axis_names),
                                out_specs=P(*mesh.axis_names)))(x)
    mine = float(np.asarray(out.addressable_data(0)).ravel()[0])
    assert mine == (12.0 if jax.process_index() % 2 == 0 else 16.0)
