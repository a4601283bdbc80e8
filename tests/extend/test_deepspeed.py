"""`shatter-extend` on a real DeepSpeed checkpoint (ZeRO-2, one rank, in a subprocess)."""

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import shatter
from shatter.tools.extend import main
from tests.jobs import child_env

from .test_cli import tokenizer_file  # noqa: F401  (fixture)
from .test_extend import inputs

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """Other suites run DeepSpeed on this machine at the same time: never share a fixed port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2])
def test_extends_a_deepspeed_checkpoint(tmp_path, tokenizer_file, stage):  # noqa: F811
    env = child_env(MASTER_PORT=str(free_port()))
    done = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).with_name("deepspeed_checkpoint.py")),
            str(tmp_path / "checkpoints"),
            str(stage),
            "fp32",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,  # a first JIT build under load is slow
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "extended"
    result = CliRunner().invoke(
        main, [str(tmp_path / "checkpoints"), "--max-len", "32", "--output", str(out)]
    )
    assert (
        result.exit_code != 0 and "no tokenizer.model found" in result.output and not out.exists()
    )
    result = CliRunner().invoke(
        main,
        [
            str(tmp_path / "checkpoints"),
            "--max-len",
            "32",
            "--output",
            str(out),
            "--tokenizer",
            str(tokenizer_file),
        ],
    )
    assert result.exit_code == 0, result.output
    assert f"total parameters added: {16 * 64:,}" in result.output
    reference, extended = (
        shatter.from_pretrained(tmp_path / "reference"),
        shatter.from_pretrained(out),
    )
    assert extended.config.max_len == 32
    ids, mask = inputs(16)
    with torch.no_grad():
        torch.testing.assert_close(
            extended.encoder(ids, mask), reference.encoder(ids, mask), rtol=0, atol=1e-5
        )
