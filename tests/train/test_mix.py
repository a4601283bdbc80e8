"""Mixing datasets by weight (`--data A:3 --data B:1`): the stream draws them in proportion,
deterministically by (seed, position), on any world size; a real 2-rank run draws them 3:1,
logs each dataset's epochs and resumes exactly on 1 rank; datasets of two vocabularies are
refused."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from shatter.pipeline.build import build
from shatter.pipeline.config import InputSpec
from shatter.shards import DatasetError, read_index
from shatter.train.config import ConfigError, data_sources, resolve
from shatter.train.loader import MaskingSpec, Mixture, ShardStream, source_epochs, stream_shape
from shatter.train.pretrain import start_up_checks
from tests.pipeline.corpus import generated_documents, quiet, small_config
from tests.train.runs import at_step, command, in_process, metrics, run_to_end

TOLERANCE = 1e-4  # relative, fp32: a sum over 2 ranks against a sum over 2 micro-batches


def dataset(
    root: Path, name: str, seed: int, docs: int, tokenizer: str | None = None, seq_len: int = 64
) -> Path:
    (root / f"{name}.jsonl").write_text(
        "".join(json.dumps({"text": d}) + "\n" for d in generated_documents(docs, seed))
    )
    out = root / name
    config = small_config(
        [InputSpec("text", str(root / f"{name}.jsonl"))], out, tokenizer=tokenizer, seq_len=seq_len
    )
    build(config, [], report=quiet)
    return out


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """Datasets `a` (the tokenizer trained on it) and `b` (a's tokenizer, other text, fewer
    rows), and `c` with a tokenizer of its own."""
    root = tmp_path_factory.mktemp("mix")
    a = dataset(root, "a", 1, 160)
    b = dataset(root, "b", 2, 90, tokenizer=str(a / "tokenizer.model"))
    c = dataset(root, "c", 3, 90)
    return a, b, c


def rows_of(a: Path, b: Path, world: int, accum: int, batches: int, start: int = 0):
    """Per rank, the sample ids its stream gives (4 rows a micro-batch), mixing a:3 and b:1."""
    mix = [(read_index(str(a)), 3.0), (read_index(str(b)), 1.0)]
    out = []
    for rank in range(world):
        stream = ShardStream(
            mix[0][0], "train", batch_size=4, seq_len=64, masking=MaskingSpec("static"),
            seed=7, rank=rank, world_size=world, grad_accum=accum, start=start, mix=mix,
        )  # fmt: skip
        it = iter(stream)
        out.append([next(it)["sample_id"].numpy() for _ in range(batches)])
    return out, mix[0][0].rows("train")


@pytest.mark.slow
def test_the_stream_draws_3_to_1_on_any_world_size(two):
    a, b, _ = two
    (r0, r1), rows_a = rows_of(a, b, world=2, accum=1, batches=50)  # 400 rows, 2 ranks
    drawn = np.concatenate(r0 + r1)
    from_a = int((drawn < rows_a).sum())
    print(f"2 ranks, first 400 rows: {from_a} from a, {400 - from_a} from b")  # report (-s)
    assert abs(from_a / 400 - 0.75) <= 0.05
    rows_b = read_index(str(b)).rows("train")
    # each dataset in its own epochs: every row once before any row twice
    assert len(np.unique(drawn[drawn < rows_a])) == min(from_a, rows_a)
    assert len(np.unique(drawn[drawn >= rows_a])) == min(400 - from_a, rows_b)
    # one rank, 2 micro-batches a step: a step's rows are the 2-rank step's, in the same slots
    (one,), _ = rows_of(a, b, world=1, accum=2, batches=100)
    for step in range(50):
        assert np.array_equal(one[2 * step], r0[step]) and np.array_equal(
            one[2 * step + 1], r1[step]
        )
    # resumed at sample 200 (step 25): the same rows
    (later, _), _ = rows_of(a, b, world=2, accum=1, batches=25, start=200)
    assert all(np.array_equal(x, y) for x, y in zip(later, r0[25:]))


def test_mixture_positions_are_arithmetic_on_the_seed():
    m = Mixture([0.7, 0.2, 0.1], seed=5)
    source, t = m.locate(np.arange(50_000))
    for i in range(3):  # each source's own stream, position after position, none skipped
        assert np.array_equal(t[source == i], np.arange((source == i).sum()))
    assert np.array_equal(m.drawn(50_000), np.bincount(source))
    window = np.bincount(m.locate(np.arange(12_345, 12_745))[0], minlength=3)
    assert np.abs(window - [280, 80, 40]).max() <= 2  # any 400 positions: in proportion
    other = Mixture([0.7, 0.2, 0.1], seed=6).locate(np.arange(4096))[0]
    assert not np.array_equal(other, source[:4096])  # the seed places the draws


@pytest.mark.slow
def test_mixing_builds_of_two_lengths_cuts_each_by_its_own_factor(two, tmp_path):
    """d (built at 128, a's tokenizer) and a (at 64) mixed 1:1 at 32: d's rows are cut in 4,
    a's in 2; global position -> (dataset, position in its cut stream) gives the very rows
    (static masks included) that dataset's own stream cut at 32 gives there."""
    a = two[0]
    d = dataset(tmp_path, "d", 4, 90, tokenizer=str(a / "tokenizer.model"), seq_len=128)
    mix = [(read_index(str(d)), 1.0), (read_index(str(a)), 1.0)]
    (id_, _), (ia, _) = mix
    epoch = (id_.rows("train") * 4, ia.rows("train") * 2)
    assert stream_shape(id_, mix, 32) == (sum(epoch), ((epoch[0], 1.0), (epoch[1], 1.0)))

    def stream(index, **kw):
        return ShardStream(
            index, "train", batch_size=8, seq_len=32, masking=MaskingSpec("static"), seed=7, **kw
        )

    q = np.arange(2 * max(epoch))  # a whole epoch of each
    mixed = stream(id_, mix=mix).batch(q)
    source, t = Mixture([1.0, 1.0], 7).locate(q)
    assert mixed["input_ids"].shape[1] == 32
    ids = mixed["sample_id"].numpy()
    for i, (index, _) in enumerate(mix):
        mine = source == i
        own = stream(index).batch(t[mine])
        for key in ("input_ids", "labels", "attention_mask"):
            assert torch.equal(mixed[key][mine], own[key]), (index.path, key)
        # its pieces are its own stream's (ids offset past the other dataset's), each once an epoch
        offset = ids[mine] - own["sample_id"].numpy()
        assert len(np.unique(offset)) == 1 and (i == 0) == (offset[0] == 0)
        first = ids[mine][t[mine] < epoch[i]]
        assert len(first) == epoch[i] == len(np.unique(first))
    assert not set(ids[source == 0]) & set(ids[source == 1])  # pieces of both never collide
    drawn = source_epochs(mix, 7, len(q), 32)
    assert drawn == pytest.approx(
        {str(d): (source == 0).sum() / epoch[0], str(a): (source == 1).sum() / epoch[1]}
    )


@pytest.mark.slow
def test_weights_and_vocabularies_are_checked_in_one_line(two, tmp_path):
    a, b, c = two
    assert data_sources(("x:3", "s3://bucket/y:1.5", "s3://bucket/z")) == [
        ("x", 3.0), ("s3://bucket/y", 1.5), ("s3://bucket/z", 1.0)
    ]  # fmt: skip
    with pytest.raises(ConfigError, match="--data x:0: the weight must be a positive number"):
        data_sources(("x:0",))
    flags = {"data": (f"{a}:3", f"{c}:1"), "output": str(tmp_path / "run"), "preset": "bert-tiny"}
    with pytest.raises(DatasetError) as refused:
        start_up_checks(resolve(None, flags))
    message = str(refused.value)
    assert "\n" not in message and str(c) in message and "share one vocabulary" in message
    assert f"--tokenizer {a / 'tokenizer.model'}" in message


@pytest.mark.slow
def test_a_two_rank_mixed_run_draws_3_to_1_and_resumes_exactly_on_one_rank(two, tmp_path):
    """One 2-rank launch mixing a:3 and b:1 over 400 rows (10 steps of 2 x 20): its rows are
    3:1 (±5%) and each dataset's epochs are logged; resumed at step 5 on 1 rank (in this
    process, 2 micro-batches a step) it draws the same rows and gives the same losses."""
    a, b, _ = two
    args = ("--data", f"{b}:1", "--preset", "bert-tiny", "--micro-batch", "20", "--lr", "2e-3")
    args += ("--max-steps", "10", "--save-every", "5", "--eval-every", "0", "--log-every", "1")
    args += ("--warmup-steps", "2", "--num-workers", "0", "--no-progress", "--seed", "7")
    args += ("--zero-stage", "1")
    run = tmp_path / "two"
    log = tmp_path / "rows"
    run_to_end(command(f"{a}:3", run, *args, "--sample-log", str(log), ranks=2), timeout=300)
    drawn = sample_log(log, ranks=2)
    rows_a = read_index(str(a)).rows("train")
    from_a = sum(r < rows_a for rows in drawn.values() for r in rows)
    print(f"2 ranks, 400 rows: {from_a} from a, {400 - from_a} from b")  # report (-s)
    assert sum(map(len, drawn.values())) == 400 and abs(from_a / 400 - 0.75) <= 0.05
    losses, _ = metrics(run)
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    last = [x for x in lines if x.get("step") == 10 and "split" not in x][0]
    mix = [(read_index(str(a)), 3.0), (read_index(str(b)), 1.0)]
    assert last["samples"] == 400
    assert last["source_epochs"] == pytest.approx(source_epochs(mix, 7, 400, 64))

    resumed = at_step(run, 5, tmp_path / "one")
    one = ("--grad-accum", "2", "--sample-log", str(tmp_path / "again"))
    done = in_process(f"{a}:3", resumed, *args, *one)  # a world of one in this process
    assert done.exit_code == 0, done.output[-3000:]
    assert "written by 2 ranks, this run has 1: converting" in done.output, done.output[-2000:]
    again = sample_log(tmp_path / "again", ranks=1)
    assert all(sorted(again[p] + again[p + 20]) == sorted(drawn[p]) for p in range(200, 400, 40))
    later, _ = metrics(resumed)
    worst = max(abs(later[s] - losses[s]) / losses[s] for s in range(6, 11))
    print(f"2 ranks -> 1 rank at step 5: largest relative loss difference {worst:.2e}")
    assert worst < TOLERANCE, (later, losses)


def sample_log(prefix: Path, ranks: int) -> dict[int, list[int]]:
    """{stream position of a micro-batch: its row ids, over the ranks} of a run's --sample-log."""
    rows: dict[int, list[int]] = {}
    for rank in range(ranks):
        for line in Path(f"{prefix}.rank{rank}.jsonl").read_text().splitlines():
            position, ids = json.loads(line)
            rows.setdefault(position, []).extend(ids)
    return rows
