"""Activation recompute (``recompute_granularity`` None / "full" / "selective") changes what the
backward keeps, never the numbers; and in bf16 the embedding lookup's backward scatter-adds in
fp32, and no training step adds rows in bf16 (one process, simulated devices, fp32 at highest
matmul precision for the equalities)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hlo_checks import bf16_scatter_adds
from jax.ad_checkpoint import print_saved_residuals
from jax.sharding import PartitionSpec as P

from core import parallel_state as ps
from core.models.gpt import GPTModel
from core.models.gpt.gpt_config import GPTConfig
from core.param_metadata import init_sharded_params
from core.training.train_step import mean_loss
from core.transformer.recompute import with_recompute

CFG = GPTConfig(vocab_size=256, padded_vocab_size=256, num_layers=2, hidden_size=64, num_attention_heads=4,
                seq_length=32)


def saved_residuals(fn, *args) -> list[str]:
    """What the backward of ``fn(*args)`` keeps, one line per value (JAX's public
    ``print_saved_residuals``: shape, then why it is kept)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(fn, *args)
    return [line for line in out.getvalue().splitlines() if re.match(r"\w+\[[\d,]*\]", line)]


@functools.cache
def _loss_and_grads(granularity: str | None, bf16: bool = False):
    """Loss and grads of one batch through the GPT with ``granularity`` recompute."""
    state = ps.build_parallel_state(1, 1, devices=jax.devices()[:1])
    model = GPTModel(dataclasses.replace(CFG, recompute_granularity=granularity, bf16=bf16), state)
    tokens = jax.random.randint(jax.random.key(1), (2, CFG.seq_length + 1), 0, CFG.vocab_size)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    params, specs, _ = init_sharded_params(model.init, state.mesh, (jax.random.key(0), batch["tokens"]), (P(), P()))
    fn = jax.shard_map(jax.value_and_grad(mean_loss(model.loss_fn)), mesh=state.mesh, in_specs=(specs, P()),
                       out_specs=(P(), specs), check_vma=False)
    with jax.default_matmul_precision("highest"):
        loss, grads = jax.jit(fn)(params, batch)
    return float(loss), jax.tree.map(np.asarray, grads), (fn, params, batch)


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_recompute_gives_the_same_loss_and_grads(granularity):
    loss, grads, _ = _loss_and_grads(None)
    got_loss, got_grads, _ = _loss_and_grads(granularity)
    assert got_loss == pytest.approx(loss, rel=1e-6)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7), got_grads, grads)


def test_selective_keeps_the_matmul_outputs_and_full_keeps_only_inputs():
    x, w = jnp.ones((4, 8)), jnp.ones((8, 16))
    layer = lambda x, w: jnp.sum(jnp.sin(jnp.tanh(x @ w) @ w.T))
    kept = {g: saved_residuals(with_recompute(layer, g), x, w) for g in (None, "full", "selective")}
    assert all("argument" in why for why in kept["full"])  # the inputs only
    selective = [why for why in kept["selective"] if "argument" not in why]
    assert len(selective) == 2 and all("dot_general" in why for why in selective)
    assert any("tanh" in why or "cos" in why for why in kept[None])  # no recompute keeps elementwise outputs too
    with pytest.raises(ValueError, match="'full' or 'selective'"):
        with_recompute(layer, "everything")


def test_in_the_model_selective_reruns_no_matmul_and_full_reruns_them():
    # The backward's program: full recompute adds the layers' forward matmuls again, selective
    # adds only the elementwise work (core attention of this XLA path is a batched dot: rerun).
    count = {}
    for granularity in (None, "selective", "full"):
        fn, params, batch = _loss_and_grads(granularity)[2]
        eqns = list(_equations(jax.make_jaxpr(fn)(params, batch).jaxpr))
        dots = [e for e in eqns if e.primitive.name == "dot_general"]
        unbatched = [e for e in dots if not e.params["dimension_numbers"][1][0]]
        count[granularity] = (len(eqns), len(unbatched))
    assert count["full"][1] > count[None][1] == count["selective"][1], count
    assert count["selective"][0] > count[None][0], count


def _equations(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs nested in its equations' parameters."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)


def test_bf16_embedding_gradient_is_scatter_added_in_fp32():
    # The lookup reads the fp32 table and casts its rows: its transpose is an fp32 scatter-add
    # (a bf16 one rounds at every add, and was 200x slower on an H100).
    fn, params, batch = _loss_and_grads(None, bf16=True)[2]
    scatters = [e for e in _equations(jax.make_jaxpr(fn)(params, batch).jaxpr) if e.primitive.name == "scatter-add"]
    assert scatters and all(e.outvars[0].aval.dtype == jnp.float32 for e in scatters), scatters


@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                                    ["--context-parallel-size", "2"],
                                    ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8"]],
                         ids=["tp2-sp", "cp2", "pp2"])
def test_bf16_train_step_adds_no_rows_in_bf16(layout):
    """The whole bf16 training step of ``launch/pretrain.py`` (model, schedule, grad sync, Adam)
    lowered on 2 devices has no bf16 scatter-add: the embedding's and the MoE layer's were 200x
    and 100x slower than their fp32 / gathered forms on an H100 (docs/gpu-performance.md)."""
    from core.training.arguments import parse_args, validate_args
    from core.training.pretrainer import Pretrainer
    from core.training.run_config import pretrain_config

    args = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                       "--micro-batch-size", "2", "--global-batch-size", "4", "--bf16", "--train-iters", "2",
                       "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                       "--no-progress-bar", *layout])
    shape = validate_args(args, 2)
    state = ps.build_parallel_state(shape.tensor_model_parallel_size, shape.pipeline_model_parallel_size,
                                    context_parallel_size=shape.context_parallel_size, devices=jax.devices()[:2])
    trainer = Pretrainer(pretrain_config(args), shape, state)
    hlo = trainer.train_step.lower(trainer.params, trainer.opt_state, trainer.data.next_train_batch()).as_text(
        dialect="hlo")
    assert "all-reduce" in hlo or "collective-permute" in hlo  # the program is the distributed step
    assert not bf16_scatter_adds(hlo)
