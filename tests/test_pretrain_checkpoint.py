"""Pretraining checkpoints across layouts (one process, 8 simulated devices): the same layout
resumes exactly; another layout loads the parameters (resharded) with --no-load-optim and
otherwise fails with a message naming both layouts."""

import jax
import numpy as np
import pytest
from pretrain_harness import TINY

from core import parallel_state as ps
from core.training.arguments import parse_args, validate_args
from core.training.pretrainer import Pretrainer, TrainingError


def _trainer(tp, pp, *extra):
    args = parse_args(TINY + ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                              "--train-iters", "6", *extra])
    layout = validate_args(args, 8)
    return Pretrainer(args, layout, ps.build_parallel_state(tp, pp, layout.virtual_pipeline_model_parallel_size,
                                                            context_parallel_size=layout.context_parallel_size))


def _host(tree):
    return jax.tree.map(np.asarray, tree)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("ckpt"))
    a = _trainer(2, 2, "--use-distributed-optimizer")
    for _ in range(3):
        a.step()
    a.save(directory)
    later = [a.step()["loss"] for _ in range(3)]
    return directory, later


def test_same_layout_resumes_exactly(saved):
    directory, later = saved
    b = _trainer(2, 2, "--use-distributed-optimizer")
    assert b.load(directory)
    assert b.iteration == 3 and b.data.sampler.consumed_samples == 3 * 16
    assert [b.step()["loss"] for _ in range(3)] == later


def test_other_layout_needs_no_load_optim(saved):
    directory, _ = saved
    b = _trainer(1, 4)
    with pytest.raises(TrainingError, match=r"tensor_model_parallel_size=2, pipeline_model_parallel_size=2.*"
                                            r"now \(tensor_model_parallel_size=1, pipeline_model_parallel_size=4.*"
                                            r"--no-load-optim"):
        b.load(directory)


def test_other_layout_loads_parameters_resharded(saved):
    directory, _ = saved
    same = _trainer(2, 2, "--use-distributed-optimizer")
    same.load(directory)
    other = _trainer(1, 4)
    assert other.load(directory, load_optimizer=False)
    jax.tree.map(np.testing.assert_array_equal, _host(other.params), _host(same.params))
    assert np.isfinite(other.step()["loss"])


def test_other_virtual_pipeline_size_is_refused(saved):
    directory, _ = saved
    b = _trainer(2, 2, "--virtual-pipeline-model-parallel-size", "2")
    with pytest.raises(TrainingError, match="virtual-pipeline-model-parallel-size None, now 2"):
        b.load(directory, load_optimizer=False)


def test_context_parallel_layout_is_recorded_and_loads_parameters(saved):
    # cp is part of the layout record: the optimizer state is refused, the parameters load (cp
    # replicates them) and train on.
    directory, _ = saved
    same = _trainer(2, 2, "--use-distributed-optimizer")
    same.load(directory)
    b = _trainer(2, 1, "--context-parallel-size", "2", "--use-distributed-optimizer")
    assert b.layout_record()["context_parallel_size"] == 2
    with pytest.raises(TrainingError, match=r"context_parallel_size=1.*now \(.*context_parallel_size=2"):
        b.load(directory)
    assert b.load(directory, load_optimizer=False)
    jax.tree.map(np.testing.assert_array_equal, _host(b.params), _host(same.params))
    assert np.isfinite(b.step()["loss"])
