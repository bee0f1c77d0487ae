"""The model flags of ``launch/pretrain.py``: Megatron's names map onto ``GPTConfig``, the
vocabulary is padded as Megatron pads it, and values no layout can use are refused in one line."""

import pytest

from core.training.arguments import ArgumentError, model_config, padded_vocab_size, parse_args, validate_args

LLAMA = ["--normalization", "RMSNorm", "--swiglu", "--group-query-attention", "--num-query-groups", "2",
         "--disable-bias-linear", "--position-embedding-type", "rope", "--rotary-base", "500000",
         "--rotary-percent", "0.5", "--untie-embeddings-and-output-weights", "--init-method-std", "0.01",
         "--norm-epsilon", "1e-6", "--attention-dropout", "0.1", "--hidden-dropout", "0.2",
         "--make-vocab-size-divisible-by", "64", "--tensor-model-parallel-size", "2",
         "--pipeline-model-parallel-size", "1"]


def test_megatron_flags_map_onto_the_config():
    config = model_config(parse_args(LLAMA), vocab_size=257)
    assert (config.normalization, config.swiglu, config.num_query_groups, config.add_bias_linear) == \
        ("RMSNorm", True, 2, False)
    assert (config.position_embedding_type, config.rotary_base, config.rotary_percent) == ("rope", 500000.0, 0.5)
    assert not config.share_embeddings_and_output_weights
    assert (config.init_method_std, config.layernorm_epsilon) == (0.01, 1e-6)
    assert (config.attention_dropout, config.hidden_dropout) == (0.1, 0.2)
    assert (config.vocab_size, config.padded_vocab_size) == (257, 384)  # a multiple of 64 x tp 2


def test_llama31_and_qwen_flags_map_onto_the_config():
    flags = LLAMA + ["--use-rope-scaling", "--rope-scaling-factor", "32", "--rope-scaling-low-freq-factor", "2",
                     "--rope-scaling-high-freq-factor", "8", "--rope-scaling-original-max-position-embeddings",
                     "4096", "--kv-channels", "48", "--add-qkv-bias", "--qk-layernorm"]
    config = model_config(parse_args(flags), vocab_size=257)
    assert (config.rope_scaling, config.rope_scaling_factor, config.rope_scaling_low_freq_factor,
            config.rope_scaling_high_freq_factor, config.rope_scaling_original_max_position_embeddings) == \
        (True, 32.0, 2.0, 8.0, 4096)
    assert (config.kv_channels, config.head_dim, config.add_qkv_bias, config.qk_layernorm) == (48, 48, True, True)
    assert config.layernorm_epsilon == 1e-6  # --norm-epsilon: every norm, the q/k norms included
    plain = model_config(parse_args(LLAMA), vocab_size=257)
    assert (plain.rope_scaling, plain.rope_scaling_factor, plain.kv_channels, plain.add_qkv_bias,
            plain.qk_layernorm) == (False, 8.0, None, False, False)  # Megatron's defaults


@pytest.mark.parametrize("flags,message", [
    (["--use-rope-scaling", "--rope-scaling-factor", "0"], "rope-scaling-factor must be positive, got 0.0"),
    (["--use-rope-scaling", "--rope-scaling-low-freq-factor", "4"],
     "rope-scaling-low-freq-factor 4.0 must be positive and below rope-scaling-high-freq-factor 4.0"),
    (["--use-rope-scaling", "--position-embedding-type", "learned_absolute"],
     "use-rope-scaling needs position-embedding-type 'rope'"),
    (["--kv-channels", "0"], "kv-channels must be positive, got 0"),
], ids=["factor", "low-high", "learned", "kv-channels"])
def test_llama31_and_qwen_flags_that_cannot_work_are_refused(flags, message):
    base = ["--position-embedding-type", "rope", "--tensor-model-parallel-size", "1",
            "--pipeline-model-parallel-size", "1"]
    with pytest.raises(ArgumentError) as err:
        validate_args(parse_args(base + flags), 1)
    assert message in str(err.value)


def test_defaults_keep_the_plain_gpt():
    config = model_config(parse_args(["--tensor-model-parallel-size", "2"]), vocab_size=256)
    assert (config.normalization, config.swiglu, config.num_query_groups, config.add_bias_linear) == \
        ("LayerNorm", False, None, True)
    assert (config.attention_dropout, config.hidden_dropout, config.padded_vocab_size) == (0.0, 0.0, 256)


