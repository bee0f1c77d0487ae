"""Thread counts and core shares of processes that share a host (core/cpu_threads.py)."""

import pytest

from core import cpu_threads


@pytest.fixture
def host(monkeypatch):
    """A fake 8-core host; returns a setter for the launcher's local size and rank."""
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
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


def test_xla_threads_follow_the_local_process_count(host, monkeypatch):
    host(8, 0)
    assert cpu_threads.configure_cpu_threads() == 1
    assert "--xla_cpu_multi_thread_eigen=false" in cpu_threads.os.environ["XLA_FLAGS"]
    monkeypatch.delenv("XLA_FLAGS")
    host(2, 0)
    assert cpu_threads.configure_cpu_threads() == 4
    assert "intra_op_parallelism_threads=4" in cpu_threads.os.environ["XLA_FLAGS"]


def test_user_flags_win(host, monkeypatch):
    host(4, 0)
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=true")
    cpu_threads.configure_cpu_threads()
    assert cpu_threads.os.environ["XLA_FLAGS"] == "--xla_cpu_multi_thread_eigen=true"


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
