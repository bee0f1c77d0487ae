"""Training on data preprocessed for Megatron-LM: a ByteLevel BPE tokenizer trained on the built-in
corpus (tokenizer.json, vocab.json + merges.txt), ``tools/preprocess_data.py`` on a JSONL of the
corpus, then ``launch/pretrain.py``'s data path on a weighted blend of two prefixes: flags and
their one-line errors, Megatron's batch fields, resume at the same sample, and the CLI.

Needs the ``tokenizers`` package for the BPE parts (skipped without it, e.g. on the GPU hosts)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from pretrain_harness import LLAMA, TINY
from spawn_env import spawn_env

from core import parallel_state as ps
from core.data import DataParallelSampler, IndexedDataset, load_corpus
from core.data.gpt_dataset import get_ltor_masks_and_position_ids
from core.data.indexed_dataset import _MAX_TOKEN_ID_CACHE, max_token_id
from core.training.arguments import ArgumentError, data_source, parse_args, validate_args
from core.training.pretrainer import Pretrainer
from core.training.pretraining_data import BATCH_FIELDS, PretrainingData, dropout_seeds
from core.training.run_config import data_config, pretrain_config, training_config

ROOT = Path(__file__).resolve().parents[1]
PREPROCESS = ROOT / "tools" / "preprocess_data.py"
PRETRAIN = ROOT / "launch" / "pretrain.py"
EOD = "<|endoftext|>"


def _documents():
    """The built-in corpus as documents (its blank-line separated paragraphs, in order)."""
    text, _ = load_corpus(None)
    return [d for d in text.split("\n\n") if d.strip()]


def _env():
    return spawn_env(XLA_FLAGS="--xla_cpu_multi_thread_eigen=false",
                     PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A ByteLevel BPE of 1000 ids trained on the corpus, saved both ways; returns its directory."""
    tokenizers = pytest.importorskip("tokenizers")
    directory = tmp_path_factory.mktemp("bpe")
    trained = tokenizers.ByteLevelBPETokenizer()
    trained.train_from_iterator(_documents(), vocab_size=1000, min_frequency=2, special_tokens=[EOD])
    trained.save(str(directory / "tokenizer.json"))
    trained.save_model(str(directory))  # vocab.json, merges.txt
    return directory


@pytest.fixture(scope="module")
def prefixes(bpe, tmp_path_factory):
    """Two datasets made by tools/preprocess_data.py with the BPE: the corpus' first 40% and the rest."""
    directory = tmp_path_factory.mktemp("data")
    docs = _documents()
    cut = int(0.4 * len(docs))
    out = []
    for name, part, workers in (("A", docs[:cut], 1), ("B", docs[cut:], 2)):
        jsonl = directory / f"{name}.jsonl"
        jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in part), encoding="utf-8")
        result = subprocess.run(
            [sys.executable, str(PREPROCESS), "--input", str(jsonl), "--output-prefix", str(directory / name),
             "--json-keys", "text", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
             str(bpe / "tokenizer.json"), "--append-eod", "--workers", str(workers)],
            capture_output=True, text=True, env=_env(), timeout=300)
        assert result.returncode == 0, result.stderr
        out.append(str(directory / f"{name}_text_document"))
    return out


def _data_flags(bpe, prefixes, *extra):
    a, b = prefixes
    return ["--data-path", "0.3", a, "0.7", b, "--split", "98,2,0", "--tokenizer-type", "HuggingFaceTokenizer",
            "--tokenizer-model", str(bpe), *extra]


ALL_FIELDS = ("--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss")


# -- tokenizers ---------------------------------------------------------------------------------

def test_bpe_tokenizers_round_trip(bpe):
    from core.data import build_tokenizer

    from_file = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(bpe / "tokenizer.json"))
    from_dir = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(bpe))
    gpt2 = build_tokenizer("GPT2BPETokenizer", vocab_file=str(bpe / "vocab.json"), merge_file=str(bpe / "merges.txt"))
    for tok in (from_file, from_dir, gpt2):
        assert tok.vocab_size == 1000 and tok.eod == 0  # the special token comes first
    for doc in _documents()[::97]:
        ids = from_file.tokenize(doc)
        assert max(ids) < 1000 and len(ids) < len(doc.encode())  # merges compress
        assert from_dir.tokenize(doc) == ids and gpt2.tokenize(doc) == ids
        assert from_file.detokenize(ids) == doc and gpt2.detokenize(ids) == doc


