"""Shared test fixtures: the location of ../shared/data, a shard dataset built from it by the real
pipeline, and offline settings for `datasets`."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

# setuptools first: DeepSpeed's JIT op loader imports it (through torch.utils.cpp_extension) in
# the test process, and after tests/test_docs.py has imported every documented program's module,
# setuptools' distutils shim found the standard library's distutils and failed its own assert.
import setuptools  # noqa: F401, E402

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without a GPU the Triton kernels run under Triton's interpreter on CPU tensors. It must be chosen
# before anything imports triton (its own tl.* helpers are decorated at import); with a GPU the
# same tests run the compiled kernels on CUDA tensors.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# DeepSpeed JIT-builds its CPU comm op into this directory; subprocesses the tests start inherit
# it, so every DeepSpeed run of the suite shares the trainer's per-environment build.
from shatter.train.engine import extensions_dir  # noqa: E402

os.environ.setdefault("TORCH_EXTENSIONS_DIR", extensions_dir())

REPO = Path(__file__).resolve().parents[1]
pytest_plugins = ("tests.s3server",)
from tests import background  # noqa: E402
from tests.jobs import jobs_end_with_their_test  # noqa: E402, F401 (autouse)  # `s3_server`: a real S3 server on loopback

SHARED_DATA = Path(os.environ.get("SHATTER_SHARED_DATA", REPO.parent / "shared" / "data"))
# The environment as the session found it (with the settings above): what background work
# (tests/background.py) gives its subprocesses, whatever a test running meanwhile sets here.
background.SESSION_ENV.update(os.environ)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """`../shared/data`, or a skip that says why: a user's fresh checkout does not have it."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real sample data not found at {SHARED_DATA} (set SHATTER_SHARED_DATA)")
    return SHARED_DATA


@pytest.fixture
def flip_weights():
    """Damage an export the way a bad disk or copy does: 64 bytes of its weights flipped (in the
    tensor data, so safetensors still parses the file). Returns the weights file."""

    def flip(export: Path) -> Path:
        weights = export / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-200:-136] = bytes(b ^ 0xFF for b in data[-200:-136])
        weights.write_bytes(bytes(data))
        return weights

    return flip


@pytest.fixture(scope="session")
def books_data(shared_data, tmp_path_factory) -> Path:
    """Real text (Gutenberg books of ../shared/data) through the real pipeline: length 64, vocab 2000."""
    out = tmp_path_factory.mktemp("books") / "data"
    cmd = [
        str(Path(sys.executable).parent / "shatter-data"),
        "build",
        "--corpus",
        "books",
        "--input",
        str(shared_data / "books"),
        "--output",
        str(out),
        "--seq-len",
        "64",
        "--vocab-size",
        "2000",
        "--dupe-factor",
        "2",
        "--num-shards",
        "4",
        "--validation-fraction",
        "0.05",
        "--seed",
        "0",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture(scope="session", autouse=True)
def started(request):
    """The BACKGROUND fixtures of the selected tests, started now (tests/background.py). A
    producer whose session fixtures skip (no ../shared/data) is left to its fixture."""
    work = {}
    for name, producer in background.declared(request.session.items).items():
        try:
            kwargs = {arg: request.getfixturevalue(arg) for arg in background.arguments(producer)}
        except pytest.skip.Exception:
            continue
        work[name] = (producer, kwargs)
    background.start(work)
    yield
    background.finish()


RENDEZVOUS_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
SESSION_RENDEZVOUS = {k: os.environ.get(k) for k in RENDEZVOUS_ENV}  # before any engine


@pytest.fixture(autouse=True)
def no_inherited_rendezvous():
    """An in-process engine (a world of one) sets RANK, WORLD_SIZE and MASTER_PORT in this
    process; a job a later test starts would inherit them, take itself for a launched rank and
    bind this process's port. After each test they are as the session found them."""
    yield
    for key, value in SESSION_RENDEZVOUS.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
