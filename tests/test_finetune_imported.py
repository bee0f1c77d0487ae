"""Fine-tuning an imported Hugging Face model on chat data (``--load --use-checkpoint-args
--finetune --sft``): the run takes the model from the checkpoint, lowers the held-out SFT loss,
and gives the same losses at tp2 x dp2 as on one device; flags that contradict the checkpoint
are refused with one line."""

import jax
import numpy as np
import pytest
from hf_finetune import finetune_flags, finetune_losses, finetune_trainer, make_imported_model

from core.training.arguments import ArgumentError, parse_args
from core.training.checkpoint_args import apply_checkpoint_args

pytest.importorskip("transformers")
pytest.importorskip("torch")


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    return make_imported_model(tmp_path_factory.mktemp("imported"))


def test_finetuning_the_imported_model_lowers_the_sft_loss(imported):
    trainer = finetune_trainer(finetune_flags(*imported), 1, jax.devices()[:1])
    assert trainer.run_config.model.rope_scaling and trainer.run_config.model.num_query_groups == 2
    before = trainer.evaluate()
    losses = [trainer.step()["loss"] for _ in range(6)]
    after = trainer.evaluate()
    assert np.all(np.isfinite(losses)) and after < before - 0.05, (before, after)


def test_tp2_dp2_finetune_equals_one_device(imported):
    flags = finetune_flags(*imported)
    np.testing.assert_allclose(finetune_losses(flags, 2, jax.devices()[:4], iters=4),
                               finetune_losses(flags, 1, jax.devices()[:1], iters=4), rtol=1e-4)


def test_flags_that_contradict_the_checkpoint_are_one_line(imported):
    args = parse_args(finetune_flags(*imported, "--hidden-size", "48"))
    with pytest.raises(ArgumentError) as info:
        apply_checkpoint_args(args)
    assert str(info.value).startswith("--hidden-size 48 disagrees with the checkpoint in --load")
    # Flags that agree, and the ones the record leaves to the run (sequence length), are accepted.
    args = parse_args(finetune_flags(*imported, "--hidden-size", "32", "--num-layers", "2"))
    apply_checkpoint_args(args)
    assert args.hidden_size == 32 and args.seq_length == 64 and args.swiglu and args.normalization == "RMSNorm"


def test_use_checkpoint_args_needs_a_checkpoint(tmp_path):
    args = parse_args(["--load", str(tmp_path), "--use-checkpoint-args"])
    with pytest.raises(ArgumentError, match="holds no complete checkpoint"):
        apply_checkpoint_args(args)


def test_every_recorded_model_field_has_a_flag():
    """Each field a checkpoint records (dense and MoE models) maps to a flag of the parser."""
    from core.checkpointing.checkpointer import model_record
    from core.models.gpt import GPTConfig
    from core.training.checkpoint_args import _flag_values
    from core.transformer.moe import MoEConfig

    args = parse_args([])
    for config in (GPTConfig(position_embedding_type="rope"),
                   GPTConfig(moe=MoEConfig(num_experts=4, moe_ffn_hidden_size=32), moe_layer_freq=2)):
        missing = [d for d in _flag_values(model_record(config)) if not d.startswith("checkpoint_")
                   and not hasattr(args, d)]
        assert not missing, missing
