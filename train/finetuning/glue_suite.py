"""The GLUE suite of the paper's Table 1 in one command: finetune a checkpoint on the eight tasks
(CoLA, SST-2, MRPC, QQP, STS-B, MNLI, QNLI, RTE) and print its row, dev metrics and average.

    shatter-glue --checkpoint RUN/export --data-dir GLUE_DIR --output glue-runs
    shatter-glue --checkpoint RUN/export --output glue-runs --gpus 0,1,2,3 --seeds 0,1,2

The protocol is the paper's (§4.2): batch 16, Adam(W), an evaluation every `--eval-every` steps
(1k) keeping the one that scores best on dev, the learning rate 5e-6 for CoLA and SST-2 and 1e-5
otherwise (train/finetune.py's default, which scales it up for models narrower than base size;
or each of `--lrs`, a sweep), and every (lr, seed) run on its own. A task's number is
the mean over seeds of the best dev score at the lr whose mean is highest; the JSON keeps every
run. Table 1's dev columns: CoLA and SST-2, MNLI-m/mm, QNLI, RTE accuracy, MRPC and QQP F1,
STS-B Spearman's ρ; MNLI-mm scores on dev_mismatched the checkpoint MNLI-m kept. The average is
over the nine columns.

GLUE_DIR holds the GLUE distribution's folders (CoLA/train.tsv, CoLA/dev.tsv, ...,
MNLI/dev_matched.tsv, MNLI/dev_mismatched.tsv); without --data-dir the Hub's `nyu-mll/glue` is
read through `datasets` (online) and written there as such TSVs first. Runs go to
OUTPUT/TASK/lr{LR}-seed{S}/ (train/finetune.py's run directories); a run with a metrics.json is
done, so the same command resumes an interrupted suite. With --gpus the runs are spread over those
GPUs, one process per GPU at a time (CUDA_VISIBLE_DEVICES); without, one at a time in this process.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click

from shatter.options import command

FINETUNE = Path(__file__).resolve().parents[1] / "finetune.py"  # train/finetune.py

# task: (GLUE folder, dev file, Table 1 column(s), dev metric of metrics.json)
TASKS = {
    "cola": ("CoLA", "dev.tsv", "CoLA", "accuracy"),
    "sst2": ("SST-2", "dev.tsv", "SST-2", "accuracy"),
    "mrpc": ("MRPC", "dev.tsv", "MRPC", "f1"),
    "qqp": ("QQP", "dev.tsv", "QQP", "f1"),
    "stsb": ("STS-B", "dev.tsv", "STS-B", "spearman"),
    "mnli": ("MNLI", "dev_matched.tsv", "MNLI-m", "accuracy"),
    "qnli": ("QNLI", "dev.tsv", "QNLI", "accuracy"),
    "rte": ("RTE", "dev.tsv", "RTE", "accuracy"),
}
COLUMNS = ["CoLA", "SST-2", "MRPC", "QQP", "STS-B", "MNLI-m", "MNLI-mm", "QNLI", "RTE"]


class SuiteError(click.ClickException):
    """One line naming what failed and where its log is."""


@dataclass(frozen=True)
class Job:
    task: str
    lr: float | None  # None: finetune's default (the paper's, scaled to the model's width)
    seed: int
    out: Path

    def command(self, args: dict) -> list[str]:
        folder, dev, _, _ = TASKS[self.task]
        data = Path(args["data_dir"]) / folder
        cmd = [sys.executable, str(FINETUNE), "--task", self.task]
        cmd += ["--checkpoint", str(args["checkpoint"]), "--output", str(self.out)]
        cmd += ["--train-file", str(data / "train.tsv"), "--validation-file", str(data / dev)]
        cmd += ["--seed", str(self.seed), "--batch-size", "16"]
        cmd += [] if self.lr is None else ["--lr", repr(self.lr)]
        cmd += ["--eval-every", str(args["eval_every"])]
        for flag in ("max_steps", "epochs", "max_len"):
            if args[flag] is not None:
                cmd += [f"--{flag.replace('_', '-')}", str(args[flag])]
        return cmd


def jobs_of(args: dict) -> list[Job]:
    out = Path(args["output"])
    jobs = []
    for task in args["tasks"]:
        for lr in args["lrs"] or [None]:
            name = "lr-default" if lr is None else f"lr{lr:g}"
            for seed in args["seeds"]:
                jobs.append(Job(task, lr, seed, out / task / f"{name}-seed{seed}"))
    return jobs


def done(job: Job) -> bool:
    return (job.out / "metrics.json").is_file()


@contextlib.contextmanager
def output_to(path: Path):
    """This process's stdout and stderr into `path`, Python's and the file descriptors' alike:
    what compilers, gloo or DeepSpeed's op probes write to fd 2 lands in the run's log, as a
    subprocess's would, not on the suite's console."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    try:
        with open(path, "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
            for fd in saved:
                os.dup2(f.fileno(), fd)
            try:
                yield
            finally:
                f.flush()
    finally:
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)


