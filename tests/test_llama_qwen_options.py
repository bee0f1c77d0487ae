"""The options that load Llama 3.1, Qwen2/2.5 and Qwen3 weights (rope scaling, kv_channels, QKV
bias, q/k norm) and ``GPTModel.logits``.

* Against transformers (torch CPU, fp32): tiny HF models with random weights copied into
  GPTModel params (``tests/hf_weights.py``) give HF's logits within 1e-4, at positions beyond
  Llama 3.1's original context.
* Each option changes the logits (it is wired); ``logits`` agrees with the loss path.
* Layout invariance of the options together: tp2 + SP and tp2 x pp2 (vpp2) x dp2 against an
  independent reference in ``tests/test_gpt_model_options.py``; here context parallelism (with
  tp2 + SP) and expert parallelism through pretraining, loss and grad norm per iteration equal to
  one device's (relative 1e-4, fp32).
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from pretrain_harness import LLAMA, layout_trainer

from core import parallel_state as ps
from core.models.gpt import GPTModel
from core.models.gpt.gpt_config import GPTConfig
from core.param_metadata import init_sharded_params
from core.transformer.rotary_pos_embedding import inverse_frequencies, llama3_scaled_frequencies

S = 32
ALL = GPTConfig(vocab_size=61, padded_vocab_size=64, num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                kv_channels=32, ffn_hidden_size=96, seq_length=S, position_embedding_type="rope", rope_scaling=True,
                rope_scaling_original_max_position_embeddings=8, normalization="RMSNorm", swiglu=True,
                add_bias_linear=False, add_qkv_bias=True, qk_layernorm=True, share_embeddings_and_output_weights=False,
                layernorm_epsilon=1e-6)
"""Every new option on a Llama-class model."""


def _one_device_params(cfg: GPTConfig, seed: int = 0) -> tuple[GPTModel, dict]:
    state = ps.build_parallel_state(devices=jax.devices()[:1])
    model = GPTModel(cfg, state)
    params, _, _ = init_sharded_params(model.init, state.mesh, (jax.random.key(seed), jnp.zeros((1, S), jnp.int32)),
                                       (P(), P()))
    return model, jax.tree.map(np.asarray, params)


def _tokens(b: int = 2, s: int = S, vocab: int = 61, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (b, s)).astype(np.int32)


# -- against transformers ----------------------------------------------------------------------
def test_llama3_frequencies_match_transformers():
    """Llama 3.1 8B's scaled frequencies (head dim 128, base 500000, factor 8 from 8192) equal HF's."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_theta=500000.0,
                                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    want = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")[0].numpy()
    got = llama3_scaled_frequencies(inverse_frequencies(500000.0, 128), 8.0, 1.0, 4.0, 8192)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)
    unscaled = np.asarray(inverse_frequencies(500000.0, 128))
    assert np.sum(np.isclose(want, unscaled)) not in (0, 64) and np.any(np.isclose(want, unscaled / 8))


def _hf_model(kind: str):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
    if kind == "llama3":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16})
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen2":  # QKV bias; small Qwen2.5 models tie the output layer
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        cls = transformers.Qwen2ForCausalLM
    else:  # qwen3: q/k norm, heads wider than hidden / heads
        cfg = transformers.Qwen3Config(**common, head_dim=16, tie_word_embeddings=False)
        cls = transformers.Qwen3ForCausalLM
    cfg._attn_implementation = "eager"
    return cls(cfg).eval()


@pytest.mark.parametrize("kind", ["llama3", "qwen2", "qwen3"])
def test_logits_match_transformers(kind):
    """GPTModel.logits of an HF model's weights equals HF's logits (fp32, within 1e-4), 48
    tokens: three times Llama's original context of 16."""
    torch = pytest.importorskip("torch")
    from hf_weights import gpt_config, gpt_params, randomize

    hf = _hf_model(kind)
    randomize(hf, seed=1)
    cfg = gpt_config(hf.config, seq_length=48)
    assert (cfg.rope_scaling, cfg.add_qkv_bias, cfg.qk_layernorm, cfg.kv_channels) == {
        "llama3": (True, False, False, None), "qwen2": (False, True, False, None),
        "qwen3": (False, False, True, 16)}[kind]
    tokens = _tokens(2, 48, 64, seed=2)
    with torch.no_grad():
        want = hf(torch.from_numpy(tokens).long()).logits.numpy()
    model = GPTModel(cfg, ps.build_parallel_state(devices=jax.devices()[:1]))
    got = np.asarray(model.global_logits(gpt_params(hf, cfg), tokens))
    assert got.shape == want.shape == (2, 48, 64) and np.abs(want).max() > 1.0
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


