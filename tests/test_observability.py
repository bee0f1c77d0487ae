"""Following a run: TensorBoard event files and an offline W&B run with Megatron's tags (read back
with TensorBoard's and W&B's own formats, equal to the metrics file's values), per-rank timers
gathered under ``mpirun -n 4`` naming a slow rank, ``tools/plot_metrics.py``, and one clear line
when an optional package is missing."""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from test_pretrain_cli import PRETRAIN, ROOT, SMALL, _env
from wandb_records import history, run_name

from core.training.timers import TimerReport, Timers

RUN = SMALL + ["--train-iters", "4", "--eval-interval", "2", "--eval-iters", "1"]


def _launch(flags, env=None, timeout=300):
    return subprocess.run([sys.executable, PRETRAIN, *flags], capture_output=True, text=True, timeout=timeout,
                          env=env or _env(), cwd=ROOT)


def _records(path):
    return {r["iteration"]: r for r in map(json.loads, Path(path).read_text().splitlines())}


def _scalars(directory):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: {e.step: e.value for e in accumulator.Scalars(tag)} for tag in accumulator.Tags()["scalars"]}


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """One short run with TensorBoard (every option on), W&B offline and the timers."""
    tmp = tmp_path_factory.mktemp("tracked")
    flags = RUN + ["--metrics-file", str(tmp / "m.jsonl"), "--tensorboard-dir", str(tmp / "tb"),
                   "--log-timers-to-tensorboard", "--log-memory-to-tensorboard", "--log-validation-ppl-to-tensorboard",
                   "--timing-log-level", "1", "--wandb-project", "obs-test", "--wandb-exp-name", "tiny-run",
                   "--wandb-save-dir", str(tmp / "wb")]
    result = _launch(flags, env=dict(_env(), WANDB_MODE="offline", WANDB_SILENT="true"))
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp, result


def test_tensorboard_holds_megatrons_tags_with_the_metrics_files_values(tracked_run):
    tmp, result = tracked_run
    records, scalars = _records(tmp / "m.jsonl"), _scalars(tmp / "tb")
    assert f"> TensorBoard: event files in {tmp / 'tb'}" in result.stdout
    assert sorted(records) == [1, 2, 3, 4]
    expected = {"lm loss": "loss", "learning-rate": "lr", "grad-norm": "grad_norm", "tokens-per-sec": "tokens_per_sec",
                "mfu": "mfu", "iteration-time": "step_time_s", "throughput": "tflops_per_device",
                "mem-max-allocated-bytes": "memory_per_device_bytes"}
    for tag, key in expected.items():
        assert scalars[tag] == pytest.approx({i: r[key] for i, r in records.items()}, rel=1e-6), tag
    for tag in ("lm loss", "learning-rate", "grad-norm", "batch-size"):  # Megatron's "vs samples" twins
        samples = {r["consumed_samples"]: scalars[tag][i] for i, r in records.items()}
        assert scalars[f"{tag} vs samples"] == samples, tag
    assert set(scalars["batch-size"].values()) == {8.0}
    valid = {i: r["valid_loss"] for i, r in records.items() if "valid_loss" in r}
    assert sorted(valid) == [2, 4]
    assert scalars["lm loss validation"] == pytest.approx(valid, rel=1e-6)
    assert scalars["lm loss validation ppl"] == pytest.approx({i: math.exp(v) for i, v in valid.items()}, rel=1e-5)
    assert scalars["lm loss validation vs samples"] == pytest.approx(
        {records[i]["consumed_samples"]: v for i, v in valid.items()}, rel=1e-6)
    for timer in ("batch-generator", "step-dispatch", "device-wait", "evaluate"):  # logged at every iteration
        assert set(scalars[f"{timer}-time"]) <= {1, 2, 3, 4} and scalars[f"{timer}-time"], timer
    assert "loss-scale" not in scalars  # nothing scales the loss here


