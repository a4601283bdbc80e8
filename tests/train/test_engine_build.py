"""DeepSpeed's CPU op is JIT-built once per environment, checkout and torch build, and the build says so
before its silent minutes of gcc."""

from pathlib import Path

from shatter.train.engine import CPU_OP, announce_cpu_build, extensions_dir

REPO = Path(__file__).resolve().parents[2]


def test_two_checkouts_never_share_a_build(tmp_path):
    ours, other = extensions_dir(), extensions_dir(tmp_path / "another-checkout")
    assert ours != other and ours == extensions_dir(REPO)


def test_a_build_is_announced_only_when_there_is_none(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    announce_cpu_build()
    said = capsys.readouterr().err
    assert "building DeepSpeed's CPU communication op" in said and "CPU-seconds" in said
    (tmp_path / CPU_OP).mkdir()
    (tmp_path / CPU_OP / f"{CPU_OP}.so").write_bytes(b"")
    announce_cpu_build()  # a .so without ninja's log: ninja compiles again, so it is said
    assert "building DeepSpeed's CPU communication op" in capsys.readouterr().err
    (tmp_path / CPU_OP / ".ninja_log").write_text("# ninja log v5\n")
    announce_cpu_build()  # a log without the link's line: a build killed midway, said
    assert "building DeepSpeed's CPU communication op" in capsys.readouterr().err
    (tmp_path / CPU_OP / ".ninja_log").write_text(f"# ninja log v5\n0\t9\t0\t{CPU_OP}.so\tab\n")
    announce_cpu_build()
    assert capsys.readouterr().err == ""


def test_a_user_s_extensions_dir_is_keyed_by_the_torch_version(tmp_path, monkeypatch):
    """TORCH_EXTENSIONS_DIR set outside, and our own cache: the build goes to a subdirectory
    named by torch's (with its build label), DeepSpeed's and the Python ABI's versions, once (a
    child process inheriting it keeps it); another torch inheriting it gets a sibling, never the
    first one's op (which crashes it with `undefined symbol`)."""
    import sys

    import torch

    from shatter.train.engine import BUILD_KEY, build_key, keyed, use_extensions_dir

    key = build_key()
    assert BUILD_KEY.fullmatch(key) and f"torch{torch.__version__}-" in key
    assert key.endswith(sys.implementation.cache_tag + sys.abiflags)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    ours = use_extensions_dir()
    assert ours == str(tmp_path / key) and use_extensions_dir() == ours  # a child keeps it
    other = "torch2.11.0+cu130-deepspeed0.19.8-cpython-312"
    assert keyed(ours, other) == str(tmp_path / other) != ours
    assert keyed(str(tmp_path / other)) == ours  # and back: one directory per build
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert use_extensions_dir() == extensions_dir() and Path(extensions_dir()).name == key


def test_every_jit_build_is_announced_before_it_starts(tmp_path, monkeypatch, capsys):
    """Any DeepSpeed op JIT-built (not only the CPU comm op) prints a line before its compiler
    runs, and none when it is built already."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    from shatter.train.engine import announce_jit_builds

    said_before = []
    monkeypatch.setattr(OpBuilder, "jit_load", lambda self, verbose=True: said_before.append(
        capsys.readouterr().err) or "loaded")  # fmt: skip
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    announce_jit_builds()
    announce_jit_builds()  # once wrapped, not twice

    class FusedAdam:
        name = "fused_adam"

    assert OpBuilder.jit_load(FusedAdam()) == "loaded"
    assert said_before[0].count("building DeepSpeed's fused_adam op") == 1, said_before
    # a build that loads (load_built's) is used as it is: nothing said, the JIT builder not called
    from shatter.train import engine

    monkeypatch.setattr(OpBuilder, "_loaded_ops", {})  # DeepSpeed's cache of loaded ops, restored
    monkeypatch.setattr(
        engine, "load_built", lambda name, built: "built" if built.is_dir() else None
    )
    (tmp_path / "fused_adam").mkdir(exist_ok=True)
    assert OpBuilder.jit_load(FusedAdam()) == "built"
    assert len(said_before) == 1 and capsys.readouterr().err == ""


def test_ranks_on_one_host_leave_the_launcher_s_default_port(tmp_path, monkeypatch):
    """Two ranks launched on the default port 29500 agree on one free port (rank 0's pick,
    through a file of their launch); a port the user gave is kept."""
    import threading

    from shatter.train import engine

    ports = {}
    envs = [
        {"MASTER_PORT": "29500", "CROSS_SIZE": "1", "WORLD_SIZE": "2", "RANK": str(r)}
        for r in (0, 1)
    ]

    def agree(env: dict) -> None:
        engine.own_port_on_one_host(tmp_path / "launch", env)
        ports[env["RANK"]] = env["MASTER_PORT"]

    threads = [threading.Thread(target=agree, args=(e,)) for e in envs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert ports["0"] == ports["1"] != "29500", ports
    given = {"MASTER_PORT": "29533", "CROSS_SIZE": "1", "WORLD_SIZE": "2", "RANK": "0"}
    engine.own_port_on_one_host(tmp_path / "other", given)
    assert given["MASTER_PORT"] == "29533"


def test_a_build_killed_midway_leaves_no_lock_that_hangs_the_next_load(tmp_path, monkeypatch):
    """torch's JIT builder marks a build with a `<op>/lock` file and every later load waits for
    it to go; a build killed midway (SIGKILL, an OOM) never removes it. The next load, holding
    the OS lock that died with the killed builder, removes it."""
    import signal
    import subprocess
    import sys

    from torch.utils.file_baton import FileBaton

    from shatter.train.engine import _sole_builder

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    builder = subprocess.Popen(
        [sys.executable, "-c", "import time\nfrom shatter.train.engine import _sole_builder\n"
         f"with _sole_builder('op'):\n open({str(tmp_path / 'op' / 'lock')!r}, 'w').close()\n"
         " print('building', flush=True)\n time.sleep(60)"],
        stdout=subprocess.PIPE, text=True, env={**__import__("os").environ},
    )  # fmt: skip
    assert builder.stdout is not None and builder.stdout.readline() == "building\n"
    builder.send_signal(signal.SIGKILL)
    builder.wait()
    assert (tmp_path / "op" / "lock").is_file()  # what made every later load wait for good
    with _sole_builder("op"):
        baton = FileBaton(str(tmp_path / "op" / "lock"))
        assert baton.try_acquire()  # torch's builder goes on instead of waiting
        baton.release()


def test_a_finished_build_is_loaded_without_the_jit_builder(tmp_path, monkeypatch, capsys):
    """An op whose build finished (its .so, and ninja's log of linking it) loads as it is: torch's
    JIT builder (ninja, which rebuilds whenever its command line differs from the last one) is
    not run. A .so that ninja's log does not show linked, or that does not load (another torch's:
    `undefined symbol`), is rebuilt, and said: the latter removed first, as ninja would keep it."""
    import os
    import shutil

    import pytest
    from deepspeed.ops.op_builder.builder import OpBuilder

    from shatter.train.engine import announce_jit_builds, build_extensions, load_built

    build_extensions()  # make setup's build: nothing to do once it has run
    built = Path(os.environ["TORCH_EXTENSIONS_DIR"]) / CPU_OP
    module = load_built(CPU_OP, built)
    assert module is not None and hasattr(module, "initialize")
    copy = tmp_path / CPU_OP
    shutil.copytree(built, copy)
    log = (copy / ".ninja_log").read_text()
    (copy / ".ninja_log").write_text("".join(x for x in log.splitlines(True) if ".so\t" not in x))
    assert load_built(CPU_OP, copy) is None  # a link that did not finish
    (copy / ".ninja_log").write_text(log)
    (copy / f"{CPU_OP}.so").write_bytes(b"not an ELF file")
    assert load_built(CPU_OP, copy) is None
    monkeypatch.setattr(OpBuilder, "jit_load", lambda self, verbose=True: pytest.fail("built"))
    monkeypatch.setattr(OpBuilder, "_loaded_ops", {})
    announce_jit_builds()

    class Shm:
        name = CPU_OP

    assert OpBuilder.jit_load(Shm()) is not None and CPU_OP in OpBuilder._loaded_ops
    seen = []  # what torch's JIT builder would find in the build directory
    monkeypatch.setattr(OpBuilder, "jit_load", lambda self, verbose=True: seen.append(
        sorted(p.name for p in copy.iterdir())) or "rebuilt")  # fmt: skip
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    capsys.readouterr()
    announce_jit_builds()
    assert OpBuilder.jit_load(Shm()) == "rebuilt" and seen == [[]], seen
    assert "building DeepSpeed's CPU communication op" in capsys.readouterr().err