# -- each option is wired ----------------------------------------------------------------------
@pytest.mark.parametrize("option", ["rope_scaling", "add_qkv_bias", "qk_layernorm", "kv_channels"])
def test_each_option_changes_the_logits(option):
    """The model without one option, its params the full model's where they exist, gives other
    logits (the QKV bias drawn nonzero); kv_channels changes the attention's shapes."""
    off = dataclasses.replace(ALL, **{option: None if option == "kv_channels" else False})
    model, params = _one_device_params(ALL)
    params["layers"]["self_attention"]["linear_qkv"]["bias"] = np.random.default_rng(0).normal(
        0, 0.5, params["layers"]["self_attention"]["linear_qkv"]["bias"].shape).astype(np.float32)
    off_model, off_params = _one_device_params(off)
    if option == "kv_channels":  # 32-wide heads vs 16 = hidden / heads
        attn, off_attn = params["layers"]["self_attention"], off_params["layers"]["self_attention"]
        assert attn["linear_qkv"]["weight"].shape[-2:] == ((4 + 2 * 2) * 32, 64)
        assert attn["linear_proj"]["weight"].shape[-2:] == (64, 4 * 32)
        assert off_attn["linear_proj"]["weight"].shape[-2:] == (64, 64)
        return
    shared = _select(params, off_params)
    tokens = _tokens()
    on, without = np.asarray(model.global_logits(params, tokens)), np.asarray(off_model.global_logits(shared, tokens))
    assert np.max(np.abs(on - without)) > 1e-2


def _select(params: dict, like: dict) -> dict:
    """``params`` restricted to the keys of ``like``."""
    if not isinstance(like, dict):
        return params
    return {k: _select(params[k], v) for k, v in like.items()}


def test_option_params_and_metadata():
    """The new params' names, shapes and parallel metadata: the QKV bias split over tp like its
    kernel's rows; the q/k norms replicated, summed over tp (not sequence-parallel-tagged)."""
    state = ps.build_parallel_state(2, devices=jax.devices()[:2])
    cfg = dataclasses.replace(ALL, sequence_parallel=True)
    _, specs, infos = init_sharded_params(GPTModel(cfg, state).init, state.mesh,
                                          (jax.random.key(0), jnp.zeros((1, S), jnp.int32)), (P(), P()))
    attn = infos["layers"]["self_attention"]
    assert attn["linear_qkv"]["bias"].partition_spec == P(None, "pp", "tp")
    for norm in ("q_layernorm", "k_layernorm"):
        assert set(attn[norm]) == {"scale"}
        info = attn[norm]["scale"]
        assert info.partition_spec == P(None, "pp", None) and info.tp_partial_grad and not info.sequence_parallel
        assert info.grad_summed_over_tp
    layer_norm = dataclasses.replace(cfg, normalization="LayerNorm")
    _, _, infos = init_sharded_params(GPTModel(layer_norm, state).init, state.mesh,
                                      (jax.random.key(0), jnp.zeros((1, S), jnp.int32)), (P(), P()))
    assert set(infos["layers"]["self_attention"]["q_layernorm"]) == {"scale", "bias"}


@pytest.mark.parametrize("kwargs,message", [
    (dict(rope_scaling_factor=0.0), "rope_scaling_factor must be positive, got 0.0"),
    (dict(rope_scaling_low_freq_factor=4.0), "rope_scaling_low_freq_factor 4.0 must be positive and below "
                                             "rope_scaling_high_freq_factor 4.0"),
    (dict(rope_scaling_original_max_position_embeddings=0), "original_max_position_embeddings must be positive"),
    (dict(position_embedding_type="learned_absolute"), "rope_scaling needs position_embedding_type 'rope'"),
    (dict(kv_channels=0), "kv_channels must be positive, got 0"),
    (dict(kv_channels=None, hidden_size=66), "hidden_size 66 is not divisible by num_attention_heads 4"),
])
def test_config_errors_name_the_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(ALL, **kwargs).validate(1)
    dataclasses.replace(ALL, hidden_size=66).validate(1)  # kv_channels set: any hidden size


