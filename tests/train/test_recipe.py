"""The cheap-pretraining recipe on one CPU rank, real shards and the real trainer: the schedules
(wsd, 1-sqrt) as metrics.jsonl logs them, a run given a budget of seconds that sets its length and
ends with an export, the two-phase recipe from one build at 128 (phase 1 at 32 and its exact
resume, `shatter-extend`, `--init-from` at 64, the phase compiled: a compiled BERT); --init-from's
and run.compile's refusals."""

import json
import logging
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from shatter.extend_cli import main as extend
from shatter.shards import read_index
from shatter.train import budget
from shatter.train.compiling import compile_problem
from shatter.train.config import ConfigError, OptimArgs, TrainConfig, lr_at, resolve
from shatter.train.init_from import check
from shatter.train.schedule import lr_factor
from tests.jobs import run_command
from tests.train.runs import at_step, cheap_config, command, in_process, run_to_end

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
BUDGET_S = 10.0  # the budget run's budget_hours, in seconds (its engine build included)


def _logged(run: Path) -> dict[int, dict]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {x["step"]: x for x in lines if "lr" in x}


SINGLE = ("--eval-every", "0", "--save-every", "0", "--log-every", "1", "--num-workers", "0")
SINGLE += ("--no-progress",)


def _single(data: Path, run: Path, *args: str, preset: str = "shatter-tiny", timeout=300):
    cmd = command(data, run, *SINGLE, *args, launcher=[sys.executable])
    cmd[cmd.index("--preset") + 1] = preset
    return run_to_end(cmd, timeout=timeout)


def _here(data: Path, run: Path, *args: str, preset: str = "shatter-tiny") -> str:
    """`_single`'s run in this process (no interpreter, torch and DeepSpeed to start again): its
    output."""
    done = in_process(data, run, *SINGLE, *args, "--preset", preset)
    assert done.exit_code == 0, f"{done.output[-3000:]}{done.exception!r}"
    return done.output


def test_the_decays_shapes():
    """eq. of each decay at a few iterations of a 100-step run, 10 of warm-up, cooldown 0.2."""
    f = {
        d: [lr_factor(d, i, 10, 100, 0.2) for i in (5, 50, 80, 90, 100)] for d in ("wsd", "1-sqrt")
    }
    assert f["wsd"] == pytest.approx([0.5, 1.0, 1.0, 0.5, 0.0])
    assert f["1-sqrt"] == pytest.approx([0.5, 1.0, 1.0, 1 - 0.5**0.5, 0.0])
    assert lr_factor("cosine", 55, 10, 100, 0.2) == pytest.approx(0.5)
    assert lr_factor("linear", 55, 10, 100, 0.2) == pytest.approx(0.5)


def test_the_planned_scheduler_starts_at_the_warm_up_without_a_warning(caplog):
    """DeepSpeed's WarmupLR asks itself for the lr in its constructor and warns of it; ours
    answers the start of the warm-up, silently, then follows the plan."""
    import torch

    from shatter.train.schedule import Plan, client_scheduler

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    build = client_scheduler(OptimArgs(lr=1e-3), Plan("linear", 10, 100, 0.1))
    deepspeed_logger = logging.getLogger("DeepSpeed")  # its own handler; it does not propagate
    deepspeed_logger.addHandler(caplog.handler)
    try:
        scheduler = build(optimizer)
    finally:
        deepspeed_logger.removeHandler(caplog.handler)
    assert not [r for r in caplog.records if "before it has started" in r.getMessage()]
    assert optimizer.param_groups[0]["lr"] == 0.0
    scheduler.step()  # iteration 0 of the plan, then 5: half the warm-up
    for _ in range(5):
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(
        1e-3 * lr_factor("linear", 5, 10, 100, 0.1)
    )


