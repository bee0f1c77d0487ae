"""Test harness for both levels.

* Single process (``pytest tests``): JAX gets 8 simulated CPU devices, so every layout of 8
  ranks can be built in one process; MPI-marked tests are skipped.
* Multi-process (``mpirun -n 8 python -m pytest --only-mpi tests``, see ``tests/run.sh``):
  ``jax.distributed`` is initialised through mpi4py before any test touches JAX, one device
  per process; only tests marked ``@pytest.mark.mpi`` run.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from core.parallel_state import mpi_world_size_from_env  # noqa: E402

# Under mpirun (also via tests/mpi_rank.py, whose sys.argv lacks pytest's flags).
_MULTI = mpi_world_size_from_env() > 1 or "--with-mpi" in sys.argv or "--only-mpi" in sys.argv


def _configure_jax() -> None:
    import jax

    if _MULTI:
        from core.parallel_state import initialize_distributed

        initialize_distributed()
        _share_compiled_programs()
    else:
        # Must run before the CPU backend starts; env vars alone are read too early.
        jax.config.update("jax_num_cpu_devices", int(os.environ.get("JAX_NUM_CPU_DEVICES", "8")))
        _cache_compiled_programs_on_disk()


def _cache_compiled_programs_on_disk() -> None:
    """With ``MCJ_TEST_CACHE_DIR`` set (``tests/run.sh`` sets a fresh one per run), every program
    compiled in this process goes to JAX's persistent cache there, and an identical program is
    loaded instead of compiled again: many tests build a new trainer or jitted step for a model
    and layout that another test (of this worker or of the other one) already compiled. Level 1
    took 17% less worker time with it (2026-11-27: 1667 -> 1383 s)."""
    directory = os.environ.get("MCJ_TEST_CACHE_DIR")
    if directory:
        from core.training.compilation_cache import enable_compilation_cache

        enable_compilation_cache(directory)


def _share_compiled_programs() -> None:
    """Under mpirun, process 0 compiles each multi-process program and the others receive the
    binary, as ``launch/pretrain.py`` does on the CPU (8 processes on 2 cores each compiling the
    same program took ~2x as long). The cache directory is fresh per mpirun job (every rank
    derives the same one) and removed by rank 0 when the session ends."""
    import atexit
    import shutil
    import tempfile

    from core.training.compilation_cache import enable_compilation_cache

    job = os.environ.get("PMIX_NAMESPACE") or os.environ.get("OMPI_MCA_ess_base_jobid") or str(os.getppid())
    directory = os.path.join(tempfile.gettempdir(), "mcj_test_cache_" + "".join(c if c.isalnum() else "_" for c in job))
    enable_compilation_cache(directory, share_between_processes=True)
    if mpi_world_size_from_env() > 1 and os.environ.get("OMPI_COMM_WORLD_RANK", "0") == "0":
        atexit.register(shutil.rmtree, directory, True)


_configure_jax()


def pytest_configure(config):
    """This is the CPU suite: on a GPU host it still runs on the CPU (as ``tests/run.sh`` asks with
    ``JAX_PLATFORMS=cpu``), unless the GPU set is selected (``-m gpu``) or the user set
    ``JAX_PLATFORMS``. Runs before any test starts a JAX backend."""
    import jax

    markexpr = config.getoption("markexpr", "") or ""
    wants_gpu = "gpu" in markexpr and "not gpu" not in markexpr
    if not wants_gpu and not os.environ.get("JAX_PLATFORMS"):
        os.environ["JAX_PLATFORMS"] = "cpu"
        jax.config.update("jax_platforms", "cpu")


# Level 1 hands files to its two xdist workers one at a time, as each runs low, in collection
# order (``tests/run.sh`` passes ``--no-loadscope-reorder``). The slowest files go first, so the
# two workers finish close together instead of one running a 6-minute file alone at the end
# (longest first; the order by seconds per file in the 2026-11-27 suite).
SLOWEST_FILES = ("test_pretrain_checkpoint.py", "test_pretrain_cli.py", "test_pretrain_moe.py",
                 "test_pretrain_layouts.py", "test_pretrain_context_parallel.py", "test_context_parallel_attention.py",
                 "test_ddp.py", "test_fsdp_params.py", "test_pretrain_data.py", "test_launch_failures.py", "test_gpt_model_options.py", "test_moe.py",
                 "test_tensor_parallel_layers.py", "test_pretrain_expert_bias.py", "test_fsdp_checkpoints.py",
                 "test_megatron_api.py", "test_generate_cli.py", "test_inference.py", "test_inference_hf.py")


def pytest_collection_modifyitems(config, items):
    """Collect :data:`SLOWEST_FILES` first, in that order; the rest keep theirs."""
    first = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(SLOWEST_FILES)))


@pytest.fixture(autouse=True)
def _reset_parallel_state():
    """Every test starts and ends without a default parallel state."""
    from core import parallel_state

    parallel_state.destroy_model_parallel()
    yield
    parallel_state.destroy_model_parallel()
