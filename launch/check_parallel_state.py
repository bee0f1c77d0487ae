"""Print the parallel layout of this job and check a collective over every mesh axis.

    mpirun -n 8 python launch/check_parallel_state.py --tensor-model-parallel-size 2 \
        --pipeline-model-parallel-size 2

Each rank reports its global rank and its tp/pp/dp coordinates; then a ``psum`` of ones over
each mesh axis must equal that axis's size on every device. Exits non-zero on a mismatch or a
bad layout (one line from rank 0).
"""

import argparse
import sys

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from core import parallel_state as ps


def parse_args() -> argparse.Namespace:
    """Megatron-style layout flags."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None)
    p.add_argument("--context-parallel-size", type=int, default=1)
    p.add_argument("--expert-model-parallel-size", type=int, default=1)
    p.add_argument("--order", default=ps.DEFAULT_ORDER)
    return p.parse_args()


def main() -> int:
    """Initialise, report, check; return the exit code."""
    args = parse_args()
    ps.initialize_distributed()
    try:
        state = ps.initialize_model_parallel(
            args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.virtual_pipeline_model_parallel_size, args.context_parallel_size,
            args.expert_model_parallel_size, args.order,
        )
    except (ValueError, RuntimeError) as err:
        if jax.process_index() == 0:
            print(f"error: {err}", file=sys.stderr)
        return 2
    mesh = state.mesh
    print(
        f"rank {ps.get_global_rank()}/{state.world_size}: tp {ps.get_tensor_model_parallel_rank()} "
        f"pp {ps.get_pipeline_model_parallel_rank()} dp {ps.get_data_parallel_rank()} "
        f"cp {ps.get_context_parallel_rank()} ep {ps.get_expert_model_parallel_rank()}",
        flush=True,
    )

    def sizes(x):
        return jax.numpy.stack([jax.lax.psum(x, a) for a in mesh.axis_names])

    out = jax.jit(jax.shard_map(sizes, mesh=mesh, in_specs=P(), out_specs=P()))(1.0)
    ok = np.array_equal(np.asarray(out), [mesh.shape[a] for a in mesh.axis_names])
    if jax.process_index() == 0:
        print(f"mesh {dict(mesh.shape)}: collectives over every axis {'OK' if ok else 'WRONG'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
