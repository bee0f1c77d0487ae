"""``Pretrainer``: the GPT pretraining loop of ``launch/pretrain.py`` as a reusable object.

One training iteration is one jitted ``shard_map`` program (DDP's fused step): the pipeline
schedule or the microbatch loop, ``finalize_model_grads``, global-norm clipping and the
(distributed) optimizer. The data order is a pure function of ``--seed`` and the number of
consumed samples, parameters and optimizer state live in the checkpoint, and nothing else is
random (no dropout), so resuming reproduces the uninterrupted run.

The loop does not wait for a step's loss before starting the next: JAX dispatches steps
asynchronously, so the host builds batch ``i + 1`` while the device runs step ``i``, and
losses and grad norms are read back (one transfer) only when a line is logged, before an
evaluation or a checkpoint, and at the end. At most two steps are in flight. A non-finite
loss or grad norm found then stops the run naming its first iteration; nothing after it is
saved.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from core import checkpointing
from core.data import ByteTokenizer, DataParallelSampler, build_train_valid_datasets, get_batch, load_corpus
from core.data.text_dataset import unigram_entropy
from core.distributed.distributed_data_parallel import DistributedDataParallel
from core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from core.models.gpt import GPTModel
from core.optimizer.optimizer_config import OptimizerConfig
from core.parallel_state import ParallelState
from core.training.arguments import ParallelLayout, model_config
from core.training.device_peak import device_peak
from core.training.train_logging import TrainingLogger, memory_per_device_bytes


class TrainingError(RuntimeError):
    """Training cannot go on (NaN loss, unusable checkpoint); reported as one line."""


def learning_rate_schedule(args: argparse.Namespace) -> optax.Schedule:
    """Megatron's schedule: linear warm-up to ``--lr``, then constant/linear/cosine decay to ``--min-lr``."""
    decay_iters = max(1, (args.lr_decay_iters or args.train_iters) - args.lr_warmup_iters)
    if args.lr_decay_style == "constant":
        decay = optax.constant_schedule(args.lr)
    elif args.lr_decay_style == "linear":
        decay = optax.linear_schedule(args.lr, args.min_lr, decay_iters)
    else:
        decay = optax.cosine_decay_schedule(args.lr, decay_iters, alpha=args.min_lr / args.lr if args.lr else 0.0)
    if args.lr_warmup_iters <= 0:
        return decay
    warmup = optax.linear_schedule(args.lr / args.lr_warmup_iters, args.lr, args.lr_warmup_iters - 1)
    return optax.join_schedules([warmup, decay], [args.lr_warmup_iters])