@pytest.mark.parametrize("vocab,divisible_by,tp,padded", [
    (256, 128, 1, 256), (257, 128, 1, 384), (257, 128, 2, 512), (50257, 128, 8, 51200), (7, 1, 1, 7),
])
def test_vocabulary_padding_as_megatron(vocab, divisible_by, tp, padded):
    assert padded_vocab_size(vocab, divisible_by, tp) == padded


def _assert_refused(flags, message):
    """One layout (tp=pp=1, 8 devices) with ``flags``: validation fails with one line containing ``message``."""
    args = parse_args(["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                       "--global-batch-size", "32", *flags])
    with pytest.raises(ArgumentError) as err:
        validate_args(args, 8)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("flags,message", [
    (["--ffn-hidden-size", "0"], "--ffn-hidden-size must be >= 1, got 0"),
    (["--ffn-hidden-size", "-4"], "--ffn-hidden-size must be >= 1, got -4"),
    (["--lr", "-0.1"], "--lr must be >= 0, got -0.1"),
    (["--min-lr", "-1"], "--min-lr must be >= 0, got -1.0"),
    (["--attention-dropout", "1.0"], "--attention-dropout must be in [0, 1), got 1.0"),
    (["--hidden-dropout", "-0.1"], "--hidden-dropout must be in [0, 1), got -0.1"),
    (["--rotary-percent", "0"], "--rotary-percent must be in (0, 1], got 0.0"),
    (["--init-method-std", "0"], "--init-method-std must be > 0, got 0.0"),
    (["--make-vocab-size-divisible-by", "0"], "--make-vocab-size-divisible-by must be >= 1, got 0"),
    (["--group-query-attention", "--num-query-groups", "3"], "num-attention-heads 4 is not divisible by "
                                                             "num-query-groups 3"),
    (["--group-query-attention", "--num-query-groups", "1", "--tensor-model-parallel-size", "2"],
     "num-query-groups 1 is not divisible by tensor-model-parallel-size 2"),
    (["--finetune"], "--finetune needs --load DIR"),
    (["--ckpt-step", "3"], "--ckpt-step needs --load DIR"),
    (["--exit-on-missing-checkpoint"], "--exit-on-missing-checkpoint needs --load DIR"),
    (["--exit-interval", "0"], "--exit-interval must be >= 1, got 0"),
    (["--exit-duration-in-mins", "0"], "--exit-duration-in-mins must be > 0, got 0.0"),
], ids=["ffn0", "ffn-neg", "lr", "min-lr", "attn-dropout", "hidden-dropout", "rotary", "std", "divisible", "gqa",
        "gqa-tp", "finetune", "ckpt-step", "exit-on-missing", "exit-interval", "exit-duration"])
def test_values_that_cannot_work_are_refused(flags, message):
    _assert_refused(flags, message)


@pytest.mark.parametrize("flags,message", [
    (["--lr", "1e-4", "--min-lr", "1e-2"], "--min-lr 0.01 is above --lr 0.0001: the decay would raise the learning "
                                          "rate (Megatron requires min-lr <= lr)"),
    (["--lr-warmup-iters", "4", "--lr-decay-iters", "2"], "--lr-warmup-iters 4 does not end before the decay does "
                                                          "at iteration 2 (--lr-decay-iters)"),
    (["--lr-warmup-iters", "5", "--train-iters", "5"], "--lr-warmup-iters 5 does not end before the decay does at "
                                                       "iteration 5 (--train-iters, the default of --lr-decay-iters)"),
    (["--lr-decay-iters", "0"], "--lr-decay-iters must be >= 1, got 0"),
    (["--lr-warmup-iters", "-1"], "--lr-warmup-iters must be >= 0, got -1"),
    (["--weight-decay", "-0.1"], "--weight-decay must be >= 0, got -0.1"),
    (["--adam-beta1", "1.0"], "--adam-beta1 must be in [0, 1), got 1.0"),
    (["--adam-beta2", "-0.5"], "--adam-beta2 must be in [0, 1), got -0.5"),
    (["--clip-grad", "-1"], "--clip-grad must be >= 0, got -1.0"),
], ids=["min-lr-above-lr", "warmup-past-decay", "warmup-past-train", "decay0", "warmup-neg", "wd", "beta1", "beta2",
        "clip"])
def test_schedule_and_optimizer_flags_as_megatron_checks_them(flags, message):
    _assert_refused(flags, message)


def test_schedule_defaults_fit_short_runs():
    """The default warm-up (10) ends before a shorter decay; the default --min-lr is --lr / 10, so a
    lower --lr alone is accepted (Megatron's own default warm-up is 0, its min-lr 0)."""
    from core.optimizer.optimizer_param_scheduler import SchedulerConfig, learning_rate_schedule
    from core.training.arguments import lr_decay_iters, lr_warmup_iters, min_lr

    short = parse_args(["--train-iters", "4", "--lr", "1e-4"])
    assert (lr_warmup_iters(short), min_lr(short)) == (3, 1e-5)
    assert lr_warmup_iters(parse_args(["--train-iters", "100"])) == 10
    assert lr_warmup_iters(parse_args(["--train-iters", "1"])) == 0
    schedule = learning_rate_schedule(SchedulerConfig(lr=short.lr, min_lr=min_lr(short), lr_decay_style=short.lr_decay_style,
                                                      lr_warmup_iters=lr_warmup_iters(short),
                                                      lr_decay_iters=lr_decay_iters(short)))
    rates = [float(schedule(i)) for i in range(4)]
    assert rates[2] == pytest.approx(1e-4, rel=1e-6) and rates[0] < rates[1] < rates[2]  # warm-up ends at 3
    validate_args(parse_args(["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                              "--global-batch-size", "32", "--train-iters", "1", "--lr", "1e-5"]), 8)


def test_context_parallel_layout():
    args = parse_args(["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1",
                       "--context-parallel-size", "2", "--cp-comm-type", "all_gather", "--sequence-parallel"])
    layout = validate_args(args, 8)
    assert (layout.context_parallel_size, layout.data_parallel_size) == (2, 2)  # dp = 8 / (tp x pp x cp)
    assert layout.describe() == "tp=2 pp=1 cp=2 dp=2"
    config = model_config(args)
    assert (config.context_parallel_size, config.cp_comm_type) == (2, "all_gather")
    plain = parse_args(["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"])
    assert validate_args(plain, 8).context_parallel_size == 1
    # The ring (the default p2p) combines with (virtual) pipeline parallelism.
    ring_pp = parse_args(["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
                          "--virtual-pipeline-model-parallel-size", "2", "--context-parallel-size", "2"])
    assert validate_args(ring_pp, 8).describe().startswith("tp=1 pp=2")
    assert model_config(ring_pp).cp_comm_type == "p2p"


@pytest.mark.parametrize("flags,message", [
    (["--context-parallel-size", "0"], "--context-parallel-size must be >= 1, got 0"),
    (["--tensor-model-parallel-size", "2", "--context-parallel-size", "3", "--seq-length", "96"],
     "world size 8 is not divisible by tensor-model-parallel-size 2 x pipeline-model-parallel-size 1 x "
     "context-parallel-size 3 = 6"),
    (["--context-parallel-size", "4", "--seq-length", "36"],
     "--seq-length 36 is not divisible by 2 x --context-parallel-size 4 = 8 (load-balanced context parallelism, "
     "--cp-comm-type p2p"),
    (["--context-parallel-size", "4", "--seq-length", "36", "--cp-comm-type", "all_gather"],
     "--seq-length 36 is not divisible by 2 x --context-parallel-size 4 = 8 (load-balanced context parallelism, "
     "--cp-comm-type all_gather"),
    (["--tensor-model-parallel-size", "4", "--context-parallel-size", "2", "--seq-length", "20",
      "--sequence-parallel"],
     "--seq-length 20 is not divisible by --context-parallel-size 2 x --tensor-model-parallel-size 4 = 8"),
], ids=["cp0", "world", "seq-p2p", "seq-all_gather", "seq-sp"])
def test_context_parallel_flags_that_cannot_work_are_refused(flags, message):
    _assert_refused(flags, message)


@pytest.mark.parametrize("flags,message", [
    (["--global-batch-size", "12"], "global-batch-size 12 is not divisible by micro-batch-size 4 x data-parallel-size 2"),
    (["--num-attention-heads", "3", "--hidden-size", "96"], "num-attention-heads 3 is not divisible by "
                                                           "tensor-model-parallel-size 2"),
    (["--num-layers", "3"], "num-layers 3 is not divisible by pipeline-model-parallel-size 2"),
], ids=["batch", "heads", "layers"])
def test_layout_checks_at_the_default_8_device_layout(flags, message):
    from core.training.arguments import fill_defaults

    with pytest.raises(ArgumentError) as err:
        validate_args(fill_defaults(parse_args(flags), 8), 8)
    assert message in str(err.value)


MOE = ["--num-experts", "8", "--moe-router-topk", "2"]


@pytest.mark.parametrize("flags,message", [
    (["--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01"],
     "--moe-router-topk --moe-aux-loss-coeff need --num-experts"),
    (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size need --num-experts"),
    (["--num-experts", "6", "--expert-model-parallel-size", "4"],
     "--num-experts (6) must be divisible by --expert-model-parallel-size (4)"),
    (["--num-experts", "16", "--expert-model-parallel-size", "16"],
     "--expert-model-parallel-size 16 does not divide the data-parallel size 8"),
    (["--num-experts", "4", "--expert-model-parallel-size", "4", "--pipeline-model-parallel-size", "4"],
     "--expert-model-parallel-size 4 does not divide the data-parallel size 2"),
    (["--num-experts", "4", "--moe-router-topk", "8"], "--moe-router-topk (8) must not exceed --num-experts (4)"),
    (MOE + ["--tensor-model-parallel-size", "2"], "MoE with --tensor-model-parallel-size 2 needs --sequence-parallel"),
    (MOE + ["--moe-router-enable-expert-bias"], "moe-router-enable-expert-bias needs"),
    # ep 4 divides dp x cp = 4 but not dp = 2: its groups would span cp ranks (Megatron's can).
    (MOE + ["--context-parallel-size", "2", "--expert-model-parallel-size", "4", "--pipeline-model-parallel-size",
            "2"], "--expert-model-parallel-size 4 does not divide the data-parallel size 2 (world / (tp x pp x cp)): "
                  "expert parallelism is a split of data parallelism (it would cut across --context-parallel-size 2"),
    (MOE + ["--moe-expert-capacity-factor", "1.0"], "--moe-expert-capacity-factor needs --moe-token-dispatcher-type "
                                                    "alltoall"),
    (MOE + ["--moe-pad-expert-input-to-capacity", "--moe-token-dispatcher-type", "alltoall"],
     "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor"),
    (MOE + ["--moe-aux-loss-coeff", "-1"], "--moe-aux-loss-coeff must be >= 0, got -1.0"),
    (MOE + ["--moe-grouped-gemm-implementation", "windows"], "--moe-grouped-gemm-implementation needs --moe-grouped-gemm"),
    (MOE + ["--num-layers", "4", "--moe-layer-freq", "[1,0]"], "moe-layer-freq has 2 entries, num-layers is 4"),
    (MOE + ["--num-layers", "4", "--moe-layer-freq", "0"], "moe-layer-freq must be >= 1, got 0"),
    (MOE + ["--num-layers", "4", "--moe-layer-freq", "[0,0,0,0]"], "makes no layer MoE"),
    # pp=2: chunks [1, 1] and [0, 1] differ (each chunk's layers are stacked by kind).
    (MOE + ["--num-layers", "4", "--moe-layer-freq", "[1,1,0,1]", "--pipeline-model-parallel-size", "2"],
     "different MoE layer patterns (not supported yet"),
])
def test_moe_flags_refused(flags, message):
    _assert_refused(flags, message)


@pytest.mark.parametrize("flags,message", [
    (["--num-distributed-optimizer-instances", "0"], "--num-distributed-optimizer-instances must be >= 1, got 0"),
    (["--num-distributed-optimizer-instances", "2"],
     "--num-distributed-optimizer-instances 2 needs --use-distributed-optimizer"),
    (["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "3"],
     "data-parallel x context-parallel size 8 is not divisible by --num-distributed-optimizer-instances 3"),
    (MOE + ["--expert-model-parallel-size", "8", "--use-distributed-optimizer",
            "--num-distributed-optimizer-instances", "2"],
     "expert data-parallel x context-parallel size 1 is not divisible by --num-distributed-optimizer-instances 2"),
], ids=["zero", "without-distributed-optimizer", "dp", "experts"])
def test_distributed_optimizer_instances_that_cannot_work_are_refused(flags, message):
    _assert_refused(flags, message)


@pytest.mark.parametrize("text", ["every other", "__import__('os').getpid()", "[1]*(10**9)", "[1.5,0]", "2+"])
def test_moe_layer_freq_that_is_not_a_number_or_list_exits_2(text):
    with pytest.raises(SystemExit) as err:
        parse_args(["--moe-layer-freq", text])
    assert err.value.code == 2


@pytest.mark.parametrize("text,value", [("2", 2), ("[1,0,1,1]", (1, 0, 1, 1)), ("([1]*3+[0]*1)*2", (1, 1, 1, 0) * 2),
                                        ("[0]+[1]*3", (0, 1, 1, 1))])
def test_moe_layer_freq_accepts_megatrons_forms(text, value):
    assert parse_args(["--moe-layer-freq", text]).moe_layer_freq == value


def test_moe_flags_map_onto_the_config():
    args = parse_args(["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                       "--sequence-parallel", "--num-layers", "4", "--swiglu", "--disable-bias-linear",
                       "--num-experts", "8", "--expert-model-parallel-size", "2", "--moe-layer-freq", "[1,0,1,0]",
                       "--moe-router-topk", "1", "--moe-router-pre-softmax", "--moe-aux-loss-coeff", "0.01",
                       "--moe-z-loss-coeff", "0.001", "--moe-token-dispatcher-type", "alltoall",
                       "--moe-grouped-gemm", "--moe-grouped-gemm-implementation", "windows",
                       "--moe-expert-capacity-factor", "1.5", "--moe-token-drop-policy",
                       "position", "--moe-shared-expert-intermediate-size", "64", "--moe-router-dtype", "fp32",
                       "--moe-router-force-load-balancing", "--global-batch-size", "32"])
    layout = validate_args(args, 16)  # tp2 pp2 dp4, ep2
    assert (layout.data_parallel_size, layout.expert_model_parallel_size) == (4, 2)
    config = model_config(args)
    moe = config.moe
    assert config.moe_layer_pattern == (True, False, True, False)
    assert (moe.num_experts, moe.moe_router_topk, moe.moe_router_pre_softmax, moe.moe_ffn_hidden_size) == \
        (8, 1, True, 512)  # expert width defaults to the MLP's (4 x 128)
    assert (moe.moe_aux_loss_coeff, moe.moe_z_loss_coeff, moe.moe_token_dispatcher_type, moe.moe_grouped_gemm) == \
        (0.01, 0.001, "alltoall", True)
    assert moe.moe_grouped_gemm_implementation == "windows"
    assert (moe.moe_expert_capacity_factor, moe.moe_token_drop_policy, moe.moe_shared_expert_intermediate_size) == \
        (1.5, "position", 64)
    assert (moe.moe_router_dtype, moe.swiglu, moe.add_bias_linear) == ("fp32", True, False)
    assert moe.moe_router_force_load_balancing and not model_config(parse_args(["--num-experts", "4"])) \
        .moe.moe_router_force_load_balancing
    assert model_config(parse_args([])).moe is None  # dense without --num-experts
    assert model_config(parse_args(["--num-experts", "4", "--moe-layer-freq", "2", "--num-layers", "4"])) \
        .moe_layer_pattern == (True, False, True, False)


def test_every_model_field_is_read_from_a_flag():
    """A GPTConfig field is the flag of the same name unless MODEL_FLAG_RULES says how it is read:
    a new model option is a field and a flag, and model_config needs no edit."""
    import dataclasses

    from core.models.gpt import GPTConfig
    from core.training.arguments import MODEL_FLAG_RULES, model_config

    args = parse_args(["--num-layers", "3", "--hidden-size", "48", "--num-attention-heads", "6", "--swiglu",
                       "--norm-epsilon", "0.01", "--untie-embeddings-and-output-weights"])
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    assert {name for name in fields if name not in MODEL_FLAG_RULES and not hasattr(args, name)} == set()
    assert set(MODEL_FLAG_RULES) <= fields
    config = model_config(args, vocab_size=300)
    assert (config.num_layers, config.hidden_size, config.num_attention_heads, config.swiglu) == (3, 48, 6, True)
    assert (config.layernorm_epsilon, config.share_embeddings_and_output_weights, config.vocab_size) == (0.01, False, 300)