def run_inline(job: Job, args: dict) -> None:
    """One run in this process (no --gpus): the imports and the process group are paid once for
    the suite, not once a run."""
    from shatter.train.finetune import main as finetune_main

    if job.out.exists():  # an interrupted run: started again from scratch
        shutil.rmtree(job.out)
    job.out.mkdir(parents=True)
    log = job.out / "finetune.log"
    click.echo(f"start: {job.out.parent.name}/{job.out.name} here (log: {log})", err=True)
    with output_to(log):
        try:
            finetune_main.main(job.command(args)[2:], standalone_mode=False)
            code = 0
        except SystemExit as e:
            code = e.code
    if code or not done(job):
        fail(job, code, log)
    say_done(job)


def fail(job: Job, code, log: Path) -> None:
    last = log.read_text().strip().splitlines()[-1:] or [""]
    raise SuiteError(
        f"{job.out.parent.name}/{job.out.name} failed (exit {code}): {last[0][:300]} "
        f"(log: {log}); run the same command again to resume the suite"
    )


def run_all(jobs: list[Job], args: dict) -> None:
    """Every job not done yet, one per GPU at a time (or one at a time here without --gpus)."""
    todo = [j for j in jobs if not done(j)]
    if not args["gpus"]:
        for job in todo:
            run_inline(job, args)
        return
    slots = args["gpus"]
    running: dict[str, tuple[Job, subprocess.Popen]] = {}
    while todo or running:
        for slot in slots:
            if slot not in running and todo:
                running[slot] = start(todo.pop(0), slot, args)
        time.sleep(0.2)
        for slot, (job, process) in list(running.items()):
            if process.poll() is None:
                continue
            del running[slot]
            if process.returncode != 0:
                for _, (_, other) in running.items():
                    other.terminate()  # their runs start again on the next call
                fail(job, process.returncode, job.out / "finetune.log")
            say_done(job)


def start(job: Job, gpu: str, args: dict) -> tuple[Job, subprocess.Popen]:
    if job.out.exists():  # an interrupted run: started again from scratch
        shutil.rmtree(job.out)
    job.out.mkdir(parents=True)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu}
    log = open(job.out / "finetune.log", "w")
    click.echo(
        f"start: {job.out.parent.name}/{job.out.name} on GPU {gpu} (log: {log.name})", err=True
    )
    process = subprocess.Popen(job.command(args), stdout=log, stderr=subprocess.STDOUT, env=env)
    return job, process


def best_score(job: Job, metric: str) -> tuple[float, float]:
    """(the best dev `metric` over the run's evaluations, the lr it ran at)."""
    evaluations = json.loads((job.out / "metrics.json").read_text())["evaluations"]
    lr = json.loads((job.out / "config.json").read_text())["lr"]
    return max(e[metric] for e in evaluations), lr


def learned_nothing(job: Job) -> bool:
    """The run's metrics.json warns that it learned nothing (train/finetuning/metrics.py)."""
    warnings = json.loads((job.out / "metrics.json").read_text()).get("warnings", [])
    return any("learned nothing" in w for w in warnings)


