"""Resume on another world size: a ZeRO-1, ZeRO-2 or ZeRO-3 checkpoint of 1 rank resumed on 2,
and of 2 resumed on 1, through DeepSpeed's universal checkpoint, trains on at the next global
sample: with the same global batch (2 ranks × 1 micro-batch = 1 rank × 2) the losses are those of
a run that never stopped, to the reduction order. And a resume with another --max-steps follows
the new run's schedule. The four chains of runs are independent: each runs when a test first
reads it. Each chain goes 1 -> 2 -> 1 ranks: both directions of a resume, one 2-rank launch; a
world of one trains in this process (the same run as `python train/pretrain.py`, without its
process's start-up)."""

import json
from pathlib import Path

import pytest

from shatter.train.config import OptimArgs, lr_at
from tests.jobs import Outcome, Runs
from tests.train.runs import at_step, cheap_config, command, in_process, metrics, run_to_end

pytestmark = [pytest.mark.slow, pytest.mark.shared_data]

SEGMENT = 2  # steps between two world sizes
TOLERANCE = 1e-4  # relative: fp32, a sum over ranks against a sum over micro-batches
ZERO3_TOLERANCE = 1e-6  # DeepSpeed's unrepaired ZeRO-3 load: 5.5e-4 within 4 steps


def _config(tmp: Path, decay: str) -> Path:
    return cheap_config(
        tmp / f"{decay}.yaml",
        {
            "  warmup_steps: 20\n": f"  warmup_steps: 2\n  decay: {decay}\n",
            "run:\n": "run:\n  keep_checkpoints: 0\n",
        },
    )


