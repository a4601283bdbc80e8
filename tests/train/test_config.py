"""Typed configs, YAML loading, flag overrides and the DeepSpeed config built from them."""

import os
from pathlib import Path

import pytest
import torch

from shatter.train.config import ConfigError, TrainConfig, load_yaml, resolve
from shatter.train.engine import deepspeed_config, param_groups, resolved_deepspeed_config

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def test_defaults_are_the_papers_optimisation():
    o = TrainConfig().optim
    assert (o.lr, o.betas, o.eps, o.weight_decay, o.warmup_steps, o.decay, o.grad_clip) == (
        1e-4,
        (0.9, 0.999),
        1e-6,
        0.01,
        10_000,
        "linear",
        1.0,
    )


def test_unknown_keys_are_rejected_naming_file_and_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run:\n  max_step: 10\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml.*max_step"):
        load_yaml(bad)
    bad.write_text("training:\n  max_steps: 10\n")
    with pytest.raises(ConfigError, match="training"):
        load_yaml(bad)


def test_flags_override_the_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("run:\n  max_steps: 10\n  micro_batch: 4\noptim:\n  betas: [0.8, 0.9]\n")
    cfg = resolve(
        str(f), {"max_steps": 7, "micro_batch": None, "masking": "dynamic", "seq_len": 32}
    )
    assert cfg.run.max_steps == 7 and cfg.run.micro_batch == 4
    assert cfg.optim.betas == (0.8, 0.9)
    assert cfg.data.masking == "dynamic" and cfg.data.seq_len == 32
    with pytest.raises(ConfigError, match="precision"):
        resolve(str(f), {"precision": "fp8"})


def test_each_flag_is_declared_once_on_its_config_field(tmp_path):
    """The flags of train/pretrain.py, FLAGS and docs/training.md's table all come from the
    `option(...)` fields of the config: a flag given on the command line lands in its field."""
    from shatter.options import docs_table
    from shatter.train.config import FLAGS, SECTIONS
    from shatter.train.pretrain import main

    table = docs_table(SECTIONS)
    assert table in (REPO / "docs" / "training.md").read_text(), (
        "docs/training.md's flag table is not the declared one: paste the output of "
        "python -c 'from shatter.options import docs_table; from shatter.train.config import SECTIONS; "
        "print(docs_table(SECTIONS))'"
    )
    params = {p.name: p for p in main.params}
    assert set(FLAGS) <= set(params) and FLAGS["optim_impl"] == "optim.impl"
    assert all(params[name].default is None for name in FLAGS)  # unset: the config file's value
    assert params["zero_stage"].type.max == 3 and params["precision"].type.choices
    args = ["--max-steps", "7", "--no-progress", "--optim-impl", "deepspeed", "--data", "D"]
    parsed = main.make_context("pretrain.py", args).params
    cfg = resolve(None, {k: v for k, v in parsed.items() if k in FLAGS})
    assert (cfg.run.max_steps, cfg.run.progress, cfg.optim.impl) == (7, False, "deepspeed")
    assert cfg.data.path == "D" and cfg.run.micro_batch == TrainConfig().run.micro_batch


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_load(path):
    cfg = load_yaml(path).validate()
    if path.name.startswith("v100x8"):
        assert cfg.model.preset == "shatter-base"
        r = cfg.run
        assert (
            r.micro_batch * r.grad_accum * r.num_gpus,
            cfg.data.seq_len,
            r.max_steps,
            r.precision,
        ) == (128, 256, 1_600_000, "fp16")


@pytest.mark.parametrize("arch", ["bert", "xlnet", "no-position"])
def test_one_gpu_config_serves_every_arch(arch):
    """One config plus --preset gives every row of the paper's GPU table; the objective follows
    the arch (plm for xlnet) unless the config or a flag sets it."""
    from shatter.train.plm import with_objective

    cfg = with_objective(
        resolve(str(REPO / "configs" / "v100x8-base-256.yaml"), {"preset": f"{arch}-base"})
    )
    assert cfg.model.preset == f"{arch}-base"
    assert cfg.data.objective == ("plm" if arch == "xlnet" else "mlm")
    assert (cfg.data.seq_len, cfg.run.precision) == (256, "fp16")


