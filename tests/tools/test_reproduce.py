"""tools/reproduce.py at micro scale: both studies through the real CLIs, their outputs, a resume
that skips every finished step, a failing sub-command reported in one line, and the extension
study's one train/evaluate_cli.py process per model scoring as one process per length.

The study command runs in this process (click's runner: its steps are the subprocesses it starts,
as from a shell); a process of its own would only import torch once more per call."""

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from shatter.tools.reproduce import PAPER_NAMES, main, verdict

# 2 archs, STEPS steps at l = 32 on a 1-layer width-32 model, one process, validated at two steps
# on EVAL_ROWS rows: a run's CPU-seconds are its process's start.
STEPS, EVAL_EVERY, EVAL_ROWS = 4, 2, 16
MICRO = f"""
model:
  overrides: {{hidden: 32, layers: 1, heads: 4, ffn: 64}}
data:
  num_workers: 0
  eval_samples: {EVAL_ROWS}
run:
  micro_batch: 8
  save_every: 10
  log_every: 5
  tensorboard: false
"""
ARCHS = ["shatter", "bert"]
# The result the fixture deletes between the two calls, as a study killed while its evaluation
# process was at the model's second length leaves it: the rerun evaluates that length alone.
LOST = "bert-s0-copy-128-at-64.json"


def reproduce(study: str, out: Path, data: Path, *extra: str) -> Result:
    """`python tools/reproduce.py STUDY ...` at micro scale: its exit code, stdout and stderr."""
    config = out.parent / "micro.yaml"
    config.write_text(MICRO)
    args = [
        study,
        "--output",
        str(out),
        "--data",
        str(data),
        "--seq-len",
        "32",
        "--steps",
        str(STEPS),
        "--eval-every",
        str(EVAL_EVERY),
        "--ranks",
        "1",
        "--archs",
        ",".join(ARCHS),
        "--config",
        str(config),
        *extra,
    ]
    return CliRunner().invoke(main, args)


def succeeded(done: Result) -> bool:
    """Exit 0; otherwise the assert shows the study's last words and any uncaught exception."""
    assert done.exit_code == 0, f"{done.stderr[-3000:]}{done.exception!r}"
    return True


def table_rows(markdown: str, first_cell: str) -> list[list[str]]:
    rows = [line.strip("|").split("|") for line in markdown.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in row] for row in rows if row[0].strip() == first_cell]


def assert_png(path: Path) -> None:
    import matplotlib.image

    image = matplotlib.image.imread(path)
    assert image.shape[0] > 100 and image.shape[1] > 100


def run_studies(books_data, tmp_path_factory):
    """Both studies in one directory (the extension reuses the ablation's runs), then both again,
    with one evaluation result (LOST) deleted in between."""
    out = tmp_path_factory.mktemp("study") / "out"
    first = [reproduce(s, out, books_data) for s in ("ablation", "extension")]
    assert all(succeeded(done) for done in first)
    lost = (out / "eval" / LOST).read_text()
    (out / "eval" / LOST).unlink()
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*.json*") if "tensorboard" not in str(p)}
    second = [reproduce(s, out, books_data) for s in ("ablation", "extension")]
    assert all(succeeded(done) for done in second)
    return out, first, second, stamps, lost


@pytest.fixture(scope="module")
def studies(books_data, tmp_path_factory):
    return run_studies(books_data, tmp_path_factory)


@pytest.mark.slow
def test_ablation_outputs(studies):
    out, first, _, _, _ = studies
    table = (out / "ablation.md").read_text()
    for arch in ARCHS:
        (row,) = table_rows(table, arch)
        assert row[1] == PAPER_NAMES[arch]
        loss, accuracy = float(row[2]), float(row[3])
        assert 0 < loss < math.log(2000) + 2 and 0 <= accuracy <= 1
        assert int(row[4].replace(",", "")) > 0  # parameters
    assert "Shatter matches BERT_Base" in table  # the one Figure 3 step both archs take part in
    assert_png(out / "ablation.png")
    lines = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    ablation = [x for x in lines if x["study"] == "ablation"]
    assert sorted(x["arch"] for x in ablation) == sorted(ARCHS)
    for x in ablation:
        assert x["curve"][-1] == [STEPS, x["loss"]]
        assert [s for s, _ in x["curve"]] == [EVAL_EVERY, STEPS]
        run = Path(x["run"])
        assert (run / "export" / "model.safetensors").is_file()
        assert "$ " in (run / "reproduce.log").read_text()  # the command, then its output
    assert first[0].stderr.count("pretrain ") == 2  # one progress line per run
    assert "left" in first[0].stderr


