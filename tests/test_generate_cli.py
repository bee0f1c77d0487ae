"""``launch/generate.py`` as users run it: text and JSONL output from a converted checkpoint and
from the Hugging Face directory it came from (the same tokens), tp2 under ``mpirun -n 2`` equal
to one process, Megatron's REST server (one process and ``mpirun -n 2``) answering real HTTP
requests, 400 for bad ones, and bad command lines ending with one ``error:`` line, exit code 2.

The model: a tiny random Llama in a byte-level BPE tokenizer's vocabulary, saved with the
tokenizer as ``transformers`` saves it, and converted to a checkpoint by ``import_hf_model``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from spawn_env import spawn_env

ROOT = Path(__file__).resolve().parents[1]
GENERATE = str(ROOT / "launch" / "generate.py")
PROMPTS = ["What is the capital of France?", "two plus"]

pytest.importorskip("transformers")
pytest.importorskip("torch")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """``(hf dir, checkpoint dir)``: the Llama (GQA, untied, 64 positions) and its conversion."""
    import torch
    import transformers
    from chat_data import write_tokenizer

    from core.models.huggingface import import_hf_model

    root = tmp_path_factory.mktemp("generate")
    hf = write_tokenizer(root / "hf", "llama3")
    vocab = len(json.loads((hf / "tokenizer.json").read_text())["model"]["vocab"])
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab + 4, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False, initializer_range=0.5)
    transformers.LlamaForCausalLM(config).save_pretrained(hf)
    import_hf_model(str(hf), str(root / "ckpt"))
    return hf, root / "ckpt"


def _tokenizer_flags(hf: Path) -> list[str]:
    return ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(hf)]


def _prompt_flags(*extra: str) -> list[str]:
    return [f for p in PROMPTS for f in ("--prompt", p)] + ["--max-new-tokens", "8", *extra]


def _run(flags: list[str], n: int = 1, timeout: float = 240) -> subprocess.CompletedProcess:
    command = [sys.executable, GENERATE] if n == 1 else ["mpirun", "--oversubscribe", "-n", str(n), sys.executable,
                                                         GENERATE]
    return subprocess.run(command + flags, capture_output=True, text=True, timeout=timeout, env=spawn_env(), cwd=ROOT)


def _rows(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines()]


def _assert_one_error_line(result: subprocess.CompletedProcess, *phrases: str) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-2000:]
    for phrase in phrases:
        assert phrase in errors[0], errors[0]
    return errors[0]


def test_checkpoint_text_and_jsonl_and_the_hf_directory_give_the_same_tokens(model, tmp_path):
    hf, ckpt = model
    out = tmp_path / "out.jsonl"
    converted = _run(["--load", str(ckpt), "--use-checkpoint-args", *_tokenizer_flags(hf), "--temperature", "0",
                      "--output-format", "jsonl", "--output", str(out), *_prompt_flags()])
    assert converted.returncode == 0, converted.stderr[-2000:]
    assert converted.stdout == "" and f"> wrote 2 results to {out}" in converted.stderr
    rows = _rows(out.read_text())
    assert [r["prompt"] for r in rows] == PROMPTS
    for row in rows:
        assert 1 <= len(row["tokens"]) <= 8 and len(row["log_probs"]) == len(row["tokens"])
        assert all(lp <= 0 for lp in row["log_probs"]) and row["prompt_tokens"]
    direct = _run(["--load", str(hf), "--temperature", "0", "--output-format", "jsonl", *_prompt_flags()])
    assert direct.returncode == 0, direct.stderr[-2000:]
    assert "(Hugging Face model)" in direct.stderr
    hf_rows = _rows(direct.stdout)
    assert [r["tokens"] for r in hf_rows] == [r["tokens"] for r in rows]
    assert [r["prompt_tokens"] for r in hf_rows] == [r["prompt_tokens"] for r in rows]
    text = _run(["--load", str(hf), "--temperature", "0", *_prompt_flags()])
    assert text.returncode == 0, text.stderr[-2000:]
    assert text.stdout == "\n".join(r["prompt"] + r["text"] + "\n" for r in rows)


def test_tp2_under_mpirun_gives_the_tokens_of_one_process(model):
    hf, ckpt = model
    flags = ["--load", str(ckpt), *_tokenizer_flags(hf), "--output-format", "jsonl", "--temperature", "0.9",
             "--top-k", "50", "--top-p", "0.95", "--seed", "7", *_prompt_flags()]
    one = _run(flags)
    two = _run(flags + ["--tensor-model-parallel-size", "2"], n=2)
    assert one.returncode == 0, one.stderr[-2000:]
    assert two.returncode == 0, two.stderr[-2000:]
    assert "2 processes" in two.stderr and "tp 2 x dp 1" in two.stderr
    assert [r["tokens"] for r in _rows(two.stdout)] == [r["tokens"] for r in _rows(one.stdout)]


class _Server:
    """``launch/generate.py --server 0`` in a session of its own; :attr:`url` once it listens."""

    def __init__(self, flags: list[str], log: Path, n: int = 1):
        command = [sys.executable, GENERATE] if n == 1 else ["mpirun", "--oversubscribe", "-n", str(n),
                                                             sys.executable, GENERATE]
        self.log = log
        with open(log, "w") as f:
            self.proc = subprocess.Popen(command + flags + ["--server", "0"], stdout=f, stderr=subprocess.STDOUT,
                                         env=spawn_env(), cwd=ROOT, start_new_session=True)
        deadline = time.monotonic() + 240
        while "/api" not in log.read_text() and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        text = log.read_text()
        assert "/api" in text, text[-3000:]
        self.url = "http://" + text.split("on http://")[1].split()[0]

    def put(self, body) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(self.url, data=data, method="PUT", headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def stop(self, pid: int | None = None) -> int:
        """SIGTERM to ``pid`` (default the process started); the exit code."""
        os.kill(pid or self.proc.pid, signal.SIGTERM)
        return self.proc.wait(timeout=60)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _rank_pids(parent: int) -> dict[int, int]:
    """``{rank: pid}`` of ``parent``'s children (mpirun's ranks), from their environment."""
    ranks = {}
    for pid in subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout.split():
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for entry in env:
            if entry.startswith(b"OMPI_COMM_WORLD_RANK="):
                ranks[int(entry.split(b"=")[1])] = int(pid)
    return ranks


BAD_REQUESTS = [
    (b"{not json", "not valid JSON"),
    ({"tokens_to_generate": 4}, "prompts argument required"),
    ({"prompts": "one string"}, "prompts must be a list of strings"),
    ({"prompts": [""]}, "prompt 0 is empty"),
    ({"prompts": ["a"], "top_p": 1.5}, "top_p must be in [0, 1]"),
    ({"prompts": ["a"], "temperature": "hot"}, "temperature must be a number"),
    ({"prompts": ["a"], "stop_token": "<|no such token|>"}, "unknown stop token"),
    ({"prompts": ["What is the capital of France? " * 8]}, "too long"),
]


def test_the_server_answers_megatrons_requests_and_refuses_bad_ones(model, tmp_path):
    hf, _ = model
    server = _Server(["--load", str(hf)], tmp_path / "server.log")
    try:
        status, answer = server.put({"prompts": PROMPTS, "tokens_to_generate": 8, "temperature": 0, "logprobs": True})
        assert status == 200, answer
        assert set(answer) == {"text", "segments", "logprobs"} and len(answer["text"]) == 2
        for prompt, text, segments, logprobs in zip(PROMPTS, answer["text"], answer["segments"], answer["logprobs"]):
            assert text.startswith(prompt) and "".join(segments).startswith(prompt[:5])
            assert len(logprobs) == len(segments) - 1
        for body, message in BAD_REQUESTS:
            status, refusal = server.put(body)
            assert status == 400 and message in refusal["error"], (body, refusal)
        status, scored = server.put({"prompts": ["two plus"], "tokens_to_generate": 0, "logprobs": True})
        assert status == 200 and scored["text"] == ["two plus"] and len(scored["logprobs"][0]) >= 1
        status, again = server.put({"prompts": PROMPTS, "tokens_to_generate": 8, "temperature": 0, "logprobs": True})
        assert status == 200 and again == answer  # still serving, and deterministic
        status, sampled = server.put({"prompts": ["two plus"], "tokens_to_generate": 4, "top_k": 5, "top_p": 0.9,
                                      "random_seed": 3, "add_BOS": True, "stop_token": ["<|eot_id|>", 5]})
        assert status == 200 and sampled["logprobs"] is None
        assert server.stop() == 0
        assert "> server stopped" in server.log.read_text()
    finally:
        server.kill()


def test_the_server_under_mpirun_with_tp2(model, tmp_path):
    hf, _ = model
    reference = _run(["--load", str(hf), "--temperature", "0", "--output-format", "jsonl", *_prompt_flags()])
    server = _Server(["--load", str(hf), "--tensor-model-parallel-size", "2"], tmp_path / "server.log", n=2)
    try:
        status, answer = server.put({"prompts": PROMPTS, "tokens_to_generate": 8, "temperature": 0})
        assert status == 200, answer
        assert answer["text"] == [r["prompt"] + r["text"] for r in _rows(reference.stdout)]
        status, refusal = server.put({"prompts": ["a"], "top_p": 1.5})
        assert status == 400 and "top_p" in refusal["error"]
        status, again = server.put({"prompts": PROMPTS, "tokens_to_generate": 8, "temperature": 0})
        assert status == 200 and again == answer
        ranks = _rank_pids(server.proc.pid)
        assert sorted(ranks) == [0, 1], ranks
        assert server.stop(ranks[0]) == 0  # SIGTERM to rank 0 ends every rank
        assert "> server stopped" in server.log.read_text()
    finally:
        server.kill()


@pytest.mark.parametrize("flags, phrases", [
    ([], ["the following arguments are required: --load"]),
    (["--load", "/nonexistent/model", "--prompt", "a"], ["--load /nonexistent/model: no such directory"]),
    (["--load", "EMPTY", "--prompt", "a"], ["an empty directory"]),
    (["--load", "HF", "--prompt", ""], ["prompt 0 is empty"]),
    (["--load", "HF", "--prompt", "a", "--top-p", "1.5"], ["--top-p must be in [0, 1]"]),
    (["--load", "HF", "--prompt", "a", "--stop-token", "<|no such token|>"], ["unknown stop token"]),
    (["--load", "HF", "--prompt", "What is the capital of France? " * 8], ["prompt 0 is too long", "64"]),
])
def test_bad_input_is_one_error_line_with_exit_code_2(model, tmp_path, flags, phrases):
    hf, _ = model
    (tmp_path / "empty").mkdir()
    flags = [{"HF": str(hf), "EMPTY": str(tmp_path / "empty")}.get(f, f) for f in flags]
    _assert_one_error_line(_run(flags, timeout=120), *phrases)


def test_bad_input_under_mpirun_ends_every_rank_with_one_line(model):
    hf, _ = model
    start = time.monotonic()
    result = _run(["--load", str(hf), "--prompt", "a", "--stop-token", "<|no such token|>",
                   "--tensor-model-parallel-size", "2"], n=2, timeout=120)
    _assert_one_error_line(result, "unknown stop token")
    assert time.monotonic() - start < 60


def test_a_launch_pretrain_checkpoint_loads_at_tp1_and_tp2_with_the_same_tokens(tmp_path):
    """A checkpoint ``launch/pretrain.py`` wrote (learned positions, the optimizer state beside
    the parameters, a byte-level model without an end-of-document token) at either tp."""
    ckpt = tmp_path / "ckpt"
    trained = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "pretrain.py"), "--num-layers", "2", "--hidden-size", "32",
         "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--train-iters", "2", "--save", str(ckpt), "--save-interval", "2", "--no-progress-bar", "--eval-interval",
         "1000", "--eval-iters", "1", "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"],
        capture_output=True, text=True, timeout=300, env=spawn_env(), cwd=ROOT)
    assert trained.returncode == 0, trained.stderr[-2000:]
    flags = ["--load", str(ckpt), "--use-checkpoint-args", "--prompt", "The ", "--max-new-tokens", "12",
             "--temperature", "0", "--output-format", "jsonl"]
    one, two = _run(flags), _run(flags + ["--tensor-model-parallel-size", "2"])
    assert one.returncode == 0 and two.returncode == 0, (one.stderr[-2000:], two.stderr[-2000:])
    assert "(checkpoint step 2)" in one.stderr and "tp 2 x dp 1" in two.stderr
    assert len(_rows(one.stdout)[0]["tokens"]) == 12
    assert _rows(one.stdout)[0]["tokens"] == _rows(two.stdout)[0]["tokens"]
    _assert_one_error_line(_run(flags + ["--ckpt-step", "1"]), "--ckpt-step 1: no complete checkpoint 1")