def test_preprocessed_documents_end_with_eod(bpe, prefixes):
    from core.data import build_tokenizer

    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(bpe))
    docs = _documents()
    a, b = (IndexedDataset(p) for p in prefixes)
    assert a.num_documents + b.num_documents == len(docs) and a.dtype == np.uint16
    assert a[0].tolist() == tok.tokenize(docs[0]) + [tok.eod]
    assert b[len(b) - 1].tolist() == tok.tokenize(docs[-1]) + [tok.eod]
    assert max_token_id(prefixes[0]) < 1000


# -- flags and their errors ---------------------------------------------------------------------

def _validate(flags, world=1):
    args = parse_args(TINY + ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", *flags])
    validate_args(args, world)
    return args


def test_data_path_kinds(bpe, prefixes, tmp_path):
    from core.data.tokenizers import TOKENIZER_TYPES
    from core.training.arguments import TOKENIZER_TYPE_NAMES

    assert sorted(TOKENIZER_TYPE_NAMES) == sorted(TOKENIZER_TYPES)  # the parser's copy of the names
    a, b = prefixes
    assert data_source(None).kind == "builtin"
    text = tmp_path / "corpus.txt"
    text.write_text("some text " * 100)
    assert data_source([str(text)]).kind == "text" and data_source([str(tmp_path)]).kind == "text"
    single = data_source([a])
    assert (single.kind, single.prefixes, single.weights) == ("indexed", (a,), (1.0,))
    blend = data_source(["3", a, "7", b])
    assert blend.prefixes == (a, b) and blend.weights == pytest.approx((0.3, 0.7))
    _validate(_data_flags(bpe, prefixes, *ALL_FIELDS))
    _validate(["--data-path", a, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(bpe / "vocab.json"),
               "--merge-file", str(bpe / "merges.txt"), "--data-cache-path", str(tmp_path / "cache")])


def _copy_dataset(prefix, tmp_path, name="copy"):
    target = str(tmp_path / name)
    for ext in (".bin", ".idx"):
        shutil.copy(prefix + ext, target + ext)
    return target


BAD = {
    "missing-idx": "idx: no such file (the index file of the Megatron dataset",
    "missing-bin": "bin: no such file (the data file of the Megatron dataset",
    "wrong-magic": "not a Megatron MMIDIDX index",
    "weight-not-a-number": "--data-path: weight 'x' (before",
    "odd-blend": "--data-path has 3 entries: expected one prefix or 'weight prefix' pairs",
    "blend-prefix-missing": "no such files (a blend takes dataset prefixes",
    "no-such-path": "no such file or directory (nor a Megatron dataset prefix",
    "extension-given": "give the dataset prefix",
    "tokenizer-model-missing": "no tokenizer.json there",
    "merge-file-missing": "merges.txt: no such file",
    "vocabulary-too-small": "token ids up to 999, but --tokenizer-type ByteLevel has a vocabulary of 257",
    "eod-flags-on-text": "--reset-position-ids --eod-mask-loss need indexed data",
    "bad-split": "--split '1,2,3,4': expected 1 to 3 non-negative weights",
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_data_flags_give_one_line(case, bpe, prefixes, tmp_path):
    a, b = prefixes
    copy = _copy_dataset(a, tmp_path)
    hf = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(bpe)]
    if case == "missing-idx":
        os.remove(copy + ".idx")
        flags = ["--data-path", copy, *hf]
    elif case == "missing-bin":
        os.remove(copy + ".bin")
        flags = ["--data-path", "0.5", copy, "0.5", b, *hf]
    elif case == "wrong-magic":
        data = bytearray(Path(copy + ".idx").read_bytes())
        data[:9] = b"TNTIDX\x00\x00\x00"
        Path(copy + ".idx").write_bytes(bytes(data))
        flags = ["--data-path", copy, *hf]
    elif case == "weight-not-a-number":
        flags = ["--data-path", "x", a, "0.7", b, *hf]
    elif case == "odd-blend":
        flags = ["--data-path", "0.3", a, b, *hf]
    elif case == "blend-prefix-missing":
        flags = ["--data-path", "0.3", a, "0.7", str(tmp_path / "nope"), *hf]
    elif case == "no-such-path":
        flags = ["--data-path", str(tmp_path / "nope")]
    elif case == "extension-given":
        flags = ["--data-path", a + ".bin", *hf]
    elif case == "tokenizer-model-missing":
        flags = ["--data-path", a, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path)]
    elif case == "merge-file-missing":
        flags = ["--data-path", a, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(bpe / "vocab.json"),
                 "--merge-file", str(tmp_path / "merges.txt")]
    elif case == "vocabulary-too-small":
        flags = ["--data-path", "0.3", a, "0.7", b]  # the default ByteLevel tokenizer
    elif case == "eod-flags-on-text":
        flags = ["--reset-position-ids", "--eod-mask-loss"]
    else:
        flags = [*_data_flags(bpe, prefixes)[:5], "--split", "1,2,3,4", *hf]
    with pytest.raises(ArgumentError) as excinfo:
        _validate(flags)
    message = str(excinfo.value)
    assert "\n" not in message and BAD[case] in message, message
    if case == "vocabulary-too-small":
        assert a in message  # names the prefix