def test_fp16_config_validated_by_deepspeed():
    """fp16 cannot run on this CPU: its DeepSpeed config is checked by DeepSpeed's own parser."""
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = load_yaml(REPO / "configs" / "v100x8-base-256.yaml")
    assert deepspeed_config(cfg, 8, cpu=False)["train_batch_size"] == 128
    parsed = DeepSpeedConfig(
        deepspeed_config(cfg, 1, cpu=False)
    )  # DeepSpeed checks batch = micro x accum x its world
    fp16 = parsed.float16_config
    assert fp16.enabled and fp16.loss_scale == 0  # 0 = dynamic loss scaling
    assert fp16.initial_scale_power == 16 and fp16.loss_scale_window == 1000
    assert not parsed.bfloat16_config.enabled
    assert parsed.zero_optimization_stage == 1 and parsed.gradient_clipping == 1.0
    # a GPU's default: torch's fused AdamW, a client optimizer (no optimizer section to build)
    assert parsed.optimizer_name is None and parsed.scheduler_name == "WarmupDecayLR"
    assert parsed.scheduler_params["total_num_steps"] == 1_600_000
    assert parsed.scheduler_params["warmup_num_steps"] == 10_000
    with pytest.raises(ConfigError, match="GPU"):
        deepspeed_config(cfg, 8, cpu=True)


def test_contiguous_gradients_off_for_zero1_on_one_gpu_only():
    """DeepSpeed's contiguous gradient bucket: off for ZeRO-1 on one rank (no reduction to
    stage; the memory estimate then counts no bucket), on with more ranks (its reduce-scatter
    path) and for ZeRO-2."""
    from shatter.train.memory import bucket_bytes

    zero = lambda stage, world: deepspeed_config(  # noqa: E731
        resolve(None, {"zero_stage": stage, "precision": "bf16"}), world, cpu=False
    )["zero_optimization"]
    assert zero(1, 1)["contiguous_gradients"] is False
    assert zero(1, 8)["contiguous_gradients"] is True
    assert zero(2, 1)["contiguous_gradients"] is True
    assert bucket_bytes({"zero_optimization": zero(1, 1)}, "bf16") == 0
    assert bucket_bytes({"zero_optimization": zero(1, 8)}, "bf16") == 2 * 5e8 * 2  # overlap_comm


def test_the_reduction_bucket_is_capped_at_the_model_s_gradients():
    """ZeRO-1/2's reduce_bucket_size at most the trainable parameters rounded up to 2^20
    elements (DeepSpeed allocates the whole bucket whatever the model; one that holds every
    gradient is reduced once, at the backward's end, as the default 5e8 was); a smaller one
    (an expert's --deepspeed-config) kept; ZeRO-0 and 3 and the given dict untouched."""
    import torch

    from shatter.train.engine import fit_reduce_bucket

    model = torch.nn.Sequential(torch.nn.Linear(1000, 1500), torch.nn.Linear(1500, 2))
    model[1].weight.requires_grad_(False)  # frozen: no gradient to reduce
    trained = 1000 * 1500 + 1500 + 2
    ds = deepspeed_config(resolve(None, {"zero_stage": 1, "precision": "bf16"}), 8, cpu=False)
    fitted = fit_reduce_bucket(ds, model)
    assert fitted["zero_optimization"]["reduce_bucket_size"] == 2 * 2**20 >= trained
    assert ds["zero_optimization"]["reduce_bucket_size"] == int(5e8)  # not mutated
    unchanged = lambda zero: {**zero, "reduce_bucket_size": 0}  # noqa: E731
    assert unchanged(fitted["zero_optimization"]) == unchanged(ds["zero_optimization"])
    small = {**ds, "zero_optimization": {**ds["zero_optimization"], "reduce_bucket_size": 10**6}}
    assert fit_reduce_bucket(small, model) == small
    for stage in (0, 3):
        other = deepspeed_config(resolve(None, {"zero_stage": stage, "precision": "bf16"}), 8)
        assert fit_reduce_bucket(other, model) == other


def test_the_optimizer_implementation_flag(monkeypatch):
    import torch

    from shatter.train.engine import client_optimizer, cuda_arch_list_for_jit, param_groups

    gpu = resolve(None, {})
    fused = resolve(None, {"optim_impl": "deepspeed"})
    assert "optimizer" not in deepspeed_config(gpu, 8, cpu=False)
    built = deepspeed_config(fused, 8, cpu=False)["optimizer"]
    assert built["type"] == "AdamW" and built["params"]["torch_adam"] is False
    for cfg in (gpu, fused):  # a CPU: DeepSpeed builds torch's AdamW either way
        assert deepspeed_config(cfg, 2, cpu=True)["optimizer"]["params"]["torch_adam"] is True
    with pytest.raises(ConfigError, match="optim.impl"):
        resolve(None, {"optim_impl": "apex"})
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = client_optimizer(param_groups(model, 0.01), gpu.optim)
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["fused"] is True
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]
    assert opt.defaults["eps"] == 1e-6 and opt.defaults["betas"] == (0.9, 0.999)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a;9.0;8.6+PTX")
    cuda_arch_list_for_jit()  # DeepSpeed's op builder reads int() of each part
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0;8.6"


