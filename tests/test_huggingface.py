"""Hugging Face conversion against ``transformers``: tiny random Llama (Llama 3.1 rope scaling),
Mistral, Qwen2 and Qwen3 models built here, converted by ``tools/checkpoint/convert.py``'s code.

For each family: the imported checkpoint's ``GPTModel.logits`` equal ``transformers``' logits
within 1e-4 (fp32) on one device and at tp2 with sequence parallelism, and the model's loss at
tp2 pp2 with SP equals the cross entropy of ``transformers``' logits within 1e-5; the export
loads with ``from_pretrained`` and gives the original's logits exactly; HF -> checkpoint -> HF
gives bit-identical tensors. Then the bad inputs, each one line. Skipped without
``transformers`` and ``torch`` (the ``test`` extra installs both).
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_weights import TINY_HF_COMMON, checkpoint_params, tiny_hf_families  # noqa: E402

from core import parallel_state as ps  # noqa: E402
from core.models.gpt import GPTModel  # noqa: E402
from core.models.huggingface import HFConversionError, export_hf_model, import_hf_model  # noqa: E402
from core.models.huggingface.conversion import checkpoint_model_config  # noqa: E402
from core.models.huggingface.safetensors_files import SafetensorsReader  # noqa: E402
from core.param_metadata import init_sharded_params  # noqa: E402

S, B = 32, 4
COMMON = TINY_HF_COMMON
FAMILIES = tiny_hf_families()


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """``{family: (hf dir, checkpoint dir, transformers model)}``: random fp32 models, saved in
    small shards (the index path), converted."""
    out = {}
    for family, (config_class, extra) in FAMILIES.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config_class(**{**COMMON, **extra}))
        with torch.no_grad():  # nonzero norms and biases: a mapping mistake must show
            for p in model.parameters():
                if p.ndim == 1:
                    p.add_(0.1 * torch.randn_like(p))
        model.eval()
        root = tmp_path_factory.mktemp(family)
        hf_dir, ckpt = str(root / "hf"), str(root / "ckpt")
        model.save_pretrained(hf_dir, max_shard_size="100KB")
        import_hf_model(hf_dir, ckpt)
        out[family] = (hf_dir, ckpt, model)
    return out


def _tokens(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, COMMON["vocab_size"], (B, S)).astype(np.int32)


def _hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()


def _layout(model: GPTModel, state, ckpt: str):
    """``(params, specs)``: the checkpoint's parameters placed as ``model``'s layout shards them."""
    _, specs, _ = init_sharded_params(model.init, state.mesh, (jax.random.key(0), jnp.zeros((2, S), jnp.int32)),
                                      (P(), P()))
    params = jax.tree.map(lambda a, spec: jax.device_put(a, NamedSharding(state.mesh, spec)), checkpoint_params(ckpt),
                          specs)
    return params, specs


@pytest.mark.parametrize("family", list(FAMILIES))
def test_imported_logits_equal_transformers(hf_models, family):
    hf_dir, ckpt, hf_model = hf_models[family]
    config, _ = checkpoint_model_config(ckpt)
    tokens = _tokens()
    want = _hf_logits(hf_model, tokens)
    one = GPTModel(config, ps.build_parallel_state(devices=jax.devices()[:1]))
    got = np.asarray(one.global_logits(checkpoint_params(ckpt), jnp.asarray(tokens)))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    sp = config.__class__(**{**config.__dict__, "sequence_parallel": True})
    state = ps.build_parallel_state(2, devices=jax.devices()[:2])
    tp2 = GPTModel(sp, state)
    got_tp2 = np.asarray(tp2.global_logits(_layout(tp2, state, ckpt)[0], jnp.asarray(tokens)))
    np.testing.assert_allclose(got_tp2, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_imported_loss_at_tp2_pp2_equals_transformers(hf_models, family):
    hf_dir, ckpt, hf_model = hf_models[family]
    config, _ = checkpoint_model_config(ckpt)
    config = config.__class__(**{**config.__dict__, "sequence_parallel": True, "seq_length": S})
    tokens = _tokens(1)
    labels = np.roll(tokens, -1, axis=1)
    logits = torch.from_numpy(_hf_logits(hf_model, tokens))
    want = float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                   torch.from_numpy(labels.astype(np.int64)).reshape(-1)))
    state = ps.build_parallel_state(2, 2, devices=jax.devices()[:4])
    model = GPTModel(config, state)
    params, specs = _layout(model, state, ckpt)

    def loss(p, batch):
        return model.forward_backward(p, batch, 2, forward_only=True)[1]

    run = jax.jit(jax.shard_map(loss, mesh=state.mesh, in_specs=(specs, P()), out_specs=P(), check_vma=False))
    got = float(run(params, {"tokens": jnp.asarray(tokens), "labels": jnp.asarray(labels)}))
    assert abs(got - want) < 1e-5, (got, want)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_loads_in_transformers_and_round_trips_bit_exactly(hf_models, family, tmp_path):
    hf_dir, ckpt, hf_model = hf_models[family]
    out = str(tmp_path / "export")
    export_hf_model(ckpt, out, max_shard_bytes=200_000)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded) is type(hf_model)
    tokens = _tokens(2)
    np.testing.assert_array_equal(_hf_logits(reloaded, tokens), _hf_logits(hf_model, tokens))
    original, exported = SafetensorsReader(hf_dir), SafetensorsReader(out)
    tied = hf_model.config.tie_word_embeddings
    names = sorted(n for n in original.names if not (tied and n == "lm_head.weight"))
    assert sorted(exported.names) == names
    for name in names:
        assert np.array_equal(original.get(name).view(np.uint8), exported.get(name).view(np.uint8)), name


def test_bf16_model_round_trips_in_bf16(tmp_path):
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "hf")
    import_hf_model(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    config = export_hf_model(str(tmp_path / "ckpt"), str(tmp_path / "back"))
    assert config["dtype"] == "bfloat16"
    a, b = SafetensorsReader(str(tmp_path / "hf")), SafetensorsReader(str(tmp_path / "back"))
    for name in a.names:
        assert b.get(name).dtype == a.get(name).dtype and np.array_equal(a.get(name).view(np.uint8),
                                                                         b.get(name).view(np.uint8))


# -- bad inputs: one line each ----------------------------------------------------------------
def _hf_dir_with(tmp_path, hf_models, edit=None, drop_shard=False) -> str:
    src = hf_models["llama"][0]
    dst = str(tmp_path / "hf")
    shutil.copytree(src, dst)
    if edit is not None:
        path = os.path.join(dst, "config.json")
        with open(path) as f:
            config = json.load(f)
        edit(config)
        with open(path, "w") as f:
            json.dump(config, f)
    if drop_shard:
        os.remove(os.path.join(dst, sorted(f for f in os.listdir(dst) if f.endswith(".safetensors"))[1]))
    return dst


@pytest.mark.parametrize("case, message", [
    ("no config", "has no config.json"),
    ("malformed config", "is not valid JSON"),
    ("family", "model_type='gemma' is not supported"),
    ("rope type", "rope_scaling.rope_type='yarn' is not supported"),
    ("sliding window", "sliding_window=4096 is not supported"),
    ("missing field", "has no 'hidden_size' field"),
    ("missing shard", "is missing"),
])
def test_bad_hf_inputs_are_one_line(hf_models, tmp_path, case, message):
    edits = {
        "family": lambda c: c.update(model_type="gemma"),
        "rope type": lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}, rope_parameters=None),
        "sliding window": lambda c: c.update(model_type="mistral", sliding_window=4096),
        "missing field": lambda c: c.pop("hidden_size"),
    }
    hf_dir = _hf_dir_with(tmp_path, hf_models, edits.get(case), drop_shard=case == "missing shard")
    if case == "no config":
        os.remove(os.path.join(hf_dir, "config.json"))
    if case == "malformed config":
        with open(os.path.join(hf_dir, "config.json"), "w") as f:
            f.write("{not json")
    with pytest.raises(HFConversionError) as info:
        import_hf_model(hf_dir, str(tmp_path / "ckpt"))
    assert message in str(info.value) and "\n" not in str(info.value)
    assert not os.path.exists(tmp_path / "ckpt" / "0")


def test_convert_tool_reports_one_line_and_keeps_destination(hf_models, tmp_path, capsys):
    from tools.checkpoint.convert import main

    hf_dir, ckpt, _ = hf_models["llama"]
    assert main(["--loader", "hf", "--saver", "core", "--load-dir", str(tmp_path / "nope"),
                 "--save-dir", str(tmp_path / "c")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "is not a directory" in err and "\n" not in err
    # An existing checkpoint directory is never written into.
    assert main(["--loader", "hf", "--saver", "core", "--load-dir", hf_dir, "--save-dir", ckpt]) == 1
    assert "already holds checkpoints" in capsys.readouterr().err
    out = tmp_path / "hf_out"
    assert main(["--loader", "core", "--saver", "hf", "--load-dir", ckpt, "--save-dir", str(out),
                 "--tokenizer-dir", str(tmp_path)]) == 1
    assert "holds none of" in capsys.readouterr().err
    assert not (out / "config.json").exists()