def say_done(job: Job) -> None:
    nothing = learned_nothing(job)
    note = " (learned nothing: see its metrics.json's warnings)" if nothing else ""
    click.echo(f"done: {job.out.parent.name}/{job.out.name}{note}", err=True)


def mismatched_score(job: Job, args: dict) -> float:
    """MNLI-mm: the accuracy on dev_mismatched of the checkpoint MNLI-m kept (RUN/best)."""
    cache = job.out / "mismatched.json"
    if cache.is_file():
        return json.loads(cache.read_text())["accuracy"]
    import shatter
    from shatter.train.finetuning.data import DataConfig, build_task_data
    from shatter.train.finetuning.features import Tokenizer
    from shatter.train.finetuning.loop import predict

    best = job.out / "best"
    model = shatter.from_pretrained(best)
    dev = Path(args["data_dir"]) / "MNLI" / "dev_mismatched.tsv"
    config = json.loads((job.out / "config.json").read_text())
    cfg = DataConfig(task="mnli", train_file=dev, validation_file=dev, max_len=config["max_len"])
    data = build_task_data(cfg, Tokenizer(best / "tokenizer.model"))
    scores, _ = data.score(predict(model, data, 64))
    cache.write_text(json.dumps(scores) + "\n")
    return scores["accuracy"]


def table(jobs: list[Job], args: dict) -> dict:
    """Each column's score: the mean over seeds at the best lr (by that mean)."""
    result = {"checkpoint": str(args["checkpoint"]), "tasks": {}, "columns": {}}
    for task in args["tasks"]:
        column, metric = TASKS[task][2], TASKS[task][3]
        runs = [j for j in jobs if j.task == task]
        scored = []
        for j in runs:
            score, lr = best_score(j, metric)
            scored.append({"lr": lr, "seed": j.seed, metric: score, "dir": str(j.out),
                           "learned_nothing": learned_nothing(j)})  # fmt: skip
        if task == "mnli":
            for j, s in zip(runs, scored, strict=True):
                s["mismatched_accuracy"] = mismatched_score(j, args)
        means = {}
        for lr in dict.fromkeys(s["lr"] for s in scored):
            at = [s for s in scored if s["lr"] == lr]
            means[lr] = {
                column: sum(s[metric] for s in at) / len(at),
                **(
                    {"MNLI-mm": sum(s["mismatched_accuracy"] for s in at) / len(at)}
                    if task == "mnli"
                    else {}
                ),
            }
        lr = max(means, key=lambda k: means[k][column])
        result["tasks"][task] = {"metric": metric, "lr": lr, "means": means, "runs": scored}
        result["columns"].update(means[lr])
        if any(s["learned_nothing"] for s in scored if s["lr"] == lr):
            result["learned_nothing_columns"] = [
                *result.get("learned_nothing_columns", []),
                *means[lr],
            ]
    present = [c for c in COLUMNS if c in result["columns"]]
    result["average"] = sum(result["columns"][c] for c in present) / len(present)
    runs = [s for t in result["tasks"].values() for s in t["runs"]]
    result["learned_nothing"] = [s["dir"] for s in runs if s["learned_nothing"]]
    result["runs"] = len(runs)
    return result


NOTHING_MARK = "!"  # a column whose mean takes in a run that learned nothing


def row(result: dict) -> str:
    """Table 1's row under its header; a column with a run that learned nothing is marked, and
    a last line counts those runs."""
    present = [c for c in COLUMNS if c in result["columns"]]
    marked = set(result.get("learned_nothing_columns", []))
    head = " | ".join(f"{c:>7}" for c in present + ["Avg"])
    values = [
        f"{100 * result['columns'][c]:6.1f}" + (NOTHING_MARK if c in marked else " ")
        for c in present
    ] + [f"{100 * result['average']:6.1f} "]
    lines = [head, " | ".join(values)]
    nothing = result.get("learned_nothing", [])
    if nothing:
        names = ", ".join("/".join(Path(d).parts[-2:]) for d in nothing[:10])
        more = f" and {len(nothing) - 10} more" if len(nothing) > 10 else ""
        lines.append(
            f"{NOTHING_MARK} learned nothing in {len(nothing)} of {result['runs']} runs (no "
            f"better than a constant prediction; see their metrics.json's warnings): {names}{more}"
        )
    return "\n".join(lines)


