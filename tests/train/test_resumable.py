"""The resume's choice among a run's checkpoints, in process on hand-made checkpoint folders (the
2-rank launches with real DeepSpeed files are in test_faults.py): only the newest may be skipped,
damage elsewhere is refused, nothing is deleted, and pruning keeps what a fault left protected."""

import hashlib
import json
from pathlib import Path

import pytest

from shatter.train import checkpoint
from shatter.train.config import ConfigError, resolve
from shatter.train.guard import LossSpike
from shatter.train.resumable import check_same_setup, choose, set_aside

FILES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt")


def fake_checkpoint(run: Path, step: int, manifest: bool = True) -> Path:
    step_dir = run / "checkpoints" / checkpoint.tag(step)
    step_dir.mkdir(parents=True)
    files = {}
    for name in FILES:
        data = f"{name} of step {step}".encode() * 50
        (step_dir / name).write_bytes(data)
        files[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    if manifest:
        text = {"tag": step_dir.name, "world_size": 1, "zero_stage": 1, "files": files}
        (step_dir / checkpoint.MANIFEST).write_text(json.dumps(text))
    return step_dir


def flip(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[7] ^= 1
    path.write_bytes(bytes(raw))


def test_an_interrupted_newest_save_is_skipped_and_kept(tmp_path):
    fake_checkpoint(tmp_path, 2)
    newest = fake_checkpoint(tmp_path, 4, manifest=False)
    said = []
    assert choose(tmp_path, said.append).tag == "step00000002"
    assert "is incomplete (no manifest" in said[0] and newest.is_dir()
    assert not (tmp_path / "checkpoints" / "step00000002" / checkpoint.PROTECTED).exists()


def test_a_bit_flip_in_the_newest_falls_back_and_protects_the_one_before(tmp_path):
    fake_checkpoint(tmp_path, 2)
    newest = fake_checkpoint(tmp_path, 4)
    flip(newest / FILES[1])
    said = []
    assert choose(tmp_path, said.append).tag == "step00000002"
    assert "does not match its sha256" in said[0] and str(newest / FILES[1]) in said[0]
    assert (tmp_path / "checkpoints" / "damaged-step00000004" / FILES[1]).is_file()
    assert "falling back to the newest intact checkpoint step00000002" in said[1]
    for step in (6, 8, 10):
        fake_checkpoint(tmp_path, step)
    checkpoint.prune(tmp_path / "checkpoints", keep=2)
    left = [p.name for p in checkpoint.step_dirs(tmp_path / "checkpoints")]
    assert left == ["step00000002", "step00000008", "step00000010"]


def test_damage_below_the_newest_is_refused_in_one_line_naming_the_file(tmp_path):
    """A run directory copied while the copy still ran: a file of each checkpoint short."""
    older = fake_checkpoint(tmp_path, 2)
    newest = fake_checkpoint(tmp_path, 4)
    for step_dir in (older, newest):
        short = step_dir / FILES[1]
        short.write_bytes(short.read_bytes()[:10])
    with pytest.raises(ConfigError) as err:
        choose(tmp_path, lambda line: None)
    line = str(err.value)
    assert str(older / FILES[1]) in line and "--restart" in line and "\n" not in line
    assert older.is_dir() and newest.is_dir()  # nothing moved, nothing removed
    assert not list((tmp_path / "checkpoints").glob("damaged-*"))


def test_no_usable_checkpoint_is_refused_and_restart_moves_the_run_aside(tmp_path):
    fake_checkpoint(tmp_path, 2, manifest=False)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match="no usable checkpoint.*--restart"):
        choose(tmp_path, lambda line: None)
    aside = set_aside(tmp_path, lambda line: None)
    assert (aside / "checkpoints" / "step00000002").is_dir()
    assert (aside / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert choose(tmp_path, lambda line: None).tag is None  # now a fresh start


def test_a_loss_spike_is_judged_against_the_median_of_healthy_lines():
    spike = LossSpike(factor=3.0, lines=3)
    for step, loss in enumerate([9.0, 7.0, 6.0, 5.5, 5.0, 4.8], start=1):
        assert spike.check(step, loss) is None  # falling: healthy
    assert spike.check(7, 20.0) == "spike" and spike.healthy_step == 6
    assert spike.check(8, 4.7) == "over"  # back under 3 × the median: a blip
    assert [spike.check(s, 50.0) for s in (9, 10, 11)] == ["spike", None, "diverged"]
    line = str(spike.error(11, 50.0, "step00000008"))
    assert "above 3 × its running median 5.5" in line and "healthy until step 8" in line
    assert spike.check(12, float("nan")) is None  # NaN/inf: the non-finite guard's
    assert LossSpike(factor=0, lines=1).check(1, 1e9) is None  # 0: no check


def test_a_resume_with_another_zero_stage_precision_length_or_seed_is_refused(tmp_path):
    fake_checkpoint(tmp_path, 2)  # its manifest: ZeRO-1
    run = {"precision": "fp32", "seed": 0}
    (tmp_path / "config.json").write_text(json.dumps({"config": {"run": run}, "seq_len": 64}))
    cfg = resolve(None, {"precision": "fp32", "seed": 0})
    found = choose(tmp_path, lambda line: None)
    check_same_setup(tmp_path, found, cfg, {"zero_optimization": {"stage": 1}}, 64)  # the same
    other = resolve(None, {"precision": "bf16", "seed": 3})
    with pytest.raises(ConfigError) as err:
        check_same_setup(tmp_path, found, other, {"zero_optimization": {"stage": 0}}, 32)
    line = str(err.value)
    assert (
        "--zero-stage 1 -> 0; --precision fp32 -> bf16; --seq-len 64 -> 32; --seed 0 -> 3" in line
    )
