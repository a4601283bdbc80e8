"""The paper's ablation study (§3, Figure 3) and length-extension study, run by the project's CLIs.

    python tools/reproduce.py ablation  --scale cpu --input wiki=DUMP.xml.bz2 --output runs/study
    python tools/reproduce.py extension --scale cpu --input wiki=DUMP.xml.bz2 --output runs/study
    python tools/reproduce.py science --scale gpu-small --data .science/l128 --output runs/science \
        --budget-seconds 180

`science` is one GPU call's answer (.ci/gpu/run.sh science): bert and shatter pretrained for the
same tokens, each in a time box of --budget-seconds, evaluated at l_train and, after
`shatter-extend`, at 2 l_train (bert with --init copy and random): OUTPUT/science.md (one table)
and science.png (validation loss over tokens).

Every step is a user-facing command run as a subprocess, so the study exercises exactly the code
users run: `shatter-data build` (the training data at l_train, and validation data at 2x and 4x
l_train with the same tokenizer), `train/pretrain.py` (under `deepspeed` when --ranks > 1),
`shatter-extend` and `train/evaluate_cli.py` (one process per model, at all its lengths). Each run
is an ordinary run directory under OUTPUT/runs/ with its own log (reproduce.log); running the
same command again skips what is finished (an export at the last step and the final validation
line) and resumes the rest from their checkpoints. The studies share OUTPUT/runs/, so an
extension study in the directory of an ablation study reuses its shatter, bert, bert-rpe,
bert-rab and no-position runs; they share OUTPUT/eval/ too, so a science call in the directory
of an extension study of the same scale reuses its evaluations.

Outputs: OUTPUT/ablation.md, ablation.png, extension.md, extension.png and results.jsonl (one
line per run or evaluation). See docs/results.md for the presets and the figures they gave.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import click
import yaml

from shatter.accelerator import say_deepspeed_accelerator
from shatter.attention import ATTENTIONS
from shatter.extras import require
from shatter.train.plm import default_objective
from shatter.train.plot_metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# Figure 3 of the paper, in the order the variants are developed (§3.1-3.3), with its labels.
PAPER_NAMES = {
    "bert": "BERT_Base",
    "no-position": "No_Position",
    "part-mask": "Part_Mask",
    "1h-softmax": "1H_Softmax",
    "1h-sigmoid": "1H_Sigmoid",
    "part-bias": "Part_Bias",
    "shatter": "Shatter",
    "bert-rpe": "BERT-RPE",
    "bert-rab": "BERT-RAB",
}
# What §3 says of each step of Figure 3: (arch, compared with, expected sign of the loss
# difference arch - other: +1 higher, -1 lower, 0 about equal or lower), the paper's words.
PAPER_STEPS = [
    ("no-position", "bert", +1, "removing position embeddings: valid loss > 6 against BERT's ~2"),
    ("part-mask", "no-position", -1, "multiplying N largely closes the gap (§3.1)"),
    ("1h-softmax", "part-mask", +1, "single-headed softmax: slightly worse (§3.2)"),
    ("1h-sigmoid", "1h-softmax", -1, "L2-normalised sigmoid: significantly improved (§3.2)"),
    ("part-bias", "1h-sigmoid", -1, "adding the bias B lowers the loss (§3.3)"),
    ("shatter", "part-bias", -1, "adding the partition value embeddings lowers it (§3.3)"),
    ("shatter", "bert", 0, "Shatter matches BERT_Base's valid loss (§3.3)"),
]
EXTENSION_ARCHS = ("shatter", "bert", "bert-rpe", "bert-rab", "no-position")
SCIENCE_ARCHS = ["bert", "shatter"]  # one GPU call's pair (Figure 3's ends, Tables 1-2's claim)
INITS = ("random", "copy")  # shatter-extend --init, for archs with absolute position rows


@dataclass(frozen=True)
class Scale:
    """A study preset: model size, training length, schedule and the pretrain.py config."""

    name: str
    size: str
    seq_len: int
    steps: int
    eval_every: int
    ranks: int
    vocab_size: int
    config: dict = field(default_factory=dict)  # pretrain.py --config sections


SCALES = {
    # 2 CPU cores: the tiny preset at l = 128, two gloo ranks of 16 rows (batch 32), sized for
    # ~40 minutes per study on this project's 2-core box. A 2000-piece vocabulary (words split
    # into more pieces, so neighbours predict each other) and lr 3e-3 gave the lowest loss of
    # the settings tried in that budget; docs/results.md says what was tried and what it showed.
    # eval_samples keeps each validation pass to seconds.
    "cpu": Scale(
        name="cpu",
        size="tiny",
        seq_len=128,
        steps=600,
        eval_every=100,
        ranks=2,
        vocab_size=2000,
        config={
            "data": {"masking": "static", "num_workers": 1, "eval_samples": 512},
            "optim": {"lr": 3.0e-3, "warmup_steps": 60},
            "run": {
                "micro_batch": 16,
                "grad_accum": 1,
                "precision": "fp32",
                "zero_stage": 1,
                "save_every": 200,
                "log_every": 10,
                "keep_checkpoints": 1,
                "progress": False,
            },
        },
    ),
    # One GPU call (.ci/gpu/run.sh science): the small preset at l = 128 on the carried dataset
    # (tools/science_data.py, ~1M training tokens: dynamic masking gives each epoch new masks),
    # one GPU, bf16, 128 rows a step (16k tokens), 2000 steps = 33M tokens per model, which
    # should take under the step's 180 s per model on an H100 (a guess until a GPU times it:
    # the run then fails on its budget, naming it, rather than overrunning the call).
    "gpu-small": Scale(
        name="gpu-small",
        size="small",
        seq_len=128,
        steps=2000,
        eval_every=200,
        ranks=1,
        vocab_size=8000,
        config={
            "data": {"masking": "dynamic", "num_workers": 2, "eval_samples": 512},
            "optim": {"lr": 1.0e-3, "warmup_steps": 200},
            "run": {
                "micro_batch": 128,
                "grad_accum": 1,
                "precision": "bf16",
                "zero_stage": 0,
                "save_every": 0,
                "log_every": 50,
                "keep_checkpoints": 1,
                "progress": False,
            },
        },
    ),
    # GPUs: the paper's base size at its GPU length 256, the §A.2 optimiser, fp16 as on V100s
    # (pass --config with run.precision: bf16 on A100/H100). Per-GPU batch 16.
    "gpu": Scale(
        name="gpu",
        size="base",
        seq_len=256,
        steps=100_000,
        eval_every=5_000,
        ranks=0,  # 0: every visible GPU
        vocab_size=32000,
        config={
            "data": {"masking": "static", "num_workers": 2, "eval_samples": 16384},
            "optim": {"lr": 1.0e-4, "warmup_steps": 10_000},
            "run": {
                "micro_batch": 16,
                "grad_accum": 1,
                "precision": "fp16",
                "zero_stage": 1,
                "save_every": 5_000,
                "log_every": 100,
                "keep_checkpoints": 2,
                "progress": False,
            },
        },
    ),
}


class StudyError(click.ClickException):
    """A failed step: one line naming the run, its command and its log."""


def merge(base: dict, over: dict) -> dict:
    """`over` deep-merged into a copy of `base` (a YAML config's sections)."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def free_port() -> int:
    """A TCP port free on this host now, for the DeepSpeed launcher's rendezvous (its default,
    29500, is shared by every job on the host: two at once would join each other's collectives)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (None for a single value)."""
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) if len(values) > 1 else None)


