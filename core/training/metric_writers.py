"""Where a run's scalars go besides the log and the metrics file: TensorBoard event files
(tensorboardX) and Weights & Biases, behind one small writer interface.

Both libraries are optional: the package imports and trains without them, and
:func:`missing_packages_error` names the package and its ``pip install`` when a flag needs one
that is not installed (checked with the other flags, before anything starts). The libraries write
their own files (event files appended and flushed by tensorboardX, W&B's run directory).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from typing import Any, Protocol

OPTIONAL_PACKAGES = {"tensorboardX": "tensorboard", "wandb": "wandb", "matplotlib": "plot"}
"""Optional import name -> this package's extra that installs it (``pip install .[extra]``)."""


def is_installed(package: str) -> bool:
    """Whether ``package`` can be imported (found, not imported: importing W&B takes a second)."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def missing_package_message(package: str, needed_by: str) -> str:
    """The one line that says ``needed_by`` needs ``package`` and how to install it."""
    return (f"{needed_by} needs the {package} package, which is not installed: pip install {package} "
            f"(or this package's extra: pip install .[{OPTIONAL_PACKAGES[package]}])")


def missing_packages_error(args: argparse.Namespace) -> str | None:
    """The one-line error for the first logging flag whose package is missing, else None."""
    for flag, value, package in (("--tensorboard-dir", args.tensorboard_dir, "tensorboardX"),
                                 ("--wandb-project", args.wandb_project, "wandb")):
        if value and not is_installed(package):
            return missing_package_message(package, flag)
    return None


class MetricWriter(Protocol):
    """A destination of scalars: a batch of ``tag -> value`` at one step, then closed once."""

    def add_scalars(self, scalars: dict[str, float], step: int) -> None:
        """Record every scalar of ``scalars`` at ``step``."""

    def close(self) -> None:
        """Flush and release the destination."""


class TensorBoardWriter:
    """TensorBoard event files in ``log_dir`` (tensorboardX's ``SummaryWriter``, as Megatron's
    ``--tensorboard-dir`` writer with ``max_queue=--tensorboard-queue-size``)."""

    def __init__(self, log_dir: str, queue_size: int = 1000):
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(logdir=log_dir, max_queue=queue_size)

    def add_scalars(self, scalars: dict[str, float], step: int) -> None:
        """The scalars as one event at ``step``, under their tags as given: tensorboardX's
        ``add_scalar`` would turn ``lm loss`` into ``lm_loss`` (PyTorch's writer, Megatron's, keeps
        the spaces, and so dashboards built on Megatron's tags expect them)."""
        from tensorboardX.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=tag, simple_value=float(v)) for tag, v in scalars.items()]
        self.writer._get_file_writer().add_summary(Summary(value=values), step)

    def flush(self) -> None:
        """Write the queued events to disk."""
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()


class WandbWriter:
    """A Weights & Biases run (Megatron's ``--wandb-project``, ``--wandb-exp-name``,
    ``--wandb-save-dir``); ``WANDB_MODE=offline`` keeps it on disk for ``wandb sync``."""

    def __init__(self, project: str, name: str | None, save_dir: str, config: dict[str, Any] | None = None):
        import wandb

        os.makedirs(save_dir, exist_ok=True)
        self.run = wandb.init(project=project, name=name or None, dir=save_dir, config=config or {})

    def add_scalars(self, scalars: dict[str, float], step: int) -> None:
        """One history row update at ``step`` (W&B merges the calls of one step)."""
        self.run.log(dict(scalars), step=step)

    def close(self) -> None:
        """Finish the run (an offline run's files are complete after this)."""
        self.run.finish()
