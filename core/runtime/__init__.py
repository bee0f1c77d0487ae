"""The process runtime: how a training process starts and what it asks of its host.

- ``cluster``: starts ``jax.distributed`` under mpirun or SLURM (coordinator address, which local
  devices each process drives, hosts); ``gloo_chatter`` keeps gloo's connection lines off a CPU
  job's stdout.
- ``jax_backend``: whether JAX will run on the CPU, decided before JAX starts; it gates every
  CPU-only setting below.
- ``cpu_threads``, ``cpu_devices``, ``cpu_malloc``: CPU backend only: thread counts (opt-in
  pinning), JAX devices per process, malloc tunables.

Nothing here imports JAX at module level or starts a backend: the launcher applies these settings
before JAX starts. Import the modules themselves (``from core.runtime.cluster import
initialize_distributed``); this package re-exports nothing.
"""