@pytest.mark.slow
def test_extension_outputs(studies, books_data):
    out, first, _, _, _ = studies
    table = (out / "extension.md").read_text()
    assert "| model | l = 32 | l = 64 | l = 128 |" in table
    (shatter,) = table_rows(table, "shatter ext 128")
    (pretrained,) = table_rows(table, "shatter")
    # shatter-extend adds no weights to shatter: at l_train the stretched model scores the same
    assert shatter[1] == pretrained[1]
    assert all(float(c) > 0 for c in shatter[1:])
    for init in ("random", "copy"):
        (row,) = table_rows(table, f"bert ext 128 ({init})")
        assert all(float(c) > 0 for c in row[1:])
    assert_png(out / "extension.png")
    lines = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert {x["study"] for x in lines} == {"ablation", "extension"}
    ext = [x for x in lines if x["study"] == "extension"]
    # shatter: export at 32, ext 64 at 32/64, ext 128 at 32/64/128; bert: twice that per init + 1
    assert len(ext) == 6 + 11
    # the length-64 data is the training data itself (same length); 32 and 128 were built
    assert not (out / "data" / "l64").exists()
    train_index = json.loads((books_data / "index.json").read_text())
    for length in (32, 128):
        index = json.loads((out / "data" / f"l{length}" / "index.json").read_text())
        assert index["seq_len"] == length
        assert index["tokenizer"]["sha256"] == train_index["tokenizer"]["sha256"]
    assert "pretrain shatter-s0: already done" in first[1].stderr  # reused from the ablation


@pytest.mark.slow
def test_second_invocation_skips_every_finished_step(studies):
    out, _, second, stamps, lost = studies
    redo = "evaluate bert-s0-copy-128 at 64 (32, 128 already done): done in "
    for done in second:
        progress = [x for x in done.stderr.splitlines() if x.startswith("[")]
        assert progress and all("already done, skipped" in x or redo in x for x in progress)
    assert second[1].stderr.count(redo) == 1  # the one lost result, its model's other lengths kept
    assert (out / "eval" / LOST).read_text() == lost  # the same figures again
    changed = [p for p, t in stamps.items() if p.stat().st_mtime_ns != t]
    # only the study's own summaries are rewritten; no run, export or evaluation is touched
    assert {p.name for p in changed} <= {"results.jsonl"}, changed


@pytest.mark.slow
def test_each_model_is_evaluated_at_all_its_lengths_in_one_process(studies, books_data):
    """One train/evaluate_cli.py process per model, one progress step each (16 steps planned and
    made), giving each length exactly the figures of an evaluation at that length alone."""
    from shatter.train.evaluate_cli import evaluate_export

    out, first, _, _, _ = studies
    progress = [x for x in first[1].stderr.splitlines() if x.startswith("[")]
    assert progress[-1].startswith("[16/16] ")  # 2 pretrain + 6 extend + 8 evaluate
    evaluated = [x.split("] evaluate ")[1].split(":")[0] for x in progress if "] evaluate " in x]
    assert evaluated == [
        "shatter-s0-pretrained-32 at 32",
        "shatter-s0-none-64 at 32, 64",
        "shatter-s0-none-128 at 32, 64, 128",
        "bert-s0-pretrained-32 at 32",
        "bert-s0-random-64 at 32, 64",
        "bert-s0-copy-64 at 32, 64",
        "bert-s0-random-128 at 32, 64, 128",
        "bert-s0-copy-128 at 32, 64, 128",
    ]
    log = (out / "eval" / "bert-s0-copy-128.log").read_text().splitlines()
    command = next(x for x in log if x.startswith("$ "))  # the first call's; the rerun appends
    assert command.count(" --data ") == 3 and command.count(" --output ") == 3
    data = {32: out / "data" / "l32", 64: books_data, 128: out / "data" / "l128"}
    for model, name in (
        ("shatter-s0-128-none", "shatter-s0-none-128"),
        ("bert-s0-128-copy", "bert-s0-copy-128"),
    ):
        for length, dataset in data.items():
            alone = evaluate_export(out / "extended" / model, dataset, max_samples=EVAL_ROWS)
            stored = json.loads((out / "eval" / f"{name}-at-{length}.json").read_text())
            assert stored == json.loads(json.dumps(alone)) and stored["seq_len"] == length


