"""Run under mpirun by tests/test_compilation_cache.py: compile one SPMD program with the
launch path's persistent cache in ``sys.argv[1]`` and print whether this process read it from
the cache (``rank hit|miss``) and whether it ran XLA's compiler on it (``compiled``) or received
it (``received``). ``share`` as ``sys.argv[2]`` turns on sharing compiled programs between
processes."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from core.runtime.cluster import initialize_distributed  # noqa: E402

initialize_distributed()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax._src import compiler  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from core.training.compilation_cache import enable_compilation_cache  # noqa: E402

enable_compilation_cache(sys.argv[1], share_between_processes=sys.argv[2:] == ["share"])
events = []
jax.monitoring.register_event_listener(lambda event, **kwargs: events.append(event))
compiler_runs = []
_backend_compile = compiler.backend_compile_and_load  # XLA's compiler proper (JAX internals: a probe only)


def _counted(*args, **kwargs):
    compiler_runs.append(1)
    return _backend_compile(*args, **kwargs)


compiler.backend_compile_and_load = _counted
mesh = jax.make_mesh((jax.device_count(),), ("dp",), devices=jax.devices())
step = jax.jit(jax.shard_map(lambda x: jax.lax.psum(jnp.sin(x) * 3.25, "dp"), mesh=mesh, in_specs=P("dp"),
                             out_specs=P()))
x = jax.make_array_from_process_local_data(jax.NamedSharding(mesh, P("dp")), jnp.ones((jax.local_device_count(),)))
del events[:], compiler_runs[:]
y = step(x)
compiled = bool(compiler_runs)
hit = "/jax/compilation_cache/cache_hits" in events
assert float(y[0]) == float(jnp.sin(1.0) * 3.25) * jax.device_count()
print(f"{jax.process_index()} {'compiled' if compiled else 'received'} {'hit' if hit else 'miss'}", flush=True)
