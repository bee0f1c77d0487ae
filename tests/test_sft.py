"""``launch/pretrain.py --sft``: chat conversations rendered with the tokenizer's own chat template,
the loss on the assistant's tokens, packed first-fit with per-conversation positions and attention.

The tokenizers are tiny byte-level BPEs trained here with Llama-3's and ChatML's (Qwen's) special
tokens, each directory laid out as Hugging Face saves it (``tokenizer.json`` with the template in
``tokenizer_config.json``, or in ``chat_template.jinja``). Where ``transformers`` is installed, the
rendered ids and the assistant masks are compared with ``apply_chat_template``'s."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from spawn_env import spawn_env

from core import parallel_state as ps
from core.data import SFTDataError, SFTDataset, build_tokenizer, load_chat_template, tokenize_conversation
from core.data.chat_template import PROMPT_FORMATS
from core.data.sft_dataset import pack_first_fit
from core.training.arguments import ArgumentError, fill_defaults, parse_args, validate_args
from core.training.flags import SFT_PROMPT_FORMAT_NAMES
from core.training.pretrainer import Pretrainer
from core.training.pretraining_data import PretrainingData
from core.training.run_config import data_config, pretrain_config, training_config

tokenizers = pytest.importorskip("tokenizers")
from chat_data import FORMATS, GOLDEN, conversation, write_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
    """name -> tokenizer directory, for both formats."""
    root = tmp_path_factory.mktemp("sft_tokenizers")
    return {name: write_tokenizer(root / name, name) for name in FORMATS}


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """The ``[start, end)`` runs of True in ``mask``."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)))


# -- tokenization --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(FORMATS))
def test_loss_mask_covers_exactly_the_assistant_tokens(tokenizer_dirs, name):
    """The mask's runs are the assistant messages, each its content and the end of its turn (not the
    role header); the ids are those of the whole rendering; both agree with transformers'
    ``apply_chat_template(return_assistant_tokens_mask=True)`` on the same template and tokenizer."""
    directory = tokenizer_dirs[name]
    raw = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    template = load_chat_template(str(directory))
    conversation = tokenize_conversation(GOLDEN, template, build_tokenizer("HuggingFaceTokenizer",
                                                                            tokenizer_model=str(directory)))
    text = template.render(GOLDEN)
    assert conversation.tokens.tolist() == raw.encode(text, add_special_tokens=False).ids
    end = FORMATS[name][4]
    spans = [raw.decode(conversation.tokens[a:b].tolist(), skip_special_tokens=False)
             for a, b in _runs(conversation.assistant)]
    assert spans == ["The capital of France is Paris." + end, "It is four." + end]
    transformers = pytest.importorskip("transformers")
    _, _, bos, eos, _ = FORMATS[name]
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"), bos_token=bos,
                                              eos_token=eos)
    assert hf.apply_chat_template(GOLDEN, chat_template=FORMATS[name][0], tokenize=False) == text
    out = hf.apply_chat_template(GOLDEN, chat_template=FORMATS[name][0], tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=True)
    assert list(out["input_ids"]) == conversation.tokens.tolist()
    assert list(out["assistant_masks"]) == conversation.assistant.astype(int).tolist()


def test_prompt_format_names_match_the_templates():
    assert tuple(PROMPT_FORMATS) == SFT_PROMPT_FORMAT_NAMES