def test_max_token_id_is_cached_next_to_the_data(prefixes, tmp_path):
    prefix = _copy_dataset(prefixes[0], tmp_path)
    expected = int(np.concatenate([IndexedDataset(prefix)[i] for i in range(len(IndexedDataset(prefix)))]).max())
    assert max_token_id(prefix) == expected
    (cache_file,) = Path(prefix, "cache").glob("max_token_id-*.json")
    record = json.loads(cache_file.read_text())
    record["max_token_id"] = 5  # the file is what a new process reads
    cache_file.write_text(json.dumps(record))
    _MAX_TOKEN_ID_CACHE.clear()
    assert max_token_id(prefix) == 5
    os.utime(prefix + ".bin", ns=(0, 0))  # another .bin: recomputed
    assert max_token_id(prefix) == expected


# -- batches ------------------------------------------------------------------------------------

def _data(flags, dropout=False):
    args = _validate(flags)
    return args, PretrainingData(data_config(args), training_config(args), ps.build_parallel_state(1, 1, None),
                                 with_dropout_seed=dropout)


def test_indexed_batches_carry_megatrons_fields(bpe, prefixes):
    # 625 x 16 = 10k training samples: the blend over them follows the weights within 1%.
    args, data = _data(_data_flags(bpe, prefixes, *ALL_FIELDS, "--train-iters", "625"), dropout=True)
    eod = data.tokenizer.eod
    assert data.vocab_size == 1000 and len(data.train_data) == 10_000 and data.num_valid_samples == 4 * 16
    share = np.bincount(data.train_data.dataset_index, minlength=2) / len(data.train_data)
    np.testing.assert_allclose(share, [0.3, 0.7], atol=0.01)
    assert "Megatron datasets 0.3" in data.corpus_description and 0 < data.unigram_entropy < np.log(1000)
    first = data.next_train_host_batch()
    second = data.next_train_host_batch()
    assert set(first) == set(BATCH_FIELDS) and data.sampler.consumed_samples == 32
    for key, dtype in [("tokens", np.int32), ("labels", np.int32), ("loss_mask", np.float32),
                       ("position_ids", np.int32), ("segment_ids", np.int32)]:
        assert first[key].dtype == dtype and first[key].shape == (16, 32), key
    assert first["dropout_seed"].dtype == np.int32 and first["dropout_seed"].shape == (16,)
    np.testing.assert_array_equal(second["dropout_seed"], dropout_seeds(args.seed, 16, 16))
    assert dropout_seeds(1234, 5, 1)[0] == (1234 * 2654435761 + 5) % 2**31
    # Samples are the blend's, in order (GPTDataset is shuffled already).
    for row in range(16):
        sample = data.train_data[16 + row]
        np.testing.assert_array_equal(second["tokens"][row], sample["tokens"])
        np.testing.assert_array_equal(second["labels"][row], sample["labels"])
    tokens = np.concatenate([first["tokens"], second["tokens"]])
    batch = {k: np.concatenate([first[k], second[k]]) for k in first}
    assert (tokens == eod).sum() > 0  # the checks below see documents end
    np.testing.assert_array_equal(batch["loss_mask"], (tokens != eod).astype(np.float32))
    for row in range(len(tokens)):
        t = tokens[row]
        mask, _, position_ids = get_ltor_masks_and_position_ids(t, eod, True, True, True, True)
        np.testing.assert_array_equal(batch["position_ids"][row], position_ids)
        seg = batch["segment_ids"][row]
        allowed = (seg[:, None] == seg[None, :]) & np.tri(32, dtype=bool)
        np.testing.assert_array_equal(allowed, ~mask[0])  # Megatron's reset_attention_mask, exactly
    valid = data.valid_host_batch(0)
    assert set(valid) == set(BATCH_FIELDS) - {"dropout_seed"}  # no dropout in evaluation