def test_wandb_offline_run_holds_the_same_scalars(tracked_run):
    tmp, _ = tracked_run
    records = _records(tmp / "m.jsonl")
    (run_file,) = (tmp / "wb").glob("wandb/offline-run-*/run-*.wandb")
    assert run_name(run_file) == "tiny-run"
    rows = history(run_file)
    assert sorted(rows) == [1, 2, 3, 4]
    for i, r in records.items():
        row = rows[i]
        assert row["lm loss"] == pytest.approx(r["loss"], rel=1e-12)
        assert row["learning-rate"] == pytest.approx(r["lr"], rel=1e-12)
        assert row["grad-norm"] == pytest.approx(r["grad_norm"], rel=1e-12)
        assert row["samples vs steps"] == r["consumed_samples"]
        assert row["tokens-per-sec"] == pytest.approx(r["tokens_per_sec"], rel=1e-12)
        assert ("lm loss validation" in row) == ("valid_loss" in r)
        if "valid_loss" in r:
            assert row["lm loss validation"] == pytest.approx(r["valid_loss"], rel=1e-12)
        assert "device-wait-time" in row


def test_tensorboard_log_interval_learning_rate_switch_and_moe_tags(tmp_path):
    """``--tensorboard-log-interval 2`` writes iterations 2 and 4 only, ``--no-log-learning-rate-to-
    tensorboard`` drops the learning-rate tags, and an MoE run adds Megatron's MoE loss tags (means
    over the MoE layers) and each layer's expert load."""
    flags = RUN + ["--metrics-file", str(tmp_path / "m.jsonl"), "--tensorboard-dir", str(tmp_path / "tb"),
                   "--tensorboard-log-interval", "2", "--no-log-learning-rate-to-tensorboard", "--num-experts", "2",
                   "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001"]
    result = _launch(flags)
    assert result.returncode == 0, result.stderr[-3000:]
    records, scalars = _records(tmp_path / "m.jsonl"), _scalars(tmp_path / "tb")
    assert sorted(scalars["lm loss"]) == [2, 4]
    assert not any(tag.startswith("learning-rate") for tag in scalars)
    assert not any(tag.endswith("-time") or tag.startswith("mem-") for tag in scalars)  # their flags are off
    layers = len(records[2]["moe_expert_load"])
    assert layers == 2
    for i in (2, 4):
        assert scalars["load_balancing_loss"][i] == pytest.approx(records[i]["moe_aux_loss"] / layers, rel=1e-6)
        assert scalars["z_loss"][i] == pytest.approx(records[i]["moe_z_loss"] / layers, rel=1e-6)
        for k in range(layers):
            assert scalars[f"moe/expert_load_layer_{k}"][i] == pytest.approx(records[i]["moe_expert_load"][k],
                                                                             rel=1e-5)


