"""Thread counts and core shares of processes that share a host (core/runtime/cpu_threads.py)."""

import pytest

from core.runtime import cpu_threads


@pytest.fixture
def host(monkeypatch):
    """A fake 8-core host; returns a setter for the launcher's local size and rank."""
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(cpu_threads, "jax_runs_on_cpu", lambda: True)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    for var in (*cpu_threads._LOCAL_SIZE_VARS, "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)  # restored after the test

    def launch(size, rank):
        monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", str(size))
        monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", str(rank))

    return launch


@pytest.mark.parametrize("size,rank,cores", [(1, 0, list(range(8))), (2, 1, [4, 5, 6, 7]), (4, 3, [6, 7]),
                                              (8, 5, [5]), (16, 11, [3])])
def test_each_local_process_gets_its_share_of_the_cores(host, size, rank, cores):
    host(size, rank)
    assert cpu_threads.cores_for_this_process() == cores


def test_shares_are_disjoint_and_cover_the_host(host):
    seen = []
    for rank in range(4):
        host(4, rank)
        seen += cpu_threads.cores_for_this_process()
    assert sorted(seen) == list(range(8))


def test_thread_counts_follow_the_local_process_count_and_no_xla_flag_is_set(host, monkeypatch):
    """Library thread counts are the process's share; XLA_FLAGS is left alone (its thread flags do
    nothing on the current CPU runtime, and a malformed one made XLA abort)."""
    host(8, 0)
    assert cpu_threads.configure_cpu_threads() == 1
    assert cpu_threads.os.environ["OMP_NUM_THREADS"] == "1"
    monkeypatch.delenv("OMP_NUM_THREADS")
    host(2, 0)
    assert cpu_threads.configure_cpu_threads() == 4
    assert cpu_threads.os.environ["OMP_NUM_THREADS"] == "4"
    assert "XLA_FLAGS" not in cpu_threads.os.environ


def test_user_thread_count_wins(host, monkeypatch):
    host(4, 0)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    cpu_threads.configure_cpu_threads()
    assert cpu_threads.os.environ["OMP_NUM_THREADS"] == "3"


def test_nothing_changes_off_the_cpu(host, monkeypatch):
    """A GPU run: no thread counts, no affinity narrowing, whatever the local process count."""
    calls = []
    monkeypatch.setattr(cpu_threads.os, "sched_setaffinity", lambda pid, cores: calls.append(pid), raising=False)
    monkeypatch.setattr(cpu_threads, "jax_runs_on_cpu", lambda: False)
    monkeypatch.setenv("MCJ_CPU_AFFINITY", "1")
    host(8, 3)
    assert cpu_threads.configure_cpu_threads(share_pool=True) == 8
    assert calls == [] and "OMP_NUM_THREADS" not in cpu_threads.os.environ


def test_share_pool_narrows_until_released(host, monkeypatch):
    """``share_pool`` narrows the affinity to the process's share (XLA sizes its pool from it) and
    ``release_cpu_affinity`` gives every thread the whole mask back; the thread count is taken
    from the whole mask."""
    calls = []
    monkeypatch.setattr(cpu_threads.os, "sched_setaffinity", lambda pid, cores: calls.append((pid, set(cores))),
                        raising=False)
    monkeypatch.setattr(cpu_threads.os, "listdir", lambda path: ["100", "101"])
    monkeypatch.delenv("MCJ_CPU_AFFINITY", raising=False)
    host(4, 1)
    assert cpu_threads.configure_cpu_threads(share_pool=True) == 2
    assert calls == [(0, {2, 3})]
    cpu_threads.release_cpu_affinity()
    assert calls[1:] == [(100, set(range(8))), (101, set(range(8)))]
    cpu_threads.release_cpu_affinity()  # once only
    assert len(calls) == 3
    cpu_threads.configure_cpu_threads(share_pool=False)  # pipeline layouts keep the whole mask
    assert len(calls) == 3
