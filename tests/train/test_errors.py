"""Wrong inputs to the trainer, train/evaluate_cli.py and shatter-extend, through their command lines
on real data (`shatter-data build`) and a real two-step run: each ends with one line naming the
cause and the file (exit 1; 2 for a usage error), before any work, and nothing is lost."""

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
from click.testing import CliRunner

from shatter.shards import read_shard

pytestmark = [pytest.mark.shared_data]

REPO = Path(__file__).resolve().parents[2]


def one_line_error(result, *parts, code=1):
    assert result.exit_code == code, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    for part in parts:
        assert str(part) in lines[0], lines[0]
    return lines[0]


def pretrain(*args):
    from shatter.train.pretrain import main

    return CliRunner().invoke(main, [str(a) for a in args])


def evaluate(*args):
    from shatter.train.evaluate_cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


def extend(*args):
    from shatter.extend_cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


def tree_digest(root: Path) -> dict:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def copy_data(books_data: Path, dest: Path) -> Path:
    shutil.copytree(books_data, dest)
    return dest


@pytest.fixture(scope="module")
def noval_data(books_data, tmp_path_factory) -> Path:
    """The books dataset with its validation split emptied the way `--validation-fraction 0`
    writes it: one shard of 0 rows."""
    data = copy_data(books_data, tmp_path_factory.mktemp("noval") / "data")
    index = json.loads((data / "index.json").read_text())
    entry = index["splits"]["validation"]["shards"][0]
    shard = data / entry["file"]
    empty = read_shard(str(shard)).slice(0, 0)
    options = ipc.IpcWriteOptions(compression="zstd")
    with ipc.new_stream(str(shard), empty.schema, options=options) as writer:
        writer.write_table(empty)
    entry.update(rows=0, tokens=0, bytes=shard.stat().st_size)
    entry["sha256"] = hashlib.sha256(shard.read_bytes()).hexdigest()
    index["splits"]["validation"].update(rows=0, tokens=0)
    (data / "index.json").write_text(json.dumps(index))
    assert pa.ipc.open_stream(str(shard)).read_all().num_rows == 0
    return data


@pytest.fixture(scope="module")
def tiny_run(noval_data, tmp_path_factory):
    """A real two-step run (one process) of shatter-tiny at length 64 on data without validation
    rows, with a warm-up longer than the run."""
    run = tmp_path_factory.mktemp("run") / "run"
    cmd = [
        sys.executable, str(REPO / "train" / "pretrain.py"), "--data", str(noval_data),
        "--output", str(run), "--preset", "shatter-tiny", "--max-steps", "2",
        "--warmup-steps", "5", "--micro-batch", "4", "--eval-every", "1", "--save-every", "1",
        "--num-workers", "0", "--no-progress",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return run, done


@pytest.mark.slow
def test_no_validation_data_and_a_too_long_warm_up_are_said_before_step_1(tiny_run):
    run, done = tiny_run
    lines = done.stderr.splitlines()
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step 1"))
    said = [i for i, line in enumerate(lines) if line.startswith("no validation data in")]
    warned = [i for i, line in enumerate(lines) if line.startswith("warning: warm-up (5 steps)")]
    assert said and warned and max(said + warned) < first_step, done.stderr
    assert "--validation-fraction" in lines[said[0]]
    assert "step 1: no validation data (0 masked tokens), validation skipped" in done.stderr
    assert "0.0000" not in done.stderr
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert records and not [r for r in records if r.get("split") == "validation"]
    assert (run / "export" / "checksums.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated", "deleted"])
def test_a_damaged_dataset_is_refused_at_start_up(books_data, tmp_path, damage):
    data = copy_data(books_data, tmp_path / "data")
    shard = sorted(data.glob("train-*.arrow"))[-1]
    if damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:1000])
        why = f"1000 bytes, {data / 'index.json'} records"
    else:
        shard.unlink()
        why = f"train shard listed in {data / 'index.json'} is missing"
    out = tmp_path / "run"
    one_line_error(
        pretrain("--data", data, "--output", out, "--preset", "shatter-tiny"), shard, why
    )
    assert not out.exists()


