"""Helpers of the loader's tests (test_loader_*.py): a train stream with small defaults."""

from shatter.train.loader import MaskingSpec, ShardStream


def stream(index, **kw) -> ShardStream:
    args = dict(batch_size=4, seq_len=index.seq_len, masking=MaskingSpec("static"), seed=3)
    args.update(kw)
    return ShardStream(index, "train", **args)


def take(loader, n_batches: int) -> list:
    it = iter(loader)
    return [next(it) for _ in range(n_batches)]
