"""Helpers of the trainer's tests that launch pretraining: the command under the deepspeed
launcher (or another), several runs on one launch's ranks, a run to its end or in this process,
its logged metrics, the tiny config cheap to run, a copy of a run as of an older checkpoint, and
the checks of tests/train/ranks_job.py's report."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from tests.jobs import free_port, run_command

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SCRIPT = str(REPO / "train" / "pretrain.py")
RANKS_JOB = str(REPO / "tests" / "train" / "ranks_job.py")
TINY = REPO / "configs" / "cpu-tiny.yaml"
RENDEZVOUS_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

# the fp32 run of tests/train/test_pretrain.py (and the XLNet one's): 60 steps, saves every 10
FP32_ARGS = (
    "--max-steps",
    "60",
    "--precision",
    "fp32",
    "--zero-stage",
    "1",
    "--micro-batch",
    "8",
    "--save-every",
    "10",
    "--eval-every",
    "30",
    "--log-every",
    "1",
    "--warmup-steps",
    "5",
    "--lr",
    "2e-3",
)


def cheap_config(
    to: Path, changes: dict[str, str] | None = None, eval_rows: int = 16, tensorboard: bool = False
) -> Path:
    """configs/cpu-tiny.yaml written to `to`, for runs whose validation figures and TensorBoard
    files no assert reads: 16 validation rows (its 512 cost more CPU seconds than a short run's
    steps; `eval_rows` where an assert reads them), no TensorBoard writer (half a CPU-second of
    imports a rank; `tensorboard` where an assert reads its files); then each text of `changes`
    replaced (each must be there)."""
    text = TINY.read_text()
    cheap = [("  eval_samples: 512 ", f"  eval_samples: {eval_rows} ")]
    cheap += [] if tensorboard else [("run:\n", "run:\n  tensorboard: false\n")]
    for old, new in [*cheap, *(changes or {}).items()]:
        assert old in text, f"configs/cpu-tiny.yaml has no {old!r}"
        text = text.replace(old, new, 1)
    to.write_text(text)
    return to


def command(
    data: Path | str,
    run: Path,
    *extra: str,
    ranks: int = 2,
    launcher: list[str] | None = None,
    config: Path = TINY,
) -> list[str]:
    """The pretraining command under `launcher` (default: the deepspeed launcher, `ranks` on
    this machine), `config` its --config."""
    if launcher is None:
        launcher = [str(BIN / "deepspeed"), "--num_gpus", str(ranks)]
        launcher += ["--master_port", str(free_port())]
    return launcher + [
        SCRIPT,
        "--data",
        str(data),
        "--output",
        str(run),
        "--preset",
        "shatter-tiny",
        "--config",
        str(config),
        *extra,
    ]


def one_launch(data: Path, tmp: Path, *runs: list[str], ranks: int = 2) -> list[str]:
    """The command of one launch (`ranks` on this machine) whose ranks run each of `runs` (the
    arguments of train/pretrain.py, as `command(..., launcher=[])[1:]` gives them) in turn:
    tests/train/ranks_job.py with its engine checks left out (its files in `tmp`, `data` the
    dataset it opens). A run that fails ends the job before the next one starts."""
    cmd = [str(BIN / "deepspeed"), "--num_gpus", str(ranks), "--master_port", str(free_port())]
    cmd += [RANKS_JOB, str(data), str(tmp / "job"), str(tmp / "job.json"), "none"]
    for run in runs:
        cmd += ["--pretrain", *run]
    return cmd


def run_to_end(
    cmd: list[str], timeout: int = 240, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`cmd` run to its end (in `env`, default this process's with the checkout on PYTHONPATH):
    exit 0, no shared memory left.
    Past `timeout` the launcher and its ranks are killed."""
    done = run_command(cmd, timeout=timeout, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert not shm_left(cmd)
    return done


def in_process(data: Path | str, run: Path, *extra: str, config: Path = TINY):
    """`command`'s pretraining run in this process instead, a world of one without a launcher:
    click's result (`exit_code`, `output` with the stderr lines). What the run set in this
    process (the rendezvous variables, the stop signals' handlers) is put back after it, so a
    job launched later is not taken for one of its ranks."""
    from click.testing import CliRunner

    from shatter.train.pretrain import main

    env = {k: os.environ.get(k) for k in RENDEZVOUS_ENV}
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return CliRunner().invoke(main, command(data, run, *extra, launcher=[], config=config)[1:])
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def shm_left(cmd: list[str]) -> list[Path]:
    """The /dev/shm segments of DeepSpeed's CPU allreduce that the job of `cmd` left behind."""
    if "--master_port" not in cmd:
        return []
    port = cmd[cmd.index("--master_port") + 1]
    return list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"))


def metrics(run: Path) -> tuple[dict[int, float], dict[int, dict]]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r["loss"] for r in lines if "split" not in r}
    val = {r["step"]: r for r in lines if r.get("split") == "validation"}
    return train, val


