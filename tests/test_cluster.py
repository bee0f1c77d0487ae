"""Starting jax.distributed on a cluster (core/runtime/cluster.py): which devices each process drives,
the coordinator, hosts, and errors that every rank raises alike."""

import pytest

from core.runtime import cluster
from core.runtime.cluster import ClusterError, choose_local_device_ids


@pytest.fixture
def gpus(monkeypatch):
    """``gpus(n)``: a host whose JAX would run on ``n`` visible NVIDIA GPUs."""

    def setup(n: int):
        monkeypatch.setattr(cluster, "jax_runs_on_cpu", lambda environ=None: n == 0)
        monkeypatch.setattr(cluster, "visible_nvidia_gpus", lambda environ=None: n)

    return setup


def test_one_gpu_per_rank_by_local_rank(gpus):
    gpus(8)
    assert [choose_local_device_ids(r, 8, [None] * 8, {}) for r in (0, 5)] == [[0], [5]]


def test_gpus_split_evenly_over_the_ranks_of_a_host(gpus):
    gpus(8)
    assert choose_local_device_ids(1, 2, [None] * 2, {}) == [4, 5, 6, 7]
    same = ["0,1,2,3"] * 4  # the same CUDA_VISIBLE_DEVICES on every rank: split it
    gpus(4)
    assert choose_local_device_ids(3, 4, same, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}) == [3]


def test_one_process_per_host_drives_all_its_gpus(gpus):
    gpus(8)
    assert choose_local_device_ids(0, 1, [None], {}) is None


def test_per_rank_cuda_visible_devices_is_honoured(gpus):
    """SLURM --gpus-per-task=1 or a wrapper: each rank sees its own GPU as device 0."""
    gpus(1)
    visible = [str(i) for i in range(8)]
    assert choose_local_device_ids(5, 8, visible, {"CUDA_VISIBLE_DEVICES": "5"}) is None


def test_jax_local_device_ids_wins(gpus):
    gpus(8)
    assert choose_local_device_ids(1, 2, [None] * 2, {"JAX_LOCAL_DEVICE_IDS": "6,7"}) == [6, 7]


def test_cpu_runs_restrict_nothing(gpus):
    gpus(0)
    assert choose_local_device_ids(3, 8, [None] * 8, {}) is None


def test_gpus_that_do_not_split_are_a_clear_error(gpus):
    gpus(8)
    with pytest.raises(ClusterError, match=r"3 processes on host .* cannot split its 8 visible GPUs evenly"):
        choose_local_device_ids(0, 3, [None] * 3, {})


def test_coordinator_address():
    assert cluster.coordinator_address(3, {"JAX_COORDINATOR_ADDRESS": "node7:1234"}) == "node7:1234"
    assert cluster.coordinator_address(3, {}) is None  # only rank 0 proposes
    assert cluster.coordinator_address(0, {"JAX_COORDINATOR_IP": "10.0.0.1", "JAX_COORDINATOR_PORT": "5555"}) == \
        "10.0.0.1:5555"
    host, port = cluster.coordinator_address(0, {}).rsplit(":", 1)
    assert host and 0 < int(port) < 65536


def test_host_indices_in_order_of_first_process():
    assert cluster.host_indices(["b", "a", "b", "a"]) == [0, 1, 0, 1]
    assert cluster.process_host_index(5) == 5  # hosts unknown: each process its own host


class _Comm:
    def __init__(self, messages):
        self.messages = messages

    def allgather(self, _):
        return self.messages


def test_every_rank_raises_the_first_problem():
    cluster._fail_together(_Comm([None, None]), None)
    with pytest.raises(ClusterError, match="^rank 1: bad$"):
        cluster._fail_together(_Comm([None, "bad", "worse"]), None)
    with pytest.raises(ClusterError, match="^bad$"):
        cluster._fail_together(_Comm(["bad", "bad"]), "bad")


def test_device_count_mismatch_is_described():
    assert cluster._describe_counts([8, 8, 8, 4]) == "4 on rank 3, 8 on ranks 0-2"
