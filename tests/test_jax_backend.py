"""Which backend JAX will run on, decided before it starts (core/runtime/jax_backend.py)."""

import pytest

from core.runtime import jax_backend


@pytest.fixture
def machine(monkeypatch):
    """A fake machine: ``machine(gpus=N, plugin=bool)`` sets its NVIDIA device nodes and whether
    JAX's GPU plugin is installed (no TPU, no AMD GPU)."""

    def setup(gpus: int = 0, plugin: bool = True):
        nodes = [f"/dev/nvidia{i}" for i in range(gpus)]
        monkeypatch.setattr(jax_backend.glob, "glob", lambda pattern: nodes if "nvidia" in pattern else [])
        monkeypatch.setattr(jax_backend, "_installed", lambda name: plugin and name == "jax_plugins")
        monkeypatch.setattr(jax_backend.os.path, "exists", lambda path: False)

    return setup


@pytest.mark.parametrize("platforms, on_cpu", [("cpu", True), ("cpu,cuda", True), ("cuda", False),
                                                ("tpu,cpu", False)])
def test_jax_platforms_decides(machine, platforms, on_cpu):
    machine(gpus=8)
    assert jax_backend.jax_runs_on_cpu({"JAX_PLATFORMS": platforms}) is on_cpu
    assert jax_backend.jax_runs_on_cpu({"JAX_PLATFORM_NAME": platforms}) is on_cpu


@pytest.mark.parametrize("gpus, plugin, env, on_cpu", [
    (8, True, {}, False),                              # a GPU host
    (8, True, {"CUDA_VISIBLE_DEVICES": "3"}, False),   # one GPU per rank (SLURM --gpus-per-task=1)
    (8, True, {"CUDA_VISIBLE_DEVICES": ""}, True),     # every GPU hidden
    (8, True, {"CUDA_VISIBLE_DEVICES": "-1"}, True),
    (8, False, {}, True),                              # GPUs but jax[cpu] only
    (0, True, {}, True),                               # the CUDA plugin installed on a CPU machine
])
def test_gpu_visibility_decides_without_jax_platforms(machine, gpus, plugin, env, on_cpu):
    machine(gpus=gpus, plugin=plugin)
    assert jax_backend.jax_runs_on_cpu(env) is on_cpu


def test_visible_gpu_count(machine):
    machine(gpus=8)
    assert jax_backend.visible_nvidia_gpus({}) == 8
    assert jax_backend.visible_nvidia_gpus({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}) == 4
    assert jax_backend.visible_nvidia_gpus({"CUDA_VISIBLE_DEVICES": "GPU-8f2c,GPU-91aa"}) == 2
    assert jax_backend.visible_nvidia_gpus({"CUDA_VISIBLE_DEVICES": ""}) == 0
    machine(gpus=0)
    assert jax_backend.visible_nvidia_gpus({"CUDA_VISIBLE_DEVICES": "0"}) == 0


def test_this_test_run_is_on_the_cpu():
    """The README test command is the CPU suite: it forces the CPU backend."""
    import jax

    assert jax_backend.jax_runs_on_cpu() and jax.default_backend() == "cpu"
