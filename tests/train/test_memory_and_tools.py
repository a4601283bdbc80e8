"""--dry-run's memory estimate (ZeRO formulas, measured activations) and train/plot_metrics.py."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import shatter
from shatter.train.memory import measure_activations, model_states

REPO = Path(__file__).resolve().parents[2]


def test_zero_stages_partition_what_the_paper_says():
    psi, n = 1_000_000, 8
    s = {k: model_states(psi, "fp16", k, n) for k in range(4)}
    assert s[0].total == 16 * psi  # 2 + 2 + 12 bytes per parameter (ZeRO paper, Fig. 1)
    assert s[1].total == 4 * psi + 12 * psi / n
    assert s[2].total == 2 * psi + 14 * psi / n
    assert s[3].total == 16 * psi / n
    assert model_states(psi, "fp32", 0, n).total == 16 * psi  # 4 + 4 + 8
    assert model_states(psi, "fp32", 1, 1).total == model_states(psi, "fp32", 0, 1).total


def test_activations_are_measured_linear_in_batch_and_halved_in_16_bit():
    model = shatter.build_model("bert-tiny", vocab_size=300)
    one = measure_activations(model, 2, 64, "fp32", 300)
    two = measure_activations(model, 4, 64, "fp32", 300)
    assert (
        one > 2 * 64 * model.config.hidden * 4 * model.config.layers
    )  # at least a hidden state per layer
    assert two == pytest.approx(2 * one, rel=0.15)
    assert measure_activations(model, 2, 64, "bf16", 300) < 0.7 * one
    longer = measure_activations(model, 2, 128, "fp32", 300)
    assert longer > 2.5 * one  # softmax attention saves L x L scores: more than linear in length


def test_dry_run_prints_configs_counts_and_verdict():
    from shatter.train.pretrain import main

    result = CliRunner().invoke(
        main,
        [
            "--config",
            str(REPO / "configs" / "cpu-tiny.yaml"),
            "--preset",
            "bert-tiny",
            "--seq-len",
            "64",
            "--dry-run",
        ],
    )
    assert result.exit_code == 0, result.output
    out = result.output
    assert '"train_batch_size": 32' in out  # micro 16 x 2 ranks (num_gpus of cpu-tiny.yaml)
    for stage in range(4):
        assert f"ZeRO-{stage} model states" in out
    assert "<- this run" in out and "fits" in out
    model = shatter.build_model(
        "bert-tiny", max_len=64
    )  # built at the training length, as pretrain.py does
    assert f"{shatter.count_parameters(model):,}" in out
    table2 = shatter.count_parameters(model.encoder)  # docs/model.md's count: no MLM head
    assert f"encoder without word embeddings (Table 2 convention): {table2:,}" in out
    assert table2 < shatter.count_parameters(model)
    # fp32 ZeRO-1 on this box: one fp32 reduction bucket (overlap_comm is off on CPU) of the
    # model's parameters rounded up to 2^20, not DeepSpeed's default 5e8 elements (1.86 GiB)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    bucket = -(-trained // 2**20) * 2**20
    label = "DeepSpeed reduction buckets (reduce_bucket_size, x2 with overlap_comm)"
    assert f"{label}: {bucket * 4 / 2**30:.2f} GiB" in out and bucket < 5e8 / 16
    largest = int(out.split("largest micro-batch that fits 24 GiB at ZeRO-1: ")[1].split()[0])
    assert largest > 16
    gpu = CliRunner().invoke(
        main, ["--config", str(REPO / "configs" / "cpu-tiny.yaml"), "--preset", "bert-tiny",
               "--seq-len", "64", "--precision", "bf16", "--dry-run", "--target", "gpu"],
    )  # fmt: skip
    assert gpu.exit_code == 0, gpu.output
    # a GPU's config: overlap_comm doubles the bf16 bucket, 2 x the cap x 2 B
    assert '"overlap_comm": true' in gpu.output
    assert f"{label}: {2 * bucket * 2 / 2**30:.2f} GiB" in gpu.output
    assert f'"reduce_bucket_size": {bucket}' in gpu.output  # the config DeepSpeed is given


def test_plot_metrics_draws_runs_and_names_a_bad_one(tmp_path):
    from shatter.train.plot_metrics import main

    runs = []
    for i in range(2):
        run = tmp_path / f"run{i}"
        run.mkdir()
        lines = [{"step": s, "loss": 8 - s / 10 - i, "lr": 1e-4} for s in range(1, 21)]
        lines += [
            {"step": s, "split": "validation", "loss": 8 - s / 9 - i, "accuracy": 0.1}
            for s in (10, 20)
        ]
        (run / "metrics.jsonl").write_text(
            "".join(json.dumps(x) + "\n" for x in lines) + '{"step": 21, "lo'
        )
        runs.append(str(run))
    png = tmp_path / "curves.png"
    result = CliRunner().invoke(main, [*runs, "-o", str(png), "--labels", "a,b"])
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    result = CliRunner().invoke(main, [str(tmp_path / "nope"), "-o", str(png)])
    assert result.exit_code == 1 and "nope" in result.output
    plm = tmp_path / "xlnet"
    plm.mkdir()
    (plm / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 7.0, "objective": "plm"}))
    result = CliRunner().invoke(main, [runs[0], str(plm), "-o", str(png)])
    assert result.exit_code == 1 and "mix objectives" in result.output


def test_plot_metrics_draws_tokens_per_s_and_mfu(tmp_path):
    from shatter.train.plot_metrics import main

    run = tmp_path / "run"
    run.mkdir()
    lines = [
        {"step": s, "loss": 5.0, "tokens_per_s": 8e5, "tokens_per_s_per_gpu": 1e5, "mfu": 0.4}
        for s in range(10, 60, 10)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    cost = tmp_path / "cost.png"
    result = CliRunner().invoke(
        main, [str(run), "-o", str(tmp_path / "a.png"), "--cost", str(cost)]
    )
    assert result.exit_code == 0, result.output
    assert cost.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and cost.stat().st_size > 10_000
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n")
    result = CliRunner().invoke(
        main, [str(run), "-o", str(tmp_path / "a.png"), "--cost", str(cost)]
    )
    assert result.exit_code == 1 and "no tokens_per_s lines" in result.output


def test_plot_metrics_names_each_run_apart(tmp_path):
    from shatter.train.plot_metrics import run_names

    a, b = tmp_path / "a" / "run", tmp_path / "b" / "run"
    assert run_names([a, b]) == ["a/run", "b/run"]
    assert run_names([tmp_path / "x", tmp_path / "y"]) == ["x", "y"]


def test_dry_run_counts_the_weights_a_v100_run_keeps(tmp_path):
    """In fp16 (a V100's precision) the dry run adds the W that `auto`'s rows-keep keeps where
    a run takes it (the base width's shape at 4 x 1024, two layers here: 2 x 12 x 4 x 1024² fp16
    = 0.19 GiB) to the peak; in bf16, or at l = 256 (rows-keep priced slower), nothing."""
    from shatter.train.pretrain import main

    config = tmp_path / "v100.yaml"
    config.write_text(
        "model:\n  preset: shatter-tiny\n"
        "  overrides: {hidden: 768, heads: 12, ffn: 768, max_len: 1024}\n"
        "data:\n  seq_len: 1024\nrun:\n  micro_batch: 4\n  precision: fp16\n  zero_stage: 1\n"
        "  num_gpus: 8\n  gpu_memory_gb: 16\n"
    )
    label = "W that auto's rows-keep keeps on a V100 or T4 in fp16"

    def dry(*flags: str) -> str:
        result = CliRunner().invoke(main, ["--config", str(config), "--dry-run", *flags])
        assert result.exit_code == 0, result.output
        return result.output

    def peak(out: str) -> float:
        return float(out.split("estimated peak per GPU at ZeRO-1: ")[1].split()[0])

    kept = dry()
    assert f"{label}: {2 * 12 * 4 * 1024**2 * 2 / 2**30:.2f} GiB" in kept
    bf16 = dry("--precision", "bf16", "--target", "gpu")  # the same DeepSpeed config as fp16's
    assert label not in bf16 and peak(kept) == pytest.approx(peak(bf16) + 0.19, abs=0.015)
    assert label not in dry("--seq-len", "256")