class PretrainingData:
    """Corpus, train/valid split and the global batches of a run (the same on every process;
    each device keeps its data-parallel rows of a global batch)."""

    def __init__(self, args: argparse.Namespace, state: ParallelState):
        self.args = args
        text, self.corpus_description = load_corpus(args.data_path)
        tokens = ByteTokenizer().encode(text)
        self.unigram_entropy = unigram_entropy(tokens, ByteTokenizer.vocab_size)
        self.train_data, self.valid_data = build_train_valid_datasets(tokens, args.seq_length, args.valid_fraction)
        self.sampler = DataParallelSampler(num_samples=len(self.train_data), micro_batch_size=args.micro_batch_size,
                                           data_parallel_rank=0, data_parallel_size=1, seed=args.seed)
        self.batch_sharding = NamedSharding(state.mesh, P(state.data_parallel_axis_name))

    def _to_global(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        return {k: jax.make_array_from_callback(v.shape, self.batch_sharding, lambda idx, v=v: v[idx])
                for k, v in batch.items()}

    def next_train_batch(self) -> dict[str, jax.Array]:
        """The next global batch (advances the sampler's consumed samples)."""
        return self._to_global(get_batch(self.train_data, self.sampler.next_global_batch(self.args.global_batch_size)))

    def valid_batch(self, i: int) -> dict[str, jax.Array]:
        """Validation batch ``i`` (a fixed set, the same at every evaluation)."""
        g = self.args.global_batch_size
        return self._to_global(get_batch(self.valid_data, np.arange(i * g, (i + 1) * g) % len(self.valid_data)))


class Pretrainer:
    """Model, DDP, optimizer, data and checkpoints of one GPT pretraining run."""

    def __init__(self, args: argparse.Namespace, layout: ParallelLayout, state: ParallelState,
                 logger: TrainingLogger | None = None):
        self.args, self.layout, self.state = args, layout, state
        self.config = model_config(args, ByteTokenizer.vocab_size)
        self.model = GPTModel(self.config, state)
        self.schedule = learning_rate_schedule(args)
        # The learning rate of every iteration, on the host: evaluating the (jnp) schedule per step
        # would queue a device op behind the running step and wait for it (a host sync per step).
        self.learning_rates = np.asarray(jax.jit(jax.vmap(self.schedule))(jnp.arange(max(1, args.train_iters))))
        # No in-step NaN skip (check_for_nan_in_grad): the loop stops at the first non-finite loss
        # or grad norm and saves nothing after it (Megatron's --check-for-nan-in-loss-and-grad), so
        # parameters left unchanged would never be used; the skip's conditional costs ~1% of a CPU step.
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=args.use_distributed_optimizer, overlap_grad_reduce=args.overlap_grad_reduce,
            grad_reduce_in_fp32=True)
        optimizer = OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=args.weight_decay,
                                    adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, clip_grad=args.clip_grad)
        self.ddp = DistributedDataParallel(state, ddp_config, self.model, optimizer, self.schedule)
        self.logger = logger
        self._peak = None
        self.data = PretrainingData(args, state)
        self.iteration = 0
        self.params = self.ddp.init(jax.random.key(args.seed),
                                    jnp.zeros((args.micro_batch_size, args.seq_length), jnp.int32))
        self.opt_state = self.ddp.init_optimizer(self.params)
        m = layout.num_microbatches
        fb = self.model.ddp_forward_backward(m) if layout.pipeline_model_parallel_size > 1 else None
        self.train_step = self.ddp.make_train_step(None if fb else self.model.loss_fn, m, forward_backward=fb)
        self.eval_step = self._make_eval_step()

    # -- steps -----------------------------------------------------------------------------
    def _make_eval_step(self):
        m, dp_axes = self.layout.num_microbatches, self.state.data_parallel_axis_name
        fn = lambda p, b: lax.pmean(self.model.eval_loss(p, b, m), dp_axes)
        return jax.jit(jax.shard_map(fn, mesh=self.state.mesh, in_specs=(self.ddp.param_specs, P(dp_axes)),
                                     out_specs=P(), check_vma=False))

    def evaluate(self) -> float:
        """Mean validation loss over ``--eval-iters`` batches."""
        return float(np.mean([float(self.eval_step(self.params, self.data.valid_batch(i)))
                              for i in range(self.args.eval_iters)]))

    def dispatch_step(self) -> dict[str, Any]:
        """Start one training iteration without waiting for it; returns its pending record, whose
        ``loss`` and ``grad_norm`` are device arrays until :meth:`collect` reads them."""
        batch = self.data.next_train_batch()
        self.params, self.opt_state, metrics = self.train_step(self.params, self.opt_state, batch)
        self.iteration += 1
        lr = float(self.learning_rates[min(self.iteration, len(self.learning_rates)) - 1])
        return {"iteration": self.iteration, "consumed_samples": self.data.sampler.consumed_samples,
                "loss": metrics["loss"], "lr": lr, "grad_norm": metrics["grad_norm"]}

    def collect(self, pending: list[dict[str, Any]], elapsed: float) -> list[dict[str, Any]]:
        """Read back the pending records' losses and grad norms (one transfer; waits for the last
        step) and add timing over the ``elapsed`` seconds they took together. Raises
        :class:`TrainingError` at the first non-finite value."""
        values = jax.device_get([(r["loss"], r["grad_norm"]) for r in pending])
        per_step = elapsed / max(1, len(pending))
        tokens = self.args.global_batch_size * self.args.seq_length
        records = []
        for record, (loss, grad_norm) in zip(pending, values):
            loss, grad_norm = float(loss), float(grad_norm)
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                raise TrainingError(f"iteration {record['iteration']}: loss is {loss}, grad norm is {grad_norm} "
                                    "(NaN/Inf in the loss or gradients); stopping, the last checkpoint is kept")
            records.append({**record, "loss": loss, "grad_norm": grad_norm, "tokens_per_sec": tokens / per_step,
                            "step_time_s": per_step})
        return records

    def step(self) -> dict[str, Any]:
        """One training iteration, waited for; returns its metrics record (host values)."""
        t = time.perf_counter()
        pending = self.dispatch_step()
        jax.block_until_ready(pending["loss"])
        return self.collect([pending], time.perf_counter() - t)[0]

    # -- checkpoints -----------------------------------------------------------------------
    def model_record(self) -> dict[str, Any]:
        """The model fields a checkpoint must match: those that shape the parameters (numerics
        and execution choices such as bf16, SP or recompute may change on resume)."""
        record = dataclasses.asdict(self.config)
        for field in ("bf16", "sequence_parallel", "recompute_granularity", "unroll_layers"):
            record.pop(field)
        return record

    def layout_record(self) -> dict[str, Any]:
        """What a checkpoint's optimizer state depends on."""
        return {"tensor_model_parallel_size": self.layout.tensor_model_parallel_size,
                "pipeline_model_parallel_size": self.layout.pipeline_model_parallel_size,
                "virtual_pipeline_model_parallel_size": self.layout.virtual_pipeline_model_parallel_size,
                "data_parallel_size": self.layout.data_parallel_size,
                "use_distributed_optimizer": bool(self.args.use_distributed_optimizer),
                "num_devices": int(self.state.mesh.devices.size)}

    def save(self, directory: str) -> None:
        """Checkpoint params, optimizer state, data position, seed and iteration (atomic)."""
        meta = {"iteration": self.iteration, "consumed_samples": self.data.sampler.consumed_samples,
                "seed": self.args.seed, "layout": self.layout_record(), "model": self.model_record()}
        checkpointing.save_checkpoint(directory, self.iteration, {"params": self.params, "opt_state": self.opt_state},
                                      meta)

    def load(self, directory: str, load_optimizer: bool = True) -> bool:
        """Resume from the latest checkpoint in ``directory``; False if there is none yet."""
        step = checkpointing.latest_step(directory)
        if step is None:
            return False
        meta = checkpointing.load_metadata(directory, step)
        self._check_compatible(directory, meta, load_optimizer)
        target = {"params": self.params}
        if load_optimizer:
            target["opt_state"] = self.opt_state
        restored, _ = checkpointing.restore_checkpoint(directory, step, target, partial=not load_optimizer)
        self.params = restored["params"]
        if load_optimizer:
            self.opt_state = restored["opt_state"]
        self.iteration = int(meta["iteration"])
        position = {"consumed_samples": int(meta["consumed_samples"]), "seed": int(meta["seed"])}
        self.data.sampler.load_state_dict(position)
        return True

    def _check_compatible(self, directory: str, meta: dict, load_optimizer: bool) -> None:
        saved = meta["model"]
        diff = [f"{k}={saved.get(k)!r} (now {v!r})" for k, v in self.model_record().items() if saved.get(k) != v]
        if diff:
            raise TrainingError(f"checkpoint {directory} holds a different model: {', '.join(diff)}")
        old, new = meta["layout"], self.layout_record()
        if old["virtual_pipeline_model_parallel_size"] != new["virtual_pipeline_model_parallel_size"]:
            raise TrainingError(
                f"checkpoint {directory} was saved with virtual-pipeline-model-parallel-size "
                f"{old['virtual_pipeline_model_parallel_size']}, now {new['virtual_pipeline_model_parallel_size']}: "
                "the stacked layer arrays differ; resume with the same --virtual-pipeline-model-parallel-size")
        if load_optimizer and old != new:
            describe = lambda r: ", ".join(f"{k}={v}" for k, v in r.items())
            raise TrainingError(
                f"checkpoint {directory} was saved with layout ({describe(old)}), now ({describe(new)}): "
                "the optimizer state is stored per device and cannot be loaded into another layout; pass "
                "--no-load-optim to load only the parameters (resharded) with a fresh optimizer state")

    # -- the loop ----------------------------------------------------------------------------
    @property
    def peak(self):
        """The device peak MFU is taken against (:mod:`core.training.device_peak`), found once."""
        if self._peak is None:
            self._peak = device_peak(self.config.compute_dtype)
        return self._peak

    def _add_throughput(self, record: dict[str, Any]) -> None:
        # A process's CPU devices share its cores, and a CPU peak is measured with all of them.
        devices_per_peak = jax.local_device_count() if jax.devices()[0].platform == "cpu" else 1
        per_device = record["tokens_per_sec"] / self.state.mesh.devices.size
        record["tflops_per_device"] = self.config.flops_per_token() * per_device / 1e12
        record["mfu"] = record["tflops_per_device"] * devices_per_peak * 1e12 / self.peak.flops
        record["memory_per_device_bytes"] = memory_per_device_bytes()

    def _must_collect(self, stop: int) -> bool:
        """Whether this iteration's values are needed now: a log line, an evaluation, a checkpoint or the end."""
        args, i = self.args, self.iteration
        evaluate = bool(args.eval_interval) and i % args.eval_interval == 0
        save = bool(args.save and args.save_interval) and i % args.save_interval == 0
        return i == 1 or i == stop or i % args.log_interval == 0 or evaluate or save

    def train(self) -> list[dict[str, Any]]:
        """Run to ``--train-iters`` (or ``--exit-interval``); returns every iteration's record."""
        args, log = self.args, self.logger
        records, pending = [], []
        stop = args.train_iters if args.exit_interval is None else min(args.train_iters, args.exit_interval)
        start = time.perf_counter()
        while self.iteration < stop:
            pending.append(self.dispatch_step())
            if log:
                log.advance()
            if len(pending) >= 2:  # at most two steps in flight: the device stays busy with the newest
                jax.block_until_ready(pending[-2]["loss"])
            if not self._must_collect(stop):
                continue
            done = self.collect(pending, time.perf_counter() - start)
            pending = []
            for record in done:
                self._add_throughput(record)
            records += done
            self._after_collect(done[-1], stop)
            start = time.perf_counter()  # evaluation and checkpoint time is not step time
        return records

    def _after_collect(self, record: dict[str, Any], stop: int) -> None:
        """Evaluate, log and save at an iteration whose values were just read back."""
        args, log, i = self.args, self.logger, self.iteration
        if args.eval_interval and i % args.eval_interval == 0:
            record["valid_loss"] = self.evaluate()
        if log:
            log.set_loss(record["loss"])
            if i % args.log_interval == 0 or i == 1 or "valid_loss" in record:
                log.log_iteration(record, args.train_iters)
            if "valid_loss" in record:
                self._log_validation(record["valid_loss"])
        if args.save and args.save_interval and i % args.save_interval == 0:
            self._save_and_log()
        elif args.save and i == stop:
            self._save_and_log()  # the final state

    def _save_and_log(self) -> None:
        self.save(self.args.save)
        if self.logger:
            self.logger.print(f" saved checkpoint at iteration {self.iteration:8d} to {self.args.save}")

    def _log_validation(self, loss: float) -> None:
        self.logger.print(f" validation loss at iteration {self.iteration} | lm loss value: {loss:.6E} | "
                          f"lm loss PPL: {math.exp(min(loss, 50)):.4E} | unigram entropy of the corpus: "
                          f"{self.data.unigram_entropy:.4f}")
