"""A remote export (`s3://`, a real S3 server on loopback: `tests.s3server`) read by
`shatter-extend` (also to a remote --output), `train/finetune.py` and `train/evaluate_cli.py`: copied once into the node's cache, its weights checked
by sha256; a missing object, or an object replaced by other bytes, is one line naming it."""

import json

import pytest
from click.testing import CliRunner

import shatter
from shatter.extend_cli import main as extend
from shatter.shards.store import configure, current
from tests.s3server import BUCKET

from .data import sentiment_rows
from .test_errors import one_line_error
from .test_finetune import run, write_csv


@pytest.mark.slow
def test_extend_and_finetune_read_an_export_from_s3(s3_server, tmp_path, export):  # noqa: F811
    configure(
        current().replace(cache_dir=str(tmp_path / "shatter-cache"), cache_limit_gb=1.0)
    )  # the node's cache
    local = export("shatter", max_len=32)
    remote = s3_server.upload(local, "exports/tiny")

    out = tmp_path / "extended"
    done = CliRunner().invoke(extend, [remote, "--max-len", "64", "--output", str(out)])
    assert done.exit_code == 0, done.output
    assert json.loads((out / "config.json").read_text())["max_len"] == 64
    assert (out / "tokenizer.model").read_bytes() == (local / "tokenizer.model").read_bytes()
    cached = list((tmp_path / "shatter-cache" / "exports").iterdir())
    assert len(cached) == 1 and not cached[0].name.startswith(".tmp-")
    weights = (cached[0] / "model.safetensors").read_bytes()
    assert weights == (local / "model.safetensors").read_bytes()

    # a remote --output: uploaded once complete, checked first (an occupied one is refused)
    remote64 = f"s3://{BUCKET}/exports/tiny-64"
    for code in (0, 1):
        done = CliRunner().invoke(extend, [remote, "--max-len", "64", "--output", remote64])
        assert done.exit_code == code, done.output
    assert done.output.strip().splitlines()[-1] == (
        f"Error: {remote64} already holds an export (pass --overwrite to replace it)"
    )
    cached = list((tmp_path / "shatter-cache" / "exports").iterdir())

    rows = write_csv(tmp_path / "reviews.csv", sentiment_rows(8))
    ft = tmp_path / "ft"
    done = run(
        "--task", "classify", "--text-columns", "review", "--label-column", "sentiment",
        "--checkpoint", remote64, "--train-file", rows, "--validation-file", rows,
        "--output", ft, "--max-steps", 1, "--batch-size", 4,
    )  # fmt: skip
    assert done.exit_code == 0, done.output
    assert json.loads((ft / "metrics.json").read_text())["evaluations"]
    assert shatter.from_pretrained(ft / "best").config.max_len == 64
    exports = sorted((tmp_path / "shatter-cache" / "exports").iterdir())
    assert len(exports) == 2 and cached[0] in exports  # tiny (once), then tiny-64

    # one line naming the object: a missing export, a missing file of one, replaced weights
    missing = CliRunner().invoke(extend, [f"s3://{BUCKET}/exports/none", "--max-len", "64",
                                          "--output", str(tmp_path / "x")])  # fmt: skip
    one_line_error(missing, f"s3://{BUCKET}/exports/none: no such object or prefix")
    s3_server.client().delete_object(Bucket=BUCKET, Key="exports/tiny/checksums.json")
    done = CliRunner().invoke(extend, [remote, "--max-len", "64", "--output", str(tmp_path / "y")])
    one_line_error(done, f"{remote}/checksums.json: no such object")
    s3_server.upload(local, "exports/tiny")
    s3_server.client().put_object(
        Bucket=BUCKET, Key="exports/tiny/model.safetensors", Body=b"other bytes"
    )
    configure(
        current().replace(cache_dir=str(tmp_path / "other-node"), cache_limit_gb=1.0)
    )  # a node that has not fetched them
    done = CliRunner().invoke(extend, [remote, "--max-len", "64", "--output", str(tmp_path / "z")])
    one_line_error(done, f"{remote}/model.safetensors is not the file that checksums.json lists")
    assert not any((tmp_path / n).exists() for n in "xyz")


def test_evaluate_reads_an_export_from_s3(s3_server, tmp_path):
    """train/evaluate_cli.py --checkpoint s3://...: the scores of the same export on local disk."""
    from shatter.train.evaluate_cli import main as evaluate
    from tests.train.shardutil import write_dataset

    data = write_dataset(tmp_path / "data", vocab=100, seq_len=32)
    model = shatter.build_model("shatter-tiny", vocab_size=100, max_len=32, hidden=32, ffn=64)
    local = shatter.save_pretrained(model, tmp_path / "export", tokenizer=data / "tokenizer.model")
    remote = s3_server.upload(local, "exports/scored")
    configure(current().replace(cache_dir=str(tmp_path / "shatter-cache"), cache_limit_gb=1.0))
    scores = []
    for checkpoint in (remote, local):
        out = tmp_path / f"{len(scores)}.json"
        args = ["--checkpoint", str(checkpoint), "--data", str(data), "--output", str(out)]
        done = CliRunner().invoke(evaluate, args)
        assert done.exit_code == 0, done.output
        scores.append(json.loads(out.read_text()))
    assert scores[0]["checkpoint"] == remote
    assert scores[0]["loss"] == scores[1]["loss"] and scores[0]["predictions"] > 0