def run_budget(books_data, tmp_path_factory) -> tuple[Path, dict, float]:
    """A run given budget_hours = BUDGET_S: (its run directory, its plan, its wall seconds)."""
    tmp = tmp_path_factory.mktemp("budget")
    config = cheap_config(
        tmp / "recipe.yaml", {"  warmup_steps: 20\n": "  warmup_steps: 2\n  cooldown: 0.5\n"}
    )
    run, started = tmp / "run", time.time()
    args = ("--config", str(config), "--decay", "wsd", "--max-steps", "100000")
    args += ("--micro-batch", "4", "--seq-len", "32")
    output = _here(books_data, run, *args, "--budget-hours", str(BUDGET_S / 3600))
    assert "complete: step" in output and (run / "export" / "model.safetensors").is_file()
    return run, json.loads((run / budget.FILE).read_text()), time.time() - started


@pytest.fixture(scope="module")
def budget_run(books_data, tmp_path_factory) -> tuple[Path, dict, float]:
    return run_budget(books_data, tmp_path_factory)


@pytest.mark.slow
@pytest.mark.shared_data
def test_a_budget_of_seconds_plans_the_wsd_schedule_and_ends_with_an_export(budget_run):
    """budget_hours = BUDGET_S: the run times its steps, plans its length from them (re-planning as
    they change), follows wsd to its decayed end inside the budget and ends with its export; its
    progress counts to the planned step and the budget's time left, not --max-steps."""
    run, planned, took = budget_run
    seconds = BUDGET_S
    lrs, last = {s: r["lr"] for s, r in _logged(run).items()}, max(_logged(run))
    print(f"budget {seconds} s: planned {planned}, ran {last} steps in {took:.1f} s")
    assert last == (planned["ended_at"] or planned["planned_steps"]) and last < 100000
    assert planned["spent_s"] < seconds * 1.2  # the plan keeps its last step inside the budget
    optim = OptimArgs(lr=1e-3, warmup_steps=2, decay="wsd", cooldown=0.5)
    plan_step = 1 + budget.MEASURE  # steps after it run on the planned length
    assert [lrs[s] for s in range(1, plan_step + 1)] == pytest.approx(
        [lr_at(optim, 100000, s) for s in range(1, plan_step + 1)], abs=1e-12
    )
    peak = max(lrs.values())
    top = max(s for s in lrs if lrs[s] == peak)  # the end of the stable phase
    assert all(lrs[s + 1] <= lrs[s] + 1e-12 for s in range(top, last))  # one decay, no jump up
    if last == planned["planned_steps"] > plan_step + 2:  # a box loaded less than ours
        # the cooldown ran to its end, still falling at the last step: there the lr is that of a
        # plan's last step (a linear decay to 0 after it: 2/n of the peak for n steps with
        # cooldown 0.5, about that after a re-plan's squeeze), not the stable phase's peak
        assert lrs[last] < lrs[last - 1]
        assert lrs[last] <= 1.2 * max(0.2 * peak, lr_at(optim, last, last))
    progress = [x for x in (run / "train.log").read_text().splitlines() if " pretrain " in x]
    assert progress and not [x for x in progress if "/100000" in x], progress[:3]
    assert all(progress_left(x) <= seconds for x in progress), progress[:3]


def progress_left(line: str) -> int:
    """The seconds a progress line's left=H:MM:SS shows."""
    hours, minutes, seconds = line.split("left=")[1].split()[0].split(":")
    return int(hours) * 3600 + int(minutes) * 60 + int(seconds)


