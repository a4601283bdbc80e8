"""A build's memory does not grow with the corpus: the peak RSS of a one-worker build of 4x the
text stays within 1.3x (the text is real: the wiki sample and books of ../shared/data, cleaned
and repeated). Before the tokenizer sample was bounded, the sample stage held the whole corpus
and this ratio was about 1.5 at these sizes (1.6 from 13 to 43 MB)."""

import argparse
import json

import pytest

from tools.bench_pipeline import cleaned_documents, write_corpus
from tools.bench_pipeline_memory import build_command, measure


@pytest.mark.slow
def test_peak_memory_is_flat_from_6_to_24_mb(shared_data, tmp_path):
    docs = cleaned_documents(shared_data)
    args = argparse.Namespace(seq_len=128, vocab_size=8000, beam_args=[])
    peaks, tokens = {}, {}
    for mb, shards in ((6, 1), (24, 4)):  # shards scale with the text: one size of shard
        corpus, out = tmp_path / f"c{mb}.jsonl", tmp_path / f"out{mb}"
        write_corpus(docs, corpus, mb)  # whole passes over the documents: at least `mb`
        _, peaks[mb], _ = measure(build_command(corpus, out, args, shards, None))
        tokens[mb] = json.loads((out / "index.json").read_text())["counters"]["document_tokens"]
        corpus.unlink()
    assert tokens[24] > 2.5 * tokens[6], tokens  # the bigger build did read several times the text
    assert peaks[24] <= 1.3 * peaks[6], peaks
