"""`shatter-extend` on a real DeepSpeed checkpoint (ZeRO-0 and ZeRO-2, one rank each, in
subprocesses)."""

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import shatter
from shatter.extend_cli import main
from tests.jobs import Outcome, Runs, child_env

from .test_cli import tokenizer_file  # noqa: F401  (fixture)
from .test_extend import inputs

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """Other suites run DeepSpeed on this machine at the same time: never share a fixed port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STAGES = (0, 2)


def _checkpoint(root: Path, stage: int) -> Path:
    """One DeepSpeed step and its checkpoint at ZeRO `stage` (deepspeed_checkpoint.py) under
    `root`: root/checkpoints, and root/reference the model the engine trained."""
    env = child_env(MASTER_PORT=str(free_port()))
    done = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).with_name("deepspeed_checkpoint.py")),
            str(root / "checkpoints"),
            str(stage),
            "fp32",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,  # a first JIT build under load is slow
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return root


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[int, Outcome]:
    """Both stages' checkpoints, each written when a test first reads it (tests/jobs.py Runs)."""
    roots = {stage: tmp_path_factory.mktemp(f"zero{stage}") for stage in STAGES}
    return Runs({s: (lambda s=s: _checkpoint(roots[s], s)) for s in STAGES})


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_extends_a_deepspeed_checkpoint(checkpoints, tmp_path, tokenizer_file, stage):  # noqa: F811
    written = checkpoints[stage].get()
    out = tmp_path / "extended"
    result = CliRunner().invoke(
        main, [str(written / "checkpoints"), "--max-len", "32", "--output", str(out)]
    )
    assert (
        result.exit_code != 0 and "no tokenizer.model found" in result.output and not out.exists()
    )
    args = [str(written / "checkpoints"), "--max-len", "32", "--output", str(out)]
    args += ["--tokenizer", str(tokenizer_file)]
    if stage == 2:  # as a user runs it, in a process of its own: DeepSpeed's logger writes to
        # the process's stdout, which CliRunner does not capture
        env = {k: v for k, v in child_env().items() if k != "DS_ACCELERATOR"}
        script = Path(sys.executable).with_name("shatter-extend")
        done = subprocess.run([script, *args], env=env, capture_output=True, text=True, timeout=300)
        code, output = done.returncode, done.stdout + done.stderr
    else:
        result = CliRunner().invoke(main, args)
        code, output = result.exit_code, result.output
    assert code == 0, output
    assert f"total parameters added: {16 * 64:,}" in output
    # quiet: no DeepSpeed internals (zero_to_fp32's lines, its accelerator guess), no \r bar
    internals = ("Processing zero checkpoint", "Reconstructed fp32", "[WARNING]", "[INFO]")
    assert not [x for x in internals if x in output] and "\r" not in output, output
    reference, extended = (
        shatter.from_pretrained(written / "reference"),
        shatter.from_pretrained(out),
    )
    assert extended.config.max_len == 32
    ids, mask = inputs(16)
    with torch.no_grad():
        torch.testing.assert_close(
            extended.encoder(ids, mask), reference.encoder(ids, mask), rtol=0, atol=1e-5
        )