def export_validation(export: Path, data: Path, eval_samples: int) -> dict:
    """The validation figures of `export`, reloaded, on `data`'s first `eval_samples` rows (a
    run's own validation at the export's step gives the same)."""
    import torch

    import shatter
    from shatter.shards import read_index
    from shatter.train.config import DataArgs
    from shatter.train.evaluate import evaluate
    from shatter.train.loader import validation_stream

    model = shatter.from_pretrained(export)
    stream = validation_stream(
        read_index(data),
        DataArgs(eval_samples=eval_samples),
        batch_size=16,
        seq_len=64,
        rank=0,
        world_size=1,
    )
    batches = ({k: b[k] for k in ("input_ids", "attention_mask", "labels")} for b in stream)
    return evaluate(model, batches, torch.device("cpu"), distributed=False)


def at_step(run: Path, step: int, to: Path) -> Path:
    """A copy of `run` as it was when checkpoint `step` was its newest."""
    shutil.copytree(run, to)
    for later in (to / "checkpoints").glob("step*"):
        if int(later.name[4:]) > step:
            shutil.rmtree(later)
    (to / "checkpoints" / "latest").write_text(f"step{step:08d}")
    shutil.rmtree(to / "export")
    return to


def shown_case(report: dict, key: str) -> str:
    """Case `key` of tests/train/ranks_job.py's report in full, its export's and its NaN step's
    figures, as an assert's message (pytest cuts the repr of a tuple short; a string it shows
    whole)."""
    return f"{key}: export {report['export'].get(key)}; NaN step {report['nan'].get(key)}"


def check_exports(report: dict, keys: list[str]) -> None:
    """Each export is the engine's fp32 masters (also tests/train/test_gpu.py's fp16 cases)."""
    for key in keys:
        case, shown = report["export"][key], shown_case(report, key)
        assert case["masters_equal"], shown  # the export is what the optimizer holds
        assert case["refused_weights_only"] == [], shown  # DeepSpeed's files: weights only
        assert case.get("zero_to_fp32_equal", True), shown  # and what DeepSpeed's files hold
        if key.startswith(("bf16", "fp16")):
            # fp32 values, not the 16-bit module weights; logits as the engine's up to rounding
            assert case["tensors_finer_than_module_dtype"] > 30, shown
            assert case["max_logit_diff"] < 0.05, shown
        else:
            assert case["max_logit_diff"] < 1e-4, shown


def check_nan_skips(report: dict, keys: list[str]) -> None:
    """The NaN step was skipped and counted, the masters left as they were and finite."""
    for key in keys:
        case, shown = report["nan"][key], shown_case(report, key)
        assert case["skipped_at_the_nan_step"] == 1, shown
        assert case["nan_step_unchanged"] and case["masters_finite"], shown
        assert case["module_finite"], shown
        assert (case["loss_scale"] is not None) == key.startswith("fp16"), shown