def fmt(mean: float, std: float | None, digits: int = 3) -> str:
    return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if std is not None else "")


def stop_group(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM to the process group of `proc` (the launcher, its ranks, their workers: the
    trainer saves and exits, a JIT build releases its lock), SIGKILL after `grace_s`."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class Study:
    """The shared machinery: data, runs, progress, failures."""

    def __init__(self, output: Path, scale: Scale, opts: dict):
        self.output = output
        self.scale = scale
        self.seq_len = opts["seq_len"] or scale.seq_len
        self.steps = opts["steps"] or scale.steps
        self.eval_every = opts["eval_every"] or scale.eval_every
        self.seeds = list(range(opts["seeds"]))
        self.ranks = opts["ranks"] if opts["ranks"] is not None else scale.ranks
        if self.ranks == 0:
            import torch

            self.ranks = max(torch.cuda.device_count(), 1)
        self.inputs = list(opts["inputs"])
        self.corpus = opts["corpus"]
        self.vocab_size = opts["vocab_size"] or scale.vocab_size
        self.data_arg = opts["data"]
        self.budget = opts.get("budget_seconds")  # a pretraining run's time box (None: none)
        config = scale.config
        if opts["config"]:
            extra = yaml.safe_load(Path(opts["config"]).read_text()) or {}
            if not isinstance(extra, dict):
                raise click.BadParameter(
                    f"{opts['config']}: not a mapping of sections", param_hint="--config"
                )
            config = merge(config, extra)
        self.config = merge(config, {"run": {"eval_every": self.eval_every}})
        self.started = time.perf_counter()
        self.planned: dict[str, int] = {}  # kind of step ("pretrain", "evaluate", ...) -> count
        self.done: dict[str, int] = {}
        self.seconds: dict[str, list[float]] = {}  # wall times of the steps this call executed
        output.mkdir(parents=True, exist_ok=True)
        self.config_path = output / "pretrain.yaml"
        self.config_path.write_text(
            "# written by tools/reproduce.py: the pretrain.py --config of every run of the study\n"
            + yaml.safe_dump(self.config, sort_keys=False)
        )

    # -- subprocesses ------------------------------------------------------------------------

    def execute(self, name: str, cmd: list, log: Path, budget: float | None = None) -> float:
        """Run `cmd` with its output in `log` (appended), in `budget` seconds when given; a
        failure ends the study in one line."""
        cmd = [str(c) for c in cmd]
        log.parent.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        with open(log, "a") as f:
            f.write(f"\n$ {' '.join(cmd)}\n")
            f.flush()
            proc = subprocess.Popen(
                cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                code = proc.wait(timeout=budget)
            except subprocess.TimeoutExpired:
                stop_group(proc)
                raise StudyError(
                    f"run {name} took over its budget of {budget:.0f} s (--budget-seconds): "
                    f"give it fewer --steps; its output is in {log}"
                ) from None
        if code != 0:
            raise StudyError(
                f"run {name} failed (exit {code}): {' '.join(cmd)}; its output is in {log}"
            )
        return time.perf_counter() - start

    def progress(self, kind: str, name: str, seconds: float | None) -> None:
        """One line per finished step: its time, the elapsed time and an estimate of the rest
        (each kind of step left times the mean of that kind so far)."""
        self.done[kind] = self.done.get(kind, 0) + 1
        if seconds is not None:
            self.seconds.setdefault(kind, []).append(seconds)
        left = 0.0
        for k, planned in self.planned.items():
            times = self.seconds.get(k) or [t for ts in self.seconds.values() for t in ts] or [0.0]
            left += max(planned - self.done.get(k, 0), 0) * statistics.fmean(times)
        took = "already done, skipped" if seconds is None else f"done in {seconds:.0f} s"
        done, total = sum(self.done.values()), sum(self.planned.values())
        estimate = f"~{left:.0f} s left" if self.seconds else "time left: after the first new step"
        click.echo(
            f"[{done}/{total}] {kind} {name}: {took}; elapsed "
            f"{time.perf_counter() - self.started:.0f} s, {estimate}",
            err=True,
        )

    # -- data --------------------------------------------------------------------------------

    def train_data(self) -> Path:
        """The training dataset: --data as given, or built from --input at l_train."""
        if self.data_arg:
            if not (self.data_arg / "index.json").is_file():
                raise click.BadParameter(
                    f"{self.data_arg} has no index.json (build it with shatter-data build)",
                    param_hint="--data",
                )
            return self.data_arg
        if not self.inputs:
            raise click.UsageError(
                "give --input (a corpus for shatter-data build, e.g. wiki=DUMP.xml.bz2 or books=DIR) or --data"
            )
        out = self.output / "data" / f"l{self.seq_len}"
        if not (out / "index.json").is_file():
            self.build(out, self.seq_len, ["--vocab-size", self.vocab_size], self.inputs)
        return out

    def build(self, out: Path, seq_len: int, extra: list, inputs: list[str], holdout=None) -> None:
        """`shatter-data build` into `out` (validation: 5% of documents, by document hash)."""
        fraction, seed = holdout or (0.05, 0)
        cmd = [BIN / "shatter-data", "build", "--corpus", self.corpus]
        for item in inputs:
            cmd += ["--input", item]
        cmd += ["--output", out, "--seq-len", seq_len, *extra, "--overwrite"]
        cmd += ["--validation-fraction", fraction, "--seed", seed, "--progress-seconds", 0]
        name = f"data-l{seq_len}"
        seconds = self.execute(name, cmd, self.output / "data" / f"{name}.log")
        click.echo(f"built {out} in {seconds:.0f} s", err=True)

    def data_at(self, train: Path, seq_len: int) -> Path:
        """Validation data at `seq_len` with the training data's tokenizer and held-out documents."""
        index = json.loads((train / "index.json").read_text())
        if index["seq_len"] == seq_len:
            return train
        for out in (train.parent / f"l{seq_len}", self.output / "data" / f"l{seq_len}"):
            if (out / "index.json").is_file():  # beside --data (tools/science_data.py), or built
                return out
        config = index.get("config", {})
        inputs = self.inputs or [
            f"{item['corpus']}={item['path']}" for item in config.get("inputs", [])
        ]
        if not inputs:
            raise click.UsageError(
                f"{train}/index.json records no inputs: give --input to build length-{seq_len} data"
            )
        holdout = (config.get("validation_fraction", 0.05), config.get("seed", 0))
        tokenizer = ["--tokenizer", train / "tokenizer.model"]
        self.build(out, seq_len, tokenizer, inputs, holdout)
        return out

    # -- pretraining -------------------------------------------------------------------------

    def run_dir(self, arch: str, seed: int) -> Path:
        return self.output / "runs" / f"{arch}-s{seed}"

    def pretrain_command(self, arch: str, seed: int, data: Path) -> list:
        script = ["train/pretrain.py"]
        if self.ranks > 1:
            launcher = [BIN / "deepspeed", "--num_gpus", self.ranks]
        else:
            launcher = [sys.executable]
        return [
            *launcher,
            *script,
            "--config",
            self.config_path,
            "--data",
            data,
            "--output",
            self.run_dir(arch, seed),
            "--preset",
            f"{arch}-{self.scale.size}",
            "--max-steps",
            self.steps,
            "--seed",
            seed,
            "--seq-len",
            self.seq_len,
            "--eval-every",
            self.eval_every,
        ]

    def finished(self, run: Path) -> bool:
        """An export of the last step and the last step's validation line."""
        from shatter.train.checkpoint import EXPORT, EXPORT_STEP

        step_file = run / EXPORT / EXPORT_STEP
        if not step_file.is_file() or not (run / "metrics.jsonl").is_file():
            return False
        if int(step_file.read_text().split()[0].removeprefix("step")) != self.steps:
            return False
        _, val = read_metrics(run)
        return bool(val) and val[-1][0] == self.steps

    def pretrain(self, arch: str, seed: int, data: Path) -> None:
        run = self.run_dir(arch, seed)
        cmd = [str(c) for c in self.pretrain_command(arch, seed, data)]
        record_path = run / "reproduce.json"
        record = json.loads(record_path.read_text()) if record_path.is_file() else None
        wanted = {"command": cmd, "config": self.config}
        if record is not None and {k: record.get(k) for k in wanted} != wanted:
            raise StudyError(
                f"run {run.name}: {run} was started by a different study command or config "
                f"(see {record_path}); use another --output or delete {run}"
            )
        if record is not None and self.finished(run):
            self.progress("pretrain", run.name, None)
            return
        record = record or {**wanted, "wall_s": 0.0}
        run.mkdir(parents=True, exist_ok=True)
        record_path.write_text(json.dumps(record, indent=1) + "\n")
        launch = cmd
        if self.ranks > 1:  # a port of its own: two studies on one host must not share a master
            launch = [*cmd[:3], "--master_port", str(free_port()), *cmd[3:]]
        say_deepspeed_accelerator()  # the launcher's and ranks' logs then hold no guess of it
        seconds = self.execute(run.name, launch, run / "reproduce.log", self.budget)
        if not self.finished(run):
            raise StudyError(
                f"run {run.name} ended without an export at step {self.steps}: {' '.join(cmd)}; "
                f"its output is in {run / 'reproduce.log'}"
            )
        record["wall_s"] += seconds
        record_path.write_text(json.dumps(record, indent=1) + "\n")
        self.progress("pretrain", run.name, seconds)

    def summary(self, arch: str, seed: int) -> dict:
        """Final validation loss and accuracy, curve, parameters, tokens/s, wall time of a run."""
        import shatter

        run = self.run_dir(arch, seed)
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
        val = [x for x in lines if x.get("split") == "validation"]
        speeds = [x["tokens_per_s"] for x in lines if x.get("tokens_per_s")][1:]  # not warm-up
        model = shatter.from_pretrained(run / "export")
        return {
            "arch": arch,
            "seed": seed,
            "run": str(run),
            "steps": self.steps,
            "seq_len": self.seq_len,
            "loss": val[-1]["loss"],
            "accuracy": val[-1]["accuracy"],
            "curve": [[x["step"], x["loss"]] for x in val],
            "params": sum(p.numel() for p in model.parameters()),
            "tokens_per_s": statistics.median(speeds) if speeds else None,
            "wall_s": json.loads((run / "reproduce.json").read_text())["wall_s"],
        }

    def header(self, title: str) -> list[str]:
        return [
            f"# {title}",
            "",
            f"Scale `{self.scale.name}` (the `{self.scale.size}` presets), l_train = {self.seq_len}, {self.steps} steps, "
            f"{self.ranks} rank(s), seeds {', '.join(map(str, self.seeds))}; pretrain config "
            f"`{self.config_path.name}`; runs under `runs/`. Written by `tools/reproduce.py`.",
            "",
        ]


# -- the ablation study ----------------------------------------------------------------------


def verdict(a: list[float], b: list[float], sign: int) -> str:
    """Does mean(a) - mean(b) have the paper's sign, beyond the seed-to-seed spread?"""
    (ma, sa), (mb, sb) = mean_std(a), mean_std(b)
    delta = ma - mb
    spread = max(s for s in (sa, sb, 0.0) if s is not None)
    if spread and abs(delta) < spread:
        return f"{delta:+.3f}: within the seed spread (±{spread:.3f})" + (
            ", consistent with the paper" if sign == 0 else ", undecided"
        )
    ok = delta < 0 if sign < 0 else delta > 0 if sign > 0 else delta <= 0
    note = "" if spread else " (one seed: spread not measured)"
    return f"{delta:+.3f}: {'reproduces' if ok else 'does NOT reproduce'}{note}"


def run_ablation(study: Study, archs: list[str]) -> None:
    data = study.train_data()
    study.planned = {"pretrain": len(archs) * len(study.seeds)}
    for seed in study.seeds:
        for arch in archs:
            study.pretrain(arch, seed, data)
    rows = [study.summary(arch, seed) for seed in study.seeds for arch in archs]
    append_results(study.output, "ablation", rows)
    by_arch = {a: [r for r in rows if r["arch"] == a] for a in archs}
    order = [a for a in PAPER_NAMES if a in archs]
    lines = study.header("Ablation study (§3, Figure 3)")
    lines += [
        "Final validation MLM loss and accuracy (mean ± sample std over seeds), parameters, "
        "median training tokens/s as logged, pretraining wall time (the mean over seeds).",
        "",
        "| arch | paper | val loss | val accuracy | params | tokens/s | wall time |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for arch in order:
        rs = by_arch[arch]
        speeds = [r["tokens_per_s"] for r in rs if r["tokens_per_s"]]
        cells = [
            arch,
            PAPER_NAMES[arch],
            fmt(*mean_std([r["loss"] for r in rs])),
            fmt(*mean_std([r["accuracy"] for r in rs])),
            f"{rs[0]['params']:,}",
            f"{statistics.fmean(speeds):,.0f}" if speeds else "-",
            f"{statistics.fmean(r['wall_s'] for r in rs):.0f} s",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "## The paper's steps (Figure 3), checked",
        "",
        "Loss difference (this arch - the one it is compared with); a difference smaller than the "
        "larger of the two seed spreads is reported as within the spread.",
        "",
        "| step | compared with | the paper | here |",
        "|---|---|---|---|",
    ]
    for arch, other, sign, words in PAPER_STEPS:
        if arch in by_arch and other in by_arch:
            losses = [[r["loss"] for r in by_arch[x]] for x in (arch, other)]
            lines.append(
                f"| {PAPER_NAMES[arch]} | {PAPER_NAMES[other]} | {words} | {verdict(*losses, sign)} |"
            )
    lines += ["", "![validation loss](ablation.png)", ""]
    (study.output / "ablation.md").write_text("\n".join(lines))
    curves = {}
    for arch in order:
        curves[PAPER_NAMES[arch]] = mean_curve([r["curve"] for r in by_arch[arch]])
    plot(curves, study.output / "ablation.png", "steps", "validation MLM loss (Figure 3 style)")
    click.echo(f"wrote {study.output / 'ablation.md'} and ablation.png", err=True)


def mean_curve(curves: list[list[list[float]]]) -> list[tuple[float, float, float]]:
    """(x, mean, std) at the x values all curves share."""
    shared = set.intersection(*(set(x for x, _ in c) for c in curves))
    points = []
    for x in sorted(shared):
        ys = [y for c in curves for cx, y in c if cx == x]
        mean, std = mean_std(ys)
        points.append((x, mean, std or 0.0))
    return points


def plot(curves: dict, output: Path, xlabel: str, title: str, log2x: bool = False) -> None:
    """One line per entry, its seed spread shaded; the paper's figure size (6.3in x 2.8in)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.3, 2.8), dpi=150)
    for i, (label, points) in enumerate(curves.items()):
        xs, ys, ss = zip(*points)
        ax.plot(xs, ys, color=f"C{i}", linewidth=1.6, marker="o", markersize=3, label=label)
        if any(ss):
            low = [y - s for y, s in zip(ys, ss)]
            high = [y + s for y, s in zip(ys, ss)]
            ax.fill_between(xs, low, high, color=f"C{i}", alpha=0.15)
    if log2x:
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({x for p in curves.values() for x, _, _ in p}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel(xlabel)
    ax.set_ylabel("MLM loss")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(frameon=False, fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(output)
    plt.close(fig)


def read_json(path: Path) -> dict | None:
    """A finished step's JSON, or None where it is missing or torn (a killed write: redo it)."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def append_results(output: Path, study: str, rows: list[dict]) -> None:
    """results.jsonl: this study's lines replaced by the new ones, the other study's kept."""
    path = output / "results.jsonl"
    kept = []
    if path.is_file():
        kept = [x for x in path.read_text().splitlines() if json.loads(x)["study"] != study]
    new = [json.dumps({"study": study, **row}) for row in rows]
    path.write_text("".join(f"{x}\n" for x in kept + new))


# -- the extension study ---------------------------------------------------------------------


def eval_result(study: Study, name: str, length: int) -> Path:
    """Where the evaluation of model `name` (`{arch}-s{seed}-{variant}-{max_len}`) at `length`
    is saved: one name per model and length in every study, so a study in the directory of
    another reuses its figures."""
    return study.output / "eval" / f"{name}-at-{length}.json"


def evaluate_model(
    study: Study,
    name: str,
    model: Path,
    data: dict[int, Path],
    results: dict[int, Path],
    max_samples: int | None,
) -> None:
    """Score `model` at each length of `results` (length -> its result JSON) that has no result
    yet, in one train/evaluate_cli.py process (`--data` per length): importing torch, most of a small
    evaluation's time, once per model rather than once per length. The process gives each length
    the figures a process of its own gives; it writes each result as it is done, so a rerun after
    a failure evaluates only the lengths still without one."""
    todo = [length for length, result in results.items() if read_json(result) is None]
    finished = ", ".join(str(length) for length in results if length not in todo)
    if not todo:
        study.progress("evaluate", f"{name} at {finished}", None)
        return
    cmd = [sys.executable, "train/evaluate_cli.py", "--checkpoint", model]
    for length in todo:
        cmd += ["--data", data[length], "--output", results[length]]
    cmd += ["--max-samples", max_samples] if max_samples else []
    seconds = study.execute(f"evaluate {name}", cmd, study.output / "eval" / f"{name}.log")
    label = f"{name} at {', '.join(map(str, todo))}"
    study.progress("evaluate", label + (f" ({finished} already done)" if finished else ""), seconds)


def run_extension(study: Study, archs: list[str]) -> None:
    data = study.train_data()
    lengths = [study.seq_len, 2 * study.seq_len, 4 * study.seq_len]
    variants = {
        a: list(INITS) if ATTENTIONS[a].absolute_positions else ["none"] for a in archs
    }  # shatter-extend --init matters only where new position rows are added
    # per seed and arch: 1 pretraining; 2 extensions per variant; 1 evaluation per model (one
    # process at all its lengths): the export at l_train, each model extended to 2l at l and
    # 2l, each extended to 4l at l, 2l and 4l
    k = len(study.seeds)
    study.planned = {
        "pretrain": k * len(archs),
        "extend": k * sum(2 * len(v) for v in variants.values()),
        "evaluate": k * sum(1 + 2 * len(v) for v in variants.values()),
    }
    eval_data = {length: study.data_at(data, length) for length in lengths}
    for seed in study.seeds:
        for arch in archs:
            study.pretrain(arch, seed, data)
    max_samples = study.config.get("data", {}).get("eval_samples")
    rows = []
    for seed in study.seeds:
        for arch in archs:
            run = study.run_dir(arch, seed)
            models = [(run / "export", "pretrained", study.seq_len)]
            for length in lengths[1:]:
                for init in variants[arch]:
                    models.append((extend(study, arch, seed, length, init), init, length))
            for model, variant, max_len in models:
                name = f"{arch}-s{seed}-{variant}-{max_len}"
                results = {
                    length: eval_result(study, name, length)
                    for length in lengths
                    if length <= max_len
                }
                evaluate_model(study, name, model, eval_data, results, max_samples)
                for length, result in results.items():
                    got = read_json(result)
                    rows.append(
                        {
                            "arch": arch,
                            "seed": seed,
                            "variant": variant,
                            "max_len": max_len,
                            "length": length,
                            "loss": got["loss"],
                            "accuracy": got["accuracy"],
                            "model": str(model),
                        }
                    )
    append_results(study.output, "extension", rows)
    write_extension(study, archs, lengths, rows)


def extend(study: Study, arch: str, seed: int, length: int, init: str) -> Path:
    """`shatter-extend` of a run's export to `length` (`--init` unless "none"), once."""
    out = study.output / "extended" / f"{arch}-s{seed}-{length}-{init}"
    if (out / "config.json").is_file():
        study.progress("extend", out.name, None)
        return out
    cmd = [BIN / "shatter-extend", study.run_dir(arch, seed) / "export", "--max-len", length]
    cmd += ["--output", out, "--seed", seed, "--overwrite"]
    cmd += ["--init", init] if init != "none" else []
    seconds = study.execute(f"extend {out.name}", cmd, out.with_suffix(".log"))
    study.progress("extend", out.name, seconds)
    return out


# -- one GPU call's science ------------------------------------------------------------------


def run_science(study: Study, archs: list[str]) -> None:
    """Each arch pretrained for the same tokens (its time box: --budget-seconds), evaluated at
    l_train, then extended to 2 l_train and evaluated there."""
    data = study.train_data()
    lengths = [study.seq_len, 2 * study.seq_len]
    variants = {a: list(INITS) if ATTENTIONS[a].absolute_positions else ["none"] for a in archs}
    study.planned = {
        "pretrain": len(archs),
        "extend": sum(len(v) for v in variants.values()),
        "evaluate": len(archs) + sum(len(v) for v in variants.values()),
    }
    eval_data = {length: study.data_at(data, length) for length in lengths}
    for arch in archs:
        study.pretrain(arch, 0, data)
    max_samples = study.config.get("data", {}).get("eval_samples")
    rows = []
    for arch in archs:
        models = [(study.run_dir(arch, 0) / "export", "pretrained", lengths[0])]
        models += [(extend(study, arch, 0, lengths[1], v), v, lengths[1]) for v in variants[arch]]
        for model, variant, length in models:
            name = f"{arch}-s0-{variant}-{length}"
            result = eval_result(study, name, length)
            evaluate_model(study, name, model, eval_data, {length: result}, max_samples)
            got = read_json(result)
            rows.append({"arch": arch, "variant": variant, "length": length, "loss": got["loss"]})
    append_results(study.output, "science", rows)
    write_science(study, archs, lengths, rows)


def write_science(study: Study, archs: list[str], lengths: list[int], rows: list[dict]) -> None:
    """OUTPUT/science.md (one table) and science.png (validation loss over tokens)."""
    per_step = study.config["run"]["micro_batch"] * study.ranks * study.seq_len
    extended = sorted({r["variant"] for r in rows} - {"pretrained"})
    lines = study.header("Shatter against BERT on one GPU call's budget")
    lines += [
        f"Validation MLM loss at l = {lengths[0]} (the pretraining length) after "
        f"{study.steps * per_step:,} training tokens each, and at l = {lengths[1]} after "
        f"`shatter-extend --max-len {lengths[1]}` (`copy`/`random`: `--init` of BERT's new "
        "position rows; `none`: no new weights). Wall time: the pretraining's.",
        "",
        "| arch | params | tokens/s | wall time | val loss l = "
        + f"{lengths[0]} | "
        + " | ".join(f"l = {lengths[1]} ({v})" for v in extended)
        + " |",
        "|---|---:|---:|---:|---:|" + "---:|" * len(extended),
    ]
    curves = {}
    for arch in archs:
        info = study.summary(arch, 0)
        loss = {r["variant"]: r["loss"] for r in rows if r["arch"] == arch}
        speed = f"{info['tokens_per_s']:,.0f}" if info["tokens_per_s"] else "-"
        cells = [arch, f"{info['params']:,}", speed, f"{info['wall_s']:.0f} s"]
        cells += [f"{loss['pretrained']:.3f}"]
        cells += [f"{loss[v]:.3f}" if v in loss else "-" for v in extended]
        lines.append("| " + " | ".join(cells) + " |")
        curves[f"{arch}-{study.scale.size}"] = [
            (step * per_step, y, 0.0) for step, y in info["curve"]
        ]
    lines += ["", "![validation loss over tokens](science.png)", ""]
    (study.output / "science.md").write_text("\n".join(lines))
    title = f"validation MLM loss at l = {lengths[0]}, scale {study.scale.name}"
    plot(curves, study.output / "science.png", "training tokens", title)
    click.echo(f"wrote {study.output / 'science.md'} and science.png", err=True)


def write_extension(study: Study, archs: list[str], lengths: list[int], rows: list[dict]) -> None:
    def losses(arch, variant, max_len, length):
        return [
            r["loss"]
            for r in rows
            if (r["arch"], r["variant"], r["max_len"], r["length"])
            == (arch, variant, max_len, length)
        ]

    lines = study.header("Length-extension study (§5.2.2, 'Extending Max Sequence Length')")
    lines += [
        f"Validation MLM loss (mean ± sample std over seeds) of each model at each evaluation "
        f"length, on data built with the training tokenizer and the same held-out documents. "
        f"`pretrained`: the run's export (max_len {lengths[0]}); `ext N`: `shatter-extend "
        f"--max-len N` of it (`random`/`copy`: `--init` of the new position rows of archs with "
        f"absolute positions; the others get no new weights). Longer rows give each token more "
        f"context, so compare models within a column.",
        "",
        "| model | " + " | ".join(f"l = {x}" for x in lengths) + " |",
        "|---|" + "---:|" * len(lengths),
    ]
    best = {}  # (arch, length) -> mean loss of its model whose max_len is that length
    curves = {}
    for arch in [a for a in PAPER_NAMES if a in archs]:
        variants = sorted({r["variant"] for r in rows if r["arch"] == arch} - {"pretrained"})
        for variant in ["pretrained", *variants]:
            for max_len in lengths if variant != "pretrained" else lengths[:1]:
                if variant != "pretrained" and max_len == lengths[0]:
                    continue
                label = arch if variant == "pretrained" else f"{arch} ext {max_len}"
                label += f" ({variant})" if variant not in ("pretrained", "none") else ""
                cells = []
                for length in lengths:
                    got = losses(arch, variant, max_len, length)
                    cells.append(fmt(*mean_std(got)) if got else "-")
                lines.append(f"| {label} | " + " | ".join(cells) + " |")
        # the curve: each length scored by the model extended to exactly that length
        for variant in variants:
            points = []
            for length in lengths:
                got = losses(arch, "pretrained", lengths[0], length) if length == lengths[0] else []
                got = got or losses(arch, variant, length, length)
                if got:
                    mean, std = mean_std(got)
                    points.append((length, mean, std or 0.0))
                    best[(arch, variant, length)] = got
            label = PAPER_NAMES[arch] + (f" ({variant})" if variant != "none" else "")
            curves[label] = points
    lines += [
        "",
        "## Against the paper",
        "",
        "The paper's SQuAD v1.1 dev EM (§5.2.2): BERT_GPU pretrained at 256 and extended to 512: "
        "80.0 -> 79.7; Shatter_GPU: 78.8 -> 81.8; BERT_Base 512 -> 1024: 83.3 -> 79.7; Shatter_Base: "
        "82.6 -> 82.8; BERT-RPE: 84.7 -> 84.4. Its claim: Shatter stretched with no new weights "
        "works at the longer length, BERT with new position rows loses more. Here, at each "
        "extended length, Shatter against each other model extended to that length (loss "
        "difference Shatter - other; negative: Shatter better):",
        "",
        "| length | compared with | Shatter - other |",
        "|---|---|---|",
    ]
    for length in lengths[1:]:
        mine = best.get(("shatter", "none", length))
        for (arch, variant, at), theirs in sorted(best.items()):
            if at != length or arch == "shatter" or mine is None:
                continue
            label = PAPER_NAMES[arch] + (f" ({variant})" if variant != "none" else "")
            lines.append(f"| {length} | {label} | {verdict(mine, theirs, -1)} |")
    lines += ["", "![loss by length](extension.png)", ""]
    (study.output / "extension.md").write_text("\n".join(lines))
    plot(
        curves,
        study.output / "extension.png",
        "evaluation length (the model extended to it)",
        f"validation MLM loss, pretrained at l = {lengths[0]}",
        log2x=True,
    )
    click.echo(f"wrote {study.output / 'extension.md'} and extension.png", err=True)


# -- the command -----------------------------------------------------------------------------


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("which", type=click.Choice(["ablation", "extension", "science"]))
@click.option("--scale", type=click.Choice(sorted(SCALES)), default="cpu", show_default=True)
@click.option("--output", required=True, type=click.Path(path_type=Path), help="Study directory.")
@click.option(
    "--input",
    "inputs",
    multiple=True,
    help="Corpus for shatter-data build (repeatable; CORPUS=PATH mixes corpora).",
)
@click.option(
    "--corpus",
    type=click.Choice(["wiki", "books", "text"]),
    default="text",
    show_default=True,
    help="Reader of --input values without a CORPUS= prefix.",
)
@click.option(
    "--data",
    type=click.Path(path_type=Path, file_okay=False),
    help="An existing shard dataset to train on instead of building one from --input.",
)
@click.option(
    "--archs", help="Comma-separated archs (default: the masked-LM archs, or the extension five)."
)
@click.option("--steps", type=int, help="Pretraining steps per run (default: the scale's).")
@click.option("--seeds", type=click.IntRange(1), default=1, show_default=True)
@click.option("--seq-len", type=int, help="l_train (default: the scale's, 128 cpu / 256 gpu).")
@click.option("--eval-every", type=int, help="Steps between validation passes.")
@click.option("--ranks", type=int, help="Training processes (cpu: 2; gpu: every visible GPU).")
@click.option(
    "--budget-seconds",
    type=click.FloatRange(min=1),
    help="Time box of each pretraining run: one over it ends the study, naming it.",
)
@click.option("--vocab-size", type=int, help="Vocabulary of a dataset built from --input.")
@click.option(
    "--config",
    type=click.Path(dir_okay=False, exists=True),
    help="YAML merged over the scale's pretrain config (e.g. model: {overrides: {...}}).",
)
def main(which: str, scale: str, archs: str | None, **opts) -> None:
    """Run the paper's ablation or length-extension study with the project's own commands."""
    mlm = [a for a in ATTENTIONS if default_objective(a) == "mlm"]  # Figure 3 compares MLM losses
    default = {"ablation": mlm, "extension": list(EXTENSION_ARCHS)}.get(which, SCIENCE_ARCHS)
    chosen = archs.split(",") if archs else default
    unknown = [a for a in chosen if a not in ATTENTIONS]
    if unknown:
        raise click.BadParameter(
            f"unknown arch(s) {', '.join(unknown)}; known: {', '.join(ATTENTIONS)}",
            param_hint="--archs",
        )
    other = [a for a in chosen if a not in mlm]
    if other:
        raise click.BadParameter(
            f"{', '.join(other)} train(s) a permutation LM, whose loss is not comparable with the "
            f"masked-LM losses of these studies; choose from {', '.join(mlm)}",
            param_hint="--archs",
        )
    require("matplotlib", extra="demo", purpose=f"the {which} study's figure")  # before training
    output = opts.pop("output")
    try:
        study = Study(output, SCALES[scale], opts)
        studies = {"ablation": run_ablation, "extension": run_extension, "science": run_science}
        studies[which](study, chosen)
    except click.ClickException:
        raise
    except Exception as e:  # one line naming the cause, never a bare traceback
        raise StudyError(f"the {which} study in {output} failed: {type(e).__name__}: {e}") from None


if __name__ == "__main__":
    main()