def test_describe_and_flops_name_the_options():
    assert "llama3 rope scaling x8.0 from 8" in ALL.describe() and "qk norm" in ALL.describe()
    assert "of 32 channels" in ALL.describe() and "qkv bias only" in ALL.describe()
    # kv_channels 32 doubles the attention width a: qkv 2h(a + 2Gd), projection 2ah, attention 4sa.
    narrow = dataclasses.replace(ALL, kv_channels=None)
    h, a, d, s = 64, 128, 32, S
    per_layer = lambda a, d: 2 * h * (a + 2 * 2 * d) + 2 * a * h + 4 * s * a
    assert ALL.flops_per_token() - narrow.flops_per_token() == 3 * 2 * (per_layer(a, d) - per_layer(64, 16))


# -- logits and the loss path -----------------------------------------------------------------
@pytest.mark.parametrize("tp", [1, 2])
def test_logits_cross_entropy_equals_the_loss(tp):
    """Inside the step's shard_map (tp2 with sequence parallelism and a padded vocabulary) the
    cross entropy of ``logits`` equals ``loss_fn``'s loss; on the host ``global_logits`` gives
    the same logits."""
    cfg = dataclasses.replace(ALL, sequence_parallel=tp > 1)
    state = ps.build_parallel_state(tp, devices=jax.devices()[:tp])
    model = GPTModel(cfg, state)
    params, specs, _ = init_sharded_params(model.init, state.mesh, (jax.random.key(0), jnp.zeros((1, S), jnp.int32)),
                                           (P(), P()))
    batch = {"tokens": _tokens(), "labels": _tokens(seed=1)}

    def both(p, b):
        loss_sum, num_tokens, _ = model.loss_fn(p, b)
        logits = model.logits(p, b["tokens"])
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), b["labels"][..., None], -1)
        return loss_sum / num_tokens, jnp.mean(nll), logits

    loss, ce, logits = jax.jit(jax.shard_map(both, mesh=state.mesh, in_specs=(specs, P()), out_specs=P(),
                                             check_vma=False))(params, batch)
    assert logits.shape == (2, S, 61) and logits.dtype == jnp.float32
    np.testing.assert_allclose(float(ce), float(loss), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(model.global_logits(params, batch["tokens"])), np.asarray(logits),
                               rtol=1e-5, atol=1e-6)


def test_logits_refuse_pipelining_and_context_parallelism():
    for kwargs, cfg in ((dict(pipeline_model_parallel_size=2), ALL),
                        (dict(context_parallel_size=2), dataclasses.replace(ALL, context_parallel_size=2))):
        state = ps.build_parallel_state(devices=jax.devices()[:2], **kwargs)
        with pytest.raises(ValueError, match="not supported with pipeline_model_parallel_size"):
            GPTModel(cfg, state).logits({}, jnp.zeros((1, S), jnp.int32))


# -- layout invariance through pretraining ----------------------------------------------------
OPTIONS = ("--use-rope-scaling", "--rope-scaling-original-max-position-embeddings", "8", "--kv-channels", "32",
           "--add-qkv-bias", "--qk-layernorm", "--norm-epsilon", "1e-6")
ITERS = 6


def _assert_matches(run: tuple[list[dict], dict], reference: tuple[list[dict], dict]) -> None:
    """Losses and grad norms (relative 1e-4), and the trained q/k norms and QKV bias: Adam's first
    steps hide partial grads from the loss (each tp rank's copy of the q/k norms would move by the
    sign of its own heads' share)."""
    (records, attention), (want_records, want) = run, reference
    assert want_records[-1]["loss"] < want_records[0]["loss"] - 0.3  # it learns
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in records], [r[key] for r in want_records], rtol=1e-4)
    # atol: Adam moves near-zero-grad weights by up to lr (3e-3) on float rounding alone.
    for name, key in (("q_layernorm", "scale"), ("k_layernorm", "scale"), ("linear_qkv", "bias")):
        np.testing.assert_allclose(attention[name][key], want[name][key], rtol=1e-3, atol=2e-5,
                                   err_msg=f"{name}/{key}")