@pytest.mark.slow
def test_evaluate_refuses_bad_data_and_weights_before_writing(
    books_data, noval_data, tiny_run, tmp_path, flip_weights
):
    export = tiny_run[0] / "export"
    result = tmp_path / "result.json"
    # 0 validation rows: an error, not a loss of 0.0000
    one_line_error(
        evaluate("--checkpoint", export, "--data", noval_data, "--output", result),
        noval_data / "index.json",
        "the validation split has no rows",
        "--validation-fraction",
    )
    # data made with another tokenizer: both files named
    other = copy_data(books_data, tmp_path / "other")
    foreign = other / "tokenizer.model"
    foreign.write_bytes(foreign.read_bytes() + b"\n")
    index = json.loads((other / "index.json").read_text())
    index["tokenizer"]["sha256"] = hashlib.sha256(foreign.read_bytes()).hexdigest()
    (other / "index.json").write_text(json.dumps(index))
    one_line_error(
        evaluate("--checkpoint", export, "--data", other, "--output", result),
        foreign,
        export / "tokenizer.model",
        "differs from",
    )
    # a damaged shard
    damaged = copy_data(books_data, tmp_path / "damaged")
    shard = sorted(damaged.glob("validation-*.arrow"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    one_line_error(evaluate("--checkpoint", export, "--data", damaged), shard, "100 bytes")
    # --output under a regular file: refused before the evaluation runs
    afile = tmp_path / "afile"
    afile.write_text("keep")
    one_line_error(
        evaluate("--checkpoint", export, "--data", books_data, "--output", afile / "r.json"),
        "which is a file, not a directory",
    )
    assert afile.read_text() == "keep"
    # 64 flipped bytes in the weights
    broken = tmp_path / "broken"
    shutil.copytree(export, broken)
    weights = flip_weights(broken)
    one_line_error(
        evaluate("--checkpoint", broken, "--data", books_data), weights, "corrupted", "checksums"
    )
    assert not result.exists()
    # and the good case still works and writes its result
    ok = evaluate(
        "--checkpoint", export, "--data", books_data, "--max-samples", 16, "--output", result
    )
    assert ok.exit_code == 0 and json.loads(result.read_text())["predictions"] > 0, ok.output


@pytest.mark.slow
def test_resuming_with_another_arch_is_refused_and_the_run_is_untouched(noval_data, tiny_run):
    run = tiny_run[0]
    before = tree_digest(run)
    one_line_error(
        pretrain("--data", noval_data, "--output", run, "--preset", "bert-tiny"),
        run / "config.json",
        "holds a shatter-tiny run",
        "arch shatter -> bert",
        "--preset shatter-tiny",
    )
    assert tree_digest(run) == before


@pytest.mark.slow
def test_an_unknown_preset_is_a_usage_error(books_data, tmp_path):
    out = tmp_path / "run"
    one_line_error(
        pretrain("--data", books_data, "--output", out, "--preset", "shatter-huge"),
        "unknown --preset 'shatter-huge'",
        "tiny, small, base, large",
        code=2,
    )
    assert not out.exists()


@pytest.mark.slow
def test_an_output_under_a_regular_file_is_refused_before_any_work(books_data, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("keep")
    one_line_error(
        pretrain("--data", books_data, "--output", afile / "run", "--preset", "shatter-tiny"),
        f"--output {afile / 'run'} is under {afile}, which is a file",
    )
    assert afile.read_text() == "keep"


@pytest.mark.slow
def test_extending_run_checkpoints_takes_the_runs_length(tiny_run, tmp_path):
    checkpoints = tiny_run[0] / "checkpoints"
    out = tmp_path / "ext"
    result = extend(checkpoints, "--max-len", 128, "--output", out)
    assert result.exit_code == 0, result.output
    assert "shatter: max_len 64 -> 128" in result.output
    assert json.loads((out / "config.json").read_text())["max_len"] == 128
    refused = extend(checkpoints, "--max-len", 32, "--output", tmp_path / "ext2")
    assert refused.exit_code == 1 and "not larger than the model's max_len 64" in refused.output
    assert not (tmp_path / "ext2").exists()