@pytest.fixture(scope="module")
def books_128(shared_data, books_data, tmp_path_factory) -> Path:
    """The books sample built once at 128, with books_data's tokenizer (vocab 2000, not trained
    again): every shorter length cuts its rows."""
    out = tmp_path_factory.mktemp("books128") / "data"
    cmd = [str(BIN / "shatter-data"), "build", "--corpus", "books", "--input",
           str(shared_data / "books"), "--output", str(out), "--seq-len", "128", "--tokenizer",
           str(books_data / "tokenizer.model"), "--dupe-factor", "2", "--num-shards", "4",
           "--validation-fraction", "0.05"]  # fmt: skip
    done = run_command(cmd, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


COMMON = ("--warmup-steps", "2", "--lr", "5e-3", "--micro-batch", "8")  # both phases'
PHASE1 = ("--max-steps", "16", "--seq-len", "32", "--save-every", "8")


@pytest.fixture(scope="module")
def phases(books_128, tmp_path_factory) -> dict:
    """The two-phase recipe on bert-tiny: phase 1 at 32 (16 steps), the same run resumed from its
    step-8 checkpoint, `shatter-extend` of its export to 64 (those three in this process), phase 2
    at 64 from it (4 steps, --init-from, 1-sqrt) with run.compile (inductor on CPU, in a process of its
    own). Their directories, and phase 2's stderr."""
    tmp = tmp_path_factory.mktemp("phases")
    out = {k: tmp / k for k in ("p1", "ext", "p2")}
    common = ("--config", str(cheap_config(tmp / "recipe.yaml")), *COMMON)
    _here(books_128, out["p1"], *common, *PHASE1, preset="bert-tiny")
    out["resumed"] = at_step(out["p1"], 8, tmp / "resumed")
    _here(books_128, out["resumed"], *common, *PHASE1, preset="bert-tiny")
    ext = [str(out["p1"] / "export"), "--max-len", "64", "--output", str(out["ext"])]
    done = CliRunner().invoke(extend, ext)  # shatter-extend's command, in this process
    assert done.exit_code == 0, f"{done.output[-2000:]}{done.exception!r}"
    two = ("--max-steps", "4", "--decay", "1-sqrt", "--seq-len", "64", "--compile")
    done = _single(books_128, out["p2"], *common, *two, "--init-from", str(out["ext"]),
                   preset="bert-tiny", timeout=840)  # fmt: skip
    return {**out, "stderr": done.stderr}


@pytest.mark.slow
@pytest.mark.shared_data
@pytest.mark.timeout(900)  # phase 2's first inductor compile: about a CPU-minute
def test_one_build_at_128_serves_32_then_64_resumes_exactly_and_init_from_continues(
    books_128, phases
):
    """Phase 1: bert-tiny at 32 on the 128 build (each row cut in 4), resumed from its step-8
    checkpoint to the same losses; `shatter-extend` to 64; phase 2 at 64 (rows cut in 2) from
    phase 1's weights with --init-from and 1-sqrt: a fresh schedule, a loss that starts where
    phase 1 ended, no second build."""
    rows = read_index(str(books_128)).rows("train")
    p1, resumed = _logged(phases["p1"]), _logged(phases["resumed"])
    assert [resumed[s]["loss"] for s in range(9, 17)] == pytest.approx(
        [p1[s]["loss"] for s in range(9, 17)], rel=1e-6
    )
    assert p1[16]["samples"] == 16 * 8 and p1[16]["epoch"] == pytest.approx(128 / (4 * rows))
    assert f"--init-from: weights from {phases['ext']}" in phases["stderr"]
    p2 = _logged(phases["p2"])
    print(f"phase 1 at 32: loss {p1[1]['loss']:.3f} -> {p1[16]['loss']:.3f}; resumed from step 8: "
          f"the same 8 losses; phase 2 at 64 from the extended export: {p2[1]['loss']:.3f} -> "
          f"{p2[4]['loss']:.3f}")  # fmt: skip
    assert p2[1]["lr"] == 0.0 and p2[3]["lr"] > 0  # a fresh schedule, from warm-up
    optim = OptimArgs(lr=5e-3, warmup_steps=2, decay="1-sqrt")
    assert [p2[s]["lr"] for s in p2] == pytest.approx([lr_at(optim, 4, s) for s in p2])
    assert p2[1]["loss"] < p1[1]["loss"] - 1.0  # phase 1's weights, at twice its length
    assert json.loads((phases["p2"] / "config.json").read_text())["seq_len"] == 64
    assert p2[4]["epoch"] == pytest.approx(4 * 8 / (2 * rows))


@pytest.mark.slow
@pytest.mark.shared_data
@pytest.mark.timeout(900)  # inductor's first compile: about a CPU-minute
def test_run_compile_trains_bert_on_cpu(phases):
    """Phase 2 of the recipe above ran compiled: it trained, validated eager, and exported."""
    run, stderr = phases["p2"], phases["stderr"]
    losses = [r["loss"] for r in _logged(run).values()]
    print(f"compiled bert-tiny on CPU: losses {losses}")
    assert len(losses) == 4 and all(x == x and x < 9 for x in losses)
    assert "complete: step 4" in stderr and (run / "export" / "model.safetensors").is_file()
    assert json.loads((run / "config.json").read_text())["config"]["run"]["compile"] is True
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x.get("split") == "validation"] == [4]
    assert "torch._dynamo" not in stderr, stderr  # validation ran eager: no recompile warning