def _run(tp: int, devices: list, extra: tuple) -> tuple[list[dict], dict]:
    """Each iteration's record and the trained attention params (host numpy)."""
    trainer = layout_trainer(tp, 1, devices, ITERS, extra)
    records = [trainer.step() for _ in range(ITERS)]
    layers = trainer.params["layers"]
    layers = layers.get("moe", layers)  # a model of MoE layers only: {"moe": [...]}
    return records, jax.tree.map(np.asarray, layers["self_attention"])


def _reference(extra: tuple) -> tuple[list[dict], dict]:
    return _run(1, [jax.local_devices()[0]], extra)


def test_tp2_sp_cp2_matches_single_device():
    """The Llama-class model with every new option: tp2 + SP x cp2 (ring) x dp2 equals one device."""
    extra = LLAMA + OPTIONS
    _assert_matches(_run(2, jax.devices(), extra + ("--sequence-parallel", "--context-parallel-size", "2")),
                    _reference(extra))


def test_moe_tp2_sp_ep2_matches_single_device():
    """MoE layers (8 experts, top 2) with every new option: tp2 + SP x ep2 x dp2 equals one device."""
    moe = ("--num-layers", "2", "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
           "--moe-token-dispatcher-type", "alltoall", "--moe-router-dtype", "fp32")
    extra = LLAMA + OPTIONS + moe
    run = _run(2, jax.devices(), extra + ("--sequence-parallel", "--expert-model-parallel-size", "2"))
    _assert_matches(run, _reference(extra))


def test_logits_inside_shard_map_give_the_local_batch():
    """At dp2 x tp2 each data-parallel rank's ``logits`` is its own samples' (the host's rows)."""
    state = ps.build_parallel_state(2, devices=jax.devices()[:4])
    model = GPTModel(dataclasses.replace(ALL, sequence_parallel=True), state)
    params, _, _ = init_sharded_params(model.init, state.mesh, (jax.random.key(0), jnp.zeros((1, S), jnp.int32)),
                                       (P(), P()))
    tokens = _tokens(4)
    got = np.asarray(model.global_logits(params, tokens))
    one, host = _one_device_params(ALL)
    np.testing.assert_allclose(got, np.asarray(one.global_logits(host, tokens)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[2:], np.asarray(one.global_logits(host, tokens[2:])), rtol=1e-5, atol=1e-5)


def test_checkpoint_model_record_round_trips_and_reads_older_records():
    """The options enter the checkpoint's model record and read back equal from its JSON; a
    record without them (written before they existed) is the model with their defaults."""
    differences = lambda config, saved: _checkpointer(config)._model_differences(saved)
    record = json.loads(json.dumps(_record(ALL)))
    assert record["rope_scaling_factor"] == 8.0 and record["kv_channels"] == 32 and record["qk_layernorm"] is True
    assert differences(ALL, record) == ""
    plain = dataclasses.replace(ALL, rope_scaling=False, rope_scaling_original_max_position_embeddings=8192,
                                kv_channels=None, add_qkv_bias=False, qk_layernorm=False)
    older = {k: v for k, v in _record(plain).items() if not k.startswith("rope_scaling") and
             k not in ("kv_channels", "add_qkv_bias", "qk_layernorm")}
    assert differences(plain, older) == ""
    assert differences(ALL, older) == (
        "rope_scaling=False (now True), rope_scaling_original_max_position_embeddings=8192 (now 8), "
        "kv_channels=None (now 32), add_qkv_bias=False (now True), qk_layernorm=False (now True)")


def _checkpointer(config: GPTConfig):
    """A Checkpointer with only its model config (all its model record reads)."""
    from core.checkpointing.checkpointer import Checkpointer

    checkpointer = Checkpointer.__new__(Checkpointer)
    checkpointer.model_config = config
    return checkpointer


def _record(config: GPTConfig) -> dict:
    return _checkpointer(config).model_record()