@pytest.mark.slow
def test_evaluate_checks_every_dataset_before_writing_a_result(studies, tmp_path):
    """A dataset the model cannot take refuses the whole call, naming it and the fix, before the
    datasets before it are scored or written."""
    from shatter.train.evaluate_cli import main as evaluate

    out, _, _, _, _ = studies
    results = [tmp_path / "at-32.json", tmp_path / "at-128.json"]
    args = ["--checkpoint", out / "runs" / "bert-s0" / "export", "--data", out / "data" / "l32"]
    args += ["--data", out / "data" / "l128", "--output", results[0], "--output", results[1]]
    done = CliRunner().invoke(evaluate, [str(a) for a in args])
    assert done.exit_code == 1, done.output
    (line,) = done.output.strip().splitlines()
    assert (
        str(out / "data" / "l128") in line and "shatter-extend" in line and "--max-len 128" in line
    )
    assert not any(r.exists() for r in results)


@pytest.mark.slow
def test_failing_run_is_one_line(books_data, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run:\n  no_such_key: 1\n")
    out = tmp_path / "out"
    done = reproduce("ablation", out, books_data, "--config", str(bad))
    assert done.exit_code != 0
    (line,) = done.stderr.strip().splitlines()
    log = out / "runs" / "shatter-s0" / "reproduce.log"
    assert "run shatter-s0 failed" in line and "train/pretrain.py" in line and str(log) in line
    assert "no_such_key" in log.read_text()


def test_verdict_weighs_the_seed_spread():
    assert "reproduces" in verdict([2.0, 2.2], [3.0, 3.2], -1)
    assert "does NOT reproduce" in verdict([3.0, 3.2], [2.0, 2.2], -1)
    assert "within the seed spread" in verdict([2.0, 2.4], [2.1, 2.5], -1)
    assert "spread not measured" in verdict([2.0], [3.0], -1)
    assert "consistent with the paper" in verdict([2.0, 2.4], [2.1, 2.5], 0)


def test_ablation_defaults_to_the_masked_lm_archs_and_refuses_plm(tmp_path):
    """Figure 3 compares MLM losses: xlnet (a permutation LM) is neither a default nor accepted."""
    result = CliRunner().invoke(main, ["ablation", "--archs", "xlnet", "--output", str(tmp_path)])
    assert result.exit_code == 2 and "permutation LM" in result.output
    assert not any(tmp_path.iterdir())  # refused before anything was written


@pytest.mark.slow
def test_science_table_and_plot_in_a_budget_of_seconds(studies):
    """The GPU lane's science call at micro scale, reusing the studies' runs, extended models and
    evaluations: one table (each arch at l_train and extended to 2 l_train, bert with --init copy
    and random) and one plot of validation loss over tokens; a run over its budget is one line."""
    out = studies[0]
    done = reproduce("science", out, out.parent / "unused", "--budget-seconds", "300")
    assert done.exit_code != 0 and "has no index.json" in done.stderr  # --data is checked
    done = reproduce("science", out, studies_data(out), "--budget-seconds", "300")
    assert succeeded(done)
    # in the studies' directory every step is theirs: their runs, extensions and evaluations
    progress = [x for x in done.stderr.splitlines() if x.startswith("[")]
    assert len(progress) == 2 + 3 + 5 and all("already done, skipped" in x for x in progress)
    table = (out / "science.md").read_text()
    (bert,) = table_rows(table, "bert")
    (shatter,) = table_rows(table, "shatter")
    header = next(line for line in table.splitlines() if line.startswith("| arch "))
    assert "l = 64 (copy)" in header and "l = 64 (random)" in header and "l = 64 (none)" in header
    losses = lambda row: [float(c) for c in row[4:] if c != "-"]  # noqa: E731
    assert len(losses(bert)) == 3 and len(losses(shatter)) == 2, table
    assert all(math.isfinite(x) for x in losses(bert) + losses(shatter))
    assert_png(out / "science.png")
    # its data laid out as tools/science_data.py does, each length beside the training length's:
    # the study finds them there and builds none
    beside = out.parent / "science-data"
    beside.mkdir()
    (beside / "l64").symlink_to(studies_data(out))
    (beside / "l32").symlink_to(out / "data" / "l32")
    late = out.parent / "late"
    done = reproduce("science", late, beside / "l64", "--budget-seconds", "1")
    assert not (late / "data").exists()
    line = done.stderr.strip().splitlines()[-1]
    first = f"{ARCHS[0]}-s0"
    assert done.exit_code != 0 and f"run {first} took over its budget of 1 s" in line, line
    assert line.startswith("Error: ") and str(late / "runs" / first / "reproduce.log") in line


def studies_data(out: Path) -> Path:
    """The dataset the studies trained on (their runs' recorded --data)."""
    record = json.loads((out / "runs" / "bert-s0" / "reproduce.json").read_text())
    return Path(record["command"][record["command"].index("--data") + 1])