def _cfg(data: Path, init_from: Path, preset: str = "bert-tiny") -> TrainConfig:
    flags = {"data": str(data), "output": "unused", "preset": preset, "init_from": str(init_from)}
    return resolve(None, flags)


@pytest.mark.slow
@pytest.mark.shared_data
def test_init_from_refuses_another_arch_vocabulary_or_a_shorter_model(books_data, tmp_path):
    import shatter

    index = read_index(str(books_data))
    model = shatter.build_model("bert-tiny", vocab_size=index.vocab_size, max_len=32)
    export = shatter.save_pretrained(model, tmp_path / "export", tokenizer=index.tokenizer)
    assert check(_cfg(books_data, export), index, 32)[0] == export
    run = tmp_path / "run"  # a run directory: its export
    shatter.save_pretrained(model, run / "export", tokenizer=index.tokenizer)
    (run / "metrics.jsonl").write_text("")
    assert check(_cfg(books_data, run), index, 32)[0] == run / "export"
    problems = {
        "not a shatter-tiny model (arch bert (export) vs shatter": (_cfg(books_data, export, "shatter-tiny"), 32),
        "max_len 32, shorter than the training length 64: extend it first": (_cfg(books_data, export), 64),
    }  # fmt: skip
    config = json.loads((export / "config.json").read_text())
    other = tmp_path / "other"
    shatter.save_pretrained(
        shatter.build_model("bert-tiny", vocab_size=500, max_len=64), other, index.tokenizer
    )
    problems["another vocabulary than the data"] = (_cfg(books_data, other), 32)
    problems["--init-from " + str(tmp_path / "nothing") + ": no such directory"] = (
        _cfg(books_data, tmp_path / "nothing"),
        32,
    )
    for message, (cfg, length) in problems.items():
        with pytest.raises(
            ConfigError, match="^.*" + message.replace("(", r"\(").replace(")", r"\)")
        ) as err:
            check(cfg, index, length)
        assert "\n" not in str(err.value)
    assert config["arch"] == "bert"


def test_compile_is_refused_in_one_line_without_a_compiler(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CXX", raising=False)
    assert compile_problem("cpu").startswith("run.compile on a CPU needs a C++ compiler")
    assert compile_problem("cpu").count("\n") == 0


def test_init_from_is_announced_or_said_unused_on_a_resume(tmp_path, capsys):
    """A fresh run says where its weights came from (the checkpoint, the model, how many) and
    what starts afresh; a resumed one that --init-from is not used."""
    import shatter
    from shatter.train.checkpoint import TrainState
    from shatter.train.pretrain import _say_init_from

    export = tmp_path / "export"
    model = shatter.build_model("bert-tiny", vocab_size=50, max_len=16)
    shatter.save_pretrained(model, export)
    (export / "STEP").write_text("step00000040\n")  # as a run's export names its checkpoint
    cfg = resolve(None, {"data": "unused", "output": "unused", "init_from": str(tmp_path)})
    _say_init_from(cfg, TrainState())
    values = sum(p.numel() for p in model.parameters())
    assert (
        f"--init-from: weights from {export} (step00000040), all {values:,} of its bert model "
        f"(2 layers, hidden 64, max_len 16); new: the optimizer's state, the linear schedule"
    ) in capsys.readouterr().err
    _say_init_from(cfg, TrainState(step=8))
    assert "not used, resuming this run's checkpoint at step 8" in capsys.readouterr().err