def test_first_fit_packing_matches_the_plain_algorithm():
    """The tree search gives the bins of the quadratic first-fit loop."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 65, 300)
    order = rng.permutation(300)
    bins, room = [], []
    for item in order:
        fits = [j for j, r in enumerate(room) if r >= lengths[item]]
        if not fits:
            bins.append([])
            room.append(64)
            fits = [len(bins) - 1]
        bins[fits[0]].append(int(item))
        room[fits[0]] -= lengths[item]
    assert pack_first_fit(lengths, 64, order) == bins


def _conversations(directory, count=24):
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(directory))
    template = load_chat_template(str(directory))
    return [tokenize_conversation(conversation(i), template, tokenizer) for i in range(count)], tokenizer


def test_packed_fields(tokenizer_dirs):
    """Every conversation once, labels its next tokens, the loss on its assistant labels only (0 at
    its last token), positions from 0, one segment each and one for the padding; long ones truncated."""
    conversations, tokenizer = _conversations(tokenizer_dirs["chatml"])
    s = 96
    longest = max(len(c.tokens) for c in conversations)
    dataset = SFTDataset(conversations, s, seed=3, pad_id=tokenizer.eod)
    assert sorted(i for pack in dataset.packs for i in pack) == list(range(len(conversations)))
    assert dataset.num_truncated == 0 and max(len(p) for p in dataset.packs) >= 2
    for i, pack in enumerate(dataset.packs):
        sample, start = dataset[i], 0
        for segment, index in enumerate(pack):
            c, end = conversations[index], start + len(conversations[index].tokens)
            assert sample["tokens"][start:end].tolist() == c.tokens.tolist()
            assert sample["labels"][start:end - 1].tolist() == c.tokens[1:].tolist()
            assert sample["loss_mask"][start:end].tolist() == [*c.assistant[1:].astype(float), 0.0]
            assert sample["position_ids"][start:end].tolist() == list(range(end - start))
            assert (sample["segment_ids"][start:end] == segment).all()
            start = end
        assert (sample["loss_mask"][start:] == 0).all() and (sample["segment_ids"][start:] == len(pack)).all()
    short = SFTDataset(conversations, longest - 4, seed=3, pad_id=tokenizer.eod)
    assert short.num_truncated >= 1 and short.num_dropped == 0
    assert max(len(c.tokens) for c in short.conversations) == longest - 4


def test_packed_loss_equals_one_conversation_per_sequence(tokenizer_dirs):
    """The real GPTModel (learned absolute positions, which see a position that was not reset;
    RMSNorm, SwiGLU): the loss of the packed batch is the loss of the same conversations one per
    sequence (padded, masked), so packing changes nothing but the padding."""
    from core.models.gpt import GPTModel
    from core.models.gpt.gpt_config import GPTConfig
    from core.param_metadata import init_sharded_params

    conversations, tokenizer = _conversations(tokenizer_dirs["llama3"], 10)
    s = 128
    packed = SFTDataset(conversations, s, seed=0, pad_id=tokenizer.eod)
    single = SFTDataset(conversations, s, seed=0, pad_id=tokenizer.eod)
    single.packs = [[i] for i in range(len(conversations))]
    assert len(packed) < len(single)
    config = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=2, vocab_size=tokenizer.vocab_size,
                       padded_vocab_size=512, seq_length=s, normalization="RMSNorm", swiglu=True,
                       add_bias_linear=False)
    state = ps.build_parallel_state(devices=jax.devices()[:1])
    model = GPTModel(config, state)
    tokens = np.zeros((1, s), np.int32)
    params, specs, _ = init_sharded_params(model.init, state.mesh, (jax.random.key(0), tokens), (P(), P()))
    loss = jax.jit(jax.shard_map(lambda p, b: model.loss_fn(p, b)[:2], mesh=state.mesh, in_specs=(specs, P()),
                                 out_specs=P(), check_vma=False))
    # Rows of nothing (no loss) bring the packed batch to the other's shape: one compiled program.
    empty = len(single) - len(packed)
    rows = {k: np.concatenate([v, np.zeros((empty, s), v.dtype)]) for k, v in packed.batch(range(len(packed))).items()}
    (a_sum, a_count), (b_sum, b_count) = loss(params, rows), loss(params, single.batch(range(len(single))))
    assert float(a_count) == float(b_count) == sum(c.assistant[1:].sum() for c in conversations)
    np.testing.assert_allclose(float(a_sum) / float(a_count), float(b_sum) / float(b_count), rtol=1e-6)


# -- flags and bad input ---------------------------------------------------------------------------

def _sft_flags(directory, data, *extra):
    return ["--sft", "--data-path", str(data), "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
            str(directory), "--seq-length", "64", "--split", "90,10,0", *extra]


def _write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def _data(flags, devices=1):
    args = fill_defaults(parse_args(flags), devices)
    validate_args(args, devices)
    return PretrainingData(data_config(args), training_config(args),
                           ps.build_parallel_state(1, 1, None, devices=jax.devices()[:devices]))


GOOD = {"messages": conversation(1)}


@pytest.mark.parametrize("lines,message", [
    ([GOOD, {"messages": [{"role": "user", "content": "Hi"}]}], "data.jsonl:2: no assistant message"),
    ([GOOD, GOOD, '{"messages": [}'], "data.jsonl:3: invalid JSON (Expecting value at column 15)"),
    ([GOOD, {"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]}],
     "data.jsonl:2: the chat template ("),
    ([{"messages": [{"role": "user"}]}], "data.jsonl:1: message 0 is not an object with string \"role\" and "),
], ids=["no-assistant", "bad-json", "rejected-role", "no-content"])
def test_bad_conversations_name_the_line(tokenizer_dirs, tmp_path, lines, message):
    data = _write_jsonl(tmp_path / "data.jsonl", lines)
    with pytest.raises(SFTDataError) as error:
        _data(_sft_flags(tokenizer_dirs["llama3"], data))
    assert str(error.value).startswith(str(tmp_path / message)) and "\n" not in str(error.value)
    if "rejected" in message:
        assert "Unknown role: tool" in str(error.value)


def test_bad_flags_one_line(tokenizer_dirs, tmp_path):
    data = _write_jsonl(tmp_path / "data.jsonl", [GOOD] * 4)
    bare = write_tokenizer(tmp_path / "bare", "chatml", with_template=False)
    cases = [
        (_sft_flags(bare, data), f"--tokenizer-model {bare}: no chat template"),
        (["--sft", "--data-path", str(data)], "--sft needs --tokenizer-type HuggingFaceTokenizer"),
        (_sft_flags(tokenizer_dirs["llama3"], data, "--reset-attention-mask"),
         "--reset-attention-mask with --sft: packed conversations"),
        (["--sft-tokenizer-prompt-format", "identity"], "--sft-tokenizer-prompt-format needs --sft"),
        (_sft_flags(tokenizer_dirs["llama3"], tmp_path)[:-2], "--sft needs --data-path FILE.jsonl"),
    ]
    for flags, message in cases:
        with pytest.raises(ArgumentError) as error:
            validate_args(fill_defaults(parse_args(flags), 1), 1)
        assert str(error.value).startswith(message) and "\n" not in str(error.value), flags


def test_cli_bad_file_exits_with_one_line(tokenizer_dirs, tmp_path):
    data = _write_jsonl(tmp_path / "data.jsonl", [GOOD, GOOD, "not json"])
    env = spawn_env(JAX_NUM_CPU_DEVICES="1", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                                                       os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, str(ROOT / "launch" / "pretrain.py"),
                             *_sft_flags(tokenizer_dirs["chatml"], data), "--no-compilation-cache"],
                            capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
    assert errors[0].startswith(f"error: {data}:3: invalid JSON")
    assert "Traceback" not in result.stderr + result.stdout


# -- training ------------------------------------------------------------------------------------

def test_sft_training_lowers_the_loss_and_resumes_at_the_same_position(tokenizer_dirs, tmp_path):
    """The batches at dp=2 are those of one device (the data does not depend on the layout); 6
    iterations at dp=2 lower the loss, and resuming from a checkpoint at 3 repeats iterations 4-6 exactly."""
    data = _write_jsonl(tmp_path / "data.jsonl", [{"messages": conversation(i)} for i in range(60)])
    flags = _sft_flags(tokenizer_dirs["llama3"], data, "--num-layers", "2", "--hidden-size", "32",
                       "--num-attention-heads", "2", "--micro-batch-size", "2", "--global-batch-size", "8",
                       "--train-iters", "6", "--lr", "1e-2", "--lr-warmup-iters", "1", "--eval-iters", "1",
                       "--position-embedding-type", "rope", "--no-progress-bar", "--tensor-model-parallel-size", "1",
                       "--pipeline-model-parallel-size", "1")
    one, two = _data(flags, 1), _data(flags, 2)
    for _ in range(3):
        a, b = one.next_train_host_batch(), two.next_train_host_batch()
        assert all(np.array_equal(a[k], b[k]) for k in ("tokens", "labels", "loss_mask", "position_ids",
                                                         "segment_ids"))
    args = parse_args(flags)
    layout = validate_args(args, 2)
    trainer = Pretrainer(pretrain_config(args), layout, ps.build_parallel_state(1, 1, None, devices=jax.devices()[:2]))
    assert "(60: 54 train, 6 valid" in trainer.data.corpus_description
    first = [trainer.step()["loss"] for _ in range(3)]
    trainer.save(str(tmp_path / "ckpt"))
    later = [trainer.step()["loss"] for _ in range(3)]
    assert all(np.isfinite(first + later)) and later[-1] < first[0]
    # The compiled step is reused (a second trainer would compile it again).
    trainer.data = PretrainingData(trainer.run_config.data, trainer.training, trainer.state)
    assert trainer.load(str(tmp_path / "ckpt"))
    assert trainer.iteration == 3 and trainer.data.sampler.consumed_samples == 3 * 8
    assert [trainer.step()["loss"] for _ in range(3)] == later
    assert np.isfinite(trainer.evaluate())
