"""Helpers of the trainer's tests that launch pretraining: the command under the deepspeed
launcher (or another), a run to its end, its logged metrics, a kill -9 after a checkpoint, a
copy of a run as of an older checkpoint, and the checks of tests/train/ranks_job.py's report."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.jobs import free_port, run_command

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SCRIPT = str(REPO / "train" / "pretrain.py")

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


def cheap_config(to: Path, changes: dict[str, str] | None = None) -> Path:
    """configs/cpu-tiny.yaml written to `to`, for runs whose validation figures and TensorBoard
    files no assert reads: 16 validation rows (its 512 cost more CPU seconds than a short run's
    steps), no TensorBoard writer (half a CPU-second of imports a rank); then each text of
    `changes` replaced (each must be there)."""
    text = (REPO / "configs" / "cpu-tiny.yaml").read_text()
    cheap = [
        ("  eval_samples: 512 ", "  eval_samples: 16 "),
        ("run:\n", "run:\n  tensorboard: false\n"),
    ]
    for old, new in [*cheap, *(changes or {}).items()]:
        assert old in text, f"configs/cpu-tiny.yaml has no {old!r}"
        text = text.replace(old, new, 1)
    to.write_text(text)
    return to


def command(
    data: Path, run: Path, *extra: str, ranks: int = 2, launcher: list[str] | None = None
) -> list[str]:
    """The pretraining command under `launcher` (default: the deepspeed launcher, `ranks` on
    this machine)."""
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
        str(REPO / "configs" / "cpu-tiny.yaml"),
        *extra,
    ]


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


def kill_9_after_a_checkpoint(cmd: list[str], run: Path, env: dict | None = None) -> str:
    """Start `cmd` (in `env`), kill -9 the launcher and both ranks once a checkpoint exists and
    12 steps are logged; return the tag of the newest checkpoint."""
    out = subprocess.DEVNULL
    job = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=out, start_new_session=True, env=env)
    try:
        deadline = time.time() + 180
        while time.time() < deadline and job.poll() is None:
            log = run / "metrics.jsonl"
            logged = log.read_text().count('"lr"') if log.exists() else 0
            if (run / "checkpoints" / "latest").exists() and logged >= 12:
                break
            time.sleep(0.05)
        assert job.poll() is None, "the run ended before it could be killed"
        os.killpg(job.pid, signal.SIGKILL)  # kill -9 of the launcher and both ranks
        job.wait(30)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    return (run / "checkpoints" / "latest").read_text().strip()


def at_step(run: Path, step: int, to: Path) -> Path:
    """A copy of `run` as it was when checkpoint `step` was its newest."""
    shutil.copytree(run, to)
    for later in (to / "checkpoints").glob("step*"):
        if int(later.name[4:]) > step:
            shutil.rmtree(later)
    (to / "checkpoints" / "latest").write_text(f"step{step:08d}")
    shutil.rmtree(to / "export")
    return to


def check_exports(report: dict, keys: list[str]) -> None:
    """Each export is the engine's fp32 masters (also tests/train/test_gpu.py's fp16 cases)."""
    for key in keys:
        case = report["export"][key]
        assert case["masters_equal"], key  # the export is what the optimizer holds
        assert case["refused_weights_only"] == [], key  # DeepSpeed's files: weights only
        assert case.get("zero_to_fp32_equal", True), key  # and what DeepSpeed's files hold
        if key.startswith(("bf16", "fp16")):
            # fp32 values, not the 16-bit module weights; logits as the engine's up to rounding
            assert case["tensors_finer_than_module_dtype"] > 30, (key, case)
            assert case["max_logit_diff"] < 0.05, (key, case)
        else:
            assert case["max_logit_diff"] < 1e-4, (key, case)


def check_nan_skips(report: dict, keys: list[str]) -> None:
    """The NaN step was skipped and counted, the masters left as they were and finite."""
    for key in keys:
        case = report["nan"][key]
        assert case["skipped_at_the_nan_step"] == 1, (key, case)
        assert case["nan_step_unchanged"] and case["masters_finite"], (key, case)
        assert case["module_finite"], (key, case)
        assert (case["loss_scale"] is not None) == key.startswith("fp16"), (key, case)