LAYOUT = (
    "download GLUE and give --data-dir GLUE_DIR, a folder of the GLUE distribution's folders "
    "(CoLA/train.tsv, CoLA/dev.tsv, SST-2/..., MRPC/, QQP/, STS-B/, QNLI/, RTE/, "
    "MNLI/train.tsv, MNLI/dev_matched.tsv, MNLI/dev_mismatched.tsv)"
)


def hub_to_tsv(target: Path, tasks: list[str]) -> None:
    """The Hub's `nyu-mll/glue` written as the GLUE distribution's TSVs (online, or offline from
    `datasets`' cache); out of reach, one line naming --data-dir and its layout."""
    from shatter.train.finetuning.glue_hub import HUB_NAME, HubUnreachable, write_task

    try:
        for task in tasks:
            write_task(task, target / TASKS[task][0])
    except HubUnreachable as e:
        raise SuiteError(f"{HUB_NAME} on the Hub is out of reach ({e}): {LAYOUT}") from None


def _floats(text: str | None) -> list[float] | None:
    return [float(x) for x in text.split(",")] if text else None


@command()
@click.option("--checkpoint", required=True, help="Export to finetune (RUN/export, or extended).")
@click.option("--data-dir", help="GLUE folders (CoLA/, SST-2/, ...); default: the Hub's.")
@click.option("--output", required=True, help="Suite directory: runs, glue.json.")
@click.option("--tasks", default=",".join(TASKS), show_default=True, help="Comma-separated.")
@click.option("--lrs", help="Learning rates to sweep (default: the paper's per task).")
@click.option("--seeds", default="0,1,2", show_default=True, help="Seeds, comma-separated.")
@click.option("--eval-every", default=1000, show_default=True, help="Steps between evaluations.")
@click.option("--epochs", type=float, help="Passes over each training set (finetune's default 3).")
@click.option("--max-steps", type=int, help="Steps per run instead of --epochs.")
@click.option("--max-len", type=int, help="Input length (default: the checkpoint's max_len).")
@click.option("--gpus", help="GPU ids to spread the runs over, e.g. 0,1,2,3 (one run each).")
def main(
    checkpoint, data_dir, output, tasks, lrs, seeds, eval_every, epochs, max_steps, max_len, gpus
):
    """Finetune CHECKPOINT on GLUE with the paper's protocol; print Table 1's row."""
    tasks = [t.strip() for t in tasks.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise SuiteError(f"--tasks: unknown {unknown}; choose from {', '.join(TASKS)}")
    args = dict(
        checkpoint=checkpoint, output=output, tasks=tasks, lrs=_floats(lrs),
        seeds=[int(s) for s in seeds.split(",")], eval_every=eval_every, epochs=epochs,
        max_steps=max_steps, max_len=max_len, gpus=gpus.split(",") if gpus else None,
        data_dir=data_dir or str(Path(output) / "data"),
    )  # fmt: skip
    if data_dir is None:
        hub_to_tsv(Path(args["data_dir"]), tasks)
    for task in tasks:
        folder, dev, _, _ = TASKS[task]
        needed = [Path(args["data_dir"]) / folder / name for name in ("train.tsv", dev)]
        if task == "mnli":
            needed.append(Path(args["data_dir"]) / folder / "dev_mismatched.tsv")
        missing = [str(p) for p in needed if not p.is_file()]
        if missing:
            raise SuiteError(
                f"{task}: {', '.join(missing)} not found; {LAYOUT}, or leave --data-dir out to "
                "read the Hub's"
            )
    jobs = jobs_of(args)
    run_all(jobs, args)
    result = table(jobs, args)
    (Path(output) / "glue.json").write_text(json.dumps(result, indent=2) + "\n")
    click.echo(row(result))
    click.echo(f"wrote {Path(output) / 'glue.json'}", err=True)


if __name__ == "__main__":
    main()
