"""`shatter-extend` end to end on real exports: output, report, and every refusal writes nothing."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import shatter
from shatter.extend_cli import main
from shatter.pipeline.tokenizer import train

from .test_extend import OLD, inputs, tiny

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    lines = [f"the quick brown fox {i} jumps over lazy dogs {i * 7}" for i in range(300)]
    (root / "t.model").write_bytes(train(lines, 48))  # the pipeline's special ids
    return root / "t.model"


@pytest.fixture
def export(tmp_path, tokenizer_file):
    def make(arch="bert", tokenizer=True):
        path = tmp_path / f"export-{arch}"
        shatter.save_pretrained(tiny(arch), path, tokenizer=tokenizer_file if tokenizer else None)
        return path

    return make


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.mark.parametrize(
    "arch, added", [("bert", (64 - OLD) * 32), ("shatter", 0), ("bert-rpe", 0), ("xlnet", 0)]
)
def test_extends_an_export(export, tmp_path, arch, added):
    out = tmp_path / "extended"
    result = run(export(arch), "--max-len", 64, "--output", out, "--init", "copy")
    assert result.exit_code == 0, result.output
    assert f"total parameters added: {added:,}" in result.output
    assert sorted(p.name for p in out.iterdir()) == [
        "checksums.json",
        "config.json",
        "model.safetensors",
        "tokenizer.model",
    ]
    assert json.loads((out / "config.json").read_text())["max_len"] == 64
    model, extended = shatter.from_pretrained(export(arch)), shatter.from_pretrained(out)
    ids, mask = inputs(OLD)
    with torch.no_grad():
        torch.testing.assert_close(
            extended.encoder(ids, mask), model.encoder(ids, mask), rtol=0, atol=1e-5
        )
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # no temp dir left behind


def refused(result, out, message):
    assert result.exit_code != 0
    assert message in result.output, result.output
    assert "Traceback" not in result.output
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if ".tmp-" in p.name]


def test_refuses_a_shorter_length(export, tmp_path):
    out = tmp_path / "o"
    refused(
        run(export(), "--max-len", OLD - 1, "--output", out),
        out,
        "not larger than the model's max_len 16",
    )


def test_refuses_unknown_and_corrupt_checkpoints(export, tmp_path):
    out = tmp_path / "o"
    refused(
        run(tmp_path / "nowhere", "--max-len", 64, "--output", out),
        out,
        "no such checkpoint directory",
    )
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "notes.txt").write_text("hello")
    refused(run(stray, "--max-len", 64, "--output", out), out, "neither an export")
    corrupt = export()
    (corrupt / "model.safetensors").write_bytes(b"\x00" * 40)
    refused(run(corrupt, "--max-len", 64, "--output", out), out, "model.safetensors")
    bad_config = export("shatter")
    (bad_config / "config.json").write_text('{"arch": "shatter", "colour": 1}')
    refused(run(bad_config, "--max-len", 64, "--output", out), out, "unknown ModelConfig keys")


def test_refuses_a_missing_tokenizer(export, tmp_path):
    out = tmp_path / "o"
    refused(
        run(export(tokenizer=False), "--max-len", 64, "--output", out),
        out,
        "no tokenizer.model found",
    )


def test_refuses_to_overwrite_unless_asked(export, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = run(export(), "--max-len", 64, "--output", out)
    assert result.exit_code != 0 and "already exists" in result.output
    assert (out / "keep.txt").read_text() == "mine"
    assert run(export(), "--max-len", 64, "--output", out, "--overwrite").exit_code == 0
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()


def test_without_the_train_extra_it_says_what_to_install():
    """A core install (the pipeline only) has no torch: a one-line message, not a traceback."""
    code = "import sys; sys.modules['torch'] = None; import shatter.extend_cli"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 1 and "pip install 'shatter-toolkit[train]'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_checkpoint_without_a_stored_config_takes_the_runs_export_config(
    tmp_path, tokenizer_file
):
    """The last fallback of shatter.sources: RUN/export/config.json beside RUN/checkpoints/.
    (The model-states file is written the way DeepSpeed's ZeRO-0 stores `module`; the real
    DeepSpeed checkpoints are in test_deepspeed.py.)"""
    model = tiny("shatter")
    tag = tmp_path / "run" / "checkpoints" / "step1"
    tag.mkdir(parents=True)
    torch.save({"module": model.state_dict()}, tag / "mp_rank_00_model_states.pt")
    (tag.parent / "latest").write_text("step1")
    (tmp_path / "run" / "export").mkdir()
    (tmp_path / "run" / "export" / "config.json").write_text(json.dumps(model.config.to_dict()))
    out = tmp_path / "o"
    result = run(tag.parent, "--max-len", 64, "--output", out, "--tokenizer", tokenizer_file)
    assert result.exit_code == 0, result.output
    extended = shatter.from_pretrained(out)
    ids, mask = inputs(OLD)
    with torch.no_grad():
        torch.testing.assert_close(
            extended.encoder(ids, mask), model.encoder(ids, mask), rtol=0, atol=1e-5
        )
    (tmp_path / "run" / "export" / "config.json").write_text('{"arch": "shatter", "colour": 1}')
    out = tmp_path / "o2"
    refused(
        run(tag.parent, "--max-len", 64, "--output", out, "--tokenizer", tokenizer_file),
        out,
        "export/config.json: unknown ModelConfig keys: colour",
    )


def test_a_trainer_checkpoint_is_extended_from_the_length_the_run_trained_at(
    tmp_path, tokenizer_file
):
    """A trainer checkpoint that stores only the run config (preset + overrides, no model
    config): the length is the run's RUN/config.json seq_len, not the preset's 512."""
    model = tiny("shatter")
    overrides = {k: getattr(model.config, k) for k in ("hidden", "ffn", "dropout")}
    run_dir = tmp_path / "run"
    tag = run_dir / "checkpoints" / "step00000002"
    tag.mkdir(parents=True)
    client = {"module": model.state_dict()}
    client["config"] = {"model": {"preset": "shatter-tiny", "overrides": overrides}, "data": {}}
    torch.save(client, tag / "mp_rank_00_model_states.pt")
    (tag.parent / "latest").write_text(tag.name)
    (run_dir / "config.json").write_text(json.dumps({"seq_len": OLD}))
    out = tmp_path / "o"
    result = run(tag.parent, "--max-len", 2 * OLD, "--output", out, "--tokenizer", tokenizer_file)
    assert result.exit_code == 0, result.output
    assert f"shatter: max_len {OLD} -> {2 * OLD}" in result.output
    assert json.loads((out / "config.json").read_text())["max_len"] == 2 * OLD
    # the same length: a conversion of the checkpoint to an export, weights unchanged
    same = run(
        tag.parent, "--max-len", OLD, "--output", tmp_path / "o1", "--tokenizer", tokenizer_file
    )
    assert same.exit_code == 0 and f"max_len {OLD} unchanged: converted" in same.output, same.output
    converted = shatter.from_pretrained(tmp_path / "o1").state_dict()
    assert converted.keys() == model.state_dict().keys()
    assert all(torch.equal(converted[k], v) for k, v in model.state_dict().items())
    refused(
        run(
            tag.parent,
            "--max-len",
            OLD - 1,
            "--output",
            tmp_path / "o2",
            "--tokenizer",
            tokenizer_file,
        ),
        tmp_path / "o2",
        f"not larger than the model's max_len {OLD}",
    )


def test_corrupted_weights_are_refused_naming_the_checksum_file(export, tmp_path, flip_weights):
    path = export()
    weights = flip_weights(path)
    out = tmp_path / "o"
    refused(run(path, "--max-len", 64, "--output", out), out, f"{weights} is corrupted")
    assert str(path / "checksums.json") in run(path, "--max-len", 64, "--output", out).output


def test_a_failed_overwrite_leaves_the_old_export_byte_identical(export, tmp_path, monkeypatch):
    out = tmp_path / "o"
    assert run(export(), "--max-len", 64, "--output", out).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    source = export("shatter")

    def disk_full(*args, **kwargs):  # the failure injected: the write of the new weights
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("safetensors.torch.save_model", disk_full)
    result = run(source, "--max-len", 64, "--output", out, "--overwrite")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.strip().splitlines() == [
        f"Error: cannot write {out}: [Errno 28] No space left on device; {out} is unchanged"
    ]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
