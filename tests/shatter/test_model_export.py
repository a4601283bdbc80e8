"""save_pretrained / from_pretrained: round trip, the files written, and clear errors."""

import hashlib
import json

import pytest
import torch

import shatter
from tests.shatter.shatter_tiny import ids, tiny


@pytest.mark.parametrize("arch", ["shatter", "bert", "bert-rpe"])
def test_round_trip_gives_the_same_model(tmp_path, arch):
    model = tiny(arch)
    tok = tmp_path / "spm.model"
    tok.write_bytes(b"\x0a\x03abc")
    out = shatter.save_pretrained(model, tmp_path / "export", tokenizer=tok)
    assert sorted(p.name for p in out.iterdir()) == [
        "checksums.json",
        "config.json",
        "model.safetensors",
        "tokenizer.model",
    ]
    assert json.loads((out / "config.json").read_text()) == model.config.to_dict()
    assert (out / "tokenizer.model").read_bytes() == tok.read_bytes()
    loaded = shatter.from_pretrained(out)
    assert not loaded.training and loaded.config == model.config
    assert (
        loaded.mlm_head.word_embeddings.weight is loaded.encoder.embeddings.word_embeddings.weight
    )
    x = ids(2, 11)
    torch.testing.assert_close(loaded(x)["logits"], model(x)["logits"], rtol=0, atol=0)


def test_overrides_and_config_errors(tmp_path):
    shatter.save_pretrained(tiny("shatter"), tmp_path)
    assert shatter.from_pretrained(tmp_path, dropout=0.2).config.dropout == 0.2
    data = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**data, "colour": "red"}))
    with pytest.raises(
        shatter.CheckpointError, match=r"config\.json.*unknown ModelConfig keys: colour"
    ):
        shatter.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(shatter.CheckpointError, match=r"config\.json is not valid JSON"):
        shatter.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**data, "hidden": 128}))
    with pytest.raises(shatter.CheckpointError, match=r"model\.safetensors .*does not match"):
        shatter.from_pretrained(tmp_path)


def test_missing_and_corrupt_files_are_named(tmp_path):
    with pytest.raises(shatter.CheckpointError, match="does not exist"):
        shatter.from_pretrained(tmp_path / "nowhere")
    shatter.save_pretrained(tiny("bert"), tmp_path)
    weights = tmp_path / "model.safetensors"
    blob = weights.read_bytes()
    weights.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(shatter.CheckpointError, match=str(weights)):
        shatter.from_pretrained(tmp_path)
    weights.unlink()
    with pytest.raises(shatter.CheckpointError, match=r"model\.safetensors is missing"):
        shatter.from_pretrained(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(shatter.CheckpointError, match=r"config\.json is missing"):
        shatter.from_pretrained(tmp_path)


def test_export_loads_at_a_longer_max_len(tmp_path):
    """Length extension in miniature: relative archs load unchanged into a longer config."""
    model = tiny("shatter", max_len=32)
    shatter.save_pretrained(model, tmp_path)
    longer = shatter.from_pretrained(tmp_path, max_len=128)
    x = ids(1, 30)
    torch.testing.assert_close(longer.encoder(x), model.encoder(x), rtol=1e-5, atol=1e-5)
    assert longer.encoder(ids(1, 100)).shape == (1, 100, 64)


def test_tokenizer_from_a_loaded_processor_and_no_temp_files(tmp_path):
    """A loaded SentencePieceProcessor is written as its serialized proto; like the other files
    it goes through a temporary name, so none is left behind."""
    spm = pytest.importorskip("sentencepiece")
    from shatter.pipeline.tokenizer import train

    (tmp_path / "t.model").write_bytes(
        train([f"the quick brown fox {i} jumps" for i in range(200)], 48)
    )
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "t.model"))
    out = shatter.save_pretrained(tiny("shatter"), tmp_path / "export", tokenizer=sp)
    assert sorted(p.name for p in out.iterdir()) == [
        "checksums.json",
        "config.json",
        "model.safetensors",
        "tokenizer.model",
    ]
    again = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    assert again.serialized_model_proto() == sp.serialized_model_proto()
    assert again.encode("the quick brown fox") == sp.encode("the quick brown fox")


def test_corrupted_weights_are_refused_and_old_exports_load_with_a_warning(
    tmp_path, caplog, flip_weights
):
    model = tiny("shatter")
    out = shatter.save_pretrained(model, tmp_path / "export")
    weights = out / "model.safetensors"
    digest = json.loads((out / "checksums.json").read_text())["model.safetensors"]
    assert digest == hashlib.sha256(weights.read_bytes()).hexdigest()
    good = weights.read_bytes()
    flip_weights(out)
    with pytest.raises(shatter.CheckpointError, match="model.safetensors is corrupted.*checksums"):
        shatter.from_pretrained(out)
    weights.write_bytes(good)
    (out / "checksums.json").unlink()  # an export written before checksums existed
    with caplog.at_level("WARNING", logger="shatter.checkpoint"):
        loaded = shatter.from_pretrained(out)
    assert "has no checksums.json" in caplog.text and str(weights) in caplog.text
    with torch.no_grad():
        x = ids(2, 8)
        torch.testing.assert_close(
            loaded.encoder(x, torch.ones_like(x)), model.encoder(x, torch.ones_like(x))
        )
