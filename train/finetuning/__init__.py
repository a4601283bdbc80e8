"""Finetuning an export on GLUE, SQuAD v1.1, BoolQ, MultiRC or any CSV/JSONL table.

    config.py    FinetuneConfig and its resolution from YAML and flags
    tasks.py     readers of each task's official files into examples
    features.py  tokenisation, pair encoding, SQuAD windows and span decoding
    data.py      examples -> padded batches per task
    metrics.py   each task's official metrics
    loop.py      the DeepSpeed finetuning loop (evaluation, best checkpoint, predictions)

`train/finetune.py` is the command line over it (docs/finetune.md).
"""
