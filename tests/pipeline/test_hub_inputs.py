"""`--input hf://datasets/ORG/NAME/...`: Hub files read through fsspec (huggingface_hub's
`HfFileSystem` in use; here a local folder registered under the `hf` protocol stands in for the
Hub, offline) build byte for byte what the same files give as local paths."""

import json

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem

from shatter.pipeline import readers
from shatter.pipeline.build import build
from shatter.pipeline.cli import main
from shatter.pipeline.config import InputSpec
from shatter.pipeline.wiki import InputError
from tests.pipeline.corpus import generated_documents, quiet, small_config


class LocalHub(DirFileSystem):
    """The `hf://` protocol served from a local folder: `hf://datasets/ORG/NAME/x` is
    ROOT/datasets/ORG/NAME/x."""

    protocol = "hf"
    root = None
    cachable = False

    def __init__(self, **_):
        super().__init__(path=str(LocalHub.root), fs=LocalFileSystem())


@pytest.fixture
def hub(tmp_path):
    """ROOT/datasets/org/corpus/ with a parquet file (text in column "content") and a jsonl file;
    `hf://` answered from ROOT for the test's duration."""
    LocalHub.root = tmp_path / "hub"
    repo = LocalHub.root / "datasets" / "org" / "corpus"
    (repo / "data").mkdir(parents=True)
    docs = generated_documents(200, seed=4)
    table = pa.table({"id": list(range(120)), "content": docs[:120]})
    pq.write_table(table, repo / "data" / "train-00000.parquet", row_group_size=40)
    lines = "".join(json.dumps({"content": d}) + "\n" for d in docs[120:])
    (repo / "data" / "train-00001.jsonl").write_text(lines)
    (repo / ".gitattributes").write_text("*.parquet filter=lfs\n")
    fsspec.register_implementation("hf", LocalHub, clobber=True)
    yield repo
    from huggingface_hub import HfFileSystem

    fsspec.register_implementation("hf", HfFileSystem, clobber=True)


@pytest.mark.slow
def test_a_hub_folder_builds_the_same_bytes_as_its_local_copy(hub, tmp_path):
    url = "hf://datasets/org/corpus"
    assert readers._list_files(url) == [
        (f"{url}/data/train-00000.parquet", (hub / "data" / "train-00000.parquet").stat().st_size),
        (f"{url}/data/train-00001.jsonl", (hub / "data" / "train-00001.jsonl").stat().st_size),
    ]  # a folder's files, dot files left out
    outs = {}
    for name, path in (("hub", url + "/data"), ("local", str(hub / "data"))):
        config = small_config(
            [InputSpec("text", path)], tmp_path / name, text_field="content", split_bytes=2000
        )
        outs[name] = build(config, [], report=quiet)
    assert outs["hub"]["splits"] == outs["local"]["splits"]
    assert outs["hub"]["counters"] == outs["local"]["counters"]
    assert outs["hub"]["counters"]["documents_read"] == 200
    files = ["tokenizer.model"] + [
        s["file"] for split in outs["hub"]["splits"].values() for s in split["shards"]
    ]
    for name in files:
        assert (tmp_path / "hub" / name).read_bytes() == (tmp_path / "local" / name).read_bytes()


def test_a_hub_glob_through_the_command_line(hub, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(
        main,
        ["build", "--input", "hf://datasets/org/corpus/data/*.parquet", "--output", str(out),
         "--text-column", "content", "--vocab-size", "200", "--seq-len", "32",
         "--dupe-factor", "1", "--validation-fraction", "0.1"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    index = json.loads((out / "index.json").read_text())
    assert index["counters"]["documents_read"] == 120  # the parquet file alone


def test_hub_inputs_that_cannot_be_read_are_one_line(hub, tmp_path):
    with pytest.raises(InputError, match="no files match"):
        readers.expand_inputs((InputSpec("text", "hf://datasets/org/none"),), 1 << 20, "line")
    with pytest.raises(InputError, match="parquet or jsonl"):
        readers.expand_inputs((InputSpec("wiki", "hf://datasets/org/corpus"),), 1 << 20, "line")
    result = CliRunner().invoke(
        main,
        ["build", "--input", "hf://datasets/org/corpus/data/train-00000.parquet",
         "--output", str(tmp_path / "o"), "--text-column", "body", "--on-error", "stop"],
    )  # fmt: skip
    assert result.exit_code == 1
    assert result.output.count("\n") == 1 and "no column 'body'" in result.output


def test_the_real_hub_offline_is_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(InputError, match=r"^input hf://datasets/org/x/\*\.parquet: cannot list it"):
        readers.expand_inputs(
            (InputSpec("text", "hf://datasets/org/x/*.parquet"),), 1 << 20, "line"
        )
