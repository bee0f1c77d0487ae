"""All-to-all context-parallel attention (``comm_type`` ``"a2a"`` and ``"a2a+p2p"``,
core/context_parallel/a2a_attention.py) against plain attention on one device: output and q/k/v
gradients at fp32 tolerance 1e-5, with the load-balanced order (and without), GQA (K/V heads
split or repeated), tp2 (heads split over a second mesh axis), the document mask, attention
dropout, and inside diverging pipeline stages. One process, 8 simulated CPU devices."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_context_parallel_attention as cpa
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from core.context_parallel import (
    context_parallel_attention,
    group_all_to_all,
    kv_rotation_for,
    reorder_for_cp,
    restore_from_cp,
)
from core.models.gpt import GPTConfig
from core.training.arguments import ArgumentError, model_config, parse_args, validate_args
from core.transformer.dot_product_attention import causal_attention

# (cp, comm_type, hierarchical sizes (a2a, ring)).
TYPES = [(2, "a2a", None), (4, "a2a", None), (4, "a2a+p2p", (2, 2)), (8, "a2a+p2p", (2, 4)), (8, "a2a+p2p", (4, 2))]


def _ids(types: list) -> list[str]:
    return [f"cp{cp}-{kind}" + ("" if sizes is None else f"-{sizes[0]}x{sizes[1]}") for cp, kind, sizes in types]


@pytest.fixture
def hierarchical(monkeypatch):
    """Sets the hierarchical sizes the shared cp test helpers pass (they call the module's
    ``context_parallel_attention``)."""
    return lambda sizes: monkeypatch.setattr(cpa, "context_parallel_attention",
                                             partial(context_parallel_attention, hierarchical_sizes=sizes,
                                                     local_attention=causal_attention))


@pytest.mark.parametrize("kv_heads", [cpa.H, 2, 1], ids=["mha", "gqa-split", "gqa-repeat"])
@pytest.mark.parametrize("cp,comm_type,sizes", TYPES, ids=_ids(TYPES))
def test_matches_full_causal_attention(hierarchical, cp, comm_type, sizes, kv_heads):
    # kv_heads 2 at a2a size 4 and kv_heads 1 at a2a size >= 2 are repeated to lcm(kv_heads, a2a).
    hierarchical(sizes)
    outs, refs = cpa._run(cp, comm_type, True, kv_heads=kv_heads)
    assert outs[2].shape == (cpa.B, kv_heads, cpa.S, cpa.D)
    cpa._assert_close(outs, refs, atol=1e-5)


@pytest.mark.parametrize("cp,comm_type,sizes", [TYPES[1], TYPES[2]], ids=_ids([TYPES[1], TYPES[2]]))
def test_contiguous_split_and_bsnd(hierarchical, cp, comm_type, sizes):
    hierarchical(sizes)
    cpa._assert_close(*cpa._run(cp, comm_type, False), atol=1e-5)
    cpa._assert_close(*cpa._run(cp, comm_type, True, layout="bsnd", scale=0.3), atol=1e-5)


@pytest.mark.parametrize("cp,comm_type,sizes", [TYPES[0], TYPES[2]], ids=_ids([TYPES[0], TYPES[2]]))
def test_tp2(cp, comm_type, sizes):
    # Heads split over "tp" too: each (cp, tp) rank exchanges its tp rank's 4 query and 2 K/V heads.
    heads, kv_heads = 8, 4
    mesh = Mesh(np.array(jax.devices()[:2 * cp]).reshape(cp, 2), ("cp", "tp"))
    spec = P(None, "tp", "cp", None)
    attn = partial(context_parallel_attention, comm_type=comm_type, hierarchical_sizes=sizes,
                   local_attention=causal_attention)

    def local(q, k, v, w):
        (_, out), grads = jax.value_and_grad(lambda q, k, v: (jnp.sum(attn(q, k, v) * w), attn(q, k, v)),
                                             argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return (out, *grads)

    keys = jax.random.split(jax.random.key(3), 4)
    q, w = (jax.random.normal(x, (cpa.B, heads, cpa.S, cpa.D)) for x in keys[:2])
    k, v = (jax.random.normal(x, (cpa.B, kv_heads, cpa.S, cpa.D)) for x in keys[2:])
    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec,) * 4, check_vma=False))
    outs = [restore_from_cp(x, cp, seq_axis=2) for x in fn(*(reorder_for_cp(x, cp, seq_axis=2) for x in (q, k, v, w)))]
    ref_out, vjp = jax.vjp(cpa._reference, q, k, v)
    cpa._assert_close(outs, [ref_out, *vjp(w)], atol=1e-5)


@pytest.mark.parametrize("cp,comm_type,sizes", [TYPES[1], TYPES[2]], ids=_ids([TYPES[1], TYPES[2]]))
@pytest.mark.parametrize("dropout_rate", [0.0, 0.2])
def test_document_mask_and_dropout(hierarchical, cp, comm_type, sizes, dropout_rate):
    # The segment ids travel with the tokens; the dropout mask is drawn per global head and
    # (query, key) index, what one device draws.
    hierarchical(sizes)
    outs, refs = cpa._document_run(cp, comm_type, dropout_rate=dropout_rate)
    assert all(np.isfinite(np.asarray(x)).all() for x in outs)
    cpa._assert_close(outs, refs, atol=1e-5)


@pytest.mark.parametrize("comm_type,sizes", [("a2a", None), ("a2a+p2p", (2, 2))])
def test_in_diverging_pipeline_stages(comm_type, sizes):
    # dp x pp2 x cp as in the pipeline executor's slot (test_ring_in_diverging_pipeline_stages):
    # stage 0 runs the forward while stage 1 idles, then stage 1 the gradient. The whole-axis
    # all-to-all rendezvouses per cp group on CPU; the group exchanges and the ring take the
    # all-gather route there (kv_rotation_for).
    cp = 2 if sizes is None else 4
    cpa.check_in_diverging_pipeline_stages(partial(context_parallel_attention, comm_type=comm_type,
                                                   kv_rotation=kv_rotation_for(True), local_attention=causal_attention,
                                                   hierarchical_sizes=sizes), cp)


@pytest.mark.parametrize("group,via", [(4, "ppermute"), (2, "ppermute"), (2, "all_gather"), (1, "ppermute")])
def test_group_all_to_all(group, via):
    # Rank r = j * group + i sends x[m] to member m of its group; it receives member m's x[i] at m.
    mesh = Mesh(np.array(jax.devices()[:4]), ("cp",))
    x = jnp.arange(4 * group).reshape(4, group)  # x[r, m]: rank r's block for member m
    fn = jax.shard_map(lambda x: group_all_to_all(x, "cp", group, 1, via), mesh=mesh, in_specs=P("cp"),
                       out_specs=P("cp"), check_vma=False)
    got = np.asarray(jax.jit(fn)(x))
    for r in range(4):
        first, member = r - r % group, r % group
        np.testing.assert_array_equal(got[r], [(first + m) * group + member for m in range(group)])


def test_collectives_in_jaxpr():
    def jaxpr(comm_type, sizes, cp, rotation="ppermute", grad=False):
        mesh = Mesh(np.array(jax.devices()[:cp]), ("cp",))
        spec = P(None, None, "cp", None)
        fn = jax.shard_map(partial(context_parallel_attention, comm_type=comm_type, hierarchical_sizes=sizes,
                                   local_attention=causal_attention,
                                   kv_rotation=rotation), mesh=mesh, in_specs=(spec,) * 3, out_specs=spec,
                           check_vma=False)
        if grad:
            fn = jax.grad(lambda *qkv, attn=fn: attn(*qkv).sum(), argnums=(0, 1, 2))
        return str(jax.make_jaxpr(fn)(*cpa._inputs()[:3]))

    a2a = jaxpr("a2a", None, 4)
    assert a2a.count("all_to_all") == 4 and "ppermute" not in a2a  # q, k, v in; the output back
    a2a_grad = jaxpr("a2a", None, 4, grad=True)
    assert a2a_grad.count("all_to_all") == 8 and "ppermute" not in a2a_grad  # the backward's: dO in; dq, dk, dv back
    hierarchical = jaxpr("a2a+p2p", (2, 2), 4)
    assert "all_to_all" not in hierarchical and "ppermute" in hierarchical
    pipelined = jaxpr("a2a+p2p", (2, 2), 4, "all_gather")
    assert "ppermute" not in pipelined and "all_gather" in pipelined


def test_refusals():
    with pytest.raises(ValueError, match="hierarchical_sizes"):
        cpa._run(4, "a2a+p2p", True)
    with pytest.raises(ValueError, match="causal=False"):
        cpa._run(2, "a2a", True, causal=False)
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, context_parallel_size=4)
    GPTConfig(**base, cp_comm_type="a2a").validate(1)
    with pytest.raises(ValueError, match=r"local attention heads \(num_attention_heads 4 / tensor_model_parallel_size "
                                         r"2 = 2\) divisible by its all-to-all size 4"):
        GPTConfig(**base, cp_comm_type="a2a").validate(2)
    GPTConfig(**base, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=(2, 2)).validate(1)
    with pytest.raises(ValueError, match="whose product is context_parallel_size 4"):
        GPTConfig(**base, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=(2, 4)).validate(1)
    with pytest.raises(ValueError, match="need cp_comm_type 'a2a\\+p2p'"):
        GPTConfig(**base, cp_comm_type="a2a", hierarchical_context_parallel_sizes=(2, 2)).validate(1)


def test_flags():
    base = ["--num-attention-heads", "4", "--hidden-size", "64", "--num-layers", "2", "--seq-length", "32",
            "--pipeline-model-parallel-size", "1", "--context-parallel-size", "4"]
    args = parse_args(base + ["--tensor-model-parallel-size", "1", "--cp-comm-type", "a2a+p2p",
                              "--hierarchical-context-parallel-sizes", "2", "2"])
    validate_args(args, 8)
    assert (model_config(args).cp_comm_type, model_config(args).hierarchical_context_parallel_sizes) == ("a2a+p2p", (2, 2))
    with pytest.raises(ArgumentError, match="^cp-comm-type 'a2a' needs the local attention heads"):
        validate_args(parse_args(base + ["--tensor-model-parallel-size", "2", "--cp-comm-type", "a2a"]), 8)
