"""Generate text from a trained or imported model: ``[mpirun -n N] python launch/generate.py --load DIR
--prompt TEXT [...]``, or serve Megatron's REST interface with ``--server PORT``.

``--load`` is a checkpoint directory of this package (the model from its record, the newest
intact step or ``--ckpt-step``) or a Hugging Face model directory (converted as it loads, with
its own tokenizer when it has a ``tokenizer.json``). ``--tensor-model-parallel-size`` splits the
model; data parallelism takes the rest of the devices (``mpirun -n 2 ... --tensor-model-parallel-size
2``: one model over two processes). The results go to stdout (or ``--output FILE``) from rank 0,
progress lines to stderr. Any failure, on any rank, ends the whole job with one ``error:`` line
(``--debug`` adds the traceback) and exit code 2 for bad input (flags, prompts, the model
directory), 130 when interrupted, 1 for anything unexpected.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

EXIT_UNEXPECTED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 1, 2, 130


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _report(failure, error: BaseException):
    """End the job for ``error`` with one line and the exit code of its kind (never returns)."""
    from core.runtime.cluster import ClusterError
    from core.training.pretrainer import describe_error

    if isinstance(error, KeyboardInterrupt):
        failure.fail(EXIT_INTERRUPTED, "interrupted", error)
    if isinstance(error, (ValueError, FileNotFoundError, ClusterError)):  # ArgumentError, ModelLoadError, ...
        failure.fail(EXIT_BAD_INPUT, " ".join(str(error).split()), error)
    hint = "" if failure.debug else " (--debug prints the traceback)"
    failure.fail(EXIT_UNEXPECTED, f"{describe_error(error)}{hint}", error)


def main(argv: list[str] | None = None) -> int:
    """Parse, check, start ``jax.distributed``, load the model, generate or serve; returns the exit code."""
    from core.inference.arguments import parse_args
    from core.runtime.cluster import mpi_rank_and_world_from_env
    from core.training.flags import parse_on_rank_0
    from core.training.job_failure import JobFailure

    rank, processes = mpi_rank_and_world_from_env()
    args = parse_on_rank_0(parse_args, argv, rank)
    failure = JobFailure(rank, debug=args.debug)
    try:
        return _start(args, rank, processes, failure)
    except (Exception, KeyboardInterrupt) as error:  # every failure becomes one line; --debug adds the traceback
        _report(failure, error)


def _devices_per_process(tp: int, processes: int) -> int:
    """CPU devices each process exposes: the tensor-parallel group's share (at least one)."""
    from core.runtime.cpu_devices import ENV_VAR

    if os.environ.get(ENV_VAR):
        return int(os.environ[ENV_VAR])
    return max(1, tp // processes) if tp % processes == 0 else 1


def _start(args, rank: int, processes: int, failure) -> int:
    from core.inference.arguments import validate_args
    from core.inference.model_loading import detect_kind
    from core.runtime.cluster import ClusterError, initialize_distributed
    from core.runtime.cpu_devices import configure_cpu_devices
    from core.runtime.jax_backend import jax_runs_on_cpu

    prompts = validate_args(args)
    kind = detect_kind(args.load)  # the same verdict on every rank, before JAX starts
    if jax_runs_on_cpu():
        configure_cpu_devices(_devices_per_process(args.tensor_model_parallel_size, processes))
    if rank != 0:
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # results are rank 0's job
    initialize_distributed()
    failure.start_watcher()  # from here on a failure on any one rank ends every rank
    import jax

    world, tp = jax.device_count(), args.tensor_model_parallel_size
    if world % tp:
        raise ClusterError(f"--tensor-model-parallel-size {tp} does not divide the {world} devices of this job")
    return _run(args, kind, prompts, rank)


def _tokenizer(args, kind: str):
    """The tokenizer of the flags (or of a Hugging Face ``--load``) and the BOS id ``--add-BOS`` uses."""
    from core.data.tokenizers import build_tokenizer
    from core.inference.arguments import tokenizer_settings
    from core.inference.model_loading import HF_KIND
    from core.inference.text_generation import tokenizer_bos
    from core.training.flags import ArgumentError

    tokenizer_type, model = tokenizer_settings(args, kind == HF_KIND)
    directory = None
    eod_token = None
    if tokenizer_type == "HuggingFaceTokenizer" and model:
        directory = model if os.path.isdir(model) else os.path.dirname(model)
        eod_token = _eos_token(directory)
    try:
        tokenizer = build_tokenizer(tokenizer_type, tokenizer_model=model, vocab_file=args.vocab_file,
                                    merge_file=args.merge_file, vocab_size=args.vocab_size, eod_token=eod_token)
    except (ValueError, FileNotFoundError, ImportError) as e:
        raise ArgumentError(" ".join(str(e).split())) from None
    except Exception as e:  # noqa: BLE001 (a corrupt tokenizer.json raises the library's bare Exception)
        raise ArgumentError(f"--tokenizer-type {tokenizer_type}: cannot load {model}: {' '.join(str(e).split())}") \
            from None
    return tokenizer, tokenizer_type, tokenizer_bos(tokenizer, directory)


def _eos_token(directory: str) -> str | None:
    """``eos_token`` of the ``tokenizer_config.json`` in ``directory`` (Megatron's HF tokenizer
    ends documents with it), when it names a token of ``tokenizer.json``."""
    try:
        with open(os.path.join(directory, "tokenizer_config.json")) as f:
            eos = json.load(f).get("eos_token")
        with open(os.path.join(directory, "tokenizer.json")) as f:
            tokenizer = json.load(f)
    except (OSError, ValueError, AttributeError):
        return None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    known = {t.get("content") for t in tokenizer.get("added_tokens") or []} | set(
        (tokenizer.get("model") or {}).get("vocab") or {})
    return eos if isinstance(eos, str) and eos in known else None


def _run(args, kind: str, prompts: list[str], rank: int) -> int:
    import jax

    from core import parallel_state as ps
    from core.inference import GenerationEngine
    from core.inference.arguments import stop_tokens
    from core.inference.model_loading import load_model
    from core.inference.text_generation import execute, prepare, text_results
    from core.training.flags import ArgumentError

    tokenizer, tokenizer_type, bos = _tokenizer(args, kind)
    state = ps.initialize_model_parallel(args.tensor_model_parallel_size)
    start = time.time()
    loaded = load_model(args.load, state, args.ckpt_step, bf16=args.bf16)
    config = loaded.config
    if rank == 0:
        for note in loaded.notes:
            _log(note)
    # A byte-level model trained on a text corpus has the 256 bytes and no end-of-document token.
    bytes_only = tokenizer_type == "ByteLevel" and config.vocab_size == tokenizer.eod == tokenizer.vocab_size - 1
    if tokenizer.vocab_size > config.vocab_size and not bytes_only:
        raise ArgumentError(f"the tokenizer's vocabulary ({tokenizer_type}, {tokenizer.vocab_size}) is larger than the "
                            f"model's in --load {args.load} ({config.vocab_size}): use the tokenizer the model was "
                            "trained with")
    what = f"checkpoint step {loaded.step}" if loaded.step is not None else "Hugging Face model"
    engine = GenerationEngine(config, state, loaded.params, loaded.moe_state)
    del loaded
    default_stop = (tokenizer.eod,) if tokenizer.eod < config.vocab_size else ()
    if rank == 0:
        _log(f"> {config.describe()} from --load {args.load} ({what}), {jax.process_count()} processes, "
             f"{jax.device_count()} {jax.devices()[0].platform} devices, tp {state.tensor_model_parallel_size} x "
             f"dp {state.data_parallel_size}; loaded in {time.time() - start:.1f} s")
    if args.server is not None:
        return _serve(args, engine, tokenizer, bos, default_stop)
    request = prepare(tokenizer, prompts, tokens_to_generate=args.max_new_tokens,
                      max_length=engine.max_sequence_length, vocab_size=config.vocab_size,
                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                      add_bos=args.add_bos, bos=bos, stop_tokens=stop_tokens(args), default_stop=default_stop)
    start = time.time()
    results = text_results(tokenizer, request, execute(engine, request))
    if rank == 0:
        generated = sum(len(r.tokens) for r in results)
        _log(f"> generated {generated} tokens for {len(results)} prompts in {time.time() - start:.1f} s")
        _write_output(args, results)
    return 0


def _format(args, results) -> str:
    if args.output_format == "jsonl":
        return "".join(json.dumps({"prompt": r.prompt, "text": r.text, "prompt_tokens": r.prompt_tokens,
                                   "tokens": r.tokens, "log_probs": r.log_probs, "stopped": r.stopped}) + "\n"
                       for r in results)
    return "\n".join(r.prompt + r.text + "\n" for r in results)


def _write_output(args, results) -> None:
    from core.atomic_files import write_atomically

    text = _format(args, results)
    if args.output:
        write_atomically(args.output, lambda f: f.write(text), mode="w")
        _log(f"> wrote {len(results)} results to {args.output}")
    else:
        sys.stdout.write(text)
        sys.stdout.flush()


def _serve(args, engine, tokenizer, bos: int, default_stop: tuple[int, ...]) -> int:
    import jax

    from core.inference.text_generation_server import GenerationService, serve

    comm = None
    if jax.process_count() > 1:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    service = GenerationService(engine, tokenizer, bos, default_stop)
    ready = lambda port: _log(f"> serving Megatron's text generation API on http://{args.host}:{port}/api")  # noqa: E731
    return serve(service, args.server, args.host, comm, log=_log, ready=ready)


if __name__ == "__main__":
    sys.exit(main())
