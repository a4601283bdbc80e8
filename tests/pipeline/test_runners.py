"""Runners and their options through the real CLI: Dask on a LocalCluster of worker processes,
Beam options checked (a typo is an error), runner-only flags after `--`."""

import json
import socket
import subprocess
import sys
import time

import apache_beam as beam
import pytest
from click.testing import CliRunner

from shatter import shards
from shatter.pipeline.cli import main
from shatter.pipeline.runners import OptionError, check_options, make_pipeline

from .test_build import _files


def _error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("shatter-data: error:")]


def _args(built_out, corpus, out, *extra):
    return [
        "build",
        "--input",
        str(corpus),
        "--output",
        str(out),
        "--tokenizer",
        str(built_out / "tokenizer.model"),
        "--seq-len",
        "64",
        "--num-shards",
        "2",
        *extra,
    ]


@pytest.fixture(scope="module")
def dask_cluster():
    distributed = pytest.importorskip("distributed")
    cluster = distributed.LocalCluster(
        n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None
    )
    yield cluster
    cluster.close()


@pytest.mark.slow  # two worker processes start and import Beam: ~20 s on the loaded 2-core box
def test_dask_runner_writes_the_bytes_of_the_fn_api_runner(corpus_dir, tmp_path, dask_cluster):
    """The whole build (tokenizer sample, training, build) on 2 Dask worker processes, run as the
    `shatter-data` program (so its driver runs without pandas, `shatter.pipeline.cli.entry`), and the
    build with that tokenizer given."""
    args = [
        "build",
        "--input",
        str(corpus_dir / "a.txt"),
        "--output",
        str(tmp_path / "dask"),
        *("--vocab-size", "300", "--seq-len", "64", "--dupe-factor", "2", "--num-shards", "3"),
        *("--validation-fraction", "0.1", "--tokenizer-sample", "5000"),
        "--runner",
        "DaskRunner",
        "--dask_client_address",
        dask_cluster.scheduler_address,
    ]
    program = subprocess.run(
        [sys.executable, "-m", "shatter.pipeline.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert program.returncode == 0, program.stderr[-3000:]
    assert "DaskRunner reports no counters" in program.stderr
    fn_api = tmp_path / "fn_api"  # the same CLI command on the default runner
    fn_result = CliRunner().invoke(
        main, [a if a != str(tmp_path / "dask") else str(fn_api) for a in args[:-4]]
    )
    assert fn_result.exit_code == 0, fn_result.output
    assert _files(tmp_path / "dask") == _files(fn_api)
    dask_index = json.loads((tmp_path / "dask" / "index.json").read_text())
    fn_index = json.loads((fn_api / "index.json").read_text())
    assert dask_index["splits"] == fn_index["splits"]
    # counters: what the shards tell, and index.json says which are missing
    # the hold-out (the driver's decision), its share and its warning (from the written rows)
    # are there on every runner
    holdout = ("warnings", "validation_fraction_obtained", "validation_hold_out")
    counters = {k: v for k, v in dask_index["counters"].items() if k not in holdout}
    assert counters == {
        "rows": fn_index["counters"]["rows"],
        "shards_written": fn_index["counters"]["shards_written"],
    }
    # the share held out is the same; the warning's wording may name counters Dask lacks
    for key in ("validation_fraction_obtained", "validation_hold_out"):
        assert dask_index["counters"][key] == fn_index["counters"][key]
    assert len(dask_index["counters"].get("warnings", [])) == len(
        fn_index["counters"].get("warnings", [])
    )
    assert "documents_read" in dask_index["counters_unavailable"]
    assert "counters_unavailable" not in fn_index
    assert not [p for p in (tmp_path / "dask").iterdir() if p.name.startswith(".")]
    # a given tokenizer: one pipeline, and a second where its count of the documents decides
    # another hold-out (here: 120 documents, 3.8% of the text below the hash threshold)
    given = [a if a != str(tmp_path / "dask") else str(tmp_path / "given") for a in args]
    given += ["--tokenizer", str(fn_api / "tokenizer.model")]
    result = CliRunner().invoke(main, given)
    assert result.exit_code == 0, result.output
    assert "building again with that hold-out" in result.output
    assert _files(tmp_path / "given") == _files(fn_api)


def test_dask_options_are_beam_options():
    check_options(["--runner", "DaskRunner", "--dask_client_address", "tcp://host:8786"])
    check_options(["--runner", "apache_beam.runners.dask.dask_runner.DaskRunner"])
    with pytest.raises(OptionError, match="did you mean --dask_client_address"):
        check_options(["--runner", "DaskRunner", "--dask_client_adress", "tcp://host:8786"])


def test_a_misspelled_beam_option_is_an_error_with_a_suggestion(built, corpus_dir, tmp_path):
    out, _ = built
    result = CliRunner().invoke(
        main, _args(out, corpus_dir / "a.txt", tmp_path / "o", "--direct_num_workrs", "2")
    )
    assert result.exit_code == 1 and "Traceback" not in result.output
    (line,) = _error_lines(result.output)
    assert "--direct_num_workrs" in line and "did you mean --direct_num_workers?" in line
    assert "after `--`" in line  # the escape hatch is named
    assert not (tmp_path / "o").exists()  # refused before any work
    stray = CliRunner().invoke(main, _args(out, corpus_dir / "a.txt", tmp_path / "o", "extra"))
    assert stray.exit_code == 1 and "unexpected argument 'extra'" in stray.output
    bad = ("--direct_running_mode", "multi_procesing")  # a bad value: argparse would exit 2
    choice = CliRunner().invoke(main, _args(out, corpus_dir / "a.txt", tmp_path / "o", *bad))
    assert choice.exit_code == 1 and "usage:" not in choice.output
    (line,) = _error_lines(choice.output)
    assert "invalid choice: 'multi_procesing'" in line
    assert not (tmp_path / "o").exists()


def test_a_portable_runner_without_its_job_server_fails_at_once(built, corpus_dir, tmp_path):
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    endpoint = ("--runner", "PortableRunner", "--job_endpoint", f"localhost:{port}")
    start = time.perf_counter()
    result = CliRunner().invoke(
        main, _args(built[0], corpus_dir / "a.txt", tmp_path / "o", *endpoint)
    )
    assert time.perf_counter() - start < 30 and result.exit_code == 1
    (line,) = _error_lines(result.output)
    assert f"no job server answers at --job_endpoint localhost:{port}" in line


@pytest.mark.slow
def test_runner_flags_after_double_dash_pass_unchecked(built, corpus_dir, tmp_path):
    out, _ = built
    result = CliRunner().invoke(
        main,
        _args(out, corpus_dir / "a.txt", tmp_path / "o", "--", "--flag_only_my_runner_knows", "1"),
    )
    assert result.exit_code == 0, result.output
    assert shards.read_index(str(tmp_path / "o")).raw["splits"]["train"]["rows"] > 0


def _even_or_odd(n):
    yield n if n % 2 == 0 else beam.pvalue.TaggedOutput("odd", n)


@pytest.mark.slow  # the module's 2 Dask worker processes
def test_dask_runner_keeps_the_outputs_of_a_pardo_apart(tmp_path, dask_cluster):
    """Beam's Dask translation gives every reader of a multi-output ParDo all of its outputs."""
    p = make_pipeline(
        ["--runner", "DaskRunner", "--dask_client_address", dask_cluster.scheduler_address]
    )
    outputs = p | beam.Create(range(7)) | beam.ParDo(_even_or_odd).with_outputs("odd", main="even")
    for name in ("even", "odd"):
        _ = (
            outputs[name]
            | f"{name} list" >> beam.combiners.ToList()
            | f"write {name}"
            >> beam.Map(lambda xs, n=name: (tmp_path / n).write_text(json.dumps(sorted(xs))))
        )
    p.run().wait_until_finish()
    assert json.loads((tmp_path / "even").read_text()) == [0, 2, 4, 6]
    assert json.loads((tmp_path / "odd").read_text()) == [1, 3, 5]


def _logged(x, path):
    with open(path, "a") as f:  # each of the 2 worker processes appends whole lines
        f.write(f"{x}\n")
    return x


@pytest.mark.slow  # the module's 2 Dask worker processes
def test_dask_runner_computes_a_side_inputs_upstream_once(tmp_path, dask_cluster):
    """dask gives a collection passed as an argument a private copy of its graph: a side input
    would compute its whole upstream again (every build step before the shard boundaries)."""
    log = tmp_path / "calls"
    p = make_pipeline(
        ["--runner", "DaskRunner", "--dask_client_address", dask_cluster.scheduler_address]
    )
    xs = p | beam.Create(range(4)) | "logged" >> beam.Map(_logged, str(log))
    total = xs | "sum" >> beam.CombineGlobally(sum)
    _ = (
        xs
        | "with total" >> beam.Map(lambda x, t: (x, t), t=beam.pvalue.AsSingleton(total))
        | beam.combiners.ToList()
        | beam.Map(lambda pairs: (tmp_path / "out").write_text(json.dumps(sorted(pairs))))
    )
    p.run().wait_until_finish()
    assert json.loads((tmp_path / "out").read_text()) == [[x, 6] for x in range(4)]
    assert sorted(log.read_text().split()) == ["0", "1", "2", "3"]


@pytest.mark.slow  # the module's 2 Dask worker processes
def test_dask_runner_combines_in_every_task_before_grouping(tmp_path, dask_cluster):
    """A combine is folded task by task, then merged (Beam's combiner lifting): grouping first
    gathered every value on one worker (the tokenizer's sample held the whole corpus there)."""
    log = tmp_path / "calls"
    p = make_pipeline(
        ["--runner", "DaskRunner", "--dask_client_address", dask_cluster.scheduler_address]
    )
    xs = p | beam.Create(range(40)) | "logged" >> beam.Map(_logged, str(log))
    _ = (
        xs
        | beam.CombineGlobally(_CountAdds())
        | beam.Map(lambda r: (tmp_path / "out").write_text(json.dumps(r)))
    )
    _ = xs | "other reader" >> beam.Map(lambda x: None)
    p.run().wait_until_finish()
    total, largest_fold = json.loads((tmp_path / "out").read_text())
    assert total == sum(range(40))
    assert largest_fold == 1  # one element per task here: folded there, never all in one place
    assert sorted(map(int, log.read_text().split())) == list(range(40))  # each element once


class _CountAdds(beam.CombineFn):
    """(sum, the most elements any one accumulator was folded from before merging)."""

    def create_accumulator(self):
        return (0, 0)

    def add_input(self, acc, x):
        return (acc[0] + x, acc[1] + 1)

    def merge_accumulators(self, accs):
        accs = list(accs)
        return (sum(a for a, _ in accs), max((n for _, n in accs), default=0))

    def extract_output(self, acc):
        return list(acc)


def test_the_dask_fork_refuses_a_beam_it_was_not_written_for():
    """pipeline/dask_runner.py patches Beam's private Dask-runner API: another Beam series is one
    line naming the installed version and the one to install, before any private import."""
    from shatter.pipeline.runners import DASK_FORK_BEAM, OptionError, check_dask_fork

    check_dask_fork(beam.__version__)  # the installed Beam is the tested one
    with pytest.raises(OptionError) as e:
        check_dask_fork("2.78.0")
    series = ".".join(map(str, DASK_FORK_BEAM))
    assert "apache-beam 2.78.0 is installed" in str(e.value) and f"=={series}.*" in str(e.value)
