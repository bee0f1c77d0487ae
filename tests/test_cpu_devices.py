"""CPU devices per process (core/runtime/cpu_devices.py): one per core of the process's share, only on
the CPU backend, only as many as the layout divides, and the user's JAX_NUM_CPU_DEVICES wins."""

import pytest

from core.runtime import cpu_devices, cpu_threads


@pytest.fixture
def host(monkeypatch):
    """A fake 8-core CPU-only host; returns a setter for the launcher's local process count."""
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(cpu_devices, "jax_runs_on_cpu", lambda: True)
    for var in (*cpu_threads._LOCAL_SIZE_VARS, cpu_devices.ENV_VAR):
        monkeypatch.delenv(var, raising=False)

    def launch(local_processes):
        monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", str(local_processes))

    return launch


@pytest.mark.parametrize("local_processes, devices", [(1, 8), (2, 4), (4, 2), (8, 1), (16, 1)])
def test_one_device_per_core_of_the_process_share(host, local_processes, devices):
    host(local_processes)
    assert cpu_devices.cpu_devices_per_process() == devices


def test_largest_count_the_layout_divides(host):
    host(1)
    assert cpu_devices.cpu_devices_per_process(lambda n: 12 % n == 0) == 6
    assert cpu_devices.cpu_devices_per_process(lambda n: False) == 1


def test_user_count_wins(host, monkeypatch):
    host(1)
    monkeypatch.setenv(cpu_devices.ENV_VAR, "3")
    assert cpu_devices.cpu_devices_per_process(lambda n: n == 8) == 3


def test_one_device_and_nothing_set_off_the_cpu(host, monkeypatch):
    host(1)
    monkeypatch.setattr(cpu_devices, "jax_runs_on_cpu", lambda: False)
    assert cpu_devices.cpu_devices_per_process() == 1
    cpu_devices.configure_cpu_devices(4)
    assert cpu_devices.ENV_VAR not in cpu_devices.os.environ
