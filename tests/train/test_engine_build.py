"""DeepSpeed's CPU op is JIT-built once per environment and checkout, and the build says so
before its silent minute of gcc."""

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
    assert "building DeepSpeed's CPU communication op" in said and "1 minute" in said
    (tmp_path / CPU_OP).mkdir()
    (tmp_path / CPU_OP / f"{CPU_OP}.so").write_bytes(b"")
    announce_cpu_build()
    assert capsys.readouterr().err == ""
