"""End to end: `build` on a generated corpus and on the real samples; the layout of DESIGN.md."""

import json

import datasets
import numpy as np
import pyarrow as pa
import pytest
import sentencepiece as spm
from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from click.testing import CliRunner

from shatter import shards
from shatter.pipeline.build import build
from shatter.pipeline.cli import main
from shatter.pipeline.config import InputSpec
from shatter.pipeline.inspect import verify_dataset
from shatter.pipeline.sharding import ShardSize

from .corpus import generated_documents, quiet, small_config


def shard_paths(out: str, split: str) -> list[str]:
    index = shards.read_index(out, verify_tokenizer=False)
    return [index.shard_path(s) for s in index.splits.get(split, ())]


def _files(out):
    return {
        p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.suffix in (".arrow", ".model")
    }


def test_layout_and_index(built):
    out, index = built
    assert (out / "index.json").exists() and (out / "tokenizer.model").exists()
    on_disk = json.loads((out / "index.json").read_text())
    assert on_disk == index and index["format"] == "shatter-shards" and index["version"] == 1
    assert [s["file"] for s in index["splits"]["train"]["shards"]] == [
        f"train-{i:05d}-of-00003.arrow" for i in range(3)
    ]
    # the count follows from the size target (conftest.small_config): the split's rows and tokens
    size = ShardSize(int(0.035 * 2**20), 2, 2, 0.15)
    for split, n in (("train", 3), ("validation", 1)):
        entry = index["splits"][split]
        assert size.count(entry["rows"], entry["tokens"]) == n == len(entry["shards"])
    assert index["config"]["shard_size_mb"] == 0.035 and index["record_batch_rows"] == 1024
    assert index["splits"]["validation"]["rows"] > 0 and index["splits"]["train"]["rows"] > 0
    assert index["tokenizer"]["special_ids"] == {
        "[PAD]": 0,
        "[UNK]": 1,
        "[CLS]": 2,
        "[SEP]": 3,
        "[MASK]": 4,
    }
    assert index["counters"]["documents_read"] == 300
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp or work files left
    rows = [s["rows"] for s in index["splits"]["train"]["shards"]]
    assert max(rows) - min(rows) <= 2  # balanced key ranges, not hash-modulo luck
    assert verify_dataset(str(out)) == []


def test_shards_read_by_datasets_with_static_masks(built):
    out, index = built
    path = out / index["splits"]["train"]["shards"][0]["file"]
    with open(path, "rb") as f:
        assert (
            pa.ipc.open_stream(f).read_all().num_rows
            == index["splits"]["train"]["shards"][0]["rows"]
        )
    ds = datasets.Dataset.from_file(str(path))
    row = ds[0]
    assert len(row["input_ids"]) <= 64 and row["input_ids"][0] == 2 and row["input_ids"][-1] == 3
    assert len(row["mask_positions"]) == 2 and len(row["word_start"]) == len(row["input_ids"])
    for pos, lab in zip(row["mask_positions"][0], row["mask_labels"][0]):
        assert row["input_ids"][pos] == lab
    keys = np.array(ds["key"], dtype=np.uint64)
    assert (keys[1:] >= keys[:-1]).all()  # sorted by content key within the shard
    lengths = np.array([len(r) for r in ds["input_ids"]])
    assert (lengths == 64).mean() > 0.9
    loaded = datasets.load_dataset(
        "arrow",
        data_files=[str(out / s["file"]) for s in index["splits"]["train"]["shards"]],
        split="train",
    )
    assert len(loaded) == index["splits"]["train"]["rows"]


def test_tokenizer_is_lower_cased_with_special_ids(built):
    out, _ = built
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    assert [sp.id_to_piece(i) for i in range(5)] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert sp.encode("KALO Mine") == sp.encode("kalo mine")


@pytest.mark.slow
def test_rebuild_is_byte_identical(built, corpus_dir, tmp_path):
    out, _ = built
    again = tmp_path / "again"
    build(small_config([InputSpec("text", str(corpus_dir))], again), [], report=quiet)
    assert _files(out) == _files(again)


