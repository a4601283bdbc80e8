"""Shared test fixtures: the location of ../shared/data, a shard dataset built from it by the real
pipeline, and offline settings for `datasets`."""

import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

# setuptools first: DeepSpeed's JIT op loader imports it (through torch.utils.cpp_extension) in
# the test process, and after tests/test_docs.py has imported every documented program's module,
# setuptools' distutils shim found the standard library's distutils and failed its own assert.
import setuptools  # noqa: F401, E402
from filelock import FileLock

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One OpenMP thread in the suite's processes and their children (set before torch loads its
# OpenMP): the xdist workers and their launches already fill the cores, and idle OpenMP threads
# spin; beside other jobs a tiny model's forward took 10x the CPU with 2 threads as with 1.
os.environ.setdefault("OMP_NUM_THREADS", "1")
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
# DeepSpeed's logger writes to the sys.stdout it finds when it is first imported. Imported here,
# before any test captures output: first imported inside a test that uses `capsys`, it would keep
# that test's stream, closed after it, and a later DeepSpeed warning ("OVERFLOW! Skipping step")
# would print a logging error and its traceback into another test's output.
import deepspeed  # noqa: E402, F401

REPO = Path(__file__).resolve().parents[1]
# One checkout's code: the suite of this checkout tests this checkout's `shatter` (a second clone
# run with another clone's venv first on the path would test the other's code without a word).
if Path(sys.modules["shatter"].__file__).resolve().parents[1] != REPO:
    pytest.exit(
        f"tests/conftest.py: these tests are {REPO}'s, but `shatter` is imported from "
        f"{Path(sys.modules['shatter'].__file__).resolve().parents[1]}; fix: run pytest from "
        f"{REPO} with its own venv (make test)",
        returncode=2,
    )
# `s3_server`: a real S3 server on loopback; `--cpu-durations`
pytest_plugins = ("tests.s3server", "tests.cputime")
from tests.jobs import jobs_end_with_their_test, run_command  # noqa: E402, F401 (autouse)

SHARED_DATA = Path(os.environ.get("SHATTER_SHARED_DATA", REPO.parent / "shared" / "data"))


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
    """Real text (Gutenberg books of ../shared/data) through the real pipeline: length 64, vocab
    2000; built once for all of pytest-xdist's workers."""
    return built_once(tmp_path_factory, "books", lambda out: build_books(shared_data, out))


def built_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """`build(out)`'s output, made once for the whole run: pytest-xdist gives each worker its own
    session fixtures, so the first worker to ask builds it under a lock shared by the run's
    workers (in the run's common temporary folder) and the others wait for it and reuse it."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        out = tmp_path_factory.mktemp(name) / "data"
        build(out)
        return out
    root = tmp_path_factory.getbasetemp().parent  # pytest-of-<user>/pytest-<n>: this run's
    out, done = root / name / "data", root / name / "done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():  # a worker whose build failed left no mark: the next one retries
            shutil.rmtree(root / name, ignore_errors=True)
            (root / name).mkdir()
            build(out)
            done.touch()
    return out


def build_books(shared_data: Path, out: Path) -> None:
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
    done = run_command(cmd, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


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