def _segment(data: Path, run: Path, config: Path, ranks: int, zero: int, max_steps: int) -> str:
    """Train `run` to `max_steps` on `ranks` ranks: 4 rows a micro-batch, 8 a step; its stderr.
    One rank trains in this process (a world of one without a launcher, as `python
    train/pretrain.py`), 2 under the deepspeed launcher."""
    args = ("--zero-stage", str(zero), "--micro-batch", "4", "--grad-accum", str(2 // ranks))
    args += ("--max-steps", str(max_steps), "--lr", "2e-3", "--save-every", str(SEGMENT))
    args += ("--eval-every", "0", "--log-every", "1", "--num-workers", "0", "--no-progress")
    if ranks == 1:
        done = in_process(data, run, *args, config=config)
        assert done.exit_code == 0, (done.exception, done.output[-4000:])
        return done.output
    return run_to_end(command(data, run, *args, ranks=ranks, config=config), timeout=300).stderr


def _check(chain: dict[int, float], reference: dict[int, float], label: str) -> float:
    assert sorted(chain) == sorted(reference), (label, sorted(chain))
    worst = max(abs(chain[s] - reference[s]) / reference[s] for s in reference)
    print(f"{label}: " + " ".join(f"{s}:{chain[s]:.6f}/{reference[s]:.6f}" for s in sorted(chain)))
    print(f"{label}: largest relative difference {worst:.2e}")  # the report's figures (-s)
    assert worst < TOLERANCE, (label, chain, reference)
    return worst


def _reference_and_zero1(data: Path, tmp: Path, config: Path) -> tuple[dict, dict]:
    """The reference (1 rank, no stop) and ZeRO-1 1 -> 2 -> 1: the reference's own step-2
    checkpoint, resumed on 2 ranks, then on 1. Returns both runs' training losses."""
    reference = tmp / "reference"
    _segment(data, reference, config, ranks=1, zero=1, max_steps=3 * SEGMENT)
    chain = at_step(reference, SEGMENT, tmp / "zero1")
    stderr = _segment(data, chain, config, ranks=2, zero=1, max_steps=2 * SEGMENT)
    assert "written by 1 ranks, this run has 2: converting" in stderr, stderr[-3000:]
    stderr = _segment(data, chain, config, ranks=1, zero=1, max_steps=3 * SEGMENT)
    assert "written by 2 ranks, this run has 1: converting" in stderr, stderr[-3000:]
    return metrics(reference)[0], metrics(chain)[0]


def _one_two_one(data: Path, tmp: Path, config: Path, zero: int) -> Path:
    """ZeRO-`zero`, SEGMENT steps on 1 rank, on 2, then on 1. The first run's lock is this
    process's until it ends (a run holds RUN/run.lock for its process's life): the launch
    continues a copy of it."""
    first = tmp / "first"
    _segment(data, first, config, ranks=1, zero=zero, max_steps=SEGMENT)
    chain = at_step(first, SEGMENT, tmp / "run")
    for step, ranks in enumerate((2, 1), start=2):
        _segment(data, chain, config, ranks=ranks, zero=zero, max_steps=step * SEGMENT)
    return chain


def _longer(data: Path, run: Path, config: Path) -> str:
    """A finished 4-step run, then the same run to 8 steps: the second run's stderr."""
    _segment(data, run, config, ranks=1, zero=1, max_steps=4)
    return _segment(data, run, config, ranks=1, zero=1, max_steps=8)


def run_chains(books_data, tmp_path_factory) -> dict[str, Outcome]:
    """The four independent chains of runs below (tests/jobs.py Runs)."""
    tmp = {k: tmp_path_factory.mktemp(k) for k in ("zero1", "zero2", "zero3", "longer")}
    constant = _config(tmp["zero1"], "constant")  # each segment's --max-steps leaves the lr alone
    linear = _config(tmp["longer"], "linear")
    return Runs(
        {
            "zero1": lambda: _reference_and_zero1(books_data, tmp["zero1"], constant),
            "zero2": lambda: _one_two_one(books_data, tmp["zero2"], constant, 2),
            "zero3": lambda: _one_two_one(books_data, tmp["zero3"], constant, 3),
            "longer": lambda: (
                tmp["longer"] / "run",
                _longer(books_data, tmp["longer"] / "run", linear),
            ),
        }
    )


@pytest.fixture(scope="module")
def chains(books_data, tmp_path_factory) -> dict[str, Outcome]:
    return run_chains(books_data, tmp_path_factory)


def test_zero1_and_zero2_resume_on_another_world_size_as_if_never_stopped(chains):
    ref_losses, zero1 = chains["zero1"].get()
    _check(zero1, ref_losses, "zero-1 1->2->1")

    # ZeRO-2, 1 -> 2 -> 1, against the same (ZeRO-1) reference: fp32, the same arithmetic
    chain = chains["zero2"].get()
    logged = [json.loads(x) for x in (chain / "metrics.jsonl").read_text().splitlines()]
    samples = [x["samples"] for x in logged if "lr" in x]
    assert samples == [8 * s for s in range(1, 3 * SEGMENT + 1)]  # no sample repeated or skipped
    # the 2 ranks' step (a 1-rank checkpoint re-partitioned) saved a partition each
    assert len(list((chain / "checkpoints" / "step00000004").glob("*optim_states.pt"))) == 2
    _check(metrics(chain)[0], ref_losses, "zero-2 1->2->1")

    # ZeRO-3, 1 -> 2 -> 1: DeepSpeed's universal load shares one Adam step between sub-groups
    # and gives biases and LayerNorm weights weight decay (train/zero3_fix.py repairs both)
    worst = _check(metrics(chains["zero3"].get())[0], ref_losses, "zero-3 1->2->1")
    assert worst <= ZERO3_TOLERANCE, worst


def test_a_resume_with_another_max_steps_follows_the_new_schedule(chains):
    """Linear decay: a finished 4-step run (lr 0 at step 4) extended to 8 steps trains steps 5-8
    at the lr of an 8-step run, reaching 0 again at step 8, and says so."""
    run, stderr = chains["longer"].get()
    assert "--max-steps 4 -> 8: from step 4 the lr follows the schedule of a 8-step" in stderr
    logged = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    lrs = {x["step"]: x["lr"] for x in logged if "lr" in x}
    optim = OptimArgs(lr=2e-3, warmup_steps=2)
    # lr_at follows DeepSpeed's scheduler, two steps behind the formula, as metrics.jsonl logs it
    expected = {s: lr_at(optim, 4 if s <= 4 else 8, s) for s in range(1, 9)}
    assert lrs == pytest.approx(expected, abs=1e-12), lrs