def test_given_tokenizer_gives_the_same_shards(built, corpus_dir, tmp_path):
    """The trained path reads cleaned text from its cache; with --tokenizer it cleans in the build."""
    out, _ = built
    again = tmp_path / "given"
    build(
        small_config(
            [InputSpec("text", str(corpus_dir))], again, tokenizer=str(out / "tokenizer.model")
        ),
        [],
        report=quiet,
    )
    assert _files(out) == _files(again)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["in_memory", "multi_threading", "multi_processing"])
def test_two_workers_write_the_same_bytes(built, corpus_dir, tmp_path, mode):
    out, _ = built
    two = tmp_path / mode
    config = small_config([InputSpec("text", str(corpus_dir))], two)
    index = build(
        config, ["--direct_num_workers", "2", "--direct_running_mode", mode], report=quiet
    )
    assert index["counters"]["spill_files"] > 2
    assert _files(out) == _files(two)


@pytest.mark.slow
def test_bad_input_stops_with_the_file_name_or_is_counted(built, tmp_path):
    out, _ = built
    good = b"Words of a first paragraph.\n\nAnd a second one here.\n"
    dump = tmp_path / "dump.xml.bz2"
    import bz2

    page = "<page><title>T</title><ns>0</ns><id>1</id><revision><text>%s</text></revision></page>\n"
    pages = "".join(page % d for d in generated_documents(200, seed=9))
    data = bz2.compress(("<mediawiki>" + pages + "</mediawiki>").encode())
    dump.write_bytes(data[: len(data) // 2])
    (tmp_path / "ok.txt").write_bytes(good + b"caf\xe9\n")
    args = [
        "build",
        "--input",
        f"wiki={dump}",
        "--input",
        f"text={tmp_path / 'ok.txt'}",
        "--seq-len",
        "32",
        "--tokenizer",
        str(out / "tokenizer.model"),
        "--num-shards",
        "1",
    ]
    stop = CliRunner().invoke(
        main, args + ["--output", str(tmp_path / "stop"), "--on-error", "stop"]
    )
    assert stop.exit_code == 1 and "dump.xml.bz2" in stop.output and "truncated" in stop.output
    assert "Traceback" not in stop.output and not (tmp_path / "stop" / "index.json").exists()
    skip = CliRunner().invoke(main, args + ["--output", str(tmp_path / "skip")])
    assert skip.exit_code == 0, skip.output
    counters = shards.read_index(str(tmp_path / "skip")).raw["counters"]
    assert counters["skipped_rest_of_file"] == 1 and counters["invalid_utf8_replaced"] == 1


def test_index_missing_is_a_clear_error(tmp_path):
    with pytest.raises(shards.DatasetError, match="index.json"):
        shards.read_index(str(tmp_path))
    result = CliRunner().invoke(main, ["verify", str(tmp_path)])
    assert result.exit_code == 1 and "index.json" in result.output


def test_verify_names_a_corrupt_shard(built, tmp_path):
    out, index = built
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    victim = copy / index["splits"]["train"]["shards"][1]["file"]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    result = CliRunner().invoke(main, ["verify", str(copy)])
    assert result.exit_code == 1 and victim.name in result.output


def test_inspect_shows_stats_and_masked_rows(built):
    out, _ = built
    result = CliRunner().invoke(main, ["inspect", str(out), "--rows", "2"])
    assert result.exit_code == 0, result.output
    assert (
        "train:" in result.output and "row lengths" in result.output and "[MASK]" in result.output
    )


@pytest.mark.slow
@pytest.mark.shared_data
def test_mixed_books_and_wiki_tables(shared_data, tmp_path):
    """Mixing corpora in one build, on the hard table-markup dump and two real books."""
    out = tmp_path / "mixed"
    books = shared_data / "books"
    config = small_config(
        [
            InputSpec("wiki", str(shared_data / "wiki" / "enwiki-table-markup.xml.bz2")),
            InputSpec("books", str(books / "macbeth_gut.txt")),
            InputSpec("books", str(books / "britannica-11th.txt")),
        ],
        out,
        vocab_size=500,
        whole_word=True,
        cross_document=False,
    )
    index = build(config, [], report=quiet)
    counters = index["counters"]
    assert counters["documents_read"] == 2 + 5 and counters.get("tokens_dropped", 0) == 0
    assert verify_dataset(str(out)) == []
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    texts = [
        sp.decode(r)
        for s in ("train", "validation")
        for p in shard_paths(str(out), s)
        for r in shards.read_shard(p)["input_ids"].to_pylist()
    ]
    joined = " ".join(texts)
    assert (
        "macbeth" in joined
        and "wikitable" not in joined
        and "{|" not in joined
        and "colspan" not in joined
    )
    assert all(
        t.count("[SEP]") == 0 for t in texts
    )  # no-cross-document: decode drops the closing [SEP]


@pytest.mark.slow
@pytest.mark.shared_data
def test_wiki_sample_end_to_end_via_cli(shared_data, tmp_path):
    out = tmp_path / "wiki"
    dump = shared_data / "wiki" / "enwiki-sample-pages-articles.xml.bz2"
    result = CliRunner().invoke(
        main,
        [
            "build",
            "--corpus",
            "wiki",
            "--input",
            str(dump),
            "--output",
            str(out),
            "--vocab-size",
            "1000",
            "--seq-len",
            "128",
            "--num-shards",
            "2",
            "--tokenizer-sample",
            "3000",
        ],
    )
    assert result.exit_code == 0, result.output
    index = shards.read_index(str(out)).raw
    counters = index["counters"]
    assert counters["skipped_redirect"] > 50 and counters["documents_read"] > 80
    assert counters.get("tokens_dropped", 0) == 0
    assert verify_dataset(str(out)) == []
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    table = shards.read_shard(str(out / index["splits"]["train"]["shards"][0]["file"]))
    text = sp.decode(table["input_ids"][0].as_py())
    assert "{{" not in text and "[[" not in text and "<ref" not in text


def test_unknown_options_reach_the_pipeline_and_its_runner():
    from apache_beam.options.pipeline_options import DirectOptions, GoogleCloudOptions

    from shatter.pipeline.runners import make_pipeline

    p = make_pipeline(
        ["--direct_num_workers", "2", "--project", "proj", "--temp_location", "gs://b/t"]
    )
    assert isinstance(p.runner, FnApiRunner)  # never Prism by default (ours: its worker module)
    assert p.options.view_as(DirectOptions).direct_num_workers == 2
    assert p.options.view_as(GoogleCloudOptions).project == "proj"
    # and the runner hands them to its workers (multi_processing harnesses read the provision info)
    assert "proj" in str(p.runner._provision_info.provision_info.pipeline_options)


def test_cli_passes_beam_options_through(built, corpus_dir, tmp_path):
    out, _ = built
    result = CliRunner().invoke(
        main,
        [
            "build",
            "--corpus",
            "text",
            "--input",
            str(corpus_dir / "a.txt"),
            "--output",
            str(tmp_path / "o"),
            "--tokenizer",
            str(out / "tokenizer.model"),
            "--seq-len",
            "64",
            "--num-shards",
            "2",
            "--direct_num_workers",
            "2",
            "--direct_running_mode",
            "multi_threading",
        ],
    )
    assert result.exit_code == 0, result.output
    assert shards.read_index(str(tmp_path / "o")).raw["splits"]["train"]["rows"] > 0
    bad = CliRunner().invoke(
        main, ["build", "--input", "x", "--output", str(tmp_path / "p"), "--seq-len", "2"]
    )
    assert bad.exit_code == 1 and "seq-len" in bad.output and "Traceback" not in bad.output


def test_a_shard_too_large_for_arrow_offsets_stops_with_advice(
    built, corpus_dir, tmp_path, monkeypatch
):
    from shatter.pipeline import sink

    out, _ = built
    monkeypatch.setattr(sink, "MAX_SHARD_IDS", 1000)  # the real limit, 2**31 - 1 ids, scaled down
    result = CliRunner().invoke(
        main,
        [
            "build",
            "--corpus",
            "text",
            "--input",
            str(corpus_dir / "a.txt"),
            "--output",
            str(tmp_path / "o"),
            "--tokenizer",
            str(out / "tokenizer.model"),
            "--seq-len",
            "64",
            "--num-shards",
            "2",
        ],
    )
    assert result.exit_code == 1 and "more than an Arrow list column can index" in result.output
    assert "--num-shards" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "o" / "index.json").exists()  # never a dataset that looks complete


def test_a_runner_failure_is_one_line_and_v_shows_the_traceback(tmp_path, monkeypatch):
    import shatter.pipeline.build

    def fail(
        *args, **kwargs
    ):  # e.g. FlinkRunner offline: "Unable to fetch remote job server jar ..."
        raise RuntimeError("job server failed\nUnable to fetch remote job server jar")

    monkeypatch.setattr(shatter.pipeline.build, "build", fail)
    args = ["build", "--input", "x", "--output", str(tmp_path / "o")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert (
        "RuntimeError: Unable to fetch remote job server jar" in result.output
        and "-v" in result.output
    )
    verbose = CliRunner().invoke(main, args + ["-v"])
    assert isinstance(verbose.exception, RuntimeError)


def test_our_options_in_beams_spelling_stop_the_build(tmp_path):
    """Beam would discard `--seq_len` (not one of its options) and the build would use the default."""
    result = CliRunner().invoke(
        main, ["build", "--input", "x", "--output", str(tmp_path / "o"), "--seq_len", "512"]
    )
    assert result.exit_code == 1 and "did you mean --seq-len?" in result.output
    assert not (tmp_path / "o").exists()


def test_separate_validation_input(built, corpus_dir, tmp_path):
    out, _ = built
    config = small_config(
        [InputSpec("text", str(corpus_dir / "a.txt"))],
        tmp_path / "v",
        validation_inputs=(InputSpec("text", str(corpus_dir / "c.jsonl")),),
        tokenizer=str(out / "tokenizer.model"),
    )
    index = build(config, [], report=quiet)
    val_rows = [
        r
        for p in shard_paths(str(tmp_path / "v"), "validation")
        for r in shards.read_shard(p)["input_ids"].to_pylist()
    ]
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    val_text = " ".join(sp.decode(r) for r in val_rows)
    c_docs = [
        json.loads(line)["text"] for line in (corpus_dir / "c.jsonl").read_text().splitlines()
    ]
    assert index["counters"]["documents_tokenized"] == 120 + len(c_docs)
    assert (
        sp.decode(sp.encode(c_docs[0].split("\n")[0]))[:40] in val_text
    )  # validation = that corpus
    assert index["splits"]["validation"]["rows"] > 0 and index["splits"]["train"]["rows"] > 0


@pytest.mark.parametrize(
    "option, value",
    [
        ("--mask-rate", "1.5"),
        ("--mask-rate", "0"),
        ("--seed", "-1"),
        ("--seed", str(2**64)),
        ("--seq-len", "70000"),
    ],
)
def test_out_of_range_options_fail_before_any_work(tmp_path, option, value):
    """Checked with the config, not after tokenizing everything (masking needs rate in (0, 1], a
    uint64 seed and uint16 positions), and never as a traceback."""
    result = CliRunner().invoke(
        main, ["build", "--input", "x", "--output", str(tmp_path / "o"), option, value]
    )
    assert result.exit_code == 1 and option.lstrip("-") in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "o").exists()


def test_commands_print_no_import_noise(built):
    """Importing Beam logs "apitools not found ..." at the root logger: the CLI filters it out."""
    import subprocess
    import sys

    out, _ = built
    proc = subprocess.run(
        [sys.executable, "-m", "shatter.pipeline.cli", "verify", str(out)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0 and proc.stdout.startswith("OK ")
    assert "apitools" not in proc.stderr and "WARNING" not in proc.stderr


@pytest.mark.slow
def test_the_program_keeps_exit_statuses_and_output_when_it_skips_teardown(built, tmp_path):
    """`shatter-data` ends without the interpreter's teardown (`shatter.pipeline.process`): the exit
    status is still the command's, every line it wrote arrives, and the exit handlers run."""
    import subprocess
    import sys

    out, _ = built

    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "shatter.pipeline.cli", *args], capture_output=True, text=True
        )

    shown = run("inspect", str(out), "--rows", "40")
    assert shown.returncode == 0
    assert shown.stdout == CliRunner().invoke(main, ["inspect", str(out), "--rows", "40"]).output
    missing = run("verify", str(tmp_path / "nothing"))
    assert missing.returncode == 1 and missing.stderr.startswith("shatter-data: error:")
    assert run("build").returncode == 2  # click's usage error
    # an exit handler registered during the command runs before the process ends
    marker = tmp_path / "handler-ran"
    code = (
        "import atexit, pathlib, sys; from shatter.pipeline import cli; "
        f"atexit.register(pathlib.Path({str(marker)!r}).touch); "
        f"sys.argv = ['shatter-data', 'verify', {str(out)!r}]; cli.entry()"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("OK ") and marker.exists()


@pytest.mark.slow
def test_a_build_process_runs_without_pandas_as_the_core_install_does(corpus_dir, tmp_path):
    """Beam imports pandas, where installed, for converters the build never uses (0.5 s of every
    build): `shatter-data build` runs as where pandas is not installed, on the runners that are
    tested so (`shatter.pipeline.process.hide_pandas`); any other runner keeps it."""
    import subprocess
    import sys

    from shatter.pipeline.process import RUNNERS_WITHOUT_PANDAS, runner_named

    seen = tmp_path / "pandas-modules"
    out = tmp_path / "out"
    argv = ["shatter-data", "build", "--input", str(corpus_dir / "a.txt"), "--output", str(out)]
    argv += ["--seq-len", "32", "--vocab-size", "200", "--num-shards", "1"]
    code = (
        "import atexit, pathlib, sys; from shatter.pipeline import cli; atexit.register(lambda: "
        f"pathlib.Path({str(seen)!r}).write_text(' '.join(m for m in sys.modules if "
        f"m.split('.')[0] == 'pandas'))); sys.argv = {argv!r}; cli.entry()"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert seen.read_text() == "" and (out / "index.json").exists()
    assert runner_named(["--seq-len", "8", "--runner", "DaskRunner"]) == "DaskRunner"
    assert runner_named(["--runner=DataflowRunner", "--project", "p"]) == "DataflowRunner"
    assert runner_named(["--", "--runner", "x"]) is None  # after `--`: the runner's own flags
    assert None in RUNNERS_WITHOUT_PANDAS and "DaskRunner" in RUNNERS_WITHOUT_PANDAS
    assert "DataflowRunner" not in RUNNERS_WITHOUT_PANDAS


@pytest.mark.slow
def test_a_shard_the_runner_did_not_report_fails_the_build(corpus_dir, tmp_path, monkeypatch):
    """Each writer leaves its shard's entry in the work directory (`sink.read_manifest`); one
    missing (a runner that dropped a write) fails the build before any index.json is written."""
    import shatter.pipeline.build as build_module
    from shatter.pipeline.build import BuildError
    from shatter.pipeline.sink import read_manifest

    def lose_one(work_dir):
        return [e for e in read_manifest(work_dir) if (e["split"], e["shard"]) != ("train", 1)]

    monkeypatch.setattr(build_module, "read_manifest", lose_one)
    out = tmp_path / "out"
    with pytest.raises(BuildError, match=r"wrote 3 of 4 shards .*missing: train 1"):
        config = small_config([InputSpec("text", str(corpus_dir / "a.txt"))], out, num_shards=3)
        build(config, [], report=quiet)
    assert not (out / "index.json").exists()