def test_timers_are_gathered_from_every_rank_and_name_the_slow_one(tmp_path):
    """Under mpirun -n 4 with rank 2's data 50 ms slower per batch: the log lists every rank's
    batch-generator time and names rank 2 the slowest; the TensorBoard file is rank 0's alone."""
    cmd = ["mpirun", "--oversubscribe", "-x", "XLA_FLAGS", "-n", "4", sys.executable,
           str(ROOT / "tests" / "slow_rank.py"), "2", "0.05"]
    flags = SMALL + ["--train-iters", "4", "--log-interval", "2", "--timing-log-level", "1", "--timing-log-option",
                     "all", "--tensorboard-dir", str(tmp_path / "tb"), "--log-timers-to-tensorboard"]
    result = subprocess.run(cmd + flags, capture_output=True, text=True, timeout=600, env=_env(), cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert out.count("times across ranks (ms):") == 3  # iterations 1, 2 and 4
    block = out.split("times across ranks (ms):")[-1]
    generator = block.split("  batch-generator: (slowest: rank 2)\n")[1].splitlines()[:4]
    times = {int(line.split("rank")[1].split(":")[0]): float(line.split(":")[1]) for line in generator}
    assert sorted(times) == [0, 1, 2, 3]
    assert times[2] >= 50.0 and max(times[r] for r in (0, 1, 3)) < 50.0, times
    for phase in ("step-dispatch", "device-wait"):
        assert f"  {phase}: (slowest: rank " in block
    assert len(list((tmp_path / "tb").iterdir())) == 1  # one event file: rank 0's
    assert _scalars(tmp_path / "tb")["batch-generator-time"][4] >= 0.05  # the max over ranks


@pytest.mark.parametrize("option,header,line", [
    ("max", "max time across ranks (ms):", "4.00 slowest: rank 1"),
    ("minmax", "(min, max) time across ranks (ms):", "(1.00, 4.00) slowest: rank 1"),
])
def test_timer_report_lines(option, header, line):
    """Megatron's ``Timers.log`` formats (ms per iteration; min over the ranks that spent time in a
    phase), the slowest rank named, phases no rank spent time in left out."""
    report = TimerReport(["batch-generator", "save-checkpoint"], np.array([[0.001, 0.0], [0.004, 0.0]]), option)
    lines = report.describe().splitlines()
    assert lines[0] == header and len(lines) == 2
    assert lines[1].startswith("    batch-generator ....") and lines[1].endswith(line)
    assert report.max_seconds() == {"batch-generator": 0.004}
    all_ranks = TimerReport(["device-wait"], np.array([[0.002], [0.0], [0.003]]), "all").describe().splitlines()
    assert all_ranks == ["times across ranks (ms):", "  device-wait: (slowest: rank 2)", "     rank  0: 2.00",
                         "     rank  1: 0.00", "     rank  2: 3.00"]


def test_timers_time_only_their_level_and_reset_when_gathered():
    assert not Timers(0).enabled and Timers(0).gather(1) is None
    timers = Timers(1, "max")
    with timers("batch-generator"):
        time.sleep(0.02)
    with timers("no-such-phase"):  # not timed at any level: a no-op
        pass
    report = timers.gather(2)
    assert report.seconds.shape == (1, len(timers.names))
    assert 0.01 <= report.max_seconds()["batch-generator"] < 0.02  # per iteration: halved
    assert timers.gather(1).max_seconds() == {}
    with pytest.raises(ValueError, match="timing log option"):
        Timers(1, "mean")


def _plot_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("plot_metrics", ROOT / "tools" / "plot_metrics.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fake_metrics(path, offset, iterations=10, valid_every=5):
    with open(path, "w") as f:
        for i in range(1, iterations + 1):
            record = {"iteration": i, "loss": 5.0 - 0.1 * i + offset, "lr": 1e-3 * i, "tokens_per_sec": 1000.0 + i}
            if i % valid_every == 0:
                record["valid_loss"] = 5.0 - 0.1 * i + offset + 0.05
            f.write(json.dumps(record) + "\n")


def test_plot_tool_draws_one_line_per_run_and_writes_a_png(tmp_path):
    from matplotlib.lines import Line2D

    plot = _plot_module()
    _fake_metrics(tmp_path / "a.jsonl", 0.0)
    _fake_metrics(tmp_path / "b.jsonl", 0.3)
    with open(tmp_path / "b.jsonl", "a") as f:  # a resumed run re-logs iteration 10: the last record wins
        f.write(json.dumps({"iteration": 10, "loss": 1.0, "lr": 0.01, "tokens_per_sec": 5.0}) + "\n")
    runs = [("a", plot.read_metrics(str(tmp_path / "a.jsonl"))), ("b", plot.read_metrics(str(tmp_path / "b.jsonl")))]
    fig = plot.plot_runs(runs)
    loss, lr, throughput = fig.axes
    lines = [line for line in loss.get_lines() if isinstance(line, Line2D)]
    assert [line.get_label() for line in lines] == ["a train", "a validation", "b train", "b validation"]
    assert list(lines[2].get_ydata())[-1] == 1.0 and list(lines[1].get_xdata()) == [5, 10]
    assert [line.get_label() for line in lr.get_lines()] == ["a", "b"]
    assert len(throughput.get_lines()) == 2 and list(throughput.get_lines()[0].get_xdata())[0] == 2  # no iteration 1
    assert loss.get_lines()[0].get_color() == lr.get_lines()[0].get_color() != lr.get_lines()[1].get_color()
    out = tmp_path / "curves.png"
    assert plot.main([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "--labels", "fp32", "bf16",
                      "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "b.jsonl", "curves.png"]  # no temporary left


def test_plot_tool_bad_input_is_one_line(tmp_path, capsys):
    plot = _plot_module()
    (tmp_path / "bad.jsonl").write_text('{"iteration": 1, "loss": 2}\nnot json\n')
    assert plot.main([str(tmp_path / "bad.jsonl"), "-o", str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'bad.jsonl'}:2: not a JSON object")
    assert plot.main([str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "x.png")]) == 2
    assert not (tmp_path / "x.png").exists()


def _without(tmp_path, package):
    """An environment whose Python cannot import ``package`` (a ``sitecustomize`` that blocks it)."""
    site = tmp_path / f"no-{package}"
    site.mkdir()
    (site / "sitecustomize.py").write_text(f"import sys\nsys.modules[{package!r}] = None\n")
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH")) if p)
    return env


def _one_error(result):
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr + result.stdout, result.stderr
    return errors[0]


def test_missing_tensorboardx_is_one_line_on_every_rank(tmp_path):
    """Under mpirun -n 2: exit code 2, one line naming the package and its pip install, in seconds."""
    start = time.monotonic()
    cmd = ["mpirun", "--oversubscribe", "-x", "XLA_FLAGS", "-x", "PYTHONPATH", "-n", "2", sys.executable, PRETRAIN]
    result = subprocess.run(cmd + RUN + ["--tensorboard-dir", str(tmp_path / "tb")], capture_output=True, text=True,
                            timeout=120, env=_without(tmp_path, "tensorboardX"), cwd=ROOT)
    assert time.monotonic() - start < 60
    assert result.returncode == 2, result.stderr[-2000:]
    assert _one_error(result) == ("error: --tensorboard-dir needs the tensorboardX package, which is not installed: "
                                  "pip install tensorboardX (or this package's extra: pip install .[tensorboard])")
    assert not (tmp_path / "tb").exists()


def test_missing_wandb_and_matplotlib_are_one_line(tmp_path):
    result = _launch(RUN + ["--wandb-project", "p"], env=_without(tmp_path, "wandb"), timeout=120)
    assert result.returncode == 2
    assert "error: --wandb-project needs the wandb package, which is not installed: pip install wandb" in \
        _one_error(result)
    _fake_metrics(tmp_path / "a.jsonl", 0.0)
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "plot_metrics.py"), str(tmp_path / "a.jsonl"),
                             "-o", str(tmp_path / "a.png")], capture_output=True, text=True, timeout=120,
                            env=_without(tmp_path, "matplotlib"), cwd=ROOT)
    assert result.returncode == 2 and not (tmp_path / "a.png").exists()
    assert _one_error(result) == ("error: tools/plot_metrics.py needs the matplotlib package, which is not installed: "
                                  "pip install matplotlib (or this package's extra: pip install .[plot])")


@pytest.mark.parametrize("flags,message", [
    (["--tensorboard-log-interval", "0"], "--tensorboard-log-interval must be >= 1, got 0"),
    (["--tensorboard-queue-size", "0"], "--tensorboard-queue-size must be >= 1, got 0"),
    (["--wandb-exp-name", "x"], "--wandb-exp-name needs --wandb-project"),
])
def test_logging_flag_errors(flags, message):
    from core.training.arguments import ArgumentError, fill_defaults, parse_args, validate_args

    with pytest.raises(ArgumentError, match=message):
        validate_args(fill_defaults(parse_args(SMALL + flags), 1), 1)


def test_the_package_trains_without_the_optional_packages(tmp_path):
    """No tensorboardX, wandb or matplotlib: a run without their flags trains as before."""
    env = _without(tmp_path, "tensorboardX")
    site = Path(env["PYTHONPATH"].split(os.pathsep)[0])
    (site / "sitecustomize.py").write_text("import sys\nfor name in ('tensorboardX', 'wandb', 'matplotlib', "
                                           "'tensorboard'):\n    sys.modules[name] = None\n")
    result = _launch(SMALL + ["--train-iters", "2", "--metrics-file", str(tmp_path / "m.jsonl")], env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(_records(tmp_path / "m.jsonl")) == [1, 2]