def test_flags_choose_the_fields(bpe, prefixes, tmp_path):
    _, data = _data(_data_flags(bpe, prefixes))
    assert set(data.next_train_host_batch()) == {"tokens", "labels", "loss_mask"}
    _, data = _data(_data_flags(bpe, prefixes, "--eod-mask-loss"))
    assert data.next_train_host_batch()["loss_mask"].min() == 0.0
    # The text path: tokens and labels (+ dropout_seed); ByteLevel keeps its 256 byte ids.
    _, data = _data([], dropout=True)
    assert data.vocab_size == 256 and set(data.next_train_host_batch()) == {"tokens", "labels", "dropout_seed"}
    assert set(data.valid_host_batch(0)) == {"tokens", "labels"}
    text = tmp_path / "corpus.txt"
    text.write_text("\n\n".join(_documents()[:300]))
    _, data = _data(["--data-path", str(text), "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                     str(bpe)])
    assert data.vocab_size == 1000 and data.next_train_host_batch()["tokens"].max() < 1000


def test_sequential_sampler_resumes():
    sampler = DataParallelSampler(num_samples=10, micro_batch_size=1, data_parallel_rank=0, data_parallel_size=1,
                                  shuffle=False)
    assert sampler.next_global_batch(4).tolist() == [0, 1, 2, 3]
    resumed = DataParallelSampler(num_samples=10, micro_batch_size=1, data_parallel_rank=0, data_parallel_size=1,
                                  shuffle=False)
    resumed.load_state_dict(sampler.state_dict())
    assert resumed.next_global_batch(8).tolist() == [4, 5, 6, 7, 8, 9, 0, 1]


# -- training -----------------------------------------------------------------------------------

def _trainer(bpe, prefixes, tp, pp, *extra):
    flags = TINY + ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                    "--train-iters", "6", *_data_flags(bpe, prefixes, *ALL_FIELDS), *extra]
    args = parse_args(flags)
    layout = validate_args(args, 8)
    return Pretrainer(pretrain_config(args), layout, ps.build_parallel_state(tp, pp, layout.virtual_pipeline_model_parallel_size))


def test_indexed_training_resumes_at_the_same_sample(bpe, prefixes, tmp_path):
    """6 iterations with a checkpoint at 3; resuming from it (data rebuilt from the index caches,
    parameters, optimizer state and position from the checkpoint) repeats iterations 4-6 exactly
    (tp=2, pp=2, dp=2 on 8 devices, a blend of two prefixes, every batch field)."""
    trainer = _trainer(bpe, prefixes, 2, 2)
    assert trainer.config.vocab_size == 1000
    first = [trainer.step()["loss"] for _ in range(3)]
    trainer.save(str(tmp_path / "ckpt"))
    later = [trainer.step()["loss"] for _ in range(3)]
    assert all(np.isfinite(first + later)) and later[-1] < first[0]
    # The compiled step is reused (a second trainer would compile it again, a minute on 2 cores).
    trainer.data = PretrainingData(trainer.run_config.data, trainer.training, trainer.state)
    assert not trainer.data.train_data.datasets[0].built_anew_on_cache_miss
    assert trainer.load(str(tmp_path / "ckpt"))
    assert trainer.iteration == 3 and trainer.data.sampler.consumed_samples == 3 * 16
    assert [trainer.step()["loss"] for _ in range(3)] == later
    assert np.isfinite(trainer.evaluate())


def _indexed_llama_losses(bpe, prefixes, tp, pp, devices, *extra):
    """5 losses of the Llama-class model on the preprocessed blend with every batch field."""
    flags = TINY + ["--train-iters", "5", *LLAMA, *_data_flags(bpe, prefixes, *ALL_FIELDS),
                    "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp), *extra]
    args = parse_args(flags)
    layout = validate_args(args, len(devices))
    state = ps.build_parallel_state(tp, pp, None, context_parallel_size=layout.context_parallel_size,
                                    devices=devices)
    trainer = Pretrainer(pretrain_config(args), layout, state)
    return [trainer.step()["loss"] for _ in range(5)]


@pytest.fixture(scope="module")
def indexed_llama_reference(bpe, prefixes):
    """:func:`_indexed_llama_losses` on one device."""
    return _indexed_llama_losses(bpe, prefixes, 1, 1, [jax.local_devices()[0]])


def test_llama_on_indexed_data_is_layout_invariant(bpe, prefixes, indexed_llama_reference):
    """A user's path: data preprocessed with a BPE, a Llama-class model with Megatron's
    flags, every batch field (document mask, reset positions, EOD loss mask): the same losses at
    tp=2 (SP), pp=2, dp=2 as on one device."""
    losses = _indexed_llama_losses(bpe, prefixes, 2, 2, jax.devices(), "--sequence-parallel")
    np.testing.assert_allclose(losses, indexed_llama_reference, rtol=1e-4)


@pytest.mark.parametrize("tp,devices,extra", [(1, 4, ()), (2, 8, ("--cp-comm-type", "all_gather",
                                                                  "--sequence-parallel"))],
                         ids=["cp2-p2p", "tp2-cp2-all_gather-sp"])
def test_document_mask_with_context_parallelism(bpe, prefixes, indexed_llama_reference, tp, devices, extra):
    """Every batch field at cp 2 (segment ids, position ids and loss mask reordered with the
    tokens; the document mask applied in the ring / the all-gather kernel): the losses of the
    one-device run, on data whose documents end inside the samples."""
    args = parse_args(TINY + ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                              *_data_flags(bpe, prefixes, *ALL_FIELDS)])
    validate_args(args, 1)
    data = PretrainingData(data_config(args), training_config(args),
                           ps.build_parallel_state(1, 1, None, devices=[jax.local_devices()[0]]))
    assert (np.diff(data.next_train_host_batch()["segment_ids"], axis=1) > 0).sum() >= 4  # documents end inside
    losses = _indexed_llama_losses(bpe, prefixes, tp, 1, jax.devices()[:devices], "--context-parallel-size", "2",
                                   *extra)
    np.testing.assert_allclose(losses, indexed_llama_reference, rtol=1e-4)


def test_model_honours_the_batch_fields(bpe, prefixes):
    """Each field changes the validation loss of a batch with documents ending in it, and its
    neutral value (all ones, 0..s-1, all zeros) does not."""
    trainer = _trainer(bpe, prefixes, 1, 1)
    batch = trainer.data.valid_host_batch(0)
    assert (batch["tokens"] == trainer.data.tokenizer.eod).any()
    loss = lambda b: float(trainer.eval_step(trainer.params, trainer.data.to_global(b)))
    base = {"tokens": batch["tokens"], "labels": batch["labels"]}
    reference = loss(base)
    neutral = {"loss_mask": np.ones_like(batch["loss_mask"]),
               "position_ids": np.broadcast_to(np.arange(32, dtype=np.int32), batch["tokens"].shape).copy(),
               "segment_ids": np.zeros_like(batch["segment_ids"])}
    for key, value in neutral.items():
        assert loss({**base, key: value}) == pytest.approx(reference, rel=1e-6), key
        assert loss({**base, key: batch[key]}) != pytest.approx(reference, rel=1e-6), key


# -- the command line ---------------------------------------------------------------------------

def test_cli_trains_on_a_blend(bpe, prefixes, tmp_path):
    """``python launch/pretrain.py --data-path 0.3 A 0.7 B --tokenizer-type HuggingFaceTokenizer ...``."""
    metrics = tmp_path / "m.jsonl"
    flags = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
             "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3", "--log-interval", "1",
             "--eval-interval", "3", "--eval-iters", "1", "--no-progress-bar", "--metrics-file", str(metrics),
             *_data_flags(bpe, prefixes, *ALL_FIELDS)]
    result = subprocess.run([sys.executable, str(PRETRAIN), *flags], capture_output=True, text=True, timeout=600,
                            env=dict(_env(), JAX_NUM_CPU_DEVICES="1"), cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "data: Megatron datasets 0.3" in result.stdout and "HuggingFaceTokenizer vocabulary 1000" in result.stdout
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in records if "loss" in r] == [1, 2, 3]
    assert np.isfinite(records[-1]["valid_loss"])


def test_cli_bad_data_one_line_exit_2_on_every_rank(prefixes):
    """Under mpirun -n 2: a tokenizer too small for the data stops every rank with exit code 2
    and one ``error:`` line (rank 0's)."""
    cmd = ["mpirun", "--oversubscribe", "-x", "XLA_FLAGS", "-n", "2", sys.executable, str(PRETRAIN),
           "--data-path", "0.3", prefixes[0], "0.7", prefixes[1], "--tensor-model-parallel-size", "1",
           "--pipeline-model-parallel-size", "1"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "token ids up to 999, but --tokenizer-type ByteLevel" in errors[0], result.stderr
    assert "Traceback" not in result.stderr + result.stdout