def test_expert_deepspeed_config_merges_over_the_built_one(tmp_path):
    f = tmp_path / "ds.json"
    f.write_text(
        '{"zero_optimization": {"stage": 2, "overlap_comm": false}, "gradient_clipping": 0.5}'
    )
    cfg = resolve(None, {"deepspeed_config": str(f), "micro_batch": 3, "grad_accum": 2})
    ds = resolved_deepspeed_config(cfg, world_size=4, cpu=True)
    assert ds["zero_optimization"]["stage"] == 2 and ds["gradient_clipping"] == 0.5
    assert ds["optimizer"]["params"]["torch_adam"] is True
    assert ds["train_batch_size"] == 24


def test_no_weight_decay_on_biases_and_layernorm():
    import shatter

    model = shatter.build_model("shatter-tiny", vocab_size=50)
    decay, no_decay = param_groups(model, 0.01)
    names = {id(p): n for n, p in model.named_parameters()}
    exempt = {names[id(p)] for p in no_decay["params"]}
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    assert exempt and all(n.endswith("bias") or "norm" in n for n in exempt)
    assert any(n.endswith("bias") for n in exempt) and any(
        "norm" in n and n.endswith("weight") for n in exempt
    )
    decayed = {names[id(p)] for p in decay["params"]}
    assert "encoder.embeddings.word_embeddings.weight" in decayed
    assert all(not n.endswith("bias") for n in decayed)
    total = sum(p.numel() for g in (decay, no_decay) for p in g["params"])
    assert total == sum(
        p.numel() for p in model.parameters()
    )  # every parameter once (tied weights too)
    assert isinstance(decay["params"][0], torch.nn.Parameter)


def test_the_default_warm_up_scales_with_a_short_run_but_a_set_one_is_kept(tmp_path):
    from shatter.train.config import lr_at, resolve, schedule_problem

    short = resolve(None, {"max_steps": 20})
    assert short.optim.warmup_steps == 2 and schedule_problem(short) is None
    assert max(lr_at(short.optim, 20, s) for s in range(1, 21)) == short.optim.lr
    assert resolve(None, {"max_steps": 10**6}).optim.warmup_steps == 10_000  # the paper's §A.2
    kept = resolve(None, {"max_steps": 20, "warmup_steps": 100})
    assert kept.optim.warmup_steps == 100
    problem = schedule_problem(kept)
    assert "warm-up (100 steps) is not shorter than the run (20 steps)" in problem
    assert "lr never reaches its peak" in problem
    # DeepSpeed's two-step lag: the last of 20 steps runs at 18/100 of the peak, not 20/100
    assert "it is 1.8e-05 at the last step" in problem
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("optim:\n  warmup_steps: 50\nrun:\n  max_steps: 40\n")
    assert resolve(str(yaml_file), {}).optim.warmup_steps == 50  # the file sets it: kept, warned
    assert schedule_problem(resolve(str(yaml_file), {})) is not None


def test_outputs_under_a_file_or_of_the_wrong_kind_are_refused(tmp_path):
    from shatter.train.config import ConfigError, check_output

    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ConfigError, match="under .*afile, which is a file"):
        check_output(afile / "run" / "deeper", directory=True)
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        check_output(afile, directory=True)
    with pytest.raises(ConfigError, match="is a directory; give a file name"):
        check_output(tmp_path, directory=False)
    check_output(tmp_path / "new" / "run", directory=True)
    check_output(tmp_path / "result.json", directory=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # checks create nothing


def test_zero_1_is_the_default_in_16_bit_and_a_set_stage_is_kept(tmp_path):
    """bf16/fp16 without a stage run ZeRO-1 (DeepSpeed's ZeRO optimizer holds the fp32 masters);
    fp32 stays at ZeRO-0; a stage set in the file or by a flag wins. The built DeepSpeed config
    (and so --dry-run's) follows the resolved stage."""
    assert resolve(None, {}).run.zero_stage == 0
    for precision in ("bf16", "fp16"):
        cfg = resolve(None, {"precision": precision})
        assert cfg.run.zero_stage == 1
        assert deepspeed_config(cfg, 8, cpu=False)["zero_optimization"]["stage"] == 1
    assert resolve(None, {"precision": "bf16", "zero_stage": 0}).run.zero_stage == 0
    f = tmp_path / "c.yaml"
    f.write_text("run: {precision: bf16, zero_stage: 0}\n")
    assert resolve(str(f), {}).run.zero_stage == 0
    f.write_text("run: {precision: bf16}\n")
    assert resolve(str(f), {}).run.zero_stage == 1
