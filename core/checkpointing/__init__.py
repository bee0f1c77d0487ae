"""Checkpoints: distributed, atomic, integrity-checked saves of global ``jax.Array`` pytrees with
orbax, and the trainer's checkpoint manager.

* :mod:`~core.checkpointing.files`: the on-disk format (step directories, commit marker,
  integrity records), finding the newest intact checkpoint, reading its metadata;
* :mod:`~core.checkpointing.step_writer`: writing and committing one step, every process together;
* :mod:`~core.checkpointing.saver`: ``CheckpointSaver`` (synchronous and asynchronous saves,
  retention) and ``save_checkpoint``; :mod:`~core.checkpointing.writer_process`: the writer
  process of asynchronous saves (Megatron's persistent checkpoint worker);
* :mod:`~core.checkpointing.restore`: ``restore_checkpoint`` into any sharding;
* :mod:`~core.checkpointing.layer_order`: the layout-independent order of stacked layers;
* :mod:`~core.checkpointing.coordination`, :mod:`~core.checkpointing.orbax_failure_noise`:
  process barriers and the quieting of orbax's repeats of a failed write.

One checkpoint is one step directory written by every process together (a collective, like
Megatron's ``save_checkpoint``); a step counts only once committed, so a failure, a signal or a
full disk leaves the earlier checkpoints intact.
"""

from core.checkpointing.files import (
    COMMIT_MARKER,
    DEFAULT_MAX_TO_KEEP,
    META_ITEM,
    complete_steps,
    incomplete_steps,
    latest_step,
    latest_valid_step,
    load_metadata,
    new_run_id,
    step_problem,
    verify_checkpoint,
    why_nothing_to_load,
)
from core.checkpointing.restore import check_against_saved, restore_checkpoint, saved_tree
from core.checkpointing.saver import WRITER_NICE, CheckpointSaver, save_checkpoint

__all__ = ["COMMIT_MARKER", "DEFAULT_MAX_TO_KEEP", "META_ITEM", "WRITER_NICE", "CheckpointSaver", "check_against_saved",
           "complete_steps", "incomplete_steps", "latest_step", "latest_valid_step", "load_metadata", "new_run_id",
           "restore_checkpoint", "save_checkpoint", "saved_tree", "step_problem", "verify_checkpoint",
           "why_nothing_to_load"]
