"""The environment for tests that start processes of their own (``mpirun ...`` or ``python ...``)."""

import os


def spawn_env(**overrides: str) -> dict[str, str]:
    """This process's environment for a child: unbuffered output, ``overrides`` set, no simulated
    CPU device count (the child's launcher chooses its own), and mpirun allowed to run as root."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **overrides)
    env.pop("JAX_NUM_CPU_DEVICES", None)
    if os.getuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env
